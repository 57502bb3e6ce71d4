"""Low-precision weights for converted TF2 SavedModels: variables read only by low-precision
consumers are stored in the target dtype and read without a cast.

After the functions are converted, every weight read is `ReadVariableOp(float) -> Cast(bf16)`. For a
variable whose every read, in every function that captures it, is such a read, this module:

- sets the variable's dtype in the SavedObjectGraph and stores its checkpoint tensors in the target
  dtype (the values are what the casts produced on every call);
- makes the function reads produce the target dtype and drops their casts;
- keeps the TF1 view consistent, so the model still restores and serves the way TF Serving loads
  it (the MetaGraph's restore op): the restore and save functions read and write the new dtype, the
  main graph's VarHandleOps hold it, and its other reads of those variables cast back to fp32.

Variables read anywhere in fp32 (batch-norm statistics feeding fp32 arithmetic, optimizer state,
`VarIsInitializedOp`, assignments) keep their dtype. Two views name the same variable: functions
capture object-graph nodes (`bound_inputs`), checkpoints and the main graph use checkpoint keys;
the checkpoint keys tie them together.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import function_pb2, graph_pb2, node_def_pb2, types_pb2
from tensorflow.core.protobuf import meta_graph_pb2, trackable_object_graph_pb2

from ...errors import AmpError
from ...ir import RangeCheck, check_range
from ...passes import StoredRange
from .load import dtype_enum

_Function_T = TypeVar("_Function_T", bound=Callable[..., Any])


def _checkpoint_errors(function: _Function_T) -> _Function_T:
    """TensorFlow's checkpoint reader fails on a damaged variables file with whatever it meets
    (IndexError for a truncated data file, DataLossError, ValueError): one line instead."""
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except AmpError:
            raise
        except (IndexError, ValueError, tf.errors.OpError) as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise AmpError(f"the SavedModel's variables checkpoint cannot be read: {detail}") \
                from None
    return wrapper  # type: ignore[return-value]


RESOURCE = types_pb2.DT_RESOURCE
FLOAT = types_pb2.DT_FLOAT
CALL_OPS = frozenset({"StatefulPartitionedCall", "PartitionedCall"})
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


@dataclass
class WeightsPlan:
    """The variables stored in low precision and what changes to get there."""

    dtype: str
    #: object-graph node id -> the variable's name
    variables: dict[int, str] = field(default_factory=dict)
    #: checkpoint keys of those variables
    keys: set[str] = field(default_factory=set)
    #: (function, ReadVariableOp node) of every read of those variables
    read_nodes: set[tuple[str, str]] = field(default_factory=set)
    #: How many of `variables` are second copies of others (Keras's `_all_variables`).
    copies: int = 0
    #: Names of variables read only in low precision whose values the dtype cannot hold
    #: (beyond its finite range, or every non-zero value flushing to zero): kept fp32.
    out_of_range: list[str] = field(default_factory=list)
    casts_removed: int = 0
    bytes_before: int = 0
    bytes_after: int = 0

    def summary(self) -> dict:
        """What the report says about the stored weights."""
        return {"dtype": self.dtype, "variables": sorted(set(self.variables.values())),
                "objects": len(self.variables), "copies": self.copies,
                "casts_removed": self.casts_removed,
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after}


def _producer(ref: str) -> str:
    """Function-body input reference -> the producing node (or argument) name."""
    return ref.lstrip("^").split(":")[0]


class _Function:
    """Consumers of every node and argument of one FunctionDef."""

    def __init__(self, fdef: function_pb2.FunctionDef):
        self.fdef = fdef
        self.nodes = {nd.name: nd for nd in fdef.node_def}
        self.args = [arg.name for arg in fdef.signature.input_arg]
        #: Nodes whose values the function returns (a `__forward_*` function hands the reads
        #: its backward pass needs to its caller, declared with their dtype).
        self.returned = {_producer(ref) for ref in fdef.ret.values()}
        #: producer name -> (consumer node, input position, full reference)
        self.consumers: dict[str, list[tuple[node_def_pb2.NodeDef, int, str]]] = {}
        for nd in fdef.node_def:
            for position, ref in enumerate(nd.input):
                if not ref.startswith("^"):
                    self.consumers.setdefault(_producer(ref), []).append((nd, position, ref))


class _Reads:
    """Where each captured resource argument is read, and whether every read is low precision."""

    def __init__(self, library: dict[str, function_pb2.FunctionDef], target: int):
        self.library = library
        self.target = target
        self.functions = {name: _Function(fdef) for name, fdef in library.items()}
        self._memo: dict[tuple[str, int], tuple[bool, list[tuple[str, str]]]] = {}

    def of_arg(self, function: str, index: int, seen: frozenset = frozenset()
               ) -> tuple[bool, list[tuple[str, str]]]:
        """(every read low precision, [(function, ReadVariableOp node)]) for one argument."""
        key = (function, index)
        if key in self._memo:
            return self._memo[key]
        if key in seen or function not in self.functions:
            return False, []
        fn = self.functions[function]
        ok, reads = True, []
        for consumer, position, _ref in fn.consumers.get(fn.args[index], []):
            callee = self._callee(consumer)
            if consumer.op == "ReadVariableOp" and position == 0:
                ok = ok and self._read_is_low(fn, consumer)
                reads.append((function, consumer.name))
            elif callee is not None:
                callee_ok, callee_reads = self.of_arg(callee, position, seen | {key})
                ok = ok and callee_ok
                reads.extend(callee_reads)
            else:  # a write, an initialisation check, a gather: the variable stays fp32
                ok = False
        self._memo[key] = (ok, reads)
        return ok, reads

    def _callee(self, node: node_def_pb2.NodeDef) -> str | None:
        if node.op in CALL_OPS:
            return node.attr["f"].func.name
        return node.op if node.op in self.library else None

    def _read_is_low(self, fn: _Function, read: node_def_pb2.NodeDef) -> bool:
        if read.attr["dtype"].type != FLOAT or read.name in fn.returned:
            return False
        consumers = fn.consumers.get(read.name, [])
        return bool(consumers) and all(
            c.op == "Cast" and c.attr["DstT"].type == self.target for c, _p, _r in consumers)


@dataclass
class VariableRanges:
    """How the captured float variables' checkpoint values fare in the target dtype, checked
    before the conversion so that the nodes reading the ones it cannot hold stay fp32."""

    #: The variables checkpoint, opened once for these checks, the weights plan and the
    #: checkpoint written with the lowered weights.
    checkpoint: _Checkpoint
    #: The functions that save or restore checkpoints: patched, never read for reads.
    skip: frozenset[str]
    #: object-graph node id -> its range check (every captured float variable with a value)
    checks: dict[int, RangeCheck] = field(default_factory=dict)
    #: function name -> {ReadVariableOp node -> its variable's range}, for the variables the
    #: dtype cannot hold (some beyond its finite range, or every non-zero value flushing to zero)
    reads: dict[str, dict[str, StoredRange]] = field(default_factory=dict)


def _refused(check: RangeCheck) -> bool:
    return bool(check.overflowed) or check.vanishes


def _captured_resources(object_graph, library: dict[str, function_pb2.FunctionDef]
                        ) -> Iterator[tuple[str, int, int]]:
    """(function, argument index, object-graph node id) for every resource a function of
    `library` captures."""
    for name, concrete in sorted(object_graph.concrete_functions.items()):
        if name not in library:
            continue
        args = library[name].signature.input_arg
        first = len(args) - len(concrete.bound_inputs)
        for offset, node_id in enumerate(concrete.bound_inputs):
            if args[first + offset].type == RESOURCE:
                yield name, first + offset, node_id


@_checkpoint_errors
def check_variable_ranges(meta_graph: meta_graph_pb2.MetaGraphDef, variables_prefix: Path,
                          dtype: str, skip: frozenset[str]) -> VariableRanges:
    """Range-check in `dtype` every float variable a function captures (`skip`: the functions
    that save or restore checkpoints), and find the reads of those out of range."""
    ranges = VariableRanges(_Checkpoint(variables_prefix), skip)
    library = {f.signature.name: f for f in meta_graph.graph_def.library.function
               if f.signature.name not in skip}
    object_graph = meta_graph.object_graph_def
    reads = _Reads(library, dtype_enum(dtype))
    read_nodes: dict[int, set[tuple[str, str]]] = {}
    for function, arg, node_id in _captured_resources(object_graph, library):
        node = object_graph.nodes[node_id]
        if node.HasField("variable") and node.variable.dtype == FLOAT:
            read_nodes.setdefault(node_id, set()).update(reads.of_arg(function, arg)[1])
    for node_id in sorted(read_nodes):
        values = ranges.checkpoint.value(node_id)
        if values is None:
            continue
        array = np.asarray(values, dtype=np.float32)
        check = ranges.checks[node_id] = check_range(array, dtype)
        if _refused(check):
            stored = StoredRange(object_graph.nodes[node_id].variable.name, check, array.size)
            for function, read in sorted(read_nodes[node_id]):
                ranges.reads.setdefault(function, {})[read] = stored
    return ranges


@_checkpoint_errors
def plan_low_precision_weights(meta_graph: meta_graph_pb2.MetaGraphDef, ranges: VariableRanges,
                               dtype: str) -> WeightsPlan:
    """Which variables of a converted MetaGraph can be stored in `dtype` (nothing is changed).

    `ranges`: the checks `check_variable_ranges` made before the conversion (its `skip`, the
    functions that save or restore checkpoints, are left out here too).
    """
    plan = WeightsPlan(dtype)
    library = {f.signature.name: f for f in meta_graph.graph_def.library.function
               if f.signature.name not in ranges.skip}
    object_graph = meta_graph.object_graph_def
    reads = _Reads(library, dtype_enum(dtype))
    verdict: dict[int, bool] = {}
    read_nodes: dict[int, set[tuple[str, str]]] = {}
    for function, arg, node_id in _captured_resources(object_graph, library):
        ok, found = reads.of_arg(function, arg)
        verdict[node_id] = verdict.get(node_id, True) and ok
        read_nodes.setdefault(node_id, set()).update(found)
    candidates = {node_id for node_id, ok in verdict.items()
                  if ok and read_nodes[node_id]
                  and object_graph.nodes[node_id].HasField("variable")
                  and object_graph.nodes[node_id].variable.dtype == FLOAT}
    # A read reached from a variable that stays fp32 (a function shared between captures) must
    # keep reading fp32: then every variable it serves stays fp32.
    shared = {read for node_id, found in read_nodes.items() if node_id not in candidates
              for read in found}
    candidates = {n for n in candidates if not read_nodes[n] & shared}
    checkpoint = ranges.checkpoint
    keys_of = checkpoint.keys
    # Before the twins are added: a twin holds its lowered variable's value, in range then.
    # (The readers of such a variable stay fp32, so it is rarely a candidate; this keeps inf
    # out of the checkpoint should one of its reads still be cast.)
    out_of_range = {n for n in candidates if n in ranges.checks and _refused(ranges.checks[n])}
    candidates -= out_of_range
    plan.out_of_range = sorted({object_graph.nodes[n].variable.name for n in out_of_range})
    twins = _unread_twins(object_graph, candidates, verdict, checkpoint)
    candidates |= twins
    for node_id in candidates:
        read_nodes.setdefault(node_id, set())
    key_owners: dict[str, set[int]] = {}
    for node_id, keys in keys_of.items():
        for key in keys:
            key_owners.setdefault(key, set()).add(node_id)
    for node_id in sorted(candidates):
        keys = keys_of.get(node_id, set())
        if not keys or any(key_owners[k] - candidates for k in keys):
            continue  # no checkpoint value, or one shared with a variable that stays fp32
        plan.variables[node_id] = object_graph.nodes[node_id].variable.name
        plan.keys.update(keys)
    plan.read_nodes = {r for n in plan.variables for r in read_nodes[n]}
    plan.copies = len(twins & plan.variables.keys())
    return plan


def _unread_twins(object_graph, lowered: set[int], captured: dict[int, bool],
                  checkpoint: _Checkpoint) -> set[int]:
    """Variables no function reads that are copies of lowered ones: Keras's `model.export`
    tracks each variable twice (`variables/N` and `_all_variables/N`, separate objects with the
    same name and value). A copy listed there follows its twin; any other unread variable
    keeps its dtype (a tf.Module's state that no function reads, which may share the default
    name "Variable" and the value of a lowered one)."""
    keras_lists = {child.node_id for node in object_graph.nodes for child in node.children
                   if child.local_name == "_all_variables"}
    listed = {child.node_id for list_id in keras_lists
              for child in object_graph.nodes[list_id].children}
    by_name: dict[str, list[np.ndarray]] = {}
    for node_id in lowered:
        tensor = checkpoint.value(node_id)
        if tensor is not None:
            by_name.setdefault(object_graph.nodes[node_id].variable.name, []).append(tensor)
    twins = set()
    for node_id, node in enumerate(object_graph.nodes):
        if not node.HasField("variable") or node_id in captured or node_id not in listed \
                or node.variable.dtype != FLOAT:
            continue
        tensor = checkpoint.value(node_id)
        if tensor is not None and any(
                t.shape == tensor.shape and np.array_equal(t, tensor)
                for t in by_name.get(node.variable.name, [])):
            twins.add(node_id)
    return twins


class _Checkpoint:
    """A variables checkpoint, opened once: each object-graph node's checkpoint keys and the
    value stored under the first."""

    def __init__(self, prefix: Path):
        self.reader = tf.train.load_checkpoint(str(prefix))
        graph = trackable_object_graph_pb2.TrackableObjectGraph()
        graph.ParseFromString(self.reader.get_tensor(OBJECT_GRAPH_KEY))
        #: object-graph node id -> the checkpoint keys of its variable values
        self.keys: dict[int, set[str]] = {}
        for node_id, node in enumerate(graph.nodes):
            for attribute in node.attributes:
                if attribute.name == "VARIABLE_VALUE":
                    self.keys.setdefault(node_id, set()).add(attribute.checkpoint_key)

    def value(self, node_id: int) -> np.ndarray | None:
        """The variable's stored value (None when it has none)."""
        keys = sorted(self.keys.get(node_id, ()))
        return self.reader.get_tensor(keys[0]) if keys else None


