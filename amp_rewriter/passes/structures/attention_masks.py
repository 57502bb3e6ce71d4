"""Additive attention masks in low precision, exactly.

A mask built from a constant beyond the target's range (`(1 - m) * finfo.min`, `Where(m, 0,
min)`, a causal triangle of `min`, several of them added) and added to attention scores before a
Softmax would keep the whole mask path fp32 under the constant-range rule: two casts of the
[batch, heads, query, key] scores per layer. This rule recognises the mask by structure and runs
the scores path in low precision instead:

- the mask *construction* (from the constant to where it meets the scores: small [B,1,1,S] /
  [1,1,S,S] tensors) stays fp32 where it computes (Mul, Sub, Add of masks), so the constant keeps
  its exact value; steps that only select or move mask values (Where(m, 0, min), Expand, ...)
  may run low precision, the constant entering them as -inf;
- where the mask joins the scores (an add), it enters low precision through a cast that turns
  every value beyond the range into -inf (IEEE rounding), so a masked score is -inf whatever the
  score was;
- right before the Softmax, the masked sum is saturated to the finite range (Clip at +-max).

What that gives, row by row, with fp32's result (where the constant, say -3.4e38, absorbs any
score: -3.4e38 + s == -3.4e38 in fp32):

- a row with an unmasked position: masked positions become -max (-65504 in fp16), unmasked ones
  keep their score, and exp(-max - rowmax) is 0 in the Softmax's fp32 accumulator: the masked
  positions get weight 0, as in fp32;
- a fully masked row: every position becomes exactly -max, so the row is uniform, as in fp32
  (without the -inf, -65504 + s would round to steps of 32 and the row would not be uniform;
  without the saturation the row would be all -inf and the Softmax NaN);
- two masks added (causal + padding): -inf + -inf = -inf, saturated to -max: the same as one
  mask. fp32 differs here: -3.4e38 + -3.4e38 overflows to -inf, so a fully masked row whose
  positions are all masked twice is NaN in fp32 (uniform here), and one where only some are is
  spread over the positions masked once (over all masked positions here);
- large negative scores: finite scores pass unchanged; a score that itself overflows the target
  (beyond -65504, the MatMul's own range) is saturated like a masked one.

Only sums that stay inside the rule's reach are accepted: every value carrying the masked sum
must flow, through adds, positive scalings and data movement, into Softmax inputs and nowhere
else (no graph output, no other op), so no op but the Softmax ever sees the -inf.

## The rewrite: `saturate_masked_sums`

Saturate masked attention sums before their Softmax (the attention-mask rule's rewrite).

`find_attention_masks` keeps a mask's construction fp32 and plans, per accepted mask, the Softmax
inputs its sums reach. Where any part of that path runs in low precision (so a masked score can be
-inf), each Softmax input is clipped to the target's finite range: -inf becomes -max, and a fully
masked row is uniform as in fp32. The proof per case is above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeGuard, cast

import numpy as np

from ...ir import (
    FLOAT32,
    FLOAT_DTYPES,
    LOW_PRECISION_DTYPES,
    Graph,
    Node,
    TypeGroup,
    Value,
    decisions,
    present,
)
from ...ir.dtypes import FINITE_MAX, NUMPY_DTYPES
from ..base import ConstantRecord, PassContext, StructureRecord, register_pass
from ..rewrite.building import new_node, scalar_constant
from .matching import heavy


@dataclass
class SaturationPlan:
    """An attention mask the analysis accepted: where its sums may carry -inf in low precision
    (`region`), and the Softmax inputs to saturate when any of it runs low precision."""

    sinks: list[Node]
    region: list[TypeGroup]
    record: StructureRecord
    #: The mask's constants (initializer names, or "node.value" for a fill value): the
    #: constant-range rule leaves them to this plan.
    constants: list[str] = field(default_factory=list)

    @property
    def anchor(self) -> Node:
        """The first Softmax the saturation goes before."""
        return self.sinks[0]

    def planned_nodes(self) -> list[Node]:
        """The Softmaxes and the masked path's nodes."""
        return [*self.sinks, *(group.node for group in self.region)]

    def kept_constants(self) -> list[str]:
        """The mask's constants."""
        return self.constants


