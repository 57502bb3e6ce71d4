"""Reading a TF1 training graph: the train op's update ops, the gradient seeds tf.gradients made,
the gradient tensors that leave the backward pass (the frontier), and the optimizer path between
them and the updates (aggregation over towers, clipping, learning rates, slots)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2

from ....errors import AmpError
from ..load import parse_graph_input

#: tf.gradients' name scopes: `gradients/`, `gradients_1/`, `tower_0/gradients/`, ...
GRADIENT_SCOPE = re.compile(r"(?:^|/)gradients(?:_\d+)?/")
#: Ops that write a variable (the update ops when they feed the train op).
_WRITE_PREFIXES = ("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply", "Scatter",
                   "ResourceScatter")
_WRITE_OPS = frozenset({"Assign", "AssignAdd", "AssignSub", "AssignVariableOp",
                        "AssignAddVariableOp", "AssignSubVariableOp"})
#: Ops that combine gradients (towers, replicas, shared weights): checked after they run.
AGGREGATION_OPS = frozenset({"AddN", "AccumulateNV2", "Add", "AddV2", "CollectiveReduce",
                             "CollectiveReduceV2", "CollectiveReduceV3", "NcclAllReduce",
                             "CollectiveAllReduceV2"})


def is_update_op(op: str) -> bool:
    """Whether `op` writes a variable (optimizer Apply ops, assigns, scatters)."""
    return op in _WRITE_OPS or op.startswith(_WRITE_PREFIXES)


def is_optimizer_op(op: str) -> bool:
    """Whether `op` is an optimizer's update kernel (Apply*, ResourceApply*, ...)."""
    return op.startswith(("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply"))


def split_ref(ref: str) -> tuple[str, int, bool]:
    """NodeDef input -> (node, port, is_control)."""
    if ref.startswith("^"):
        return ref[1:], -1, True
    node, port = parse_graph_input(ref)
    return node, port, False


def node_name(name_or_object) -> str:
    """A node name from a tf.Tensor / tf.Operation / "name" / "name:0"."""
    name = getattr(name_or_object, "name", name_or_object)
    if not isinstance(name, str) or not name:
        raise AmpError(f"expected a node or tensor name, got {name_or_object!r}")
    return name.lstrip("^").partition(":")[0]


class GraphIndex:
    """Producers, consumers and ancestor walks over a GraphDef (iterative: graphs are big)."""

    def __init__(self, graph_def: graph_pb2.GraphDef):
        self.nodes = {nd.name: nd for nd in graph_def.node}
        self.consumers: dict[str, list[tuple[str, int, int]]] = {}  # node -> (consumer, slot, port)
        self.control_consumers: dict[str, list[str]] = {}
        for nd in graph_def.node:
            for slot, ref in enumerate(nd.input):
                producer, port, control = split_ref(ref)
                if control:
                    self.control_consumers.setdefault(producer, []).append(nd.name)
                else:
                    self.consumers.setdefault(producer, []).append((nd.name, slot, port))

    def ancestors(self, roots: Iterable[str], data_only: bool = False,
                  ignored_controls: set[str] | frozenset[str] = frozenset()) -> set[str]:
        """`roots` and everything they wait for (control edges from `ignored_controls` aside)."""
        seen: set[str] = set()
        stack = [r for r in roots if r in self.nodes]
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            for ref in self.nodes[name].input:
                producer, _port, control = split_ref(ref)
                if control and (data_only or producer in ignored_controls):
                    continue
                if producer in self.nodes and producer not in seen:
                    stack.append(producer)
        return seen

    def descendants(self, roots: Iterable[str]) -> set[str]:
        """Everything that runs after `roots` (data and control edges)."""
        seen: set[str] = set()
        stack = list(roots)
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            stack.extend(c for c, _s, _p in self.consumers.get(name, []) if c not in seen)
            stack.extend(c for c in self.control_consumers.get(name, []) if c not in seen)
        return seen