def apply_low_precision_weights(meta_graph: meta_graph_pb2.MetaGraphDef, plan: WeightsPlan,
                                checkpoint_functions: frozenset[str]) -> None:
    """Rewrite the MetaGraph for `plan`: variable dtypes, reads, save/restore, the main graph."""
    target = dtype_enum(plan.dtype)
    for node_id in plan.variables:
        meta_graph.object_graph_def.nodes[node_id].variable.dtype = target
    library = {f.signature.name: f for f in meta_graph.graph_def.library.function}
    by_function: dict[str, set[str]] = {}
    for function, read in plan.read_nodes:
        by_function.setdefault(function, set()).add(read)
    for function, read_names in by_function.items():
        plan.casts_removed += _drop_read_casts(library[function], read_names, target)
    restored_args: dict[str, set[int]] = {}
    for name in checkpoint_functions:
        fdef = library.get(name)
        if fdef is not None:
            restored_args[name] = _retype_checkpoint_function(fdef, plan.keys, target)
    _retype_main_graph(meta_graph.graph_def, restored_args, target)


def _drop_read_casts(fdef: function_pb2.FunctionDef, read_names: set[str], target: int) -> int:
    """Reads produce `target`; the casts after them go, their readers read the reads."""
    fn = _Function(fdef)
    replace: dict[str, str] = {}
    dropped: set[str] = set()
    for name in read_names:
        read = fn.nodes[name]
        read.attr["dtype"].type = target
        for cast, _position, ref in fn.consumers.get(name, []):
            replace[f"{cast.name}:y:0"] = ref
            replace[f"^{cast.name}"] = f"^{name}"
            dropped.add(cast.name)
    kept = [nd for nd in fdef.node_def if nd.name not in dropped]
    for nd in kept:
        for position, ref in enumerate(nd.input):
            if ref in replace:
                nd.input[position] = replace[ref]
    for key, ref in list(fdef.ret.items()):
        if ref in replace:
            fdef.ret[key] = replace[ref]
    del fdef.node_def[:]
    fdef.node_def.extend(kept)
    return len(dropped)


