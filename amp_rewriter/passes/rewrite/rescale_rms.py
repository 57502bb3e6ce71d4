"""Compute an RMS norm's mean square in low precision on a rescaled row (`RescalePlan`).

mean(x^2) overflows fp16 once |x| > 256, so `recognize_rms_norm` keeps the square and the mean
fp32 during the painting, which costs a copy of the row in fp32 and an fp32 square: the biggest
fp32 tensors left in a converted decoder. Once x is fp16 this pass replaces

    Cast(x -> fp32) -> square -> mean                    (two fp32 tensors of x's shape)

by the same statistic computed on y = x / s, where (fp16, one value per row)

    s = Clip(ReduceMax(Abs(x)), 2^-14, 65504) * 2^-7
    mean(x^2) = Cast32(mean(y * y)) * Cast32(s)^2        y, y * y fp16; the product fp32

Why it holds to fp16's precision: s >= 2^-21 is nonzero and within 2^-4 of its exact value
(3 significant bits at worst, as a subnormal), and the same fp16 s divides the row and scales the
mean back, so only the bounds on y matter. |y| <= 2^7 * (1 + 2^-4): every square is below 18500,
far from fp16's 65504. Where max|x| >= 2^-14 the largest square is above 14000, so the mean of n
squares is a normal fp16 number up to n = 2^27, and the squares that fall below fp16's normal
range (each losing at most 2^-25) add up to less than n * 2^-38 of the sum. The mean accumulates
in fp32 (ORT's CUDA and CPU reductions do) and rounds once. A row of only subnormal values
(max|x| < 2^-14) has a mean square below 2^-28, under any eps it is added to. An all-zero row
gives 0 / s = 0, as fp32 does; an infinite element gives an infinite mean square, so, as in
fp32, the finite elements scale to 0 and the infinite one to NaN (the clip keeps s finite).

Where the norm's step multiplies x by 1/sqrt(mean(x^2) + eps), each of +eps, root and inverse
read only by the next (`RescalePlan.after_mean`), the inverse root runs in fp16 too:

    1/sqrt(mean(x^2) + eps) = 1/s * 1/sqrt(mean(y^2) + (sqrt(eps)/s)^2)

with the clipped max|x| at least 8 sqrt(eps), so that s >= sqrt(eps)/16 and (sqrt(eps)/s)^2 <=
2^8: the sum stays below 18500 + 256, its root is at least min(sqrt(mean(y^2)), 16), which is a
normal number (the mean is above 14000/n where the floor does not bind, and where it binds the
sum is at least 256), and the result lies within [1/(1.07 max|x|), 1/sqrt(eps)], the scaling
step's own range (see `scaling_fits`). Each of the six steps rounds once, so the inverse is
within about 3 * 2^-11 (relative) of fp32's. Squares that underflow where the floor binds lose
less than 2^-25 each against a sum of at least 256. No fp32 tensor and no cast are left.
"""

from __future__ import annotations

import math

import numpy as np

from ...ir import FLOAT32, LOW_PRECISION_DTYPES, Node, Value, decisions, short_name
from ...ir.dtypes import FINITE_MAX, NUMPY_DTYPES, SMALLEST_NORMAL
from ..base import INVERSE_FLOOR, PassContext, RescalePlan, register_pass
from .building import CAST, GraphEdits, PlanBuilder, dropped_sources, rewrite_plans

#: The class the report gives the nodes this pass builds.
RESCALE_CLASS = "rescale"

#: The scaled row's largest |y| (see above): its square, 2^14, keeps the mean of a long row a
#: normal fp16 number and stays far from fp16's 65504.
HEADROOM = 2.0**7


def _cast_source(value: Value | None, x: Value) -> Node | None:
    """The cast that reads x and produces `value` (the painting's, or the model's own)."""
    cast = value.producer if value is not None else None
    if cast is None or cast.op_type != CAST or not cast.inputs or cast.inputs[0] is not x:
        return None
    return cast


def _low_inverse_readers(plan: RescalePlan) -> list[Value] | None:
    """Where the scaling step reads the inverse root in low precision (the inverse's value, or
    the painting's casts of it), when the plan rebuilds the whole statistic and the painting
    left the chain as planned; None otherwise."""
    step, chain = plan.step, plan.after_mean
    if step is None or not chain or step.graph is None:
        return None
    inverse = chain[0].outputs[0] if chain[0].outputs else None
    if inverse is None:
        return None
    readers = [value for value in step.inputs if value is not None
               and (value is inverse or _cast_source(value, inverse) is not None)]
    if not readers or any(v.dtype not in LOW_PRECISION_DTYPES for v in readers):
        return None
    return readers


def _applies(plan: RescalePlan) -> list[Node] | None:
    """The casts of x the square reads, when the painting left the plan's shape: x low, the
    square and mean fp32, the square reading x only through casts and read only by the mean."""
    x, square, mean = plan.x, plan.square, plan.mean
    squared = square.outputs[0] if square.outputs else None
    averaged = mean.outputs[0] if mean.outputs else None
    if x.dtype not in LOW_PRECISION_DTYPES or squared is None or averaged is None \
            or squared.dtype != FLOAT32 or averaged.dtype != FLOAT32 \
            or squared.graph_output_uses or len(squared.uses) != 1 \
            or mean.inputs[0] is not squared or averaged.graph_output_uses:
        return None
    data_slots = range(len(square.inputs)) if len(square.inputs) == 2 and \
        square.inputs[0] is square.inputs[1] else range(1)
    casts = [_cast_source(square.inputs[slot], x) for slot in data_slots]
    if any(cast is None for cast in casts):
        return None
    return [cast for cast in casts if cast is not None]