def const_value(nd: node_def_pb2.NodeDef) -> np.ndarray | None:
    """The value of a Const node (None for other ops and malformed constants)."""
    if nd.op != "Const":
        return None
    try:
        return tf.make_ndarray(nd.attr["value"].tensor)
    except Exception:  # a malformed constant: not a seed
        return None


@dataclass
class TrainingPlan:
    """The parts of a training graph the rewrite works on (all node names)."""

    loss: str
    train_op: str
    seeds: list[str]
    scopes: list[str]
    #: gradient tensors leaving the gradient scopes -> the nodes outside that read them
    frontier: dict[tuple[str, int], list[str]]
    update_ops: list[str]
    optimizer_path: set[str]
    aggregations: list[str]
    gradient_aggregations: list[str]
    converted_region: set[str]
    losses_differentiated: list[str] = field(default_factory=list)
    #: control edges moved from the passes to the train op: writer -> nodes that waited for it
    deferred: dict[str, list[str]] = field(default_factory=dict)
    #: NoOps that run variable initializers (the scaler's initializers join them)
    initializer_groups: list[str] = field(default_factory=list)
    #: the loss is neither a tensor the gradients are taken of nor computed from one
    loss_unrelated: bool = False


def plan_training_graph(graph_def: graph_pb2.GraphDef, loss: str | None, train_op: str
                        ) -> TrainingPlan:
    """Find the train op's update ops, the gradient seeds and frontier, and the optimizer path.

    Raises AmpError when a name is unknown or the graph has no gradients or no update ops.
    """
    index = GraphIndex(graph_def)
    nodes = index.nodes
    if train_op not in nodes:
        raise AmpError(f"train op {train_op!r}: no such node in the graph")
    if loss is not None and loss not in nodes:
        raise AmpError(f"loss {loss!r}: no such node in the graph")
    closure = index.ancestors([train_op])
    update_ops = sorted(n for n in closure if is_update_op(nodes[n].op))

    seeds, scopes = [], []
    for name in sorted(closure):
        nd = nodes[name]
        matches = list(GRADIENT_SCOPE.finditer(name))
        match = matches[-1] if matches else None  # the innermost gradients scope
        # the seed sits right in the gradients scope (`gradients/grad_ys_0`, `gradients/Fill`);
        # Fill(shape, 1) inside an op's `*_grad/` scope is part of that op's gradient
        if nd.op != "Fill" or match is None or len(nd.input) < 2 or "/" in name[match.end():] \
                or not tf.as_dtype(nd.attr["T"].type).is_floating:
            continue
        value_node = nodes.get(split_ref(nd.input[1])[0])
        value = const_value(value_node) if value_node is not None else None
        if value is not None and value.size == 1 and float(value.reshape(())) == 1.0:
            seeds.append(name)
            if name[:match.end()] not in scopes:
                scopes.append(name[:match.end()])
    if not seeds:
        raise AmpError(f"no gradients found in the ancestors of train op {train_op!r} "
                       f"(tf.gradients seeds its gradients with Fill(shape, 1) under a "
                       f"'gradients/' scope): not a training graph?")
    in_scope = {n for n in nodes if any(n.startswith(s) for s in scopes)}

    differentiated = []
    for seed in seeds:
        scope = next(s for s in scopes if seed.startswith(s))
        for consumer, _slot, _port in index.consumers.get(seed, []):
            rest = consumer[len(scope):] if consumer.startswith(scope) else ""
            if "_grad/" in rest:
                target = rest.rsplit("_grad/", 1)[0]
                if target in nodes and target not in differentiated:
                    differentiated.append(target)
    if loss is None:
        if len(differentiated) != 1:
            raise AmpError(f"give the loss (--loss NAME): gradients are taken of "
                           f"{', '.join(differentiated) or 'an unrecognised tensor'}")
        loss = differentiated[0]
        # tf.identity(loss, name="loss") has no gradient op of its own: name the Identity
        while True:
            readers = [c for c, _s, _p in index.consumers.get(loss, []) if c not in in_scope]
            if len(readers) != 1 or nodes[readers[0]].op != "Identity":
                break
            loss = readers[0]

    frontier: dict[tuple[str, int], list[str]] = {}
    for name in sorted(closure - in_scope):
        for ref in nodes[name].input:
            producer, port, control = split_ref(ref)
            if not control and producer in in_scope:
                readers = frontier.setdefault((producer, port), [])
                if name not in readers:
                    readers.append(name)
    if not frontier:
        raise AmpError(f"no gradient reaches an update of train op {train_op!r}: not a training "
                       f"graph?")
    roots = [p for p, _ in frontier] + [loss]
    deferred = _deferred_updates(index, roots, in_scope, set(update_ops))
    forward_and_backward = index.ancestors(roots, ignored_controls=set(deferred))
    gated = [n for n in update_ops if n not in forward_and_backward]
    if not any(is_update_op(nodes[n].op) for n in gated):
        raise AmpError(f"train op {train_op!r} updates no variable (no Apply*/Assign* op in its "
                       f"ancestors): not a training graph?")
    optimizer_path = closure - forward_and_backward
    after_frontier = index.descendants(n for readers in frontier.values() for n in readers)
    # what runs after an update (sparse Adam's `v + epsilon`, ...) must not feed the flag that
    # gates the updates
    after_updates = index.descendants(gated)
    aggregations = sorted(n for n in (optimizer_path & after_frontier) - after_updates
                          if nodes[n].op in AGGREGATION_OPS)
    gradient_aggregations = []
    for producer, _port in frontier:
        name = producer
        while nodes[name].op == "Identity" and nodes[name].input:
            name = split_ref(nodes[name].input[0])[0]
        if nodes[name].op in ("AddN", "AccumulateNV2") and name in in_scope \
                and name not in gradient_aggregations:
            gradient_aggregations.append(name)
    loss_unrelated = bool(differentiated) and loss not in index.descendants(differentiated)
    return TrainingPlan(loss, train_op, seeds, scopes, frontier, gated, optimizer_path,
                        aggregations, sorted(gradient_aggregations), forward_and_backward,
                        differentiated, deferred, initializer_groups(index, closure),
                        loss_unrelated)