def saturation_plans(ctx: PassContext) -> list[SaturationPlan]:
    """The masks `find_attention_masks` accepted, for `saturate_masked_sums`."""
    return cast(list[SaturationPlan], ctx.plans.setdefault("attention_mask", []))


@dataclass
class _Mask:
    """One connected mask: its constants, construction, joins, masked sums and Softmax sinks."""

    constants: list[str] = field(default_factory=list)
    construction: list[Node] = field(default_factory=list)
    joins: list[Node] = field(default_factory=list)
    region: list[Node] = field(default_factory=list)
    sinks: list[Node] = field(default_factory=list)
    #: Why the rule cannot apply ("" while it can).
    refused: str = ""


class _Components:
    """Union-find over nodes and constants."""

    def __init__(self) -> None:
        self.parent: dict[Node | Value, Node | Value] = {}

    def find(self, key: Node | Value) -> Node | Value:
        self.parent.setdefault(key, key)
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def union(self, a: Node | Value, b: Node | Value) -> None:
        self.parent[self.find(a)] = self.find(b)


def _is_float(value: Value | None) -> TypeGuard[Value]:
    return value is not None and value.original_dtype in FLOAT_DTYPES


def _positive_constant(value: Value | None) -> bool:
    tensor = value.known_constant if value is not None else None
    if tensor is None:
        return False
    data = np.asarray(tensor.numpy(), dtype=np.float64)
    return data.size > 0 and bool(np.all(np.isfinite(data) & (data > 0)))


def _after_heavy_ops(ctx: PassContext) -> set[Value]:
    """The values computed (transitively) from the output of an allow-class op: activations
    such as attention scores, as opposed to masks built from inputs and constants. A shape read
    (Shape, Size) carries no activation: T5's relative position bias is looked up from positions
    counted off the keys' shape, and is data like the mask it is added to."""
    tainted: set[Value] = set()
    metadata = ctx.rules.metadata_ops
    for node in ctx.model.graph.nodes:
        if heavy(node) or (node.op_type not in metadata
                           and any(v is not None and v in tainted for v in node.inputs)):
            tainted.update(v for v in node.outputs if v is not None)
    return tainted


def _overflowing_sources(ctx: PassContext) -> tuple[list[Value], list[Node]]:
    """Float32 constants with values beyond the target's range, in the order the main graph's
    nodes first read them, and constant-filling nodes whose fill value is (the constant filling
    a causal triangle)."""
    target = ctx.target_dtype
    graph = ctx.model.graph
    fill_attrs = ctx.rules.constant_fill_attrs
    fills = [node for node in graph.nodes
             if (attr := fill_attrs.get(node.op_type)) is not None and attr in node.attrs
             and node.outputs and _is_float(node.outputs[0])
             and ctx.range_check(node.attrs[attr], target).overflowed]
    # The graph's constants are few beside its node inputs (a million at a million nodes):
    # the inputs are walked only to order the constants that overflow, when there are any,
    # and only up to the last one's first reader (a mask is read from the first layer on).
    constants = {value: tensor for value in graph.values.values()
                 if (tensor := value.known_constant) is not None and value.uses
                 and value.dtype == FLOAT32}
    ctx.range_check_all(constants.values(), target)
    unordered = {value: value for value, tensor in constants.items()
                 if ctx.range_check(tensor, target).overflowed}
    ordered: list[Value] = []
    for node in graph.nodes:
        if not unordered:
            break
        for value in node.inputs:
            if value is not None and value in unordered:
                ordered.append(unordered.pop(value))
    return ordered, fills


