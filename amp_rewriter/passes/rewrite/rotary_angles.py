"""Reduce a rotary embedding's angle modulo 2*pi in integers (`RotaryPlan`).

A rotary embedding rotates by angles p * f: integer positions p times constant frequencies f
(|f| <= 1), read only by Cos and Sin. Converted as an ordinary product, the angle is off by whole
radians once p * f passes 2048 (fp16's spacing there is 2); kept fp32, it leaves fp32 tensors
and casts in every decoder. Once the painting has put the product in fp16, this pass replaces

    Cast(p -> fp32) -> Mul(f)                               the angle, unbounded

by the same angle reduced into [-pi, pi) in int64, where it is exact, and only then rounded:

    F = round(f * 2^K), P = round(2*pi * 2^K), H = floor(P / 2)            K = 38
    b = Mod(p, 2^S), a = (p - b) / 2^S              p = a * 2^S + b, 0 <= b < 2^S    S = 24
    G = (F * 2^S) mod P                             (offline)
    r = Mod(a * G + b * F + H, P) - H              int64: (p * f reduced modulo 2*pi) * 2^K
    angle = Cast16(Div(r, 2^(K - 14))) * 2^-14     fp16, in [-pi, pi]

No product leaves int64 for |p| < 2^45: |b * F| < 2^24 * 2^38 = 2^62, |a| < 2^21, G < P < 2^41
so |a * G| < 2^62 - 2^41, and H < 2^41 (p * F itself would pass 2^63 from p = 2^25 on). a * G
is congruent to a * 2^S * F modulo P, so r is p * F reduced modulo P exactly.

Why it is within 2^-10 rad of p * f modulo 2*pi for |p| < 2^24 (where fp32 itself stops holding
integers exactly): F is within 2^-39 * 2^K of f * 2^K, so p * F is within 2^-15 rad of p * f.
P is within 2^-39 rad of 2*pi per period, and at most 2^22 periods are taken away: 2^-17 rad.
Mod with a positive divisor gives a remainder in [0, P) for either sign of p, so r lies in
[-H, H]; the integer quotient by 2^24 is off by less than one unit, 2^-14 rad, and its
magnitude is at most 51472, which fp16 holds finitely, rounded to 11 significant bits: at most
2^4 units, 2^-10 rad (2^-11 for angles below 2). The scaling by 2^-14 is exact (powers of two
of normal fp16 numbers). Cos and Sin are 1-Lipschitz, so their fp16 results differ from fp32's
by at most the sum, about 1.1e-3, plus their own rounding, at every position; an fp16
product's error grows with the position. Past 2^24 the first two terms grow with p (p * 2^-39
and p * 2^-41 rad: 2^-8 at p = 2^31), where fp32 itself rounds the position (by up to 64 at
2^31).
"""

from __future__ import annotations

import math

import numpy as np

from ...ir import FLOAT16, Node, Value, decisions, present
from ..base import PassContext, RotaryPlan, register_pass
from .building import CAST, GraphEdits, PlanBuilder, dropped_sources, rewrite_plans

#: The class the report gives the nodes this pass builds.
ROTARY_CLASS = "rotary"
#: Fraction bits of the angle in int64: |f| <= 1 and 0 <= b < 2^24 keep b * F below 2^62.
FIXED_POINT_BITS = 38
#: Bits of the position's low part b (p = a * 2^S + b).
POSITION_SPLIT_BITS = 24
#: Fraction bits of the integer fp16 is given: pi * 2^14 < 65504.
LOW_BITS = 14
INT64 = "int64"


