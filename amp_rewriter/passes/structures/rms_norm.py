"""The RMS-norm rule: recognition, plan and rewrite.

`recognize_rms_norm`: an RMS normalisation, x * 1/sqrt(mean(x^2) + eps), keeps its statistics
fp32 (the square overflows fp16 beyond 256) without being a barrier: the residual stream it
reads and the scaling step run in low precision, with one cast of x into the statistics and
one of the per-row scale out of them. Where the backend has the kernels, it plans
(`RescalePlan`) the mean square in fp16 on the row divided by 2^-7 of its largest |x|, which
`rescale_rms_statistics` builds after the painting: only one value per row stays fp32.

## The rewrite: `rescale_rms_statistics`

Compute an RMS norm's mean square in low precision on a rescaled row (`RescalePlan`).

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
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from ...ir import (
    ALLOW,
    DENY,
    FLOAT16,
    FLOAT32,
    FP32,
    INFER,
    LOW_PRECISION_DTYPES,
    Node,
    Value,
    decisions,
    short_name,
)
from ...ir.dtypes import FINITE_MAX, NUMPY_DTYPES, SMALLEST_NORMAL
from ...op_lists import OpLists
from ..analysis.classify import set_class
from ..base import FormatRules, PassContext, StructureRecord, register_pass
from ..rewrite.building import CAST, GraphEdits, PlanBuilder, dropped_sources, rewrite_plans
from .matching import scalar


@dataclass
class RescalePlan:
    """An RMS norm whose mean square runs in low precision on a rescaled row (planned by
    `recognize_rms_norm`, built by `rescale_rms_statistics` once the painting has put x in low
    precision and the square fp32)."""

    x: Value
    square: Node
    mean: Node
    record: StructureRecord
    eps: float = 0.0
    #: The scaling step and the nodes from the mean to the inverse root it reads (+eps, root,
    #: inverse; nearest the step first) when the whole statistic runs in low precision; empty:
    #: +eps, root and inverse stay fp32 on one value per row.
    step: Node | None = None
    after_mean: list[Node] = field(default_factory=list)

    @property
    def anchor(self) -> Node:
        """The node the rewrite's nodes go before (and a failure is blamed on)."""
        return self.mean

    def planned_nodes(self) -> list[Node]:
        """The square, the mean, the scaling step and what lies between mean and step."""
        nodes = [self.square, self.mean, self.step, *self.after_mean]
        return [node for node in nodes if node is not None]

    def kept_constants(self) -> list[str]:
        """None: the constant-range rule applies as usual."""
        return []


#: With an RMS norm's inverse root in low precision, the clipped max|x| is at least this many
#: sqrt(eps): s >= sqrt(eps) / 16 then, and (sqrt(eps) / s)^2 <= 2^8 (see rescale_rms). The
#: floor must itself be a finite number of the target, which bounds eps.
INVERSE_FLOOR = 8.0


def rescale_plans(ctx: PassContext) -> list[RescalePlan]:
    """The RMS norms `recognize_rms_norm` planned for `rescale_rms_statistics`."""
    return cast(list[RescalePlan], ctx.plans.setdefault("rms_norm", []))


def _producer(value: Value | None, role: str, rules: FormatRules) -> Node | None:
    node = value.producer if value is not None else None
    return node if node is not None and rules.role(node.op_type) == role else None


def _same_tensor(value: Value | None, x: Value, rules: FormatRules) -> bool:
    """Whether `value` is `x` or a cast of `x` to its own dtype (an export's `.to(float32)`)."""
    if value is x:
        return True
    cast = _producer(value, "cast", rules)
    return (cast is not None and bool(cast.inputs) and cast.inputs[0] is x and value is not None
            and value.original_dtype == x.original_dtype)


def _mean_square_of(value: Value | None, x: Value, rules: FormatRules) -> bool:
    """Whether `value` is mean(x^2): ReduceMean/Mean of Pow(x, 2), x*x or Square(x)."""
    mean = _producer(value, "mean", rules)
    if mean is None or not mean.inputs:
        return False
    square = mean.inputs[0].producer if mean.inputs[0] is not None else None
    if square is None:
        return False
    role = rules.role(square.op_type)
    if role == "pow" and len(square.inputs) == 2:
        return scalar(square.inputs[1]) == 2.0 and _same_tensor(square.inputs[0], x, rules)
    if role == "mul" and len(square.inputs) == 2:
        return all(_same_tensor(v, x, rules) for v in square.inputs)
    return role == "square" and bool(square.inputs) and _same_tensor(square.inputs[0], x, rules)


