"""Gradient accumulation (`UpdateOptions.accumulate` = N > 1): the training pass that sums the
gradients of N micro-steps into fp32 accumulators and lets the optimizer apply them once per
window, as DeepSpeed and PyTorch's GradScaler do:

- each micro-step adds its (scaled) gradients to the accumulators, unless one of them is not
  finite: then nothing is added, so no accumulator ever holds inf or NaN, and the window is
  marked bad;
- the optimizer path reads the window's sums (unscaled by 1/(scale x N), their mean, by
  `unscale_gradients`, or with that factor folded into the optimizer);
- at the window's last micro-step the writes apply if the whole window was finite
  (`gate_variable_writes`), the loss scale and its counters move once (`update_loss_scale`:
  growth is counted in windows), and the accumulators are reset by assigning zeros, whether the
  window applied or was discarded.

The loss scale only changes at a window's end, so it is the same for every micro-step of a
window: the sums add gradients of one scale.
"""

from __future__ import annotations

import numpy as np

from ..passes.base import PassContext, register_pass
from .passes import AccumulationWindow, commit, training_of
from .plan import GradientExit


@register_pass("accumulate_gradients")
def accumulate_gradients(ctx: PassContext) -> tuple[int, list[str]]:
    """Sum each gradient over a window of micro-steps in an fp32 accumulator that the optimizer
    path reads instead; mark the window's end and whether it stayed finite."""
    training = training_of(ctx)
    steps = training.update_options.accumulate
    if steps == 1:
        return 0, []
    ops, plan = training.ops, training.plan
    micro_step = ops.state_variable("micro_step", np.asarray(0, np.int32))
    window_finite = ops.state_variable("window_finite", np.asarray(True))
    sums = []
    for exit_ in training.gradient_exits():
        ctx.focus = exit_.value.producer
        accumulator = ops.accumulator(exit_.value, "accumulate/sum")
        sums.append((exit_, accumulator, ops.add(accumulator.value, exit_.value,
                                                 "accumulate/candidate")))
    # one flag for the micro-step: a candidate sum is finite when the gradient is and adding
    # it overflows nothing
    micro_finite = ops.all_finite([candidate for _, _, candidate in sums],
                                  "accumulate/micro_step_finite")
    next_step = ops.add(micro_step.value, ops.constant(np.asarray(1, np.int32),
                                                       "accumulate/one"), "accumulate/next")
    boundary = ops.at_least(next_step, ops.constant(np.asarray(steps, np.int32),
                                                    "accumulate/steps"), "accumulate/window_ends")
    writes = []
    exits = []
    for exit_, accumulator, candidate in sums:
        kept = ops.select(micro_finite, candidate, accumulator.value, "accumulate/window_sum")
        reset = ops.select(boundary, ops.zeros_like(kept, "accumulate/zeros"), kept,
                           "accumulate/next_sum")
        writes.append(ops.assign(accumulator, reset, "accumulate/assign_sum"))
        for reader, slot in exit_.readers:
            reader.set_input(slot, kept)
        exits.append(GradientExit(kept, list(exit_.readers)))
    finite_so_far = ops.both(window_finite.value, micro_finite, "accumulate/window_finite")
    writes.append(ops.assign(window_finite, ops.select(
        boundary, ops.constant(np.asarray(True), "accumulate/fresh_window"), finite_so_far,
        "accumulate/next_window_finite"), "accumulate/assign_window_finite"))
    writes.append(ops.assign(micro_step, ops.select(
        boundary, ops.constant(np.asarray(0, np.int32), "accumulate/zero"), next_step,
        "accumulate/next_micro_step"), "accumulate/assign_micro_step"))
    plan.step.add_control_input(ops.group(writes, "accumulate/update"))
    training.gradients = exits
    training.window = AccumulationWindow(boundary, finite_so_far, [micro_step, window_finite])
    changed = commit(training)
    ctx.model.graph.sort_nodes()
    return changed, [f"{len(exits)} gradients summed over windows of {steps} micro-steps"]
