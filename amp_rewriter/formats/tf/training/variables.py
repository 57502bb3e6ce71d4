"""TF variables stored in 16 bits (`--weights`, `--slots`): the TensorFlow side of the training
core's `TrainingOps.variable`, `update_in_fp32`, `write_variable` and `store_variable`.

A variable is a ref variable (VariableV2) or a resource variable (VarHandleOp). An update runs
its original kernel (ApplyMomentum, ResourceApplyAdam, AssignSub, ...) unchanged, in fp32, on a
scratch copy made from an fp32 view of the variable, and the copy's final value is what the core
rounds and writes back:

- ref kernels take a TemporaryVariable (Assign'ed the view); DestroyTemporaryVariable, after the
  kernel, gives its value and frees it;
- resource kernels take a VarHandleOp of their own (AssignVariableOp'ed the view); after the
  kernel its value is read and the resource destroyed (DestroyResourceOp; a skipped step leaves
  it for the next step to overwrite).

Storing the variable in 16 bits sets its op's `dtype`, and every loaded node that reads it:
reads (Identity, ReadVariableOp, ResourceGather) give the new dtype, initializers (Assign,
AssignVariableOp) write their initial value rounded to nearest, and the saver's SaveV2/RestoreV2
entries carry the new dtype, so checkpoints hold 16 bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tensorflow.core.framework import types_pb2

from ....errors import AmpError
from ....ir import FLOAT32, Node, TypeGroup, Value, present
from ....training.ops import StoredVariable
from ..rules import REF_VARIABLE_OPS

if TYPE_CHECKING:
    from .ops import TfTrainingOps

#: Ops that make a variable the rewrite can store in 16 bits.
VARIABLE_OPS = REF_VARIABLE_OPS | {"VarHandleOp"}
#: Ops whose outputs are what a checkpoint holds: restoring into a 16-bit variable reads them
#: in its dtype.
RESTORE_OPS = frozenset({"RestoreV2", "Restore", "RestoreSlice"})


@dataclass
class TfStoredNodes:
    """The op that makes a stored variable, whether it is a ref variable, its shape (None
    when unknown), and the dtype the caller's variable holds (a TF2 step's captured variable:
    float32, or the 16-bit dtype it was built in; None: the graph's own, stored by the
    rewrite)."""

    node: Node | None
    ref: bool
    shape: list[int] | None
    storage: str | None = None


def stored_variable(value: Value, dtype: str) -> StoredVariable:
    """The variable `value` names (a VariableV2 or VarHandleOp output), to be stored in
    `dtype`."""
    node = value.producer
    if node is None or node.op_type not in VARIABLE_OPS or node.handle is None:
        made_by = f"made by {node.op_type} {node.name!r}" if node is not None else "a graph input"
        raise AmpError(f"--weights/--slots: {value.name} is {made_by}, not a VariableV2 or "
                       f"VarHandleOp variable")
    nd = node.handle
    if nd.attr["dtype"].type != types_pb2.DT_FLOAT:
        raise AmpError(f"--weights/--slots: variable {node.name!r} is not float32")
    proto_shape = nd.attr["shape"].shape
    shape = None if proto_shape.unknown_rank else [d.size for d in proto_shape.dim]
    return StoredVariable(value, dtype, node.name,
                          TfStoredNodes(node, node.op_type in REF_VARIABLE_OPS, shape))


class TfVariableStore:
    """Builds the nodes of stored variables' updates and retypes their readers, with the
    format's ops (`TfTrainingOps`)."""

    def __init__(self, ops: TfTrainingOps):
        self.ops = ops

    def read(self, variable: StoredVariable, name: str, dtype: str | None = None) -> Value:
        """The variable's value, in `dtype`, else the dtype the caller stores it in, else its
        (16-bit) dtype."""
        nodes: TfStoredNodes = variable.handle
        op = "Identity" if nodes.ref else "ReadVariableOp"
        return self.ops.op(op, [variable.value], dtype or nodes.storage or variable.dtype, name)

    def update_in_fp32(self, write: Node, variables: dict[int, StoredVariable]
                       ) -> dict[int, Value]:
        """See `TrainingOps.update_in_fp32` (and the module docstring): each variable is read
        in the dtype it is stored in (a TF2 caller's: `TfStoredNodes.storage`)."""
        updated: dict[int, Value] = {}
        for slot, variable in variables.items():
            base = f"round/{variable.name}"
            view = self.ops.cast(self.read(variable, f"{base}/read"), FLOAT32,
                                 f"{base}/view")
            nodes: TfStoredNodes = variable.handle
            if nodes.ref:
                updated[slot] = self._temporary(write, slot, view, nodes, base)
            else:
                updated[slot] = self._scratch_resource(write, slot, view, nodes, base)
        return updated

    def _temporary(self, write: Node, slot: int, view: Value, nodes: TfStoredNodes,
                   base: str) -> Value:
        assert nodes.node is not None  # a ref variable is a graph's
        if nodes.shape is None or any(size < 0 for size in nodes.shape):
            raise AmpError(f"--weights/--slots: ref variable {nodes.node.name!r} has no static "
                           f"shape for its fp32 scratch copy")
        scratch = self.ops.make("TemporaryVariable", [], [FLOAT32], f"{base}/scratch",
                                attrs={"shape": nodes.shape})
        scratch.set_attr("var_name", scratch.name)
        filled = self.ops.op("Assign", [present(scratch.outputs[0]), view], FLOAT32,
                             f"{base}/scratch_fill")
        write.set_input(slot, filled)
        return self.ops.op("DestroyTemporaryVariable", [filled], FLOAT32, f"{base}/updated",
                           waits=[write], var_name=scratch.name)

    def _scratch_resource(self, write: Node, slot: int, view: Value, nodes: TfStoredNodes,
                          base: str) -> Value:
        scratch = self.ops.make("VarHandleOp", [], ["resource"], f"{base}/scratch",
                                attrs={"dtype": FLOAT32, "shape": nodes.shape, "container": ""})
        scratch.set_attr("shared_name", scratch.name)
        handle = present(scratch.outputs[0])
        fill = self.ops.make("AssignVariableOp", [handle, view], [], f"{base}/scratch_fill")
        original = write.inputs[slot]
        write.set_input(slot, handle)
        write.add_control_input(fill)
        read = self.ops.op("ReadVariableOp", [handle], FLOAT32, f"{base}/updated_read",
                           waits=[write])
        assert read.producer is not None
        later = self._read_after(write, original, base, handle)
        free = self.ops.make("DestroyResourceOp", [handle], [], f"{base}/scratch_free",
                             waits=[read.producer, *later],
                             attrs={"ignore_lookup_error": True})
        return self.ops.op("Identity", [read], FLOAT32, f"{base}/updated", waits=[free])

    def _read_after(self, write: Node, variable: Value | None, base: str,
                    handle: Value) -> list[Node]:
        """Reads of the variable that the step orders after `write` (Keras's momentum: the
        weight's update reads the slot just written) read the scratch copy's fresh value
        instead, cast to the dtype they read; the new reads."""
        later: list[Node] = []
        if variable is None:
            return later
        for reader, slot in list(variable.uses):
            if reader.op_type != "ReadVariableOp" or slot != 0 \
                    or not any(w is write for w in reader.control_inputs):
                continue
            old = present(reader.outputs[0])
            fresh = self.ops.op("ReadVariableOp", [handle], FLOAT32, f"{base}/read_after_write",
                                waits=[write])
            assert fresh.producer is not None
            later.append(fresh.producer)
            value = self.ops.cast(fresh, old.dtype or FLOAT32, f"{base}/read_after_write_cast")
            for user, user_slot in list(old.uses):
                user.set_input(user_slot, value)
        return later

    def write(self, variable: StoredVariable, value: Value, name: str) -> Node:
        """A node that writes `value` (of the variable's dtype) into the variable."""
        nodes: TfStoredNodes = variable.handle
        if nodes.ref:
            return self.ops.make("Assign", [variable.value, value], [variable.dtype], name)
        return self.ops.make("AssignVariableOp", [variable.value, value], [], name)

    # -- storing ----------------------------------------------------------------------------
    def store(self, variable: StoredVariable) -> None:
        """See `TrainingOps.store_variable` (and the module docstring)."""
        nodes: TfStoredNodes = variable.handle
        assert nodes.node is not None  # stored in 16 bits: a graph's variable
        nodes.node.set_attr("dtype", variable.dtype)
        if nodes.ref:
            _retype(variable.value, variable.dtype)
        for reader, slot in list(variable.value.uses):
            if reader.handle is None:
                continue  # made by the passes: it reads the variable in its dtype already
            group = reader.input_group[slot] if slot < len(reader.input_group) else None
            groups = [group] if group is not None else [] if nodes.ref else [
                g for g in reader.type_groups if g.name == "dtype"]
            for group in groups:
                self._retype_group(reader, group, variable)

    def _retype_group(self, node: Node, group: TypeGroup, variable: StoredVariable) -> None:
        """The slots of `node` that carry the variable's dtype carry the new one: a fixed type
        attribute is set, outputs are retyped, other inputs (an initial value) are rounded to
        it, or read in it where they come from a checkpoint."""
        dtype = variable.dtype
        if group.fixed and "[" not in group.name:
            node.set_attr(group.name, dtype)
        for slot in group.output_slots:
            _retype(node.outputs[slot], dtype)
        for slot in group.input_slots:
            value = node.inputs[slot]
            if value is None or value is variable.value or value.dtype == dtype:
                continue
            if not _retype_restored(value, dtype):
                node.set_input(slot, self.ops.cast(value, dtype,
                                                   f"round/{variable.name}/initial_value"))


def _retype(value: Value | None, dtype: str) -> None:
    """`value` now carries `dtype`, in the input model's view too (so no pass paints it)."""
    if value is not None:
        value.dtype = value.original_dtype = dtype


def _retype_restored(value: Value, dtype: str) -> bool:
    """Whether `value` is a checkpoint entry (through Identity ops); if so, it and the Identity
    ops on the way are read in `dtype`."""
    chain = [value]
    producer = value.producer
    while producer is not None and producer.op_type == "Identity" and producer.handle is not None \
            and producer.inputs and producer.inputs[0] is not None:
        chain.append(producer.inputs[0])
        producer = producer.inputs[0].producer
    if producer is None or producer.op_type not in RESTORE_OPS:
        return False
    for link in chain:
        _retype(link, dtype)
    return True