def find_masks(ctx: PassContext) -> list[_Mask]:
    """Every additive mask of the main graph, with `refused` set where the rule cannot apply."""
    rules = ctx.rules
    graph = ctx.model.graph
    constants, fills = _overflowing_sources(ctx)
    if not constants and not fills:
        return []
    heavy = _after_heavy_ops(ctx)
    parts = _Components()
    masked: set[Value] = set()   # the fp32 values of a mask's construction (the mask itself)
    summed: set[Value] = set()   # the values carrying a masked sum (scores + mask)
    role: dict[Node, str] = {}  # node -> construction / join / region / sink / refused: why
    for value in constants:
        masked.add(value)
    for node in fills:
        role[node] = "construction"
        for out in node.outputs:
            if _is_float(out):
                masked.add(out)
                parts.union(out, node)
    for node in graph.nodes:
        if node in role:
            continue
        float_slots = [s for s, v in enumerate(node.inputs) if _is_float(v)]
        mask_slots = [s for s in float_slots if node.inputs[s] in masked]
        sum_slots = [s for s in float_slots if node.inputs[s] in summed]
        if not mask_slots and not sum_slots:
            continue
        for s in mask_slots + sum_slots:
            parts.union(node, present(node.inputs[s]))  # a float slot: never empty
        others = [s for s in float_slots if s not in mask_slots and s not in sum_slots]
        kind = rules.role(node.op_type)
        if sum_slots:
            verdict = _sum_step(node, kind, sum_slots, mask_slots, others, ctx)
        elif kind in ("add", "sub") and others and all(node.inputs[s] in heavy
                                                       for s in others) \
                and (kind == "add" or mask_slots == [1]):
            verdict = "join"  # the mask meets the scores
        elif node.op_type in rules.mask_build_ops \
                and not any(node.inputs[s] in heavy for s in others):
            verdict = "construction"
        else:
            verdict = (f"refused: the mask reaches {node.name} ({node.op_type}), which neither "
                       f"builds a mask nor adds it to the scores")
        role[node] = verdict
        out_set = masked if verdict == "construction" else summed
        if verdict in ("construction", "join", "region"):
            for out in node.outputs:
                if _is_float(out):
                    out_set.add(out)
                    parts.union(out, node)
                    if out_set is summed and out is not None and out.graph_output_uses:
                        role[node] = (f"refused: the masked sum {out.name!r} is a graph "
                                          f"output")
                    if out_set is summed and out is not None and any(
                            consumer.graph is not graph for consumer, _ in out.uses):
                        role[node] = (f"refused: the masked sum {out.name!r} is read "
                                          f"inside a subgraph")
    masks: dict[Node | Value, _Mask] = {}
    for value in constants:
        masks.setdefault(parts.find(value), _Mask()).constants.append(value.name)
    for node in graph.nodes:
        found = role.get(node)
        if found is None:
            continue
        verdict = found
        mask = masks.setdefault(parts.find(node), _Mask())
        if verdict.startswith("refused"):
            mask.refused = mask.refused or verdict[len("refused: "):]
        elif verdict == "construction":
            mask.construction.append(node)
            if node in fills:
                mask.constants.append(f"{node.name}.value")
        else:
            {"join": mask.joins, "region": mask.region, "sink": mask.sinks}[verdict].append(node)
    result = []
    for mask in masks.values():
        if not mask.refused and not mask.sinks:
            mask.refused = "the mask is never added to the input of a Softmax"
        result.append(mask)
    return result


def _sum_step(node: Node, kind: str, sum_slots: list[int], mask_slots: list[int],
              others: list[int], ctx: PassContext) -> str:
    """What a node reading a masked sum is: a region step that keeps the -inf meaningful, the
    Softmax at its end, or (refused: why) anything else."""
    rules = ctx.rules
    if kind == "softmax" and sum_slots == [0]:
        return "sink"
    if len(sum_slots) == 1:
        slot = sum_slots[0]
        if kind == "add":
            return "region"  # scores + mask + another mask: -inf + -inf stays -inf
        if kind == "sub" and slot == 0 and not mask_slots:
            return "region"  # -inf - finite stays -inf
        if kind == "mul" and not mask_slots and others \
                and all(_positive_constant(node.inputs[s]) for s in others):
            return "region"  # a positive scale keeps -inf
        if kind == "div" and slot == 0 and not mask_slots and others == [1] \
                and _positive_constant(node.inputs[1]):
            return "region"
    carry = rules.carry_ops.get(node.op_type)
    if carry is not None and all(s in carry for s in sum_slots + mask_slots):
        return "region"  # data movement and selection
    return (f"refused: the masked sum reaches {node.name} ({node.op_type}), which is not a "
            f"Softmax input nor a step that keeps -inf meaningful")