def _epsilon_of_shifted_mean(value: Value | None, x: Value, rules: FormatRules) -> float | None:
    """eps when `value` is mean(x^2) + eps with a positive constant eps (either order)."""
    add = _producer(value, "add", rules)
    if add is None or len(add.inputs) != 2:
        return None
    for slot in (0, 1):
        eps = scalar(add.inputs[1 - slot])
        if eps is not None and eps > 0 and _mean_square_of(add.inputs[slot], x, rules):
            return eps
    return None


def _epsilon_of_root(value: Value | None, x: Value, rules: FormatRules) -> float | None:
    """eps when `value` is sqrt(mean(x^2) + eps) with a positive constant eps."""
    root = _producer(value, "sqrt", rules)
    if root is None or not root.inputs:
        return None
    return _epsilon_of_shifted_mean(root.inputs[0], x, rules)


def _epsilon_of_inverse_root(value: Value | None, x: Value, rules: FormatRules) -> float | None:
    """eps when `value` is 1/sqrt(mean(x^2) + eps): Reciprocal(Sqrt(.)), 1 / Sqrt(.) or
    Rsqrt(mean(x^2) + eps)."""
    node = value.producer if value is not None else None
    if node is None or not node.inputs:
        return None
    role = rules.role(node.op_type)
    if role == "reciprocal":
        return _epsilon_of_root(node.inputs[0], x, rules)
    if role == "div" and len(node.inputs) == 2 and scalar(node.inputs[0]) == 1.0:
        return _epsilon_of_root(node.inputs[1], x, rules)
    if role == "rsqrt":
        return _epsilon_of_shifted_mean(node.inputs[0], x, rules)
    return None


def rms_norm_scaling(node: Node, rules: FormatRules) -> tuple[Value, float] | None:
    """(x, eps) when `node` is the scaling step of an RMS norm of x, or None.

    The step is x * 1/sqrt(mean(x^2) + eps) (a Mul with the inverse root as either input) or
    x / sqrt(mean(x^2) + eps), with a positive constant eps.
    """
    role = rules.role(node.op_type)
    if role not in ("mul", "div") or len(node.inputs) != 2 or any(v is None for v in node.inputs):
        return None
    candidates = [(0, 1), (1, 0)] if role == "mul" else [(0, 1)]
    for data_slot, scale_slot in candidates:
        x, scale = node.inputs[data_slot], node.inputs[scale_slot]
        assert x is not None
        eps = _epsilon_of_inverse_root(scale, x, rules) if role == "mul" else \
            _epsilon_of_root(scale, x, rules)
        if eps is not None:
            return x, eps
    return None


def scaling_fits(eps: float, dtype: str) -> bool:
    """Whether the per-row scale of an RMS norm with this eps is a normal number of `dtype`:
    sqrt(mean(x^2) + eps) lies in [sqrt(eps), max|x|] and its inverse in [1/max|x|, 1/sqrt(eps)],
    so eps decides both ends (an x that fits the dtype bounds the other)."""
    root = eps ** 0.5
    return root >= SMALLEST_NORMAL[dtype] and 1.0 / root <= FINITE_MAX[dtype]


def _rms_norm_reasons(eps: float, dtype: str, rescaled: bool, whole: bool = False,
                      backend_refusal: str | None = None) -> tuple[str, str | None]:
    """Why the statistics stay fp32, and why the scaling step runs low (None: it stays fp32).
    `rescaled`: whether the mean square runs in low precision on a rescaled row; `whole`:
    the inverse root too (see rescale_rms; only where the scaling step runs low);
    `backend_refusal`: why the backend rules the rescaled form out, where it does."""
    if rescaled and whole:
        statistics = (f"the statistics of an RMS norm (eps {eps:g}) run in {short_name(dtype)} "
                      f"on the row divided by 2^-7 of its largest |x| (s; at least "
                      f"8*sqrt(eps)): 1/sqrt(mean(x^2) + eps) = 1/s * 1/sqrt(mean((x/s)^2) + "
                      f"(sqrt(eps)/s)^2), every term below 18800 and the mean accumulated in "
                      f"fp32 by the reduction, so no fp32 tensor is left")
    elif rescaled:
        statistics = (f"the statistics of an RMS norm (eps {eps:g}) stay fp32 on one value per "
                      f"row (+eps, root, inverse); the mean square runs in "
                      f"{short_name(dtype)} on the row divided by 2^-7 of its largest |x| "
                      f"(each square below 18500: no overflow; the largest above 14000, so the "
                      f"mean stays normal and what underflows is negligible), accumulated in "
                      f"fp32 by the reduction and scaled back in fp32")
    else:
        statistics = (f"the statistics of an RMS norm (eps {eps:g}) stay fp32: the square "
                      f"overflows fp16 once |x| > 256, so the norm reads its low-precision input "
                      f"through one cast; the residual stream stays low")
        if backend_refusal is not None:
            statistics += f" (no rescaled fp16 form on this backend: {backend_refusal})"
    if not scaling_fits(eps, dtype):
        return statistics + (f"; the scaling stays fp32 too, since 1/sqrt(eps) = {eps ** -0.5:.3g}"
                             f" is outside {short_name(dtype)}'s normal range"), None
    return statistics, (f"the scaling step of an RMS norm (eps {eps:g}) runs in "
                        f"{short_name(dtype)}: its per-row scale lies within [1/max|x|, "
                        f"1/sqrt(eps) = {eps ** -0.5:.3g}], a normal {short_name(dtype)} number, "
                        f"and the normalised output is bounded by sqrt(row length)")


