"""The dynamic loss scaler: its rule (`LossScaleConfig`) and the subgraph that carries it out
inside a training graph (scale and good-step counter variables, scaled seeds, fp32 unscale,
one all-finite flag, Switch-gated updates, the scale update)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from ....errors import AmpError
from ..load import value_name
from .plan import TrainingPlan

SCOPE = "amp_loss_scale"
DEFAULT_LOSS_SCALE = {"fp16": "dynamic", "bf16": "none"}


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
    def parse(cls, spec: str | float | None, target: str, **rule) -> LossScaleConfig:
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
        if not _is_step_count(self.growth_interval):
            problems.append(f"the growth interval must be an integer from 1 to {STEP_COUNT_MAX}, "
                            f"got {self.growth_interval}")
        if not (math.isfinite(self.growth_factor) and self.growth_factor > 1):
            problems.append(f"the growth factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            problems.append(f"the backoff factor must be in (0, 1), got {self.backoff_factor}")
        if not (math.isfinite(self.min_scale) and self.min_scale > 0):
            problems.append(f"the minimum scale must be a finite number > 0, got "
                            f"{self.min_scale}")
        if not _is_step_count(self.hysteresis):
            problems.append(f"hysteresis must be an integer from 1 to {STEP_COUNT_MAX}, got "
                            f"{self.hysteresis}")
        if problems:
            raise AmpError("loss scale: " + "; ".join(problems))


#: The largest growth interval or hysteresis: the step counters they are compared with are int32.
STEP_COUNT_MAX = 2**31 - 1


def _is_step_count(value: object) -> bool:
    """Whether `value` is a whole number of steps an int32 counter can reach (1e23 or inf is
    not: TensorFlow could not even make the constant)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value == int(value) and 1 <= value <= STEP_COUNT_MAX)


class Rewires:
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


def _ref_of(tensor: tf.Tensor) -> str:
    return value_name(tensor.op.name, tensor.value_index)


def _lazy_read(variable, initial, scope: str) -> tf.Tensor:
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
class ScalerNames:
    """The names of the loss-scaling subgraph's tensors, variables and ops (for the report)."""

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


def build_loss_scaling(graph: tf.Graph, plan: TrainingPlan, config: LossScaleConfig,
                       rewires: Rewires) -> ScalerNames:
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

        unscaled: dict[tuple[str, int], tf.Tensor] = {}
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
        return ScalerNames(
            scale_value=scale.name,
            scale_variable=scale_var.handle.op.name if good_var is not None else None,
            good_steps_value=good.name if good is not None else None,
            good_steps_variable=good_var.handle.op.name if good_var is not None else None,
            bad_steps_variable=bad_var.handle.op.name if bad_var is not None else None,
            all_finite=finite.name, update=update, initializers=initializers)
