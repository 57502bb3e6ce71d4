"""The TF1 front end's reading of a training graph: a `TrainingPlan` over the IR of a GraphDef.

TF1 graphs say what they are through names and collections, and this is where those heuristics
live: tf.gradients' seeds are `Fill(shape, 1)` right under a `gradients/` scope (`gradients_1/`,
`tower_0/gradients/`, ...); the gradient of op X sits under `.../X_grad/`; the frontier is
every value made inside a gradient scope that a node outside reads; the writes are the train
op's ancestors that the optimizer tables (`formats/tf/optimizers.py`) know; writes the backward
pass waits for through control edges (batch norm's `control_dependencies(UPDATE_OPS)`) are
moved after it; `NoOp`s whose control inputs run `*/Assign` initializers are the initializer
groups the scaler's state joins.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np

from ....errors import AmpError
from ....ir import FLOAT_DTYPES, Graph, Model, Node, Value, present
from ....training.plan import (
    GradientExit,
    GradientSeed,
    TrainingPlan,
    VariableWrite,
    nodes_after,
    nodes_before,
)
from ..optimizers import COUNTING_OPS, GRADIENT, SLOT, VARIABLE, scale_fold, write_args

#: tf.gradients' name scopes: `gradients/`, `gradients_1/`, `tower_0/gradients/`, ...
GRADIENT_SCOPE = re.compile(r"(?:^|/)gradients(?:_\d+)?/")
#: Ops that combine gradients (towers, replicas, shared weights): checked after they run.
AGGREGATION_OPS = frozenset({"AddN", "AccumulateNV2", "Add", "AddV2", "CollectiveReduce",
                             "CollectiveReduceV2", "CollectiveReduceV3", "NcclAllReduce",
                             "CollectiveAllReduceV2"})
#: Ops through which a factor on the gradients reaches their readers unchanged (sums, copies,
#: reshapes, sparse gradients' gathers and segment sums); Mul and RealDiv when the other operand
#: is no gradient.
_LINEAR_OPS = frozenset({"Identity", "Snapshot", "AddN", "Add", "AddV2", "AccumulateNV2", "Sub",
                         "Neg", "Reshape", "ExpandDims", "Squeeze", "ConcatV2", "Pack", "Unpack",
                         "Transpose", "Gather", "GatherV2", "UnsortedSegmentSum",
                         "CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3",
                         "NcclAllReduce", "CollectiveAllReduceV2"}) | AGGREGATION_OPS
_SCALING_OPS = frozenset({"Mul", "RealDiv", "Div"})
#: Sums tf.gradients makes of the gradients of a value read more than once.
_GRADIENT_SUM_OPS = frozenset({"AddN", "AccumulateNV2"})
#: Initializer ops whose `*/Assign` nodes a NoOp groups into an init op.
_INITIALIZER_OPS = frozenset({"Assign", "AssignVariableOp"})


def node_name(name_or_object) -> str:
    """A node name from a tf.Tensor / tf.Operation / "name" / "name:0"."""
    name = getattr(name_or_object, "name", name_or_object)
    if not isinstance(name, str) or not name:
        raise AmpError(f"expected a node or tensor name, got {name_or_object!r}")
    return name.lstrip("^").partition(":")[0]


def _is_one(value: Value | None) -> bool:
    """Whether `value` is a constant holding the single number 1."""
    if value is None or value.const is None:
        return False
    try:
        data = np.asarray(value.const.numpy())
    except Exception:  # a malformed constant: not a seed
        return False
    return data.size == 1 and float(data.reshape(())) == 1.0


def _seeds(closure: list[Node]) -> tuple[list[GradientSeed], list[str]]:
    """tf.gradients' seeds among the train op's ancestors, and their gradient scopes."""
    seeds, scopes = [], []
    for node in closure:
        matches = list(GRADIENT_SCOPE.finditer(node.name))
        match = matches[-1] if matches else None  # the innermost gradients scope
        # the seed sits right in the gradients scope (`gradients/grad_ys_0`, `gradients/Fill`);
        # Fill(shape, 1) inside an op's `*_grad/` scope is part of that op's gradient
        if node.op_type != "Fill" or match is None or len(node.inputs) < 2 \
                or "/" in node.name[match.end():] or not node.outputs \
                or present(node.outputs[0]).dtype not in FLOAT_DTYPES \
                or not _is_one(node.inputs[1]):
            continue
        seeds.append(GradientSeed(node, 1))
        if node.name[:match.end()] not in scopes:
            scopes.append(node.name[:match.end()])
    return seeds, scopes


def _differentiated(seeds: list[GradientSeed], scopes: list[str],
                    nodes: dict[str, Node]) -> list[Node]:
    """What the gradients are taken of: the op whose `X_grad/` scope reads a seed."""
    found: list[Node] = []
    for seed in seeds:
        scope = next(s for s in scopes if seed.node.name.startswith(s))
        for consumer, _slot in present(seed.node.outputs[0]).uses:
            rest = consumer.name[len(scope):] if consumer.name.startswith(scope) else ""
            if "_grad/" in rest:
                target = nodes.get(rest.rsplit("_grad/", 1)[0])
                if target is not None and target not in found:
                    found.append(target)
    return found


def write_of(node: Node, trainable: frozenset[str] | None = None) -> VariableWrite | None:
    """The variable write `node` is, from the optimizer tables (None when it writes none). Its
    variable is a weight when the graph lists it as trainable (`trainable`, the names of the
    MetaGraph's trainable variables) or, without that list, when an optimizer kernel updates
    it."""
    args = write_args(node.op_type)
    if args is None:
        return None
    kind = args.kind
    value = node.inputs[-1] if node.inputs else None
    if node.op_type in COUNTING_OPS and value is not None and value.dtype is not None \
            and value.dtype.startswith(("int", "uint")):
        kind = "step_counter"
    variable_slot = args.slot(VARIABLE)
    variable = node.inputs[variable_slot] if variable_slot is not None else None
    producer = variable.producer if variable is not None else None
    if trainable is not None:
        weight = producer is not None and producer.name in trainable and kind != "step_counter"
    else:
        weight = args.is_optimizer_update
    fold = scale_fold(node.op_type)
    return VariableWrite(node, kind, variable_slot, args.slots(GRADIENT), args.slots(SLOT),
                         weight=weight,
                         scale_fold=fold if fold is not None and _slots_start_at_zero(
                             node, args.slots(SLOT)) else None)


def _slots_start_at_zero(node: Node, slots: tuple[int, ...]) -> bool:
    """Whether every optimizer state the update keeps starts at zero (a factor on the gradients
    then scales the state by the same factor from the first step: TF1's RMSProp starts its mean
    square at one, which no factor follows)."""
    for slot in slots:
        variable = node.inputs[slot]
        producer = variable.producer if variable is not None else None
        if producer is None:
            return False
        initial = [reader.inputs[1] for reader, port in present_uses(producer)
                   if reader.op_type in _INITIALIZER_OPS and port == 0
                   and reader.name.endswith("/Assign") and len(reader.inputs) > 1]
        if len(initial) != 1 or not _is_zero_fill(initial[0]):
            return False
    return True


def present_uses(node: Node) -> list[tuple[Node, int]]:
    """The (reader, slot) pairs of `node`'s first output (none when it has no output)."""
    return list(node.outputs[0].uses) if node.outputs and node.outputs[0] is not None else []


def _is_zero_fill(value: Value | None) -> bool:
    """Whether `value` is all zeros: a constant of zeros, or Fill(shape, 0)."""
    if value is None:
        return False
    producer = value.producer
    if producer is not None and producer.op_type == "Fill" and len(producer.inputs) == 2:
        value = producer.inputs[1]
        if value is None:
            return False
    if value.const is None:
        return False
    try:
        data = np.asarray(value.const.numpy())
    except Exception:  # a malformed constant: not a known zero
        return False
    return data.size > 0 and not np.any(data)


def find_training_plan(model: Model, loss: str | None, train_op: str,
                       trainable: frozenset[str] | None = None) -> TrainingPlan:
    """The plan of the TF1 training step that `train_op` runs (see the module docstring);
    `trainable` names the graph's trainable variables (a MetaGraph's collection) when known.

    Raises AmpError when a name is unknown or the graph has no gradients or no variable writes.
    """
    graph = model.graph
    nodes = {node.name: node for node in graph.nodes}
    step = nodes.get(train_op)
    if step is None:
        raise AmpError(f"train op {train_op!r}: no such node in the graph")
    if loss is not None and loss not in nodes:
        raise AmpError(f"loss {loss!r}: no such node in the graph")
    closure = sorted(nodes_before([step]), key=lambda n: n.name)
    seeds, scopes = _seeds(closure)
    if not seeds:
        raise AmpError(f"no gradients found in the ancestors of train op {train_op!r} "
                       f"(tf.gradients seeds its gradients with Fill(shape, 1) under a "
                       f"'gradients/' scope): not a training graph?")
    in_scope = {n for n in graph.nodes if any(n.name.startswith(s) for s in scopes)}
    differentiated = _differentiated(seeds, scopes, nodes)
    loss_node = nodes[loss] if loss is not None else _default_loss(differentiated, in_scope)

    exits = gradient_exits(closure, in_scope)
    if not exits:
        raise AmpError(f"no gradient reaches an update of train op {train_op!r}: not a "
                       f"training graph?")
    writes = [w for w in (write_of(node, trainable) for node in closure) if w is not None]
    plan = assemble_plan(step, seeds, exits, loss_node, differentiated, writes, in_scope,
                         region=closure, initializers=_initializer_groups(graph.nodes,
                                                                          set(closure)))
    if not plan.writes:
        raise AmpError(f"train op {train_op!r} updates no variable (no Apply*/Assign* op in its "
                       f"ancestors): not a training graph?")
    return plan


def gradient_exits(nodes: Iterable[Node], in_scope: set[Node]) -> list[GradientExit]:
    """The gradients leaving the backward pass (the nodes `in_scope`), each with
    every slot of a reader among `nodes` outside it that reads it, in name order."""
    readers: dict[Value, GradientExit] = {}
    for node in nodes:
        if node in in_scope:
            continue
        for slot, value in enumerate(node.inputs):
            if value is not None and value.producer is not None \
                    and value.producer in in_scope:
                readers.setdefault(value, GradientExit(value, [])).readers.append(
                    (node, slot))
    return sorted(readers.values(), key=lambda e: (_producer(e.value).name,
                                                   e.value.producer_slot))


def assemble_plan(step: Node, seeds: list[GradientSeed], exits: list[GradientExit],
                  loss_node: Node, differentiated: list[Node], writes: list[VariableWrite],
                  in_scope: set[Node], region: Iterable[Node] | None = None,
                  initializers: list[Node] | None = None,
                  backward: Iterable[Node] = ()) -> TrainingPlan:
    """The plan from what a front end found: the forward and backward passes are what the
    gradients leaving the backward pass, the loss and the `backward` nodes (gradients nothing
    reads, which the runtime drops, still belong to the backward pass) need (writes they wait
    for only by control edges deferred to the step); the gated writes are the others; the
    optimizer path is the rest of `region` (by default, what the gated writes need).

    Raises AmpError when the loss has no output; a plan may come back with no writes (the
    front end says why that is wrong)."""
    graph = present_graph(step)
    roots = [_producer(e.value) for e in exits] + [loss_node] + list(backward)
    deferred = _deferred_writes(roots, in_scope, [w.node for w in writes])
    compute = nodes_before(roots, ignored=frozenset(writer for writer, _ in deferred))
    gated = [w for w in writes if w.node not in compute]
    if region is None:
        needed = nodes_before(w.node for w in gated)
        region = [n for n in graph.nodes if n in needed]
    optimizer_path = [n for n in region if n not in compute]
    after_frontier = nodes_after(reader for e in exits for reader, _ in e.readers)
    # what runs after a write (sparse Adam's `v + epsilon`, ...) must not feed the flag that
    # gates the writes
    after_writes = nodes_after(w.node for w in gated)
    aggregations = [value for node in optimizer_path
                    if node in after_frontier and node not in after_writes
                    and node.op_type in AGGREGATION_OPS
                    for value in node.outputs if value is not None
                    and value.dtype in FLOAT_DTYPES]
    frontier = [e for e in exits if e.value.dtype in FLOAT_DTYPES]
    loss_value = present(loss_node.outputs[0]) if loss_node.outputs else None
    if loss_value is None:
        raise AmpError(f"loss {loss_node.name!r} ({loss_node.op_type}) has no output")
    return TrainingPlan(
        loss=loss_value, step=step, seeds=seeds, frontier=frontier,
        aggregations=aggregations, writes=gated,
        compute=[n for n in graph.nodes if n in compute], optimizer_path=optimizer_path,
        gradient_sums=_gradient_sums(exits, in_scope), differentiated=differentiated,
        deferred=deferred, initializers=initializers or [],
        loss_unrelated=bool(differentiated) and loss_node not in nodes_after(differentiated),
        linear_gradient_path=_linear_to_writes(frontier, gated))


def _linear_to_writes(frontier: list[GradientExit], writes: list[VariableWrite]) -> bool:
    """Whether every frontier gradient reaches only the writes' gradient inputs, and only
    through `_LINEAR_OPS` (a factor on the gradients then reaches the updates unchanged)."""
    ends: set[tuple[Node, int]] = {(w.node, slot) for w in writes for slot in w.gradient_slots}
    derived: dict[Value, None] = dict.fromkeys(e.value for e in frontier)
    stack = list(derived)
    while stack:  # everything computed from the gradients before the writes
        for reader, slot in stack.pop().uses:
            if (reader, slot) in ends:
                continue
            for output in reader.outputs:
                if output is not None and output not in derived:
                    derived[output] = None
                    stack.append(output)
    for value in derived:
        for reader, slot in value.uses:
            if (reader, slot) in ends or reader.op_type in _LINEAR_OPS:
                continue
            if reader.op_type not in _SCALING_OPS:
                return False
            if reader.op_type != "Mul" and slot != 0:
                return False  # dividing by a gradient
            if any(v in derived for i, v in enumerate(reader.inputs)
                   if i != slot and v is not None):
                return False  # a gradient times a gradient
    return True


def present_graph(node: Node) -> Graph:
    """The graph `node` belongs to (a plan's step is always in one)."""
    if node.graph is None:
        raise ValueError(f"{node.name}: not in a graph")
    return node.graph


def _producer(value: Value) -> Node:
    """The node that makes `value` (a gradient: always made by a node)."""
    if value.producer is None:
        raise AmpError(f"{value.name}: a gradient no node makes")
    return value.producer


def _default_loss(differentiated: list[Node], in_scope: set[Node]) -> Node:
    """The one tensor the gradients are taken of, or the Identity that names it."""
    if len(differentiated) != 1:
        raise AmpError(f"give the loss (--loss NAME): gradients are taken of "
                       f"{', '.join(n.name for n in differentiated) or 'an unrecognised tensor'}")
    loss = differentiated[0]
    # tf.identity(loss, name="loss") has no gradient op of its own: name the Identity
    while loss.outputs:
        readers = [c for c, _s in present(loss.outputs[0]).uses if c not in in_scope]
        if len(readers) != 1 or readers[0].op_type != "Identity":
            break
        loss = readers[0]
    return loss


def _deferred_writes(roots: list[Node], in_scope: set[Node], writes: list[Node]
                     ) -> list[tuple[Node, Node]]:
    """(write, waiter): variable writes the passes wait for only through control edges.

    TF1 batch norm's `with tf.control_dependencies(UPDATE_OPS): train = opt.minimize(loss)`
    makes the moving-average assigns control inputs of the gradient ops. Nothing in the passes
    reads what they write, so the rewrite moves those control edges to the train op: the writes
    then run after the all-finite flag and are gated like every other update.
    """
    everything = nodes_before(roots)
    data = nodes_before(roots, data_only=True)
    control_only = everything - data - in_scope
    writers = control_only & nodes_after(writes)  # writes, or waits for one
    deferred = []
    for node in sorted(everything - writers, key=lambda n: n.name):
        for waited in node.control_inputs:
            if waited in writers:
                deferred.append((waited, node))
    return sorted(deferred, key=lambda pair: pair[0].name)


def _gradient_sums(exits: list[GradientExit], in_scope: set[Node]) -> list[Node]:
    """The sums that add up the gradients of a variable read more than once (in scope)."""
    sums: list[Node] = []
    for exit_ in exits:
        node = exit_.value.producer
        while node is not None and node.op_type == "Identity" and node.inputs \
                and node.inputs[0] is not None and node.inputs[0].producer is not None:
            node = node.inputs[0].producer
        if node is not None and node.op_type in _GRADIENT_SUM_OPS and node in in_scope \
                and node not in sums:
            sums.append(node)
    return sorted(sums, key=lambda n: n.name)


def _initializer_groups(nodes: list[Node], train_closure: set[Node]) -> list[Node]:
    """NoOps that run variable initializers (`init` from global_variables_initializer, ...)."""
    return [node for node in nodes if node.op_type == "NoOp" and node not in train_closure
            and any(c.op_type in _INITIALIZER_OPS and c.name.endswith("/Assign")
                    for c in node.control_inputs)]
