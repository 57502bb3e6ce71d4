"""TF1 training graphs: mixed-precision forward and backward passes, fp32 master weights, and a
dynamic loss-scaling subgraph inside the graph.

    result = rewrite_training_graph(graph, loss="loss", train_op="train", target="fp16")
    with tf.compat.v1.Session(graph=result.graph) as session: ...

What the rewrite does, in order:

1. Finds the parts of the graph: the train op's ancestors, the variable writes among them (the
   update ops), the gradient seeds tf.gradients made (`Fill(shape, 1)` under a `gradients/`
   scope), the gradient tensors that leave those scopes (the *frontier*), and the optimizer path
   between them and the updates (aggregation over towers, clipping, learning rates, slots).
2. Builds the loss-scaling subgraph (`amp_loss_scale/`): a scale variable and a good-step
   counter (local variables, read through an "initialized yet?" switch so any initializer
   works), the seeds multiplied by the scale, every frontier gradient multiplied by 1/scale in
   fp32, one all-finite flag over the unscaled gradients and every aggregation of them, each
   update op's inputs passed through Switch(flag) so that a bad step writes nothing, and the
   scale/counter update attached to the train op.
3. Converts the forward and backward passes with the inference op lists and passes; everything
   else (optimizer path, initializers, saver, the loss-scaling subgraph) is pinned to fp32 with
   its reason, so weights, slots, optimizer constants and the update stay fp32.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from .errors import AmpError
from .report import Report

import tensorflow as tf  # noqa: E402
from tensorflow.core.framework import graph_pb2, node_def_pb2  # noqa: E402
from tensorflow.core.protobuf import meta_graph_pb2  # noqa: E402

from . import tf_api  # noqa: E402
from .loaders.tf import parse_graph_input, value_name  # noqa: E402

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
SCOPE = "amp_loss_scale"
DEFAULT_LOSS_SCALE = {"fp16": "dynamic", "bf16": "none"}


def is_update_op(op: str) -> bool:
    """Whether `op` writes a variable (optimizer Apply ops, assigns, scatters)."""
    return op in _WRITE_OPS or op.startswith(_WRITE_PREFIXES)


def is_optimizer_op(op: str) -> bool:
    return op.startswith(("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply"))


# -- options and results -----------------------------------------------------------------------

@dataclass
class LossScaleConfig:
    """The dynamic loss scaler's rule and defaults (TF's DynamicLossScale values).

    mode: "dynamic" (the default for fp16), "none" (the default for bf16) or "fixed" (`initial`
    is used as a constant scale; bad steps are still skipped).
    """

    mode: str = "dynamic"
    initial: float = 2.0 ** 15
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    #: Consecutive bad steps tolerated before backing off (1: back off at once).
    hysteresis: int = 1

    @classmethod
    def parse(cls, spec: str | float | None, target: str, **rule) -> "LossScaleConfig":
        """`spec` as the CLI takes it: "dynamic", "none", a number (fixed scale) or None (the
        target's default). `rule` sets the other fields."""
        rule = {k: v for k, v in rule.items() if v is not None}
        if spec is None:
            spec = DEFAULT_LOSS_SCALE[target]
        if isinstance(spec, str) and spec.lower() in ("dynamic", "none"):
            config = cls(mode=spec.lower(), **rule)
        else:
            try:
                value = float(spec)
            except (TypeError, ValueError):
                raise AmpError(f"--loss-scale must be dynamic, none or a number, got "
                               f"{spec!r}") from None
            config = cls(mode="fixed", **{**rule, "initial": value})
        config.validate()
        return config

    def validate(self) -> None:
        problems = []
        if self.mode not in ("dynamic", "fixed", "none"):
            problems.append(f"mode must be dynamic, fixed or none, not {self.mode!r}")
        if not (math.isfinite(self.initial) and self.initial > 0):
            problems.append(f"the initial scale must be a finite number > 0, got {self.initial}")
        if not (int(self.growth_interval) == self.growth_interval and self.growth_interval >= 1):
            problems.append(f"the growth interval must be an integer >= 1, got "
                            f"{self.growth_interval}")
        if not (math.isfinite(self.growth_factor) and self.growth_factor > 1):
            problems.append(f"the growth factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            problems.append(f"the backoff factor must be in (0, 1), got {self.backoff_factor}")
        if not (math.isfinite(self.min_scale) and self.min_scale > 0):
            problems.append(f"the minimum scale must be a finite number > 0, got "
                            f"{self.min_scale}")
        if not (int(self.hysteresis) == self.hysteresis and self.hysteresis >= 1):
            problems.append(f"hysteresis must be an integer >= 1, got {self.hysteresis}")
        if problems:
            raise AmpError("loss scale: " + "; ".join(problems))


@dataclass
class TrainingRewrite:
    """What `rewrite_training_graph` returns.

    `loss` is the loss tensor's name ("loss:0") and `train_op` the train op's node name, ready
    for `session.run`. `loss_scale` and `good_steps` are tensors to fetch for the current scale
    and counter (they read the variables, or give the initial values before the first step); the
    variables themselves are `loss_scale_variable` and `good_steps_variable` (local variables,
    so a default Saver neither saves nor needs them and fp32 checkpoints restore into the graph).
    """

    graph: "tf.Graph"
    meta_graph_def: meta_graph_pb2.MetaGraphDef
    loss: str
    train_op: str
    loss_scale: str | None
    good_steps: str | None
    report: Report
    loss_scale_variable: str | None = None
    good_steps_variable: str | None = None
    bad_steps: str | None = None
    all_finite: str | None = None
    init_op: str | None = None


# -- graph analysis -----------------------------------------------------------------------------

def _split(ref: str) -> tuple[str, int, bool]:
    """NodeDef input -> (node, port, is_control)."""
    if ref.startswith("^"):
        return ref[1:], -1, True
    node, port = parse_graph_input(ref)
    return node, port, False


def _node_name(name_or_object) -> str:
    """A node name from a tf.Tensor / tf.Operation / "name" / "name:0"."""
    name = getattr(name_or_object, "name", name_or_object)
    if not isinstance(name, str) or not name:
        raise AmpError(f"expected a node or tensor name, got {name_or_object!r}")
    return name.lstrip("^").partition(":")[0]


class _GraphIndex:
    """Producers, consumers and ancestor walks over a GraphDef (iterative: graphs are big)."""

    def __init__(self, graph_def: graph_pb2.GraphDef):
        self.nodes = {nd.name: nd for nd in graph_def.node}
        self.consumers: dict[str, list[tuple[str, int, int]]] = {}  # node -> (consumer, slot, port)
        self.control_consumers: dict[str, list[str]] = {}
        for nd in graph_def.node:
            for slot, ref in enumerate(nd.input):
                producer, port, control = _split(ref)
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
                producer, _port, control = _split(ref)
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


def _const_value(nd: node_def_pb2.NodeDef) -> np.ndarray | None:
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
    index = _GraphIndex(graph_def)
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
        match = None
        for match in GRADIENT_SCOPE.finditer(name):
            pass
        # the seed sits right in the gradients scope (`gradients/grad_ys_0`, `gradients/Fill`);
        # Fill(shape, 1) inside an op's `*_grad/` scope is part of that op's gradient
        if nd.op != "Fill" or match is None or len(nd.input) < 2 or "/" in name[match.end():] \
                or not tf.as_dtype(nd.attr["T"].type).is_floating:
            continue
        value_node = nodes.get(_split(nd.input[1])[0])
        value = _const_value(value_node) if value_node is not None else None
        if value is not None and value.size == 1 and float(value.reshape(())) == 1.0:
            seeds.append(name)
            if name[:match.end()] not in scopes:
                scopes.append(name[:match.end()])
    if not seeds:
        raise AmpError(f"no gradients found in the ancestors of train op {train_op!r} (tf.gradients "
                       f"seeds its gradients with Fill(shape, 1) under a 'gradients/' scope): not "
                       f"a training graph?")
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
            producer, port, control = _split(ref)
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
            name = _split(nodes[name].input[0])[0]
        if nodes[name].op in ("AddN", "AccumulateNV2") and name in in_scope \
                and name not in gradient_aggregations:
            gradient_aggregations.append(name)
    loss_unrelated = bool(differentiated) and loss not in index.descendants(differentiated)
    return TrainingPlan(loss, train_op, seeds, scopes, frontier, gated, optimizer_path,
                        aggregations, sorted(gradient_aggregations), forward_and_backward,
                        differentiated, deferred, _initializer_groups(index, closure),
                        loss_unrelated)


def _deferred_updates(index: _GraphIndex, roots: list[str], in_scope: set[str],
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
            producer, _port, control = _split(ref)
            if control and producer in writers:
                waiting.setdefault(producer, []).append(name)
    return waiting


# -- building the loss-scaling subgraph ----------------------------------------------------------

class _Rewires:
    """NodeDef edits to make after export: input slots to replace and control inputs to add."""

    def __init__(self):
        self.inputs: dict[str, dict[int, str]] = {}
        self.controls: dict[str, list[str]] = {}
        self.dropped_controls: dict[str, set[str]] = {}

    def drop_control(self, node: str, op_name: str) -> None:
        self.dropped_controls.setdefault(node, set()).add(f"^{op_name}")

    def replace(self, node: str, slot: int, new_ref: str) -> None:
        self.inputs.setdefault(node, {})[slot] = new_ref

    def add_control(self, node: str, op_name: str) -> None:
        self.controls.setdefault(node, []).append(f"^{op_name}")

    def apply(self, graph_def: graph_pb2.GraphDef) -> None:
        for nd in graph_def.node:
            for slot, ref in self.inputs.get(nd.name, {}).items():
                nd.input[slot] = ref
            dropped = self.dropped_controls.get(nd.name)
            if dropped:
                kept = [ref for ref in nd.input if ref not in dropped]
                del nd.input[:]
                nd.input.extend(kept)
            for ref in self.controls.get(nd.name, []):
                if ref not in nd.input:
                    nd.input.append(ref)


def _ref_of(tensor: "tf.Tensor") -> str:
    return value_name(tensor.op.name, tensor.value_index)


def _lazy_read(variable, initial, scope: str) -> "tf.Tensor":
    """The variable's value, or `initial` while it is uninitialized: the scaler then works with
    whichever initializer the training script runs (global, local, or none)."""
    with variable.graph.name_scope(scope):
        is_set = tf.raw_ops.VarIsInitializedOp(resource=variable.handle, name="is_initialized")
        _unset_handle, set_handle = tf.raw_ops.Switch(data=variable.handle, pred=is_set,
                                                      name="switch_handle")
        stored = tf.raw_ops.ReadVariableOp(resource=set_handle, dtype=variable.dtype,
                                           name="stored")
        fallback, _ = tf.raw_ops.Switch(data=tf.constant(initial, variable.dtype, name="initial"),
                                        pred=is_set, name="switch_initial")
        value, _index = tf.raw_ops.Merge(inputs=[fallback, stored], name="merge")
        return tf.identity(value, name="value")


@dataclass
class _ScalerNames:
    scale_value: str
    scale_variable: str | None
    good_steps_value: str | None
    good_steps_variable: str | None
    bad_steps_variable: str | None
    all_finite: str
    update: str | None
    initializers: list[str]


def _scale_state(config: LossScaleConfig):
    """The scaler's variables (dynamic mode) or a constant scale (fixed mode)."""
    local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
    if config.mode == "fixed":
        return tf.constant(config.initial, tf.float32, name="scale"), None, None
    scale = tf.compat.v1.Variable(config.initial, dtype=tf.float32, trainable=False,
                                  use_resource=True, collections=local, name="scale")
    good = tf.compat.v1.Variable(0, dtype=tf.int32, trainable=False, use_resource=True,
                                 collections=local, name="good_steps")
    bad = None
    if config.hysteresis > 1:
        bad = tf.compat.v1.Variable(0, dtype=tf.int32, trainable=False, use_resource=True,
                                    collections=local, name="bad_steps")
    return scale, good, bad


def _scale_update(config: LossScaleConfig, scale, good, bad, finite) -> tuple[list, object, object]:
    """Assignments of the scaler's rule: grow after `growth_interval` good steps in a row (only
    to a finite value), back off on a bad step (after `hysteresis` of them), never below min."""
    growth_interval = tf.constant(int(config.growth_interval), tf.int32, name="growth_interval")
    good_next = tf.add(good, 1, name="good_next")
    grow = tf.logical_and(finite, good_next >= growth_interval, name="grow")
    grown = tf.multiply(scale, config.growth_factor, name="grown")
    grow_to_finite = tf.logical_and(grow, tf.math.is_finite(grown), name="grow_to_finite")
    scale_if_good = tf.where(grow_to_finite, grown, scale, name="scale_if_good")
    backed_off = tf.maximum(scale * config.backoff_factor, config.min_scale, name="backed_off")
    zero = tf.constant(0, tf.int32, name="zero")
    updates = []
    if bad is None:
        back_off = tf.logical_not(finite, name="back_off")
    else:
        bad_value = _lazy_read(bad, 0, "bad_steps_read")
        bad_next = tf.add(bad_value, 1, name="bad_next")
        back_off = tf.logical_and(tf.logical_not(finite), bad_next >= config.hysteresis,
                                  name="back_off")
        new_bad = tf.where(tf.logical_or(finite, back_off), zero, bad_next, name="new_bad_steps")
        updates.append(tf.raw_ops.AssignVariableOp(resource=bad.handle, value=new_bad,
                                                   name="assign_bad_steps"))
    scale_if_bad = tf.where(back_off, backed_off, scale, name="scale_if_bad")
    new_scale = tf.where(finite, scale_if_good, scale_if_bad, name="new_scale")
    new_good = tf.where(tf.logical_and(finite, tf.logical_not(grow)), good_next, zero,
                        name="new_good_steps")
    return updates, new_scale, new_good



def build_loss_scaling(graph: "tf.Graph", plan: TrainingPlan, config: LossScaleConfig,
                       rewires: _Rewires) -> _ScalerNames:
    """Add the loss-scaling subgraph to `graph` (imported from the training graph); record in
    `rewires` the edits to the original nodes (seeds, gradient readers, update ops, train op)."""
    with graph.as_default(), graph.name_scope(SCOPE):
        scale_var, good_var, bad_var = _scale_state(config)
        if config.mode == "dynamic":
            scale = _lazy_read(scale_var, config.initial, "scale_read")
            good = _lazy_read(good_var, 0, "good_steps_read")
        else:
            scale, good = scale_var, None

        with graph.name_scope("scale_seeds"):
            for seed in plan.seeds:
                fill = graph.get_operation_by_name(seed)
                one = fill.inputs[1]
                scaled = tf.multiply(one, tf.cast(scale, one.dtype), name="scaled")
                rewires.replace(seed, 1, _ref_of(scaled))

        unscaled: dict[tuple[str, int], "tf.Tensor"] = {}
        checks = []
        with graph.name_scope("unscale"):
            inverse = tf.math.reciprocal(scale, name="inverse_scale")
            for (producer, port), readers in sorted(plan.frontier.items()):
                gradient = graph.get_operation_by_name(producer).outputs[port]
                if not gradient.dtype.is_floating:
                    continue  # IndexedSlices indices and shapes are not scaled
                value = tf.multiply(gradient, tf.cast(inverse, gradient.dtype), name="unscaled")
                unscaled[(producer, port)] = value
                checks.append(value)
                for reader in readers:
                    for slot, tensor in enumerate(graph.get_operation_by_name(reader).inputs):
                        if (tensor.op.name, tensor.value_index) == (producer, port):
                            rewires.replace(reader, slot, _ref_of(value))
        for name in plan.aggregations:
            for tensor in graph.get_operation_by_name(name).outputs:
                if tensor.dtype.is_floating:
                    checks.append(tensor)

        with graph.name_scope("check"):
            flags = [tf.reduce_all(tf.math.is_finite(t), name="finite") for t in checks]
            finite = tf.reduce_all(tf.stack(flags, name="flags"), name="all_finite")

        with graph.name_scope("gate"):
            for name in plan.update_ops:
                op = graph.get_operation_by_name(name)
                for slot, tensor in enumerate(op.inputs):
                    source = unscaled.get((tensor.op.name, tensor.value_index), tensor)
                    if tensor.dtype._is_ref_dtype:
                        switched = tf.raw_ops.RefSwitch(data=source, pred=finite, name="switch")
                    else:
                        switched = tf.raw_ops.Switch(data=source, pred=finite, name="switch")
                    rewires.replace(name, slot, _ref_of(switched[1]))

        update, initializers = None, []
        if config.mode == "dynamic":
            with graph.name_scope("update"):
                assigns, new_scale, new_good = _scale_update(config, scale, good, bad_var, finite)
                assigns.append(tf.raw_ops.AssignVariableOp(resource=scale_var.handle,
                                                           value=new_scale, name="assign_scale"))
                assigns.append(tf.raw_ops.AssignVariableOp(resource=good_var.handle,
                                                           value=new_good,
                                                           name="assign_good_steps"))
                update = tf.group(*assigns, name="update").name
            initializers = [v.initializer.name for v in (scale_var, good_var, bad_var)
                            if v is not None]
        rewires.add_control(plan.train_op, update or finite.op.name)
        return _ScalerNames(
            scale_value=scale.name,
            scale_variable=scale_var.handle.op.name if good_var is not None else None,
            good_steps_value=good.name if good is not None else None,
            good_steps_variable=good_var.handle.op.name if good_var is not None else None,
            bad_steps_variable=bad_var.handle.op.name if bad_var is not None else None,
            all_finite=finite.name, update=update, initializers=initializers)


# -- the whole rewrite ----------------------------------------------------------------------------

def as_meta_graph(source) -> meta_graph_pb2.MetaGraphDef:
    """A copy of the training graph as a MetaGraphDef, from a tf.Graph, GraphDef, MetaGraphDef or
    a file (.meta, .pb, .pbtxt)."""
    meta = meta_graph_pb2.MetaGraphDef()
    if isinstance(source, meta_graph_pb2.MetaGraphDef):
        meta.CopyFrom(source)
    elif isinstance(source, graph_pb2.GraphDef):
        meta.graph_def.CopyFrom(source)
    elif isinstance(source, tf.Graph):
        with source.as_default():
            meta.CopyFrom(tf.compat.v1.train.export_meta_graph(graph=source))
    elif isinstance(source, (str, os.PathLike)):
        if Path(source).suffix == ".meta":
            meta.CopyFrom(tf_api.read_meta_graph(source))
        else:
            meta.graph_def.CopyFrom(tf_api.read_graphdef(source))
    else:
        raise AmpError(f"expected a tf.Graph, GraphDef, MetaGraphDef or file path, got "
                       f"{type(source).__name__}")
    return meta


def _collection_train_op(meta: meta_graph_pb2.MetaGraphDef) -> str:
    entries = meta.collection_def["train_op"].node_list.value \
        if "train_op" in meta.collection_def else []
    names = list(dict.fromkeys(_node_name(e) for e in entries))
    if len(names) != 1:
        raise AmpError("name the train op (--train-op NAME): the graph has "
                       + ("no 'train_op' collection" if not names
                          else f"{len(names)} train ops in its 'train_op' collection"))
    return names[0]


def _initializer_groups(index: _GraphIndex, train_closure: set[str]) -> list[str]:
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


def _pins(plan: TrainingPlan, original: set[str], graph_def: graph_pb2.GraphDef
          ) -> dict[str, str]:
    pins = {}
    for nd in graph_def.node:
        name = nd.name
        if name == plan.loss or name in plan.losses_differentiated:
            pins[name] = "the loss stays fp32"
        elif name not in original:
            pins[name] = "loss-scaling subgraph: fp32 by design"
        elif name in plan.gradient_aggregations:
            pins[name] = ("adds up the gradients of a variable used more than once: gradients "
                          "return to fp32 before aggregation")
        elif name in plan.optimizer_path:
            pins[name] = ("optimizer and update path: fp32 master weights, optimizer slots and "
                          "constants, gradients after they leave the backward pass")
        elif name not in plan.converted_region:
            pins[name] = ("outside the forward and backward passes (initializers, saver, "
                          "summaries): left in fp32")
    return pins


def _loss_port(loss) -> int:
    """The output index the caller named ("loss:1" -> 1; a node name or None -> 0)."""
    name = getattr(loss, "name", loss)
    if isinstance(name, str) and ":" in name:
        port = name.rpartition(":")[2]
        return int(port) if port.isdigit() else 0
    return 0


def rewrite_training_meta_graph(
        source, loss=None, train_op=None, target: str = "fp16", backend: str | None = None,
        loss_scale: str | float | None = None, *, initial_scale: float | None = None,
        growth_interval: int | None = None, growth_factor: float | None = None,
        backoff_factor: float | None = None, min_scale: float | None = None,
        hysteresis: int | None = None, allow: Iterable[str] = (), infer: Iterable[str] = (),
        deny: Iterable[str] = (), clear: Iterable[str] = (), keep_nodes: Iterable[str] = (),
        config: str | os.PathLike | None = None, clamp: bool = False
        ) -> tuple[meta_graph_pb2.MetaGraphDef, dict, Report]:
    """The rewrite as protos: (MetaGraphDef, names, report). See `rewrite_training_graph`."""
    from .passes.base import TARGET_DTYPES

    if target not in TARGET_DTYPES:
        raise AmpError(f"unknown target {target!r} (expected fp16 or bf16)")
    scaler = LossScaleConfig.parse(loss_scale, target, initial=initial_scale,
                                   growth_interval=growth_interval, growth_factor=growth_factor,
                                   backoff_factor=backoff_factor, min_scale=min_scale,
                                   hysteresis=hysteresis)
    meta = as_meta_graph(source)
    train_op_name = _node_name(train_op) if train_op is not None else _collection_train_op(meta)
    plan = plan_training_graph(meta.graph_def, _node_name(loss) if loss is not None else None,
                               train_op_name)
    original = {nd.name for nd in meta.graph_def.node}

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.train.import_meta_graph(meta, clear_devices=False)
    rewires = _Rewires()
    for writer, waiting in plan.deferred.items():
        for name in waiting:
            rewires.drop_control(name, writer)
        rewires.add_control(plan.train_op, writer)
    scaler_names = None
    if scaler.mode != "none":
        scaler_names = build_loss_scaling(graph, plan, scaler, rewires)
        for group in plan.initializer_groups:
            for initializer in scaler_names.initializers:
                rewires.add_control(group, initializer)
    with graph.as_default():
        exported = tf.compat.v1.train.export_meta_graph(
            graph=graph, saver_def=meta.saver_def if meta.HasField("saver_def") else None)
    for key, signature in meta.signature_def.items():
        exported.signature_def[key].CopyFrom(signature)
    rewires.apply(exported.graph_def)

    fetches = [plan.loss, plan.train_op] + tf_api.meta_graph_fetches(exported)
    if scaler_names is not None:
        fetches += [scaler_names.scale_value, scaler_names.all_finite]
        fetches += [scaler_names.good_steps_value] if scaler_names.good_steps_value else []
    fetches = list(dict.fromkeys(fetches))
    converted, report = tf_api.convert_graphdef(
        exported.graph_def, fetches, target, backend, clamp=clamp, allow=allow, infer=infer,
        deny=deny, clear=clear, keep_nodes=keep_nodes, config=config,
        pins=_pins(plan, original, exported.graph_def))
    if report.summary["low_precision_nodes"] == 0:
        raise AmpError(f"nothing in the forward or backward pass can run in {target}: the graph "
                       f"has no float32 compute ops (MatMul, Conv2D, ...) to convert")
    exported.graph_def.CopyFrom(converted)
    if plan.loss_unrelated:
        report.warnings.append(f"loss {plan.loss!r} is neither the tensor the gradients are taken "
                               f"of ({', '.join(plan.losses_differentiated)}) nor computed from it")

    loss_port = _loss_port(loss)
    names = {"loss": f"{plan.loss}:{loss_port}", "train_op": plan.train_op}
    if scaler_names is not None:
        names.update(loss_scale=scaler_names.scale_value,
                     loss_scale_variable=scaler_names.scale_variable,
                     good_steps=scaler_names.good_steps_value,
                     good_steps_variable=scaler_names.good_steps_variable,
                     bad_steps_variable=scaler_names.bad_steps_variable,
                     all_finite=scaler_names.all_finite)
    report.training = {
        **names,
        "loss_scale_rule": asdict(scaler),
        "gradient_seeds_scaled": plan.seeds if scaler_names else [],
        "gradients_unscaled": sum(1 for _ in plan.frontier) if scaler_names else 0,
        "update_ops_gated": plan.update_ops if scaler_names else [],
        "updates_moved_after_backward_pass": sorted(plan.deferred),
        "finite_checks": (len(plan.frontier) + len(plan.aggregations)) if scaler_names else 0,
        "nodes_pinned_fp32": sum(1 for n in report.nodes
                                 if n.get("class") == "fp32" and n["name"] in plan.optimizer_path),
    }
    return exported, names, report


def rewrite_training_graph(
        graph_or_graph_def_or_meta_graph, loss=None, train_op=None, target: str = "fp16",
        backend: str | None = None, loss_scale: str | float | None = None,
        **options) -> TrainingRewrite:
    """Rewrite a TF1 training graph to mixed precision with fp32 master weights and loss scaling.

    Args:
        graph_or_graph_def_or_meta_graph: a tf.Graph (its collections come along), a GraphDef,
            a MetaGraphDef or a path to one (.meta, .pb, .pbtxt). It is not modified.
        loss: the loss tensor, op or name (default: the one tensor the gradients are taken of).
        train_op: the train op or its name (default: the `train_op` collection's only entry).
        target: "fp16" or "bf16".
        backend: "tf-gpu" or "tf-cpu" (default: tf-gpu for fp16, tf-cpu for bf16).
        loss_scale: "dynamic" (fp16 default), "none" (bf16 default) or a number (fixed scale).
        **options: initial_scale (2**15), growth_interval (2000), growth_factor (2),
            backoff_factor (0.5), min_scale (1), hysteresis (1), and the op-list overrides of
            convert (allow, infer, deny, clear, keep_nodes, config, clamp).

    Returns:
        A TrainingRewrite: a new tf.Graph ready for a tf.compat.v1 Session (collections and
        saver of the input restored), the names of the loss, train op, scale and counter, and
        the conversion report (with a `training` section).
    """
    meta, names, report = rewrite_training_meta_graph(
        graph_or_graph_def_or_meta_graph, loss, train_op, target, backend, loss_scale, **options)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.train.import_meta_graph(meta, clear_devices=False)
    return TrainingRewrite(graph=graph, meta_graph_def=meta, report=report,
                           loss=names["loss"], train_op=names["train_op"],
                           loss_scale=names.get("loss_scale"), good_steps=names.get("good_steps"),
                           loss_scale_variable=names.get("loss_scale_variable"),
                           good_steps_variable=names.get("good_steps_variable"),
                           bad_steps=names.get("bad_steps_variable"),
                           all_finite=names.get("all_finite"))


def convert_training_file(input_path: str | os.PathLike, output_path: str | os.PathLike,
                          loss: str | None = None, train_op: str | None = None, **options
                          ) -> Report:
    """`convert --training`: a .meta (or a .pb/.pbtxt with --loss and --train-op) in, the
    rewritten graph out in the output's format (.meta keeps collections, signatures, saver)."""
    input_path, output_path = Path(input_path), Path(output_path)
    if output_path.exists() and input_path.exists() and os.path.samefile(input_path, output_path):
        raise AmpError("the output path is the input: refusing to overwrite the input")
    if tf_api.is_saved_model_dir(input_path):
        raise AmpError("--training takes a TF1 training graph (.meta, or .pb/.pbtxt with --loss "
                       "and --train-op), not a SavedModel")
    meta, _names, report = rewrite_training_meta_graph(input_path, loss, train_op, **options)
    if output_path.suffix == ".meta":
        tf_api.write_graphdef(meta, output_path)
    else:
        tf_api.write_graphdef(meta.graph_def, output_path)
    return report


# -- check --------------------------------------------------------------------------------------

#: Ops a constant passes through unchanged on its way to an optimizer input.
_PASS_THROUGH = frozenset({"Identity", "Snapshot", "StopGradient", "Cast", "Switch", "RefSwitch"})
_LOW_TF_DTYPES = {tf.float16.as_datatype_enum: "fp16", tf.bfloat16.as_datatype_enum: "bf16"}


def _in_dtype(value: np.ndarray, target: str) -> np.ndarray:
    import ml_dtypes  # ships with TensorFlow

    low = np.float16 if target == "fp16" else ml_dtypes.bfloat16
    with np.errstate(over="ignore"):
        return np.asarray(value, np.float32).astype(low).astype(np.float32)


def _trace_constant(nodes: dict, ref: str) -> tuple[np.ndarray | None, str | None, str]:
    """Follow `ref` back through Identity/Cast to a Const: (value, first low-precision type on
    the way or None, the Const's name)."""
    low = None
    name = _split(ref)[0]
    for _ in range(64):
        nd = nodes.get(name)
        if nd is None:
            return None, None, name
        if nd.op == "Const":
            dtype = nd.attr["dtype"].type
            low = low or _LOW_TF_DTYPES.get(dtype)
            return _const_value(nd), low, name
        if nd.op not in _PASS_THROUGH or not nd.input:
            return None, None, name
        if nd.op == "Cast":
            low = low or _LOW_TF_DTYPES.get(nd.attr["DstT"].type)
        name = _split(nd.input[0])[0]
    return None, None, name


def check_tf_graph(path: str | os.PathLike, target: str | None = None,
                   backend: str | None = None):
    """`check` for TensorFlow graphs (.meta, .pb, .pbtxt): optimizer updates in low precision,
    optimizer constants (Adam's epsilon, learning rates) that underflow or overflow in the low
    precision type they are cast to, and deny-list ops running in low precision."""
    from tensorflow.python.framework import op_def_registry

    from .check import CheckResult
    from .ir import DENY

    meta = as_meta_graph(path)
    nodes = {nd.name: nd for nd in meta.graph_def.node}
    if target is None:
        found = [_LOW_TF_DTYPES[a.type] for nd in meta.graph_def.node for a in nd.attr.values()
                 if a.type in _LOW_TF_DTYPES]
        target = found[0] if found else "fp16"
    result = CheckResult(target)
    for nd in meta.graph_def.node:
        if not is_update_op(nd.op):
            continue
        op_def = op_def_registry.get(nd.op)
        dtype = nd.attr["T"].type if "T" in nd.attr else nd.attr["dtype"].type
        if dtype in _LOW_TF_DTYPES and is_optimizer_op(nd.op):
            result.problems.append({
                "kind": "low_precision_update", "node": nd.name, "op": nd.op,
                "message": f"{nd.name} ({nd.op}) updates its variable in "
                           f"{_LOW_TF_DTYPES[dtype]}: optimizer updates need fp32 master "
                           f"weights"})
        if op_def is None or not is_optimizer_op(nd.op):
            continue
        data_inputs = [ref for ref in nd.input if not ref.startswith("^")]
        for arg, ref in zip(op_def.input_arg, data_inputs):
            if arg.is_ref or arg.name in ("var", "accum", "m", "v", "ms", "mom", "mg", "grad",
                                          "indices", "linear", "accum_update"):
                continue
            value, low, const = _trace_constant(nodes, ref)
            if value is None or value.dtype.kind != "f" or value.size != 1:
                continue
            v = float(np.asarray(value, np.float32).reshape(()))
            where = f"{nd.name} input {arg.name!r} (constant {const}, {v:g})"
            if low is not None:
                stored = float(_in_dtype(v, low).reshape(()))
                if v != 0 and stored == 0:
                    kind, detail = "optimizer_constant_underflow", f"underflows to 0 in {low}"
                elif math.isfinite(v) and not math.isfinite(stored):
                    kind, detail = "optimizer_constant_overflow", f"overflows to inf in {low}"
                elif v == 0 and arg.name == "epsilon":
                    kind, detail = "optimizer_constant_underflow", f"is 0 in {low}"
                else:
                    continue
                result.problems.append({"kind": kind, "node": nd.name, "constant": const,
                                        "message": f"{where} {detail}"})
            elif v != 0 and float(_in_dtype(v, target).reshape(())) == 0:
                result.notes.append(f"{where} would underflow in {target}; it is fp32 here and "
                                    f"amp-rewriter keeps optimizer constants fp32")
    lists = tf_api.load_tf_lists(target, backend or tf_api.default_backend(target))
    for nd in meta.graph_def.node:
        op_class, why = lists.class_of(nd.op)
        if op_class == DENY and any(a.type in _LOW_TF_DTYPES for a in nd.attr.values()):
            result.problems.append({
                "kind": "deny_op_in_low_precision", "node": nd.name, "op": nd.op,
                "message": f"{nd.name} ({nd.op}) runs in low precision but is on the {target} "
                           f"deny list: {why}"})
    return result