def _deferred_updates(index: GraphIndex, roots: list[str], in_scope: set[str],
                      update_ops: set[str]) -> dict[str, list[str]]:
    """Variable writes the passes wait for only through control edges -> the nodes that wait.

    TF1 batch norm's `with tf.control_dependencies(UPDATE_OPS): train = opt.minimize(loss)`
    makes the moving-average assigns control inputs of the gradient ops. Nothing in the passes
    reads what they write, so the rewrite moves those control edges to the train op: the writes
    then run after the all-finite flag and are gated like every other update.
    """
    everything = index.ancestors(roots)
    control_only = everything - index.ancestors(roots, data_only=True) - in_scope
    writers = control_only & index.descendants(update_ops)  # writes, or waits for one
    waiting: dict[str, list[str]] = {}
    for name in sorted(everything - writers):
        for ref in index.nodes[name].input:
            producer, _port, control = split_ref(ref)
            if control and producer in writers:
                waiting.setdefault(producer, []).append(name)
    return waiting


def initializer_groups(index: GraphIndex, train_closure: set[str]) -> list[str]:
    """NoOps that run variable initializers (`init` from global_variables_initializer, ...)."""
    nodes = index.nodes
    groups = []
    for nd in nodes.values():
        if nd.op != "NoOp" or nd.name in train_closure:
            continue
        controls = [ref[1:] for ref in nd.input if ref.startswith("^")]
        if any(c in nodes and nodes[c].op in ("Assign", "AssignVariableOp")
               and c.endswith("/Assign") for c in controls):
            groups.append(nd.name)
    return groups