def _rescale(ctx: PassContext, plan: RescalePlan, casts: list[Node], edits: GraphEdits) -> None:
    """Build the rescaled mean square of one plan before its mean, which goes with the nodes
    the new ones replace."""
    x, mean = plan.x, plan.mean
    averaged = mean.outputs[0]
    assert x.dtype is not None and averaged is not None
    ops, low = ctx.rules.rescale_ops, x.dtype
    build = PlanBuilder(ctx.model, mean, "rescaled", "rescale", RESCALE_CLASS, plan.record.detail)

    def constant(label: str, value: float) -> Value:
        return build.constant(label, np.asarray(value, dtype=NUMPY_DTYPES[low]))
    row = averaged.shape
    reduce_attrs = {k: v for k, v in mean.attrs.items() if isinstance(v, (int, float, tuple))}
    axes_inputs = list(mean.inputs[1:])

    def widen(value: Value) -> Value:
        return build.node(CAST, [value], FLOAT32, row, {"to": FLOAT32})

    inverse_readers = _low_inverse_readers(plan)
    floor = SMALLEST_NORMAL[low]
    if inverse_readers is not None:  # (sqrt(eps) / s)^2 <= 2^8 needs s >= sqrt(eps) / 16
        floor = max(floor, INVERSE_FLOOR * math.sqrt(plan.eps))
    magnitude = build.node(ops["abs"], [x], low, x.shape)
    largest = build.node(ops["reduce_max"], [magnitude, *axes_inputs], low, row, reduce_attrs)
    bounded = build.node(ops["clip"], [largest, constant("floor", floor),
                                       constant("ceiling", FINITE_MAX[low])], low, row)
    scale = build.node(ops["mul"], [bounded, constant("step", 1.0 / HEADROOM)], low, row)
    scaled = build.node(ops["div"], [x, scale], low, x.shape)
    squares = build.node(ops["mul"], [scaled, scaled], low, x.shape)
    scaled_mean = build.node(mean.op_type, [squares, *axes_inputs], low, row, reduce_attrs)
    replaced_nodes = [plan.square, mean]
    if inverse_readers is not None:
        shift = build.node(ops["div"], [constant("root_eps", math.sqrt(plan.eps)), scale], low,
                           row)
        shifted = build.node(ops["add"], [scaled_mean, build.node(ops["mul"], [shift, shift],
                                                                   low, row)], low, row)
        inverse = build.node(ops["reciprocal"], [build.node(ops["sqrt"], [shifted], low, row)],
                             low, row)
        result = build.node(ops["div"], [inverse, scale], low, row)
        how = f"{short_name(low)} throughout: no fp32 tensor"
        replaced_nodes += plan.after_mean
        for reader in inverse_readers:
            reader.replace_all_uses_with(result)
        for reader in inverse_readers:  # the painting's casts of the fp32 inverse
            edits.doomed.extend(dropped_sources(reader))
        former = [v for node in plan.after_mean for v in node.inputs]
        for node in plan.after_mean:
            node.detach_inputs()
        edits.doomed.extend(plan.after_mean)
        for value in former:  # eps, and the 1 of a 1 / root, when nothing else reads them
            edits.doomed.extend(dropped_sources(value))
    else:
        wide_scale = widen(scale)
        scale_squared = build.node(ops["mul"], [wide_scale, wide_scale], FLOAT32, row)
        result = build.node(ops["mul"], [widen(scaled_mean), scale_squared], FLOAT32, row)
        how = "fp32 on one value per row"
        averaged.replace_all_uses_with(result)
    replaced = (f"replaced by the rescaled mean square ({', '.join(n.name for n in build.nodes)}):"
                f" {short_name(low)} on the row divided by 2^-7 of its largest |x|, {how}")
    for node in replaced_nodes:
        for group in node.float_groups():  # for the report: the node is gone from the graph
            group.decide(low, decisions.STRUCTURE, replaced)
    edits.insert_before(mean, build.nodes)
    square_inputs = [v for v in plan.square.inputs if v is not None]
    mean.detach_inputs()
    plan.square.detach_inputs()
    edits.doomed.extend([mean, plan.square])
    edits.doomed.extend(cast for cast in casts if not cast.is_used)
    # The square's exponent, when a Constant node made it for the square alone.
    edits.doomed.extend(v.producer for v in square_inputs
                  if v.const is not None and v.producer is not None and not v.producer.inputs
                  and not v.producer.is_used)
    plan.record.added.extend(n.name for n in build.nodes)


@register_pass("rescale_rms_statistics")
def rescale_rms_statistics(ctx: PassContext) -> tuple[int, list[str]]:
    """Compute each planned RMS norm's mean square in low precision on its row divided by 2^-7
    of the row's largest |x| (no fp32 copy of the row, no fp32 square)."""
    return rewrite_plans(ctx, ctx.rescales, _applies, _rescale), []
