"""The training passes: fp32 master weights and in-graph loss scaling on a `TrainingPlan`.

They run before the precision passes (pipeline `tf-training`), each with one job, in order:

- `pin_training_path` keeps the loss, the optimizer path and what lies outside the forward and
  backward passes fp32, with the plan's reason for each;
- `move_waited_writes` makes the step wait for variable writes the backward pass waited for by
  control edges (so they can wait for the all-finite flag in turn);
- `create_loss_scale_state` makes the scaler's state (scale and counters, joining the graph's
  initializers), or the constant scale of a fixed rule;
- `scale_gradient_seeds` multiplies each seed by the scale (the same as scaling the loss);
- `fold_unscale_into_optimizer` decides where 1/scale goes (`UpdateOptions.unscale`) and, when
  it is the optimizer, multiplies each update's learning rate or epsilon by the power of the
  gradients' factor that leaves the step unchanged (`ScaleFold`);
- `accumulate_gradients` (training/accumulation.py, with `accumulate` > 1) sums the gradients
  of a window of micro-steps into fp32 accumulators that the optimizer path reads instead;
- `unscale_gradients` multiplies each gradient (or window sum) by 1/(scale x micro-steps) in
  fp32 where it leaves the backward pass, before any aggregation, clipping or optimizer reads
  it, unless that was folded into the optimizer;
- `check_gradients_finite` computes one all-finite flag over those gradients and every
  aggregation of them (and, accumulating, over every micro-step of the window);
- `gate_variable_writes` makes every variable write wait for the format's gate on that flag
  (and, accumulating, on the window's last micro-step);
- `update_loss_scale` writes the rule's next state (`LossScaleRule.step`, node for node, once
  per window) and makes the step wait for it;
- `release_step_results` makes what the step returns on every step (a TF2 function's return
  values) wait for the ops' `settle` node instead of for the gated writes, so a bad step still
  returns them.

The passes of 16-bit weights (training/weights.py) run between `move_waited_writes` and
`create_loss_scale_state`. With the rule's mode "none" and no accumulation the scaler's passes
do nothing (no scale, no check, no gate).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import AmpError
from ..ir import FLOAT32, Node, Value, decisions
from ..passes.base import PassContext, register_pass
from .ops import StateVariable, StoredVariable, TrainingOps
from .plan import GradientExit, TrainingPlan, nodes_after, nodes_before
from .rule import LossScaleRule
from .update import UpdateOptions

LOSS_REASON = "the loss stays fp32"
GRADIENT_SUM_REASON = ("adds up the gradients of a variable used more than once: gradients "
                       "return to fp32 before aggregation")
OPTIMIZER_REASON = ("optimizer and update path: fp32 master weights, optimizer slots and "
                    "constants, gradients after they leave the backward pass")
OUTSIDE_REASON = ("outside the forward and backward passes (initializers, saver, summaries): "
                  "left in fp32")


@dataclass
class TrainingContext:
    """A front end's plan, the loss-scale rule and the format's ops, and what the training
    passes made (for the front end's report and names)."""

    plan: TrainingPlan
    rule: LossScaleRule
    ops: TrainingOps
    update_options: UpdateOptions = field(default_factory=UpdateOptions)
    #: The scale a step uses (a state variable's value, or a constant for a fixed rule).
    scale: Value | None = None
    scale_state: StateVariable | None = None
    good_steps: StateVariable | None = None
    bad_steps: StateVariable | None = None
    unscaled: list[Value] = field(default_factory=list)
    all_finite: Value | None = None
    gate: Node | None = None
    #: What the step waits for to update the scaler's state.
    update: Node | None = None
    #: What the step's results wait for instead of the gated writes (`release_step_results`).
    settled: Node | None = None
    #: The nodes that stopped waiting for a gated write, by name.
    released: list[str] = field(default_factory=list)
    #: Every node the training passes added, in the order they were made.
    added: list[Node] = field(default_factory=list)
    #: The variables stored in 16 bits, and the step counter their random bits are keyed by.
    stored: list[StoredVariable] = field(default_factory=list)
    rounding_step: StateVariable | None = None
    #: Where 1/scale went ("gradients" or "optimizer"), why, and each input it was folded into
    #: (write, input, multiplier).
    unscale: str = "gradients"
    unscale_reason: str = ""
    folded: list[tuple[str, str, float]] = field(default_factory=list)
    #: The gradients the optimizer path reads where they leave the backward pass (None: the
    #: plan's frontier; accumulating: each window's sums).
    gradients: list[GradientExit] | None = None
    window: AccumulationWindow | None = None

    def states(self) -> list[StateVariable]:
        """The scaler's state variables (none for a fixed or absent scale)."""
        return [s for s in (self.scale_state, self.good_steps, self.bad_steps) if s is not None]

    def gradient_exits(self) -> list[GradientExit]:
        """The gradients the optimizer path reads, where they leave the backward pass."""
        return self.plan.frontier if self.gradients is None else self.gradients

    @property
    def checks(self) -> bool:
        """Whether steps are checked for non-finite gradients and gated (a loss scale, or a
        window of micro-steps whose writes wait for its end)."""
        return self.rule.scales or self.window is not None


@dataclass
class AccumulationWindow:
    """What `accumulate_gradients` made that the later passes read: whether this micro-step
    ends the window (writes apply, the scaler updates) and whether every micro-step of the
    window so far had finite gradients."""

    boundary: Value
    finite: Value
    state: list[StateVariable] = field(default_factory=list)


def training_of(ctx: PassContext) -> TrainingContext:
    """The training context a front end put on `ctx` (a training pass needs one)."""
    if ctx.training is None:
        raise ValueError("a training pass runs without a training plan (the front end puts a "
                         "TrainingContext on the PassContext)")
    return ctx.training


def commit(training: TrainingContext) -> int:
    """Put the nodes the format's ops made into the graph; returns how many (the training
    passes' count of what they changed)."""
    added = training.ops.commit()
    training.added.extend(added)
    return len(added)


@register_pass("pin_training_path")
def pin_training_path(ctx: PassContext) -> tuple[int, list[str]]:
    """Pin the loss, the optimizer path and what lies outside the forward and backward passes
    fp32, each with the plan's reason (a user's --keep-node and a loader's pins come first)."""
    plan = training_of(ctx).plan
    reasons: dict[Node, str] = {}
    loss_nodes = [*plan.differentiated] + ([plan.loss.producer] if plan.loss.producer else [])
    for nodes, reason in ((loss_nodes, LOSS_REASON), (plan.gradient_sums, GRADIENT_SUM_REASON),
                          (plan.optimizer_path, OPTIMIZER_REASON)):
        for node in nodes:
            reasons.setdefault(node, reason)
    compute: set[Node] = set(plan.compute)
    pinned = 0
    for node in ctx.model.graph.nodes:
        reason = reasons.get(node) or (OUTSIDE_REASON if node not in compute else "")
        if reason and not node.pin_reason:
            node.pin_reason, node.pin_kind, node.pin_barrier = reason, decisions.PIN, True
            pinned += 1
    return pinned, []


@register_pass("move_waited_writes")
def move_waited_writes(ctx: PassContext) -> tuple[int, list[str]]:
    """Variable writes the forward or backward pass waits for by control edges (TF1's
    UPDATE_OPS) are waited for by the step instead, so they can wait for the all-finite flag."""
    plan = training_of(ctx).plan
    for writer, waiter in plan.deferred:
        waiter.remove_control_input(writer)
        plan.step.add_control_input(writer)
    if plan.deferred:
        ctx.model.graph.sort_nodes()
    moved = sorted({writer.name for writer, _ in plan.deferred})
    return len(moved), [f"moved after the backward pass: {', '.join(moved)}"] if moved else []


@register_pass("create_loss_scale_state")
def create_loss_scale_state(ctx: PassContext) -> tuple[int, list[str]]:
    """Make the scaler's state: the scale and its good-step counter (and a bad-step counter
    for hysteresis) as variables whose initializers join the graph's, or a constant scale."""
    training = training_of(ctx)
    rule, ops = training.rule, training.ops
    if not rule.scales:
        return 0, ["no loss scale"]
    initial = np.float32(rule.initial_scale)
    if not rule.dynamic:
        training.scale = ops.constant(np.asarray(initial), "scale")
        return commit(training), [f"fixed scale {rule.initial_scale:g}"]
    training.scale_state = ops.state_variable("scale", np.asarray(initial))
    training.good_steps = ops.state_variable("good_steps", np.asarray(0, np.int32))
    if rule.counts_bad_steps:
        training.bad_steps = ops.state_variable("bad_steps", np.asarray(0, np.int32))
    training.scale = training.scale_state.value
    initializers = [s.initializer for s in training.states() if s.initializer is not None]
    for group in training.plan.initializers:
        group.add_control_inputs(initializers)
    changed = commit(training)
    ctx.model.graph.sort_nodes()
    return changed, [f"state: {', '.join(s.name for s in training.states())}"]


def _scale(training: TrainingContext) -> Value:
    if training.scale is None:
        raise ValueError("the scale is made by create_loss_scale_state, which runs first")
    return training.scale


@register_pass("scale_gradient_seeds")
def scale_gradient_seeds(ctx: PassContext) -> tuple[int, list[str]]:
    """Multiply each gradient seed by the loss scale (the same as scaling the loss)."""
    training = training_of(ctx)
    if not training.rule.scales:
        return 0, []
    ops, scale = training.ops, _scale(training)
    for seed in training.plan.seeds:
        ctx.focus = seed.node
        one = seed.value
        scaled = ops.multiply(one, ops.cast(scale, _dtype(one), "scale_seeds/scale"),
                              "scale_seeds/scaled")
        seed.node.set_input(seed.slot, scaled)
    commit(training)
    return len(training.plan.seeds), []


@register_pass("fold_unscale_into_optimizer")
def fold_unscale_into_optimizer(ctx: PassContext) -> tuple[int, list[str]]:
    """Decide where 1/scale goes (`--unscale`) and, for the optimizer, multiply each update's
    learning rate or epsilon by the power of the gradients' factor that leaves its step as it
    was (one scalar product per input instead of one product per gradient)."""
    training = training_of(ctx)
    if not training.rule.scales:
        return 0, []
    mode, reason = _unscale_choice(training)
    training.unscale, training.unscale_reason = mode, reason
    if mode != "optimizer":
        return 0, [f"1/scale multiplies the gradients: {reason}"]
    ops, factor = training.ops, _gradient_factor(training)
    folded: dict[tuple[Value, int], Value] = {}
    for write in training.plan.writes:
        fold = write.scale_fold
        if fold is None or not write.gradient_slots:
            continue
        ctx.focus = write.node
        value = write.node.inputs[fold.slot]
        assert value is not None
        multiplier = float(np.float32(np.float64(factor) ** fold.power))
        product = folded.get((value, fold.power))
        if product is None:
            constant = ops.constant(np.asarray(multiplier, np.float32), "unscale/fold")
            product = ops.multiply(value, ops.cast(constant, _dtype(value), "unscale/fold"),
                                   "unscale/folded")
            folded[(value, fold.power)] = product
        write.node.set_input(fold.slot, product)
        training.folded.append((write.node.name, fold.what, multiplier))
    commit(training)
    return len(training.folded), [f"1/scale folded into {len(training.folded)} updates: "
                                  f"{reason}"]


def _gradient_factor(training: TrainingContext) -> float:
    """What the gradients the optimizer reads are multiplied by: the fixed scale, times the
    window's micro-steps when they are summed."""
    return float(np.float32(training.rule.initial_scale)) * training.update_options.accumulate


def _unscale_choice(training: TrainingContext) -> tuple[str, str]:
    """("gradients" or "optimizer", why) for `--unscale`; AmpError when `optimizer` is asked
    for and cannot be done."""
    asked, rule, plan = training.update_options.unscale, training.rule, training.plan
    if asked == "gradients":
        return "gradients", "--unscale gradients"
    obstacle = ""
    if rule.dynamic:
        obstacle = ("the loss scale is dynamic: the optimizer's slots would hold gradients of "
                    "different scales")
    elif not plan.linear_gradient_path:
        obstacle = ("the gradients reach the updates through more than sums and means "
                    "(clipping, or a second reader)")
    else:
        unfit = [w.node for w in plan.writes if w.gradient_slots and w.scale_fold is None]
        if unfit:
            obstacle = (f"{unfit[0].name} ({unfit[0].op_type}) has no exact fold (see "
                        f"--unscale in the README)")
    if obstacle and asked == "optimizer":
        raise AmpError(f"--unscale optimizer: {obstacle}")
    if obstacle:
        return "gradients", obstacle
    factor = _gradient_factor(training)
    if asked == "auto" and np.frexp(factor)[0] != 0.5:
        return "gradients", (f"the gradients' factor {factor:g} is not a power of two: folding "
                             f"would round")
    keeping = [w.node for w in plan.writes if w.gradient_slots and w.state_slots]
    if asked == "auto" and keeping:
        # exact for the weights, but the optimizer's state would hold scaled gradients: the
        # checkpoint's momentum, m and v would change (--unscale optimizer accepts that)
        return "gradients", (f"{keeping[0].name} ({keeping[0].op_type}) keeps optimizer state, "
                             f"which would hold gradients times {factor:g}")
    exact = "exact: a power of two" if np.frexp(factor)[0] == 0.5 else "within rounding"
    return "optimizer", f"--unscale {asked}: a fixed factor {factor:g} ({exact})"


@register_pass("unscale_gradients")
def unscale_gradients(ctx: PassContext) -> tuple[int, list[str]]:
    """Multiply each gradient by 1/scale (1/(scale x micro-steps) for a window's sum) in fp32
    where it leaves the backward pass: every reader outside it (aggregation, clipping, the
    optimizer) reads the unscaled gradient. Nothing when that was folded into the optimizer."""
    training = training_of(ctx)
    steps = training.update_options.accumulate
    if training.unscale == "optimizer" or (not training.rule.scales and steps == 1):
        return 0, []
    ops = training.ops
    if not training.rule.scales:
        inverse = ops.constant(np.asarray(1.0 / steps, np.float32), "unscale/inverse_steps")
    elif steps == 1:
        inverse = ops.reciprocal(_scale(training), "unscale/inverse_scale")
    else:
        window = ops.multiply(_scale(training), ops.constant(np.asarray(steps, np.float32),
                                                             "unscale/steps"), "unscale/window")
        inverse = ops.reciprocal(window, "unscale/inverse_scale")
    for exit_ in training.gradient_exits():
        gradient = exit_.value
        ctx.focus = gradient.producer
        unscaled = ops.multiply(gradient, ops.cast(inverse, _dtype(gradient), "unscale/inverse"),
                                "unscale/unscaled")
        for reader, slot in exit_.readers:
            reader.set_input(slot, unscaled)
        training.unscaled.append(unscaled)
    commit(training)
    return len(training.unscaled), []


@register_pass("check_gradients_finite")
def check_gradients_finite(ctx: PassContext) -> tuple[int, list[str]]:
    """One all-finite flag over every gradient the optimizer path reads and every aggregation
    of them (towers, replicas): a non-finite gradient anywhere makes the whole step bad; a
    window is bad when any of its micro-steps was."""
    training = training_of(ctx)
    if not training.checks:
        return 0, []
    checked = (training.unscaled or [e.value for e in training.gradient_exits()]) \
        + training.plan.aggregations
    flag = training.ops.all_finite(checked, "check/all_finite")
    if training.window is not None:
        flag = training.ops.both(flag, training.window.finite, "check/window_finite")
    training.all_finite = flag
    commit(training)
    return len(checked), []


@register_pass("gate_variable_writes")
def gate_variable_writes(ctx: PassContext) -> tuple[int, list[str]]:
    """Make every variable write (optimizer updates, slots, assigns, scatters, step counters)
    wait for the gate on the all-finite flag (and on the window's end, accumulating): a bad
    step writes nothing but the scaler's state."""
    training = training_of(ctx)
    if not training.checks or training.all_finite is None:
        return 0, []
    flag = training.all_finite
    if training.window is not None:
        flag = training.ops.both(flag, training.window.boundary, "gate/window_ends")
    training.gate = training.ops.gate(flag, "gate/apply")
    commit(training)
    for write in training.plan.writes:
        write.node.add_control_input(training.gate)
    ctx.model.graph.sort_nodes()
    return len(training.plan.writes), []


@register_pass("update_loss_scale")
def update_loss_scale(ctx: PassContext) -> tuple[int, list[str]]:
    """Write the rule's next scale and counters (`LossScaleRule.step`, op for op; accumulating,
    at each window's end only) and make the step wait for it; a fixed scale only makes the
    step wait for the flag."""
    training = training_of(ctx)
    rule, ops, plan = training.rule, training.ops, training.plan
    if not rule.scales or training.all_finite is None:
        return 0, []
    finite = training.all_finite
    if not rule.dynamic:
        if finite.producer is not None:
            plan.step.add_control_input(finite.producer)
            ctx.model.graph.sort_nodes()  # a step node made before the flag runs after it
        return 0, []
    assert training.scale_state is not None and training.good_steps is not None
    scale, good = training.scale_state.value, training.good_steps.value

    def number(value: float | int, dtype: type, name: str) -> Value:
        return ops.constant(np.asarray(value, dtype), f"update/{name}")

    def once_per_window(new: Value, old: Value) -> Value:
        """`new` at a window's end, `old` within it (the state counts windows)."""
        if training.window is None:
            return new
        return ops.select(training.window.boundary, new, old, "update/at_window_end")

    zero, one = number(0, np.int32, "zero"), number(1, np.int32, "one")
    good_next = ops.add(good, one, "update/good_next")
    grow = ops.both(finite, ops.at_least(good_next, number(rule.growth_interval, np.int32,
                                                           "growth_interval"),
                                         "update/at_interval"), "update/grow")
    grown = ops.multiply(scale, number(rule.growth_factor, np.float32, "growth_factor"),
                         "update/grown")
    grow_to_finite = ops.both(grow, ops.is_finite(grown, "update/grown_finite"),
                              "update/grow_to_finite")
    scale_if_good = ops.select(grow_to_finite, grown, scale, "update/scale_if_good")
    backed_off = ops.maximum(
        ops.multiply(scale, number(rule.backoff_factor, np.float32, "backoff_factor"),
                     "update/backoff"),
        number(rule.min_scale, np.float32, "min_scale"), "update/backed_off")
    bad_step = ops.negate(finite, "update/bad_step")
    writes: list[Node] = []
    if training.bad_steps is None:
        back_off = bad_step
    else:
        bad_next = ops.add(training.bad_steps.value, one, "update/bad_next")
        back_off = ops.both(bad_step, ops.at_least(bad_next, number(rule.hysteresis, np.int32,
                                                                    "hysteresis"),
                                                   "update/at_hysteresis"), "update/back_off")
        new_bad = ops.select(ops.either(finite, back_off, "update/bad_reset"), zero, bad_next,
                             "update/new_bad_steps")
        writes.append(ops.assign(training.bad_steps, once_per_window(new_bad,
                                                                     training.bad_steps.value),
                                 "update/assign_bad_steps"))
    scale_if_bad = ops.select(back_off, backed_off, scale, "update/scale_if_bad")
    new_scale = ops.select(finite, scale_if_good, scale_if_bad, "update/new_scale")
    counting = ops.both(finite, ops.negate(grow, "update/no_growth"), "update/counting")
    new_good = ops.select(counting, good_next, zero, "update/new_good_steps")
    writes.append(ops.assign(training.scale_state, once_per_window(new_scale, scale),
                             "update/assign_scale"))
    writes.append(ops.assign(training.good_steps, once_per_window(new_good, good),
                             "update/assign_good_steps"))
    training.update = ops.group(writes, "update/update")
    changed = commit(training)
    plan.step.add_control_input(training.update)
    ctx.model.graph.sort_nodes()
    return changed, []


@register_pass("release_step_results")
def release_step_results(ctx: PassContext) -> tuple[int, list[str]]:
    """Make what the step hands back on every step stop waiting for the gated writes: each node
    of a result that waits (by a control edge) for something a bad step skips waits for the
    ops' `settle` node instead, which completes on every step, after the writes on a good one;
    where the caller waits for the graph's control outputs, those a bad step skips give way to
    the step node, which waits for `settle` too."""
    training = training_of(ctx)
    plan, gate, graph = training.plan, training.gate, ctx.model.graph
    if gate is None or not (plan.results or plan.caller_waits):
        return 0, []
    skipped = nodes_after([gate])
    writes = [write.node for write in plan.writes]
    feeds_writes = nodes_before(writes)

    def settled() -> Node:
        if training.settled is None:
            training.settled = training.ops.settle(gate, writes, "settle/settled")
            commit(training)
        return training.settled

    pending = [v.producer for v in plan.results if v.producer is not None]
    dropped = []
    if plan.caller_waits:
        dropped = sorted(key for key, node in graph.control_outputs.items()
                         if node in skipped and node is not plan.step)
        for key in dropped:
            graph.remove_control_output(key)
        if dropped:
            plan.step.add_control_input(settled())
        pending.append(plan.step)
    seen: set[Node] = set()
    while pending:
        node = pending.pop()
        if node in seen or node not in skipped:
            continue
        seen.add(node)
        ctx.focus = node
        if node in feeds_writes:
            raise AmpError(f"the step returns a value computed from {node.name!r}, which a "
                           f"variable update needs after another update: return it before the "
                           f"updates, or read the variable after the step")
        waited = [n for n in node.control_inputs if n in skipped]
        if waited:
            for other in waited:
                node.remove_control_input(other)
            node.add_control_input(settled())
            training.released.append(node.name)
        pending.extend(v.producer for v in node.inputs if v is not None and v.producer is not None)
    if not training.released and not dropped:
        return 0, []
    graph.sort_nodes()
    notes = [f"no longer wait for the gated writes: {', '.join(sorted(training.released))}"]
    if dropped:
        notes.append(f"{len(dropped)} control output(s) a bad step skips left to the step node")
    return len(training.released) + len(dropped), notes


def _dtype(value: Value) -> str:
    return value.dtype or FLOAT32