def fixed_point(frequencies: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(F, P, H) for `frequencies`: F = round(f * 2^K), P = round(2*pi * 2^K), H = P // 2."""
    scale = float(2**FIXED_POINT_BITS)
    fixed = np.round(np.asarray(frequencies, dtype=np.float64) * scale).astype(np.int64)
    period = int(round(2.0 * math.pi * scale))
    return fixed, period, period // 2


def _casts_back(value: Value | None, source: Value) -> list[Node] | None:
    """The chain of casts from `source` to `value` (the model's own cast of the positions, and
    any the painting retargeted or added), nearest first; None when `value` is not one."""
    casts: list[Node] = []
    while value is not source:
        cast = value.producer if value is not None else None
        if cast is None or cast.op_type != CAST or not cast.inputs:
            return None
        casts.append(cast)
        value = cast.inputs[0]
    return casts


def _applies(plan: RotaryPlan) -> list[Node] | None:
    """The casts the product reads the positions through, when the painting left the plan's
    shape: the product in fp16, reading the positions through casts alone."""
    product = plan.product
    angle = product.outputs[0] if product.outputs and product.graph is not None else None
    if angle is None or angle.dtype != FLOAT16 or len(product.inputs) != 2:
        return None
    for slot in (0, 1):
        casts = _casts_back(product.inputs[slot], plan.positions)
        if casts:
            return casts
    return None


def _reduce(ctx: PassContext, plan: RotaryPlan, casts: list[Node], edits: GraphEdits) -> None:
    """Build the reduced angle of one plan before its product, which goes with the casts of the
    positions nothing else reads."""
    product, ops = plan.product, ctx.rules.integer_ops
    assert plan.frequencies.const is not None
    build = PlanBuilder(ctx.model, product, "reduced", "reduced", ROTARY_CLASS,
                        plan.record.detail)
    shape = present(product.outputs[0]).shape
    frequencies = np.asarray(plan.frequencies.const.numpy(), dtype=np.float64)
    fixed, period, half = fixed_point(frequencies)
    positions = plan.positions
    if positions.dtype != INT64:
        positions = build.node(CAST, [positions], INT64, shape, {"to": INT64})

    def integer(label: str, value: int) -> Value:
        return build.constant(label, np.asarray(value, dtype=np.int64))

    split = integer("split", 2 ** POSITION_SPLIT_BITS)
    low_part = build.node(ops["mod"], [positions, split], INT64, shape)
    high_part = build.node(ops["div"], [build.node(ops["sub"], [positions, low_part], INT64,
                                                   shape), split], INT64, shape)
    shifted_frequencies = np.mod(fixed * 2 ** POSITION_SPLIT_BITS, period)
    scaled = build.node(ops["add"], [
        build.node(ops["mul"], [high_part, build.constant("frequencies_high",
                                                          shifted_frequencies)], INT64, shape),
        build.node(ops["mul"], [low_part, build.constant("frequencies", fixed)], INT64, shape),
    ], INT64, shape)
    shifted = build.node(ops["add"], [scaled, integer("half_period", half)], INT64, shape)
    wrapped = build.node(ops["mod"], [shifted, integer("period", period)], INT64, shape)
    centered = build.node(ops["sub"], [wrapped, integer("half_period", half)], INT64, shape)
    steps = build.node(ops["div"], [centered, integer("step", 2 ** (FIXED_POINT_BITS - LOW_BITS))],
                       INT64, shape)
    low = build.node(CAST, [steps], FLOAT16, shape, {"to": FLOAT16})
    angle = build.node(ops["mul"], [low, build.constant(
        "scale", np.asarray(2.0**-LOW_BITS, dtype=np.float16))], FLOAT16, shape)
    replaced = (f"replaced by the angle reduced modulo 2*pi in int64 "
                f"({', '.join(n.name for n in build.nodes)})")
    for node in (product, *casts):
        for group in node.float_groups():  # for the report: these nodes go from the graph
            group.decide(FLOAT16, decisions.STRUCTURE, replaced)
    present(product.outputs[0]).replace_all_uses_with(angle)
    edits.insert_before(product, build.nodes)
    former = list(product.inputs)
    product.detach_inputs()
    edits.doomed.append(product)
    for value in former:
        edits.doomed.extend(dropped_sources(value))
    plan.record.added.extend(n.name for n in build.nodes)


@register_pass("reduce_rotary_angles")
def reduce_rotary_angles(ctx: PassContext) -> tuple[int, list[str]]:
    """Compute each planned rotary angle modulo 2*pi in int64 and round it to fp16 only then
    (see the module's docstring): no fp32 tensor, and no error that grows with the position."""
    return rewrite_plans(ctx, ctx.rotaries, _applies, _reduce), []
