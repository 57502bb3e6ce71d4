"""Decide the precision of every type group, in the order TensorFlow Grappler's AMP pass uses.

This is an analysis: it writes `TypeGroup.precision`, `.reason` and `.via`, and never edits the
graph. The vertices are fp32 type groups; an edge runs from the group that produces a value to each
group that consumes it, across subgraph boundaries (captured values, If/Loop/Scan bodies).

1. allow: groups of allow-list ops.
2. deny spreads forward from deny ops through infer/clear ops that lie upstream of a deny or infer
   op (so the taint reaches every op whose result it can affect before an allow op absorbs it).
3. infer/clear groups both downstream and upstream of allow groups become allow.
4. (bf16 only, as in Grappler) an infer group fed by an allow group and no deny group becomes allow.
5. allow spreads through clear groups in both directions.
6. allow-list groups the backend cannot run in low precision go back to fp32.
7. existing Cast(to=float) nodes whose consumers are all low precision are retargeted, inputs
   that merely inspect a value (Shape, Cast's source) follow their producer, and constant-only
   parameter groups (BatchNormalization's scale/mean/var) follow the node's data group.
"""

from __future__ import annotations

from ..ir import ALLOW, BFLOAT16, CLEAR, DENY, FLOAT32, FP32, INFER, Graph, TypeGroup, Value
from .base import PassContext, PassResult
from .classify import FOLLOW_PRODUCER_INPUTS


class GroupGraph:
    """Producer -> consumer edges between the fp32 type groups of a model."""

    def __init__(self, graph: Graph):
        self.vertices: list[TypeGroup] = []
        owner_of_use: dict[tuple[int, int], TypeGroup] = {}
        self.owner_of_def: dict[int, TypeGroup] = {}
        for node in graph.walk_nodes():
            for group in node.type_groups:
                if group.fixed or group.dtype != FLOAT32:
                    continue
                self.vertices.append(group)
                for sub, index in group.inner_uses:
                    if sub is not None:
                        owner_of_use[(id(sub), index)] = group
                for value in group.inner_defs:
                    self.owner_of_def[id(value)] = group
        members = set(self.vertices)
        self.succ: dict[TypeGroup, list[TypeGroup]] = {g: [] for g in self.vertices}
        self.pred: dict[TypeGroup, list[TypeGroup]] = {g: [] for g in self.vertices}
        for group in self.vertices:
            seen: set[int] = set()
            for value in self.defined_values(group):
                for consumer, slot in value.uses:
                    target = consumer.input_group[slot]
                    if target in members and id(target) not in seen:
                        seen.add(id(target))
                        self.succ[group].append(target)
                        self.pred[target].append(group)
                for sub, index in value.graph_output_uses:
                    target = owner_of_use.get((id(sub), index))
                    if target is not None and id(target) not in seen:
                        seen.add(id(target))
                        self.succ[group].append(target)
                        self.pred[target].append(group)

    @staticmethod
    def defined_values(group: TypeGroup) -> list[Value]:
        """Values whose dtype this group decides: its outputs and its body-side definitions."""
        node = group.node
        values = [node.outputs[s] for s in group.output_slots if node.outputs[s] is not None]
        return values + list(group.inner_defs)

    def producer_group(self, value: Value) -> TypeGroup | None:
        if value.producer is not None:
            return value.producer.output_group[value.producer_slot]
        return self.owner_of_def.get(id(value))


def _op_class(group: TypeGroup) -> str:
    return DENY if group.forced_deny else group.node.op_class


def _label(group: TypeGroup) -> str:
    node = group.node
    return f"{node.name} ({node.op_type})"