def _square_and_mean(members: list[Node], rules: FormatRules) -> tuple[Node, Node] | None:
    """The square and the mean of an RMS norm's statistics (members from _statistics_nodes)."""
    for mean in members:
        if rules.role(mean.op_type) == "mean" and mean.inputs and mean.inputs[0] is not None:
            square = mean.inputs[0].producer
            if square is not None and any(square is m for m in members):
                return square, mean
    return None


def _chain_to_mean(step: Node, x: Value, mean: Node, rules: FormatRules) -> list[Node] | None:
    """The nodes between the mean and a scaling step x * 1/sqrt(mean + eps) (the inverse, the
    root when separate, +eps; nearest the step first) when each is read only by the next and
    the mean only by +eps: the statistic is then a chain that can be rebuilt as a whole."""
    if rules.role(step.op_type) != "mul" or len(step.inputs) != 2:
        return None
    value = step.inputs[1] if step.inputs[0] is x else step.inputs[0]
    chain: list[Node] = []
    averaged = mean.outputs[0] if mean.outputs else None
    while value is not averaged:
        node = value.producer if value is not None else None
        if node is None or value is None or len(value.uses) != 1 or value.graph_output_uses \
                or len(chain) == 3 or not node.inputs:
            return None
        role = rules.role(node.op_type)
        if role == "add":
            value = next((v for v in node.inputs if scalar(v) is None), None)
        elif role == "div":
            value = node.inputs[1] if len(node.inputs) == 2 else None
        elif role in ("reciprocal", "sqrt", "rsqrt"):
            value = node.inputs[0]
        else:
            return None
        chain.append(node)
    if averaged is None or len(averaged.uses) != 1 or averaged.graph_output_uses:
        return None
    return chain


def rescale_applies(ctx: PassContext, mean: Node) -> bool:
    """Whether the mean square of an RMS norm has a rescaled low-precision form here: fp16
    (bf16's range holds any square), a format that names the ops, and a mean that keeps the
    reduced axes (the row's scale then broadcasts against the row)."""
    return (ctx.target_dtype == FLOAT16 and bool(ctx.rules.rescale_ops)
            and mean.attrs.get("keepdims", 1) != 0)


def rescale_refusal(ctx: PassContext, mean: Node) -> str | None:
    """Why the backend rules out the rescaled form (an op of it with no kernel, or one measured
    slow or wrong there), or None when a rewrite may build every op of it."""
    return ctx.lists.rewrite_refusal((*ctx.rules.rescale_ops.values(), mean.op_type))