def _string_list(nd: node_def_pb2.NodeDef) -> list[str]:
    return [s.decode() for s in tf.make_ndarray(nd.attr["value"].tensor).reshape(-1).tolist()]


def _retype_checkpoint_function(fdef: function_pb2.FunctionDef, keys: set[str], target: int
                                ) -> set[int]:
    """SaveV2 / RestoreV2 of the keys in `keys` work in `target`; returns the argument positions
    (resources) whose variables the function restores into in `target`."""
    fn = _Function(fdef)
    restored: set[int] = set()
    for nd in fdef.node_def:
        if nd.op not in ("SaveV2", "RestoreV2"):
            continue
        names_node = fn.nodes.get(_producer(nd.input[1]))
        if names_node is None or names_node.op != "Const":
            raise AmpError(f"{fdef.signature.name}: {nd.op} tensor names are not a constant")
        for index, key in enumerate(_string_list(names_node)):
            if key not in keys:
                continue
            nd.attr["dtypes"].list.type[index] = target
            if nd.op == "SaveV2":
                _retype_upstream(fn, nd.input[3 + index], target)
            else:
                restored |= _retype_downstream(fn, f"{nd.name}:tensors:{index}", target)
    return restored


def _retype_upstream(fn: _Function, ref: str, target: int) -> None:
    """The chain feeding SaveV2 (Identity ... ReadVariableOp) carries `target`."""
    node = fn.nodes.get(_producer(ref))
    while node is not None:
        if node.op == "ReadVariableOp":
            node.attr["dtype"].type = target
            return
        if node.op != "Identity":
            raise AmpError(f"{fn.fdef.signature.name}: unexpected {node.op} before SaveV2")
        node.attr["T"].type = target
        node = fn.nodes.get(_producer(node.input[0]))