def _selection_only(mask: _Mask, ctx: PassContext) -> list[Node]:
    """Construction nodes that only move or select mask values (Where(m, 0, min), Expand,
    Reshape, ...) and whose results reach only joins or other such nodes: they may run in low
    precision, the constant entering them as -inf through a runtime cast, since no arithmetic
    sees the -inf before the saturated sum. Arithmetic (Mul, Sub, Add of masks) and constant
    fills stay fp32: (1 - m) * -inf would be NaN where m is 1."""
    carry = ctx.rules.carry_ops
    joins = {n for n in mask.joins + mask.region + mask.sinks}
    fills = {n for n in mask.construction if not any(v is not None for v in n.inputs)
             or n.op_type in ctx.rules.constant_fill_attrs}
    selecting = {n: n for n in mask.construction
                 if n.op_type in carry and n not in fills}
    changed = True
    while changed:
        changed = False
        for key, node in list(selecting.items()):
            for out in node.outputs:
                if out is None or not _is_float(out):
                    continue
                if out.graph_output_uses or not all(c in joins or c in selecting
                                                    for c, _ in out.uses):
                    del selecting[key]
                    changed = True
                    break
    return [n for n in mask.construction if n in selecting]


def _explain(mask: _Mask, ctx: PassContext) -> str:
    limit = FINITE_MAX[ctx.target_dtype]
    names = ", ".join(repr(c) for c in mask.constants)
    return (f"attention mask from constant {names} (beyond {ctx.options.target}'s range): its "
            f"construction stays fp32; it joins the scores at "
            f"{', '.join(n.name for n in mask.joins)} as -inf and the sum is saturated to "
            f"+-{limit:g} before {', '.join(n.name for n in mask.sinks)}, so masked positions "
            f"get weight 0 and fully masked rows are uniform, as in fp32 (differs from fp32 "
            f"only where two masks overlap on a row with no unmasked position: fp32's "
            f"-3.4e38 + -3.4e38 overflows there)")


@register_pass("find_attention_masks")
def find_attention_masks(ctx: PassContext) -> tuple[int, list[str]]:
    """Recognise additive attention masks whose constant overflows the target: keep their
    construction fp32 and plan the saturation of the masked sums (see the module docstring).

    Masks the rule cannot take (a masked sum read by anything but a Softmax, --clamp, a format
    that cannot saturate) are left to guard_constant_ranges, which keeps their path fp32.
    """
    rules = ctx.rules
    can_saturate = bool(rules.saturate_op) and (
        ctx.lists.has_kernel(rules.saturate_op)
        or (bool(rules.saturate_pair)
            and all(ctx.lists.has_kernel(op) for op in rules.saturate_pair)))
    if ctx.options.clamp or not can_saturate:
        return 0, []
    accepted = 0
    notes = []
    for mask in find_masks(ctx):
        ruled = [n.name for n in mask.construction if n in ctx.user_rule_nodes]
        if ruled and not mask.refused:
            mask.refused = f"a pattern rule decides its construction ({', '.join(ruled)})"
        if mask.refused:
            notes.append(f"constant(s) {', '.join(mask.constants)}: not an attention mask the "
                         f"rule can take ({mask.refused}); left to the constant-range rule")
            continue
        why = _explain(mask, ctx)
        selecting = _selection_only(mask, ctx)
        for node in mask.construction:
            ctx.focus = node
            if node in selecting:
                continue  # moves or selects mask values only: may carry -inf in low precision
            for group in node.type_groups:
                if group.dtype == FLOAT32 and not group.fixed:
                    group.paintable = False
                    group.reason, group.kind = (f"builds an {why[0].lower()}{why[1:]}",
                                                decisions.STRUCTURE)
        region: list[TypeGroup] = [g for n in selecting + mask.joins + mask.region + mask.sinks
                                   for g in n.type_groups if g.dtype == FLOAT32]
        record = StructureRecord("attention_mask",
                                 [n.name for n in mask.construction + mask.joins + mask.sinks],
                                 why)
        ctx.structures.append(record)
        saturation_plans(ctx).append(SaturationPlan(list(mask.sinks), region, record,
                                              list(mask.constants)))
        for name in mask.constants:
            if not any(c.name == name for c in ctx.constants):
                size = _constant_size(ctx, name)
                ctx.constants.append(ConstantRecord(
                    name, "kept_fp32", size, detail="attention-mask constant: its construction "
                    "stays fp32; the scores path runs low precision with a saturated sum"))
        accepted += 1
    return accepted, notes


