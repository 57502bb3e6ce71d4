"""`TfTrainingOps`: how TensorFlow graphs spell the training passes' nodes (the format side of
`training.ops.TrainingOps`).

Arithmetic is one TF op each (Mul, AddV2, Reciprocal, Maximum, GreaterEqual, LogicalAnd,
LogicalOr, LogicalNot, SelectV2, IsFinite); the all-finite flag is All over IsFinite of each
value (flattened), packed and reduced once more.

A state variable is a resource variable (VarHandleOp, initialized by AssignVariableOp from its
initial value) read lazily: before its initializer has run it reads as its initial value, so the
scaler works whichever initializer a TF1 script runs (global, local, none) and after a restore
that did not know it. The read branches on VarIsInitializedOp with a pivot per branch, as TF1's
cond does: Switch(flag, flag) feeds two Identity pivots, the ReadVariableOp waits for one and a
copy of the initial value for the other, and Merge takes whichever ran.

The gate is the same pivot on the all-finite flag: Identity(Switch(flag, flag):1). On a bad step
the Switch's true output is dead, so is the pivot, and so is every node that waits for it by a
control edge: TensorFlow's executor does not run a node with a dead input, data or control. A
gated write keeps its inputs as they were: the Switch carries a bool, never a variable, so the
form holds for reference variables (no RefSwitch), resource variables and inside TF2 function
bodies (no Switch on a resource handle, which a function's arguments cannot take through v1
control flow: `If` itself is lowered to Switch/Merge on its predicate exactly so). What waits
for a gated write (TF1's train op) is skipped on a bad step too: a session that runs it as a
target does not mind; a function that must return a live value joins the branches with Merge:
`settle` is Merge(Identity(Switch:0), Identity(pivot) waiting for the writes), live on every step.

In a TF2 function body (`FunctionTrainingOps`) a state variable is a resource argument the
caller passes (a captured tf.Variable, initialized before the first call), read once with
ReadVariableOp and written with AssignVariableOp: no lazy read, no initializer in the body.
Gradient accumulators are the body's own resources (VarHandleOp, shared name under the
rewrite's prefix, read lazily as in a graph). A weight "stored in 16 bits" there is the
caller's float32 tf.Variable: the update runs on an fp32 scratch copy as in a graph and the
write-back is rounded to the 16-bit type and cast back to float32, exactly, so the variable
only ever holds 16-bit values (the same numbers as 16-bit storage, without its memory saving:
the tf.Variable objects are the caller's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ....errors import AmpError
from ....ir import FLOAT32, FP32, Model, Node, Value, decisions, present
from ....ir.rounding import NEAREST, ROUNDING_ATTR
from ....passes.rewrite.building import array_constant, fill_node
from ....training.ops import SCALER_REASON, PendingNodes, StateVariable, StoredVariable
from ..load import value_name
from .variables import TfStoredNodes, TfVariableStore, stored_variable

#: Where the loss-scaling nodes live (names of the scaler's variables: `amp_loss_scale/scale`).
SCOPE = "amp_loss_scale"


@dataclass
class TfVariableNodes:
    """The nodes a TF1 MetaGraph lists for one of the scaler's variables (a VariableDef)."""

    handle: Node
    #: None for an accumulator (no initializer: it reads as zeros until written).
    initializer: Node | None
    snapshot: Node | None
    initial_value: Value | None