def _retype_downstream(fn: _Function, ref: str, target: int) -> set[int]:
    """The chain after RestoreV2 (Identity ... AssignVariableOp) carries `target`; returns the
    argument positions of the resources assigned."""
    restored: set[int] = set()
    frontier = [ref]
    while frontier:
        current = frontier.pop()
        for consumer, position, _ref in _consumers_of_ref(fn, current):
            if consumer.op == "Identity":
                consumer.attr["T"].type = target
                frontier.append(f"{consumer.name}:output:0")
            elif consumer.op == "AssignVariableOp" and position == 1:
                consumer.attr["dtype"].type = target
                resource = _producer(consumer.input[0])
                if resource in fn.args:
                    restored.add(fn.args.index(resource))
            else:
                raise AmpError(f"{fn.fdef.signature.name}: unexpected {consumer.op} after "
                               f"RestoreV2")
    return restored


def _consumers_of_ref(fn: _Function, ref: str) -> Iterator[tuple[node_def_pb2.NodeDef, int, str]]:
    for consumer, position, full in fn.consumers.get(_producer(ref), []):
        if full == ref:
            yield consumer, position, full


def _retype_main_graph(graph_def: graph_pb2.GraphDef, restored_args: dict[str, set[int]],
                       target: int) -> None:
    """The main graph's VarHandleOps the restore op fills in `target` hold `target`.

    Their reads produce `target`, assignments to them take `target`; where a value crosses from
    one dtype to the other (an fp32 initializer into a low-precision variable, a low-precision
    read into anything else) a cast goes in between.
    """
    nodes = {nd.name: nd for nd in graph_def.node}
    handles: set[str] = set()
    for nd in graph_def.node:
        if nd.op not in CALL_OPS:
            continue
        positions = restored_args.get(nd.attr["f"].func.name, set())
        data = [ref for ref in nd.input if not ref.startswith("^")]
        for position in positions:
            producer = nodes.get(data[position].split(":")[0])
            if producer is not None and producer.op == "VarHandleOp":
                handles.add(producer.name)
    for name in handles:
        nodes[name].attr["dtype"].type = target
    low_reads = {nd.name for nd in graph_def.node
                 if nd.op == "ReadVariableOp" and nd.input and nd.input[0] in handles}
    for name in low_reads:
        nodes[name].attr["dtype"].type = target
    casts: dict[tuple[str, int], str] = {}
    added: list[node_def_pb2.NodeDef] = []

    def cast(ref: str, source: int, destination: int, device: str) -> str:
        key = (ref, destination)
        if key not in casts:
            suffix = "amp_cast_fp32" if destination == FLOAT else "amp_cast_low"
            node = node_def_pb2.NodeDef(name=f"{ref.replace(':', '_')}/{suffix}", op="Cast",
                                        input=[ref], device=device)
            node.attr["SrcT"].type = source
            node.attr["DstT"].type = destination
            node.attr["Truncate"].b = False
            added.append(node)
            casts[key] = node.name
        return casts[key]

    for nd in list(graph_def.node):
        assigns_low = nd.op.startswith("Assign") and nd.op.endswith("VariableOp") \
            and nd.input and nd.input[0] in handles
        if assigns_low:
            nd.attr["dtype"].type = target
        for position, ref in enumerate(nd.input):
            if ref.startswith("^") or (position == 0 and nd.op in ("ReadVariableOp",)):
                continue
            is_low = ref.split(":")[0] in low_reads
            if assigns_low and position == 1 and not is_low:
                nd.input[position] = cast(ref, FLOAT, target, nd.device)
            elif is_low and not (assigns_low and position == 1):
                nd.input[position] = cast(ref, target, FLOAT, nd.device)
    graph_def.node.extend(added)


@_checkpoint_errors
def write_checkpoint(source: _Checkpoint, target_prefix: Path, plan: WeightsPlan) -> None:
    """Copy a checkpoint, with the tensors under `plan.keys` converted to `plan.dtype`."""
    reader = source.reader
    shapes = reader.get_variable_to_shape_map()
    names = sorted(shapes)
    tensors = []
    low = tf.as_dtype(plan.dtype)
    for name in names:
        value = reader.get_tensor(name)
        if name in plan.keys:
            plan.bytes_before += int(np.asarray(value).nbytes)
            value = tf.cast(value, low)
            plan.bytes_after += int(value.numpy().nbytes)
        tensors.append(value)
    for stale in target_prefix.parent.glob(target_prefix.name + ".*"):
        stale.unlink()
    with tf.device("/cpu:0"):
        tf.raw_ops.SaveV2(prefix=str(target_prefix), tensor_names=names,
                          shape_and_slices=[""] * len(names), tensors=tensors)