def _constant_size(ctx: PassContext, name: str) -> int:
    value = ctx.model.graph.lookup(name)
    if value is not None and value.const is not None:
        return value.const.size
    return 1


def _bound(ctx: PassContext, graph: Graph, dtype: str, sign: int,
           cache: dict[tuple[Graph, str, int], Value]) -> Value:
    """The constant -max or +max of the target, in `dtype`, one per graph."""
    key = (graph, dtype, sign)
    if key not in cache:
        cache[key] = scalar_constant(
            ctx.model, graph, f"mask_saturation_{'max' if sign > 0 else 'min'}_{dtype}",
            sign * FINITE_MAX[ctx.target_dtype], dtype)
    return cache[key]


def _saturation_steps(ctx: PassContext, op: str, dtype: str) -> list[tuple[str, tuple[int, ...]]]:
    """The saturation as (op, bound signs) steps: one clip, or max then min where the backend has
    no kernel for the clip in this dtype (ORT CUDA has no bf16 Clip, measured)."""
    pair = ctx.rules.saturate_pair
    if dtype in LOW_PRECISION_DTYPES and pair and not ctx.lists.has_kernel(op):
        return [(pair[0], (-1,)), (pair[1], (+1,))]
    return [(op, (-1, +1))]


@register_pass("saturate_masked_sums")
def saturate_masked_sums(ctx: PassContext) -> tuple[int, list[str]]:
    """Clip the input of every Softmax an accepted attention mask reaches to +-max of the target,
    where any step of the masked path runs in low precision."""
    op = ctx.rules.saturate_op
    cache: dict[tuple[Graph, str, int], Value] = {}
    added = 0
    for plan in saturation_plans(ctx):
        if not any(g.precision in LOW_PRECISION_DTYPES for g in plan.region):
            continue  # the whole path stayed fp32: the mask keeps its exact fp32 meaning
        for sink in plan.sinks:
            ctx.focus = sink
            source = present(sink.inputs[0])
            dtype = source.dtype if source.dtype in NUMPY_DTYPES else FLOAT32
            graph = sink.graph
            assert graph is not None
            steps = _saturation_steps(ctx, op, dtype)
            value = source
            nodes: list[Node] = []
            for step_op, bounds in steps:
                step = new_node(ctx.model, graph, f"{sink.name}/saturate", step_op,
                                [value, *(_bound(ctx, graph, dtype, sign, cache)
                                          for sign in bounds)],
                                f"{source.name}_saturated", dtype, source.shape,
                                op_class="saturation", reason=plan.record.detail,
                                order=sink.order)
                nodes.append(step)
                value = present(step.outputs[0])
            sink.set_input(0, value)
            graph.insert_before(sink, nodes)
            plan.record.added.extend(n.name for n in nodes)
            added += 1
    return added, []