class TfTrainingOps(PendingNodes):
    """`TrainingOps` for a TF graph or function body (see the module docstring)."""

    def __init__(self, model: Model, scope: str = SCOPE):
        super().__init__(model.graph)
        self.model, self.scope = model, scope
        self.variables: list[StateVariable] = []
        self.store = TfVariableStore(self)

    # -- building -------------------------------------------------------------------------
    def make(self, op: str, inputs: list[Value], dtypes: list[str], name: str, *,
             waits: list[Node] | None = None, attrs: dict[str, object] | None = None) -> Node:
        """A node of TF op `op` reading `inputs`, with outputs of `dtypes`, named `name` under
        the scope, waiting for `waits`; pending until `commit`."""
        node = Node(self.model.unique_name(f"{self.scope}/{name}"), op, "", self.graph)
        outputs = []
        for slot, dtype in enumerate(dtypes):
            output = Value(value_name(node.name, slot), self.graph, dtype)
            self.model.used_names.add(output.name)
            outputs.append(output)
        fill_node(node, inputs, outputs, op_class=FP32, reason=SCALER_REASON,
                  kind=decisions.PIN, order=len(self.graph.nodes), attrs=attrs,
                  waits=waits or ())
        node.pin_reason, node.pin_kind = SCALER_REASON, decisions.PIN
        self.pending.append(node)
        return node

    def op(self, op: str, inputs: list[Value], dtype: str, name: str, *,
           waits: list[Node] | None = None, **attrs: object) -> Value:
        """The one output (of `dtype`) of a new node of TF op `op` (see `make`)."""
        return present(self.make(op, inputs, [dtype], name, waits=waits, attrs=attrs)
                       .outputs[0])

    # -- values ---------------------------------------------------------------------------
    def constant(self, value: np.ndarray, name: str) -> Value:
        return array_constant(self.model, self.graph, f"{self.scope}/{name}", np.asarray(value))

    def cast(self, value: Value, dtype: str, name: str, rounding: str = NEAREST,
             key: Value | None = None) -> Value:
        if value.dtype == dtype:
            return value
        if rounding == NEAREST:
            return self.op("Cast", [value], dtype, name, to=dtype)
        if key is None:
            raise ValueError(f"a {rounding} rounding cast needs its key")
        # the IR's rounding Cast: formats/tf/rounding.py lowers it before the graph is written
        return present(self.make("Cast", [value, key], [dtype], name,
                                 attrs={"to": dtype, ROUNDING_ATTR: rounding}).outputs[0])

    def pack(self, values: list[Value], name: str) -> Value:
        return self.op("Pack", values, present_dtype(values[0]), name, axis=0)

    def zeros_like(self, value: Value, name: str) -> Value:
        return self.op("ZerosLike", [value], present_dtype(value), name)

    def multiply(self, a: Value, b: Value, name: str) -> Value:
        return self.op("Mul", [a, b], present_dtype(a), name)

    def add(self, a: Value, b: Value, name: str) -> Value:
        return self.op("AddV2", [a, b], present_dtype(a), name)

    def reciprocal(self, a: Value, name: str) -> Value:
        return self.op("Reciprocal", [a], present_dtype(a), name)

    def maximum(self, a: Value, b: Value, name: str) -> Value:
        return self.op("Maximum", [a, b], present_dtype(a), name)

    def at_least(self, a: Value, b: Value, name: str) -> Value:
        return self.op("GreaterEqual", [a, b], "bool", name)

    def both(self, a: Value, b: Value, name: str) -> Value:
        return self.op("LogicalAnd", [a, b], "bool", name)

    def either(self, a: Value, b: Value, name: str) -> Value:
        return self.op("LogicalOr", [a, b], "bool", name)

    def negate(self, a: Value, name: str) -> Value:
        return self.op("LogicalNot", [a], "bool", name)

    def select(self, condition: Value, if_true: Value, if_false: Value, name: str) -> Value:
        return self.op("SelectV2", [condition, if_true, if_false], present_dtype(if_true),
                           name)

    def is_finite(self, a: Value, name: str) -> Value:
        return self.op("IsFinite", [a], "bool", name)

    def all_finite(self, values: list[Value], name: str) -> Value:
        if not values:
            return self.constant(np.asarray(True), name)
        flatten = self.constant(np.asarray([-1], np.int32), f"{name}/flat_shape")
        first_axis = self.constant(np.asarray([0], np.int32), f"{name}/axis")
        flags = []
        for value in values:
            finite = self.is_finite(value, f"{name}/is_finite")
            flat = self.op("Reshape", [finite, flatten], "bool", f"{name}/flat")
            flags.append(self.op("All", [flat, first_axis], "bool", f"{name}/finite"))
        if len(flags) == 1:
            return flags[0]
        packed = self.op("Pack", flags, "bool", f"{name}/flags", axis=0)
        return self.op("All", [packed, first_axis], "bool", name)

    # -- state, gate, group ---------------------------------------------------------------
    def state_variable(self, name: str, initial: np.ndarray) -> StateVariable:
        dtype = initial.dtype.name
        handle = self.make("VarHandleOp", [], ["resource"], name,
                            attrs={"dtype": dtype, "shape": (), "container": ""})
        handle.set_attr("shared_name", handle.name)
        initial_value = self.constant(initial, f"{name}/Initializer/initial_value")
        resource = present(handle.outputs[0])
        initializer = self.make("AssignVariableOp", [resource, initial_value], [],
                                 f"{name}/Assign")
        snapshot = self.make("ReadVariableOp", [resource], [dtype], f"{name}/Read/ReadVariableOp")
        value = self._lazy_read(resource, dtype, f"{name}_read", initial_value)
        variable = StateVariable(name, value, initializer, initial,
                                 TfVariableNodes(handle, initializer, snapshot, initial_value))
        self.variables.append(variable)
        return variable

    def accumulator(self, like: Value, name: str) -> StateVariable:
        dtype = present_dtype(like)
        handle = self.make("VarHandleOp", [], ["resource"], name,
                           attrs={"dtype": dtype, "shape": None, "container": ""})
        handle.set_attr("shared_name", handle.name)
        resource = present(handle.outputs[0])
        value = self._lazy_read(resource, dtype, f"{name}_read",
                                self.zeros_like(like, f"{name}/zeros"))
        return StateVariable(name, value, None, None, TfVariableNodes(handle, None, None, None))

    def _lazy_read(self, resource: Value, dtype: str, read: str, fallback_value: Value
                   ) -> Value:
        """The variable's value once it is initialized, else `fallback_value` (TF1 cond's
        pivots on VarIsInitializedOp, see the module docstring)."""
        is_set = self.op("VarIsInitializedOp", [resource], "bool", f"{read}/is_initialized")
        switch = self.make("Switch", [is_set, is_set], ["bool", "bool"], f"{read}/switch")
        unset = self.make("Identity", [present(switch.outputs[0])], ["bool"], f"{read}/unset")
        set_ = self.make("Identity", [present(switch.outputs[1])], ["bool"], f"{read}/set")
        stored = self.op("ReadVariableOp", [resource], dtype, f"{read}/stored", waits=[set_])
        fallback = self.op("Identity", [fallback_value], dtype, f"{read}/fallback",
                           waits=[unset])
        merge = self.make("Merge", [fallback, stored], [dtype, "int32"], f"{read}/merge")
        return self.op("Identity", [present(merge.outputs[0])], dtype, f"{read}/value")

    def variable(self, value: Value, dtype: str) -> StoredVariable:
        return stored_variable(value, dtype)

    def stored_dtype(self, value: Value) -> str | None:
        return None  # a graph's variables are stored as the rewrite decides

    def update_in_fp32(self, write: Node, variables: dict[int, StoredVariable]
                       ) -> dict[int, Value]:
        return self.store.update_in_fp32(write, variables)

    def write_variable(self, variable: StoredVariable, value: Value, name: str) -> Node:
        return self.store.write(variable, value, name)

    def store_variable(self, variable: StoredVariable) -> None:
        self.store.store(variable)

    def assign(self, variable: StateVariable, value: Value, name: str) -> Node:
        handle: TfVariableNodes = variable.handle
        write = self.make("AssignVariableOp", [present(handle.handle.outputs[0]), value], [],
                           name)
        variable.writes.append(write)
        return write

    def gate(self, flag: Value, name: str) -> Node:
        switch = self.make("Switch", [flag, flag], ["bool", "bool"], f"{name}/switch")
        return self.make("Identity", [present(switch.outputs[1])], ["bool"], name)

    def group(self, nodes: list[Node], name: str) -> Node:
        return self.make("NoOp", [], [], name, waits=nodes)

    def settle(self, gate: Node, writes: list[Node], name: str) -> Node:
        # the gate's Switch: its false output is live exactly when the gate is dead
        switch = present(gate.inputs[0]).producer
        if switch is None or switch.op_type != "Switch":
            raise ValueError(f"{gate.name}: not a gate made by TfTrainingOps.gate")
        skipped = self.op("Identity", [present(switch.outputs[0])], "bool",
                              f"{name}/skipped")
        applied = self.op("Identity", [present(gate.outputs[0])], "bool", f"{name}/applied",
                              waits=writes)
        return self.make("Merge", [skipped, applied], ["bool", "int32"], name)


