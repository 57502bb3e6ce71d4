"""The rotary-angle rule: recognition, plan and rewrite.

`recognize_rotary_angles`: a rotary embedding's angle (integer positions times constant
frequencies, read only by Cos and Sin) runs in fp16, reduced modulo 2*pi in integers by
`reduce_rotary_angles` after the painting, where an fp16 product would be off by radians.

## The rewrite: `reduce_rotary_angles`

Reduce a rotary embedding's angle modulo 2*pi in integers (`RotaryPlan`).

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
from dataclasses import dataclass
from typing import cast

import numpy as np

from ...ir import ALLOW, FLOAT16, FLOAT32, INFER, Node, Value, decisions, present, short_name
from ..analysis.classify import set_class
from ..base import FormatRules, PassContext, StructureRecord, register_pass
from ..rewrite.building import CAST, GraphEdits, PlanBuilder, dropped_sources, rewrite_plans
from .matching import constant_data, is_float


@dataclass
class RotaryPlan:
    """A rotary embedding's angle, integer positions times constant frequencies read only by
    Cos and Sin, that is reduced modulo 2*pi in integers (planned by `recognize_rotary_angles`,
    built by `reduce_rotary_angles` once the painting has put the product in low precision)."""

    #: The integer positions the model casts to float.
    positions: Value
    #: positions (as floats) x frequencies.
    product: Node
    #: The constant frequencies.
    frequencies: Value
    record: StructureRecord

    @property
    def anchor(self) -> Node:
        """The node the rewrite's nodes go before (and a failure is blamed on)."""
        return self.product

    def planned_nodes(self) -> list[Node]:
        """The product."""
        return [self.product]

    def kept_constants(self) -> list[str]:
        """None: the constant-range rule applies as usual."""
        return []


def rotary_plans(ctx: PassContext) -> list[RotaryPlan]:
    """The rotary angles `recognize_rotary_angles` planned for `reduce_rotary_angles`."""
    return cast(list[RotaryPlan], ctx.plans.setdefault("rotary_angle", []))


#: Integer dtypes of the positions a rotary angle's reduction reads (int32 widened first).
_POSITION_DTYPES = frozenset({"int64", "int32"})


def _periodic_readers(angle: Value, rules: FormatRules) -> list[Node] | None:
    """The nodes that read `angle`: periodic ops (Cos, Sin) and the ops carrying it to them with
    its values unchanged or only selected (`rules.carry_ops`, float outputs); None when anything
    else reads it or what they carry (another op or slot, a graph output, a nested graph)."""
    readers: list[Node] = []
    seen: set[Node] = set()
    stack = [angle]
    while stack:
        value = stack.pop()
        if value.graph_output_uses:
            return None
        for node, slot in value.uses:
            if node.graph is not angle.graph:
                return None
            if node in seen:
                continue
            seen.add(node)
            readers.append(node)
            if node.op_type in rules.periodic_ops:
                continue
            carried = [v for v in node.outputs if v is not None]
            if slot not in rules.carry_ops.get(node.op_type, ()) \
                    or not all(is_float(v) for v in carried):
                return None
            stack.extend(carried)
    return readers if any(n.op_type in rules.periodic_ops for n in readers) else None


def rotary_angle(node: Node, rules: FormatRules
                 ) -> tuple[Value, Value, list[Node], Node] | None:
    """(integer positions, frequencies, readers, the positions' cast) when `node` is a rotary
    embedding's angle: integer positions cast to fp32 times constant frequencies (finite, none
    above 1 in magnitude, not all zero), read only by Cos and Sin (`_periodic_readers`)."""
    if rules.role(node.op_type) != "mul" or len(node.inputs) != 2 or len(node.outputs) != 1 \
            or node.outputs[0] is None or node.outputs[0].original_dtype != FLOAT32:
        return None
    for slot in (0, 1):
        floats, frequencies = node.inputs[slot], node.inputs[1 - slot]
        cast = floats.producer if floats is not None else None
        positions = cast.inputs[0] if cast is not None and cast.inputs else None
        if cast is None or rules.role(cast.op_type) != "cast" or positions is None \
                or positions.dtype not in _POSITION_DTYPES or floats is None \
                or floats.dtype != FLOAT32 or frequencies is None \
                or frequencies.dtype != FLOAT32:
            continue
        values = constant_data(frequencies)  # read last: most products are not rotary angles
        if values is None:
            continue
        largest = float(np.max(np.abs(values))) if values.size else 0.0
        if not np.all(np.isfinite(values)) or not 0.0 < largest <= 1.0:
            continue
        readers = _periodic_readers(node.outputs[0], rules)
        return (positions, frequencies, readers, cast) if readers is not None else None
    return None


@register_pass("recognize_rotary_angles")
def recognize_rotary_angles(ctx: PassContext) -> tuple[int, list[str]]:
    """Run a rotary embedding's angle, and the Cos and Sin reading it, in fp16 without its
    rounding error: the product of positions and frequencies becomes an allow op, and
    `reduce_rotary_angles` computes it modulo 2*pi in int64 once the painting has put it in fp16
    (to within 2^-10 rad at any position below 2^24). Painted as an ordinary product, an fp16
    angle is off by up to 1 rad at position 2048; kept fp32, it leaves fp32 tensors and casts.
    Only for fp16 (a bf16 angle in [-pi, pi) would be off by 2^-7 rad: those stay as painted)
    and where the backend runs the periodic ops in it."""
    rules = ctx.rules
    if ctx.target_dtype != FLOAT16 or not rules.integer_ops or not rules.periodic_ops:
        return 0, []
    missing = sorted({op for op in rules.integer_ops.values() if not ctx.op_available(op)})
    found = 0
    for node in list(ctx.model.graph.nodes):
        ctx.focus = node
        match = rotary_angle(node, rules)
        if match is not None and missing:
            return 0, [f"rotary angles are left to the painting: the model's format version "
                       f"has no {', '.join(missing)} to reduce them with"]
        if match is None:
            continue
        positions, frequencies, readers, cast = match
        members = [node, *readers, cast]  # the cast goes too: a pin on it counts
        if any(m.pin_reason or m.class_kind == decisions.USER_OVERRIDE
               or m in ctx.user_rule_nodes for m in members):
            continue
        periodic = [m for m in readers if m.op_type in rules.periodic_ops]
        if not all(m.op_class in (ALLOW, INFER) and any(g.paintable for g in m.float_groups())
                   for m in periodic):
            continue  # the backend keeps Cos/Sin fp32: the angle is left as it is
        why = (f"rotary angle (integer positions {short_name(positions.dtype)} x constant "
               f"frequencies, read only by {', '.join(sorted({m.op_type for m in periodic}))}): "
               f"reduced modulo 2*pi in int64 and run in fp16 within [-pi, pi), off by at most "
               f"2^-10 rad for positions below 2^24 (an fp16 product is off by up to 1 rad at "
               f"position 2048)")
        set_class(ctx, node, ALLOW, why, decisions.STRUCTURE)
        record = StructureRecord("rotary_angle", [m.name for m in (node, *periodic)], why)
        ctx.structures.append(record)
        rotary_plans(ctx).append(RotaryPlan(positions, node, frequencies, record))
        found += 1
    return found, []


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
    return rewrite_plans(ctx, rotary_plans(ctx), _applies, _reduce), []