def rescaled_mean_square(node: Node, rules: FormatRules, lists: OpLists) -> str | None:
    """Why `node` is the low-precision mean of a rescaled RMS-norm row that
    `rescale_rms_statistics` builds, or None when it is not (or the backend rules that form out,
    as convert would). `check` asks this of a deny-list op it finds in low precision.

    The pattern, by structure: mean(y * y) with y = x / (Clip(ReduceMax(Abs(x)), ...) * c).
    """
    ops = rules.rescale_ops
    if not ops or lists.rewrite_refusal((*ops.values(), node.op_type)) is not None:
        return None

    def made_by(reader: Node | None, slot: int, role: str) -> Node | None:
        """The producer of `reader`'s input `slot` when it is the op `_rescale` builds for
        `role` there."""
        value = reader.inputs[slot] if reader is not None and slot < len(reader.inputs) else None
        producer = value.producer if value is not None else None
        return producer if producer is not None and producer.op_type == ops.get(role) else None
    # The walk follows `_rescale`'s input positions, from the mean back to |x|.
    squares = made_by(node, 0, "mul")
    scaled = made_by(squares, 0, "div")
    largest = made_by(made_by(made_by(scaled, 1, "mul"), 0, "clip"), 0, "reduce_max")
    magnitude = made_by(largest, 0, "abs")
    if squares is None or scaled is None or largest is None or magnitude is None \
            or len(squares.inputs) != 2 or squares.inputs[0] is not squares.inputs[1] \
            or not magnitude.inputs or magnitude.inputs[0] is not scaled.inputs[0]:
        return None
    return (f"the mean square of an RMS norm on its row divided by 2^-7 of its largest |x| "
            f"(<- {largest.name}): every square is below 18500, and the backend's "
            f"{node.op_type} accumulates in fp32")


def _statistics_nodes(step: Node, x: Value) -> list[Node]:
    """The nodes between x and the scaling step (the square, mean, +eps, root, inverse), and it."""
    found: list[Node] = [step]
    stack = [v for v in step.inputs if v is not None and v is not x]
    seen: set[Node] = set()
    while stack:
        value = stack.pop()
        node = value.producer
        if node is None or node in seen or value.const is not None:
            continue
        seen.add(node)
        found.append(node)
        stack.extend(v for v in node.inputs if v is not None and v is not x)
    return found


@register_pass("recognize_rms_norm")
def recognize_rms_norm(ctx: PassContext) -> tuple[int, list[str]]:
    """Keep an RMS norm's statistics fp32 without making them a barrier: they are pinned (not
    deny), so the painting runs the residual stream around them in low precision; the norm's
    input is cast up once for the square, and the per-row scale (a small tensor) is cast down
    for the scaling step, which runs low where eps keeps the scale in range (see scaling_fits)."""
    found = 0
    #: The nodes an RMS norm pinned: two norms may share a square or a mean, and the
    #: second still needs its own +eps, root and inverse pinned.
    claimed: set[Node] = set()
    for node in list(ctx.model.graph.walk_nodes()):
        ctx.focus = node
        if node.pin_reason or node.class_kind == decisions.USER_OVERRIDE:
            continue
        match = rms_norm_scaling(node, ctx.rules)
        if match is None:
            continue
        x, eps = match
        members = _statistics_nodes(node, x)
        if any((m.pin_reason and m not in claimed)
               or m.class_kind == decisions.USER_OVERRIDE for m in members):
            continue
        parts = _square_and_mean(members, ctx.rules)
        applies = parts is not None and rescale_applies(ctx, parts[1])
        refusal = rescale_refusal(ctx, parts[1]) if applies and parts is not None else None
        rescaled = applies and refusal is None
        # Only a step that runs low reads the inverse in low precision.
        chain = _chain_to_mean(node, x, parts[1], ctx.rules) \
            if rescaled and parts and scaling_fits(eps, ctx.target_dtype) \
            and INVERSE_FLOOR * eps ** 0.5 <= FINITE_MAX[ctx.target_dtype] else None
        why, scaling_why = _rms_norm_reasons(eps, ctx.target_dtype, rescaled, chain is not None,
                                             backend_refusal=refusal)
        for member in members:
            if member is node and scaling_why is not None:
                low_class = member.op_class if member.op_class in (ALLOW, INFER) else INFER
                set_class(ctx, member, low_class, scaling_why, decisions.STRUCTURE)
                continue
            if member in claimed:
                continue  # shared with a norm recognised before: pinned with its reason
            if member.op_class in (FP32, DENY):
                set_class(ctx, member, INFER, why, decisions.STRUCTURE)
            member.pin_reason, member.pin_kind, member.pin_barrier = why, decisions.STRUCTURE, False
            claimed.add(member)
        record = StructureRecord("rms_norm", [m.name for m in members],
                                 why if scaling_why is None else f"{why}; {scaling_why}")
        ctx.structures.append(record)
        if rescaled and parts is not None:
            rescale_plans(ctx).append(RescalePlan(x, parts[0], parts[1], record, eps,
                                            node if chain else None, chain or []))
        found += 1
    return found, []


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
    return rewrite_plans(ctx, rescale_plans(ctx), _applies, _rescale), []