def present_dtype(value: Value) -> str:
    """The dtype of a value the training passes read (they read only typed values)."""
    if value.dtype is None:
        raise ValueError(f"{value.name}: no dtype")
    return value.dtype


class FunctionTrainingOps(TfTrainingOps):
    """`TfTrainingOps` for a TF2 function body: each state variable is a new resource argument
    (appended to the function's arguments, in the order made), read once per call."""

    def __init__(self, model: Model, scope: str = SCOPE, *, resource_prefix: str = "",
                 variable_names: dict[str, str] | None = None,
                 stored_dtypes: dict[str, str] | None = None):
        super().__init__(model, scope)
        #: The resource arguments added, in order: the caller passes its variables' handles.
        self.arguments: list[Value] = []
        #: What the body's own resources (gradient accumulators) are named under.
        self.resource_prefix = resource_prefix or scope
        #: The captured variables' names by argument name (16-bit weights' random keys).
        self.variable_names = dict(variable_names or {})
        #: The captured variables the caller built in 16 bits: their dtype by argument name.
        self.stored_dtypes = dict(stored_dtypes or {})

    def state_variable(self, name: str, initial: np.ndarray) -> StateVariable:
        dtype = initial.dtype.name
        # a function argument's name: lower case, digits and underscores
        argument = Value(self.model.unique_name(f"{self.scope}_{name}_resource"), self.graph,
                         "resource")
        self.graph.add_value(argument)
        self.graph.add_input(argument)
        self.arguments.append(argument)
        value = self.op("ReadVariableOp", [argument], dtype, f"{name}/read")
        variable = StateVariable(name, value, None, initial, argument)
        self.variables.append(variable)
        return variable

    def assign(self, variable: StateVariable, value: Value, name: str) -> Node:
        if isinstance(variable.handle, TfVariableNodes):  # the body's own (an accumulator)
            return super().assign(variable, value, name)
        write = self.make("AssignVariableOp", [variable.handle, value], [], name)
        variable.writes.append(write)
        return write

    def accumulator(self, like: Value, name: str) -> StateVariable:
        # a resource of the body's own (the caller cannot know a gradient's shape before the
        # rewrite), named after this rewrite so that two steps never share one
        variable = super().accumulator(like, name)
        nodes: TfVariableNodes = variable.handle
        nodes.handle.set_attr("shared_name", f"{self.resource_prefix}/{nodes.handle.name}")
        return variable

    def variable(self, value: Value, dtype: str) -> StoredVariable:
        # a captured variable: its argument's name, or the name the caller gave it (the same
        # for every replica's copy, so that their random bits agree)
        if value.dtype not in (None, "resource") or value.producer is not None:
            return super().variable(value, dtype)
        name = self.variable_names.get(value.name, value.name)
        storage = self.stored_dtypes.get(value.name, FLOAT32)
        if storage != FLOAT32 and storage != dtype:
            raise AmpError(f"variable {name} is stored in {storage}, not {dtype}")
        return StoredVariable(value, dtype, name, TfStoredNodes(None, False, None, storage))

    def stored_dtype(self, value: Value) -> str | None:
        if value.producer is not None or value.dtype not in (None, "resource"):
            return None
        return self.stored_dtypes.get(value.name)

    def update_in_fp32(self, write: Node, variables: dict[int, StoredVariable]
                       ) -> dict[int, Value]:
        return self.store.update_in_fp32(write, variables)

    def write_variable(self, variable: StoredVariable, value: Value, name: str) -> Node:
        # the caller's variable keeps the dtype it was built in: a float32 one holds the
        # rounded value exactly, a 16-bit one the rounded value itself
        nodes: TfStoredNodes = variable.handle
        return self.store.write(variable, self.cast(value, nodes.storage or FLOAT32,
                                                    f"{name}/exact"), name)

    def store_variable(self, variable: StoredVariable) -> None:
        return  # the caller's tf.Variable keeps its float32 storage (see the module docstring)
