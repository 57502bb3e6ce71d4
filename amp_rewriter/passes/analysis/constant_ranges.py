"""Force fp32 on groups whose constant inputs (or stored ones a front end range-checked) the
target dtype would not represent."""

from __future__ import annotations

from collections.abc import Iterator

from ...ir import FLOAT32, LazyTensor, Node, TypeGroup, Value
from ...ir.dtypes import FINITE_MAX
from ..base import ConstantRecord, PassContext, StoredRange, register_pass


def _constant_inputs(ctx: PassContext
                     ) -> Iterator[tuple[TypeGroup, int, Value | LazyTensor | StoredRange]]:
    """(group, slot, source) for every paintable group slot fed by a float32 constant or by a
    node whose stored output a front end range-checked (`ctx.stored_ranges`), and for the fill
    value of constant-filling ops (slot -1)."""
    fill_attrs = ctx.rules.constant_fill_attrs
    stored = ctx.stored_ranges
    for node in ctx.model.graph.walk_nodes():
        ctx.focus = node
        for group in node.type_groups:
            if not group.paintable:
                continue
            for slot in group.input_slots:
                value = node.inputs[slot]
                if value is None or value.dtype != FLOAT32:
                    continue
                if value.const is not None:
                    yield group, slot, value
                elif stored and value.producer is not None and value.producer.name in stored:
                    yield group, slot, stored[value.producer.name]
            attr = fill_attrs.get(node.op_type)
            if attr is not None and attr in node.attrs:
                yield group, -1, node.attrs[attr]


@register_pass("guard_constant_ranges")
def guard_constant_ranges(ctx: PassContext) -> tuple[int, list[str]]:
    """Keep fp32 the ops whose constant inputs would overflow or vanish in the target dtype.

    A constant beyond the finite range (an attention mask filled with -3.4e38) keeps its exact
    value unless `--clamp`: the op consuming it runs in fp32, and as a deny seed that decision
    spreads to the infer/clear ops downstream of it (the mask Add and the Softmax). A constant
    whose non-zero values would all flush to zero, or any divisor (the format's divisor slots)
    that would partly flush (x / 0), is kept in fp32 the same way, clamp or not. A stored
    tensor (a SavedModel variable) is guarded as a constant, clamp or not: it stays fp32 in
    storage, and a cast of it on every call would overflow just the same.
    """
    target = ctx.target_dtype
    forced = 0
    # Constants a structural rule takes care of (attention masks: their sums are saturated).
    mask_constants = {name for plans in ctx.plans.values() for plan in plans
                      for name in plan.kept_constants()}
    for group, slot, source in _constant_inputs(ctx):
        if group.forced_deny:
            continue
        if isinstance(source, StoredRange):
            name, what, result, elements = source.name, "variable", source.check, source.elements
        else:
            tensor = source.const if isinstance(source, Value) else source
            assert tensor is not None
            name = source.name if isinstance(source, Value) else f"{group.node.name}.value"
            if name in mask_constants:
                continue
            what, result, elements = "constant", ctx.range_check(tensor, target), tensor.size
        divisor = (group.node.op_type, slot) in ctx.rules.divisor_slots
        if result.overflowed and isinstance(source, StoredRange):
            why = (f"variable {name!r} has {result.overflowed} value(s) beyond "
                   f"{ctx.options.target}'s finite range ({FINITE_MAX[target]:g}); it stays fp32 "
                   f"where it is stored, and so does what reads it")
        elif result.overflowed and not ctx.options.clamp:
            why = (f"constant {name!r} has {result.overflowed} value(s) beyond "
                   f"{ctx.options.target}'s finite range ({FINITE_MAX[target]:g}); kept exact in "
                   f"fp32 (use --clamp to saturate instead)")
        elif result.vanishes or (divisor and result.flushed_to_zero):
            why = (f"{what} {name!r}: {result.flushed_to_zero} of its {result.nonzero} non-zero "
                   f"value(s) would flush to zero in {ctx.options.target}"
                   f"{' (a divisor)' if divisor else ''}; kept exact in fp32")
        else:
            continue
        if not any(r.name == name for r in ctx.constants):
            ctx.constants.append(ConstantRecord(
                name, "kept_fp32", elements, overflowed=result.overflowed,
                flushed_to_zero=result.flushed_to_zero,
                detail=f"feeds {group.node.name} ({group.node.op_type}), which stays fp32"))
        group.forced_deny = why
        forced += 1
        if slot >= 0:
            forced += _force_carried_readers(ctx, group.node, slot, why)
    return forced, []


def _force_carried_readers(ctx: PassContext, node: Node, slot: int, why: str) -> int:
    """Keep fp32 the groups that read a constant's values through ops that carry them unchanged
    or only selected (`rules.carry_ops`: an Identity, a Reshape; every frozen TF2 graph reads
    its weights through Identity nodes): a cast after the carrying op would overflow just the
    same. Returns how many groups it forced."""
    forced = 0
    seen: set[Value] = set()
    stack = [(node, slot)]
    while stack:
        carrier, carried_slot = stack.pop()
        if carried_slot not in ctx.rules.carry_ops.get(carrier.op_type, ()):
            continue
        for value in carrier.outputs:
            if value is None or value in seen:
                continue
            seen.add(value)
            for reader, reader_slot in value.uses:
                group = reader.input_group[reader_slot] \
                    if reader_slot < len(reader.input_group) else None
                if group is not None and group.paintable and not group.forced_deny:
                    group.forced_deny = f"{why}; read through {carrier.name} ({carrier.op_type})"
                    forced += 1
                stack.append((reader, reader_slot))
    return forced