def propagate_precision(ctx: PassContext) -> PassResult:
    """Paint every fp32 type group low precision or fp32, recording why."""
    gg = GroupGraph(ctx.model.graph)
    target = ctx.target_dtype
    allow: set[TypeGroup] = set()
    reason: dict[TypeGroup, str] = {}
    via: dict[TypeGroup, TypeGroup] = {}

    # 1. allow-list ops.
    for g in gg.vertices:
        if _op_class(g) == ALLOW and g.paintable:
            if not ctx.lists.has_kernel(g.node.qualified_op, g.name):
                # Kept out from the start, so it cannot pull its neighbours into low precision.
                reason[g] = (f"{ctx.lists.backend} has no {ctx.options.target} kernel for "
                             f"{g.node.qualified_op}")
                continue
            allow.add(g)
            reason[g] = f"allow list: {g.node.class_reason}"

    # 2. deny forward through infer/clear ops that are upstream of a deny or infer op.
    upstream_of_deny_or_infer: set[TypeGroup] = set()
    stack = [g for g in gg.vertices if _op_class(g) in (DENY, INFER)]
    upstream_of_deny_or_infer.update(stack)
    while stack:
        g = stack.pop()
        for p in gg.pred[g]:
            if p not in upstream_of_deny_or_infer and _op_class(p) == CLEAR:
                upstream_of_deny_or_infer.add(p)
                stack.append(p)
    deny: set[TypeGroup] = set()
    for root in gg.vertices:
        if _op_class(root) != DENY or root in deny:
            continue
        deny.add(root)
        reason[root] = root.forced_deny or f"deny list: {root.node.class_reason}"
        stack = [root]
        while stack:
            g = stack.pop()
            for s in gg.succ[g]:
                if s not in deny and s in upstream_of_deny_or_infer:
                    deny.add(s)
                    via[s] = g
                    reason[s] = (f"{_op_class(s)} op downstream of deny op {_label(root)} through "
                                 f"infer/clear ops: its numeric risk carries here")
                    stack.append(s)
    for g in deny:
        allow.discard(g)

    # 3. infer/clear between allow ops.
    def can_join(g: TypeGroup, classes: tuple[str, ...]) -> bool:
        return (g.paintable and g not in deny and g not in allow
                and _op_class(g) in classes)

    def allow_in_order() -> list[TypeGroup]:
        # Graph order, not set order, so the output never depends on object addresses.
        return [g for g in gg.vertices if g in allow]

    downstream_of_allow: set[TypeGroup] = set()
    for a in allow_in_order():
        stack = [a]
        while stack:
            g = stack.pop()
            for s in gg.succ[g]:
                if s not in downstream_of_allow and can_join(s, (CLEAR, INFER)):
                    downstream_of_allow.add(s)
                    stack.append(s)
    for a in allow_in_order():
        stack = [a]
        while stack:
            g = stack.pop()
            for p in gg.pred[g]:
                if p in downstream_of_allow and p not in allow:
                    allow.add(p)
                    via[p] = g
                    reason[p] = (f"{_op_class(p)} op between allow ops: downstream of one and "
                                 f"upstream of {_label(a)}")
                    stack.append(p)

    # 4. bf16: infer ops directly fed by allow ops (Grappler does this for oneDNN bf16 only).
    if target == BFLOAT16:
        for g in gg.vertices:
            if can_join(g, (INFER,)):
                fed = [p for p in gg.pred[g] if p in allow]
                if fed and not any(p in deny for p in gg.pred[g]):
                    allow.add(g)
                    via[g] = fed[0]
                    reason[g] = f"infer op fed by low-precision {_label(fed[0])} (bf16 rule)"

    # 5. allow through clear ops, both ways.
    for a in allow_in_order():
        stack = [a]
        while stack:
            g = stack.pop()
            for n in gg.succ[g] + gg.pred[g]:
                if can_join(n, (CLEAR,)):
                    allow.add(n)
                    via[n] = g
                    reason[n] = f"clear op connected to low-precision {_label(a)}"
                    stack.append(n)

    # 6. what the backend cannot run in low precision goes back to fp32.
    for g in allow_in_order():
        op = g.node.qualified_op
        if not ctx.lists.has_kernel(op, g.name):
            allow.discard(g)
            reason[g] = f"{ctx.lists.backend} has no {ctx.options.target} kernel for {op}"

    # 7a. existing casts to fp32 whose consumers all run low precision are retargeted.
    retargeted = 0
    for g in gg.vertices:
        node = g.node
        if node.op_type != "Cast" or g.output_slots != [0] or node.op_class == DENY:
            continue
        value = node.outputs[0]
        consumers = [c.input_group[s] for c, s in value.uses]
        top_level_output = any(sub.parent is None for sub, _ in value.graph_output_uses)
        if (consumers and not value.graph_output_uses and not top_level_output
                and all(c in allow for c in consumers)):
            allow.add(g)
            via[g] = consumers[0]
            reason[g] = "existing Cast to float32 retargeted: every consumer runs low precision"
            retargeted += 1

    # 7b. inputs that only inspect a value take the producer's dtype (no cast needed).
    for g in gg.vertices:
        if g.name not in FOLLOW_PRODUCER_INPUTS.get(g.node.op_type, ()) or g.output_slots:
            continue
        producers = [gg.producer_group(g.node.inputs[s]) for s in g.input_slots
                     if g.node.inputs[s] is not None]
        if producers and all(p in allow for p in producers) and g.allowed and target in g.allowed:
            allow.add(g)
            via[g] = producers[0]
            reason[g] = "reads its producer's dtype as is (no numeric effect)"

    # 7c. parameter-only groups (BatchNormalization's scale/mean/var) follow the node's data group,
    # so one kernel type serves the whole node.
    for g in gg.vertices:
        node = g.node
        if g in allow or g.output_slots or g.inner_defs or not g.paintable or g in deny:
            continue
        inputs = [node.inputs[s] for s in g.input_slots if node.inputs[s] is not None]
        data_groups = [d for d in node.type_groups if d.output_slots and d is not g]
        if inputs and all(v.const is not None for v in inputs) and data_groups \
                and all(d in allow for d in data_groups):
            allow.add(g)
            via[g] = data_groups[0]
            reason[g] = f"constant parameters follow the node's {data_groups[0].name} group"

    for g in gg.vertices:
        if g in allow:
            g.precision = target
            g.reason = reason[g]
        else:
            g.precision = FLOAT32
            g.reason = reason.get(g) or g.reason or _why_fp32(g)
        g.via = via.get(g)
    notes = [f"low precision groups: {len(allow)} of {len(gg.vertices)}",
             f"deny groups: {len(deny)}", f"existing casts retargeted: {retargeted}"]
    return PassResult("propagate_precision", len(allow), notes)


def _why_fp32(g: TypeGroup) -> str:
    op_class = _op_class(g)
    if op_class == INFER:
        return "infer op not between low-precision ops: nothing would be gained by a cast"
    if op_class == CLEAR:
        return "clear op not connected to a low-precision op"
    if op_class == FP32:
        return g.node.class_reason
    return f"{op_class} op kept fp32"
