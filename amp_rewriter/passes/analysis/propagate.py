"""Decide the precision of every type group, in the order TensorFlow Grappler's AMP pass uses.

This is an analysis: it writes each group's decision and never edits the graph. It runs as a
list of phases over one `Painting`, which keeps what it decides in the groups' own decision fields
(precision, kind, reason, path), where it stays: a table per field would cost ~40 MB each at a
million groups, at the conversion's peak. The phases:

1. seed_allow: groups of allow-list ops.
2. spread_deny: deny spreads forward from deny ops through infer/clear ops that lie upstream of a
   deny or infer op (so the taint reaches every op whose result it can affect before an allow op
   absorbs it).
3. fill_between_allow: infer/clear groups both downstream and upstream of allow groups go low.
   fill_from_constants: infer/clear groups computed only from constants and integers (embedding
   lookups and their sums) that lead into allow groups go low.
   fill_tail_to_outputs: infer/clear groups after the last allow groups that reach only graph
   outputs go low where that needs fewer casts (more low inputs than outputs).
4. infer_after_allow (bf16 only, as in Grappler): an infer group fed by an allow group and no
   deny group goes low.
5. spread_through_clear: allow spreads through clear groups in both directions.
6. drop_without_kernel: groups the backend cannot run in low precision go back to fp32.
   drop_pins_without_barrier: pinned nodes that are no barrier (`convert --auto`'s measured
   hazards) go back to fp32. The painting above saw them with their op class, so their
   neighbours are decided as in the conversion that was measured.
7. retarget_existing_casts: the model's casts to fp32 whose consumers all run low precision.
8. follow_producers: inputs that merely inspect a value (Shape, Cast's source) follow their
   producer.
9. follow_data_group: constant-only parameter groups (BatchNormalization's scale/mean/var)
   follow the node's data group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ...ir import (
    ALLOW,
    BFLOAT16,
    CLEAR,
    DENY,
    FLOAT32,
    FP32,
    INFER,
    IRError,
    TypeGroup,
    Value,
    decisions,
)
from ..base import PassContext, register_pass
from .group_graph import GroupGraph


def op_class(group: TypeGroup) -> str:
    """The group's class for propagation: deny when a constant forced it, else its node's."""
    return DENY if group.forced_deny else group.node.op_class


def label(group: TypeGroup) -> str:
    """"name (Op)" of the group's node, for reasons."""
    node = group.node
    return f"{node.name} ({node.op_type})"


@dataclass
class Painting:
    """The analysis state: which groups go low precision, which are deny, and why.

    A group the painting has not looked at yet has no precision; one it noted has float32 (for
    now) and its kind, reason and path (`via`); one it painted has the target dtype.
    """

    graph: GroupGraph
    ctx: PassContext
    deny: set[TypeGroup] = field(default_factory=set)

    def __post_init__(self) -> None:
        #: The target dtype: the precision of a painted group.
        self.low = self.ctx.target_dtype
        if any(g.precision is not None for g in self.graph.vertices):
            raise IRError("a painting starts from undecided groups: these were decided before")

    def paint(self, group: TypeGroup, kind: str, reason: str,
              via: TypeGroup | None = None) -> None:
        """Put `group` in low precision, recording why."""
        self.note(group, kind, reason, via)
        group.precision = self.low

    def note(self, group: TypeGroup, kind: str, reason: str, via: TypeGroup | None = None) -> None:
        """Record why `group` is where it is (without moving it)."""
        if group.precision is None:
            group.precision = FLOAT32
        group.kind, group.reason = kind, reason
        if via is not None:
            group.via = via

    def unpaint(self, group: TypeGroup) -> bool:
        """Take `group` back to fp32 (its reason is the caller's to note); False when it was
        not low precision."""
        if group.precision != self.low:
            return False
        group.precision = FLOAT32
        return True

    def is_low(self, group: TypeGroup | None) -> bool:
        """Whether `group` is painted low precision (None, a slot of no group: it is not)."""
        return group is not None and group.precision == self.low

    def allow_in_order(self) -> list[TypeGroup]:
        """The low-precision groups in graph order."""
        low = self.low
        return [g for g in self.graph.vertices if g.precision == low]

    def can_join(self, group: TypeGroup, classes: tuple[str, ...]) -> bool:
        """Whether a group of one of `classes` may still be painted low."""
        return (group.paintable and group.precision != self.low and group not in self.deny
                and op_class(group) in classes)

    def no_kernel(self, group: TypeGroup) -> str | None:
        """Why the backend cannot run `group` in the target dtype, or None when it can."""
        ctx = self.ctx
        op = group.node.qualified_op
        if ctx.lists.has_kernel(op, group.name):
            return None
        return f"{ctx.lists.backend} has no {ctx.options.target} kernel for {op}"


Phase = Callable[[Painting], int]


class SharedTexts(dict[str, str]):
    """Reasons by what varies in them, so that the groups one rule decides from one source
    share one string (a million-node graph would otherwise hold a copy per group):
    `texts.get(key) or texts.put(key, f"...")` formats the text once."""

    def put(self, key: str, text: str) -> str:
        self[key] = text
        return text


def seed_allow(p: Painting) -> int:
    """Allow-list ops go low, unless the backend has no kernel for them (then they stay out from
    the start, so they cannot pull their neighbours into low precision)."""
    seeded = 0
    reasons = SharedTexts()
    for g in p.graph.vertices:
        if op_class(g) != ALLOW or not g.paintable:
            continue
        missing = p.no_kernel(g)
        if missing:
            p.note(g, decisions.BACKEND_KERNEL, missing)
            continue
        class_reason = g.node.class_reason
        p.paint(g, g.node.class_kind or decisions.OP_LIST,
                reasons.get(class_reason) or reasons.put(class_reason,
                                                         f"allow list: {class_reason}"))
        seeded += 1
    return seeded


def spread_deny(p: Painting) -> int:
    """Deny spreads forward through infer/clear ops that lie upstream of a deny or infer op."""
    gg = p.graph
    upstream: set[TypeGroup] = set()
    stack = [g for g in gg.vertices if op_class(g) in (DENY, INFER)]
    upstream.update(stack)
    while stack:
        g = stack.pop()
        for pred in gg.pred[g]:
            if pred not in upstream and op_class(pred) == CLEAR:
                upstream.add(pred)
                stack.append(pred)
    root_reasons = SharedTexts()
    for root in gg.vertices:
        if op_class(root) != DENY or root in p.deny:
            continue
        p.deny.add(root)
        if root.forced_deny:
            p.note(root, decisions.CONSTANT_RANGE, root.forced_deny)
        else:
            class_reason = root.node.class_reason
            p.note(root, root.node.class_kind or decisions.OP_LIST,
                   root_reasons.get(class_reason)
                   or root_reasons.put(class_reason, f"deny list: {class_reason}"))
        reasons = SharedTexts()
        stack = [root]
        while stack:
            g = stack.pop()
            for succ in gg.succ[g]:
                if succ not in p.deny and succ in upstream:
                    p.deny.add(succ)
                    cls = op_class(succ)
                    p.note(succ, decisions.PROPAGATION, reasons.get(cls) or reasons.put(
                        cls, f"{cls} op downstream of deny op {label(root)} through "
                             f"infer/clear ops: its numeric risk carries here"), via=g)
                    stack.append(succ)
    for g in p.deny:
        p.unpaint(g)
    return len(p.deny)


def fill_between_allow(p: Painting) -> int:
    """Infer and clear ops that are downstream of one allow op and upstream of another go low."""
    gg = p.graph
    downstream: set[TypeGroup] = set()
    for a in p.allow_in_order():
        stack = [a]
        while stack:
            g = stack.pop()
            for succ in gg.succ[g]:
                if succ not in downstream and p.can_join(succ, (CLEAR, INFER)):
                    downstream.add(succ)
                    stack.append(succ)
    painted = 0
    low = p.low
    for a in p.allow_in_order():
        reasons = SharedTexts()
        stack = [a]
        while stack:
            g = stack.pop()
            for pred in gg.pred[g]:
                if pred in downstream and pred.precision != low:
                    cls = op_class(pred)
                    p.paint(pred, decisions.PROPAGATION, reasons.get(cls) or reasons.put(
                        cls, f"{cls} op between allow ops: downstream of one and upstream of "
                             f"{label(a)}"), via=g)
                    painted += 1
                    stack.append(pred)
    return painted


def fill_from_constants(p: Painting) -> int:
    """Infer and clear ops computed only from constants and integer inputs (embedding lookups,
    their sums and normalisation) that lead into an allow op go low: their fp32 sources are
    constants, which convert offline, so running them low removes the cast in front of the
    allow op instead of adding one."""
    gg = p.graph
    constant_fed: set[TypeGroup] = set()
    for g in gg.vertices:  # graph order: producers first
        if g.inner_defs or g.inner_uses or not g.input_slots:
            continue
        # A loop that stops at the first input computed at run time: that is most groups'
        # first (a million groups at a million nodes).
        node_inputs = g.node.inputs
        for slot in g.input_slots:
            value = node_inputs[slot]
            if value is None or value.is_graph_input:
                break
            if value.known_constant is None and gg.producer_group(value) not in constant_fed:
                break
        else:
            constant_fed.add(g)
    painted = 0
    for a in p.allow_in_order():
        reasons = SharedTexts()
        stack = [a]
        while stack:
            g = stack.pop()
            for pred in gg.pred[g]:
                if pred in constant_fed and p.can_join(pred, (CLEAR, INFER)):
                    cls = op_class(pred)
                    p.paint(pred, decisions.PROPAGATION, reasons.get(cls) or reasons.put(
                        cls, f"{cls} op computed only from constants and integers, upstream of "
                             f"{label(a)}: its constants convert offline, so it runs low "
                             f"precision instead of casting in front of the allow op"), via=g)
                    painted += 1
                    stack.append(pred)
    return painted


def fill_tail_to_outputs(p: Painting) -> int:
    """Infer and clear ops after the last allow ops, whose results reach only graph outputs (the
    final residual add and normalisation), go low when that needs fewer casts: each connected
    tail whose inputs are all low precision or constants, and which reads more low-precision
    values than it hands to graph outputs, moves its casts to the outputs."""
    gg = p.graph
    tail: set[TypeGroup] = set()
    for g in reversed(gg.vertices):  # consumers before producers
        if p.can_join(g, (INFER, CLEAR)) and not g.inner_defs and not g.inner_uses \
                and all(s in tail for s in gg.succ[g]):
            tail.add(g)
    painted = 0
    seen: set[TypeGroup] = set()
    for start in gg.vertices:
        if start not in tail or start in seen:
            continue
        component, stack = [], [start]
        seen.add(start)
        while stack:  # the tail groups connected to `start`
            g = stack.pop()
            component.append(g)
            for n in (*gg.succ[g], *gg.pred[g]):
                if n in tail and n not in seen:
                    seen.add(n)
                    stack.append(n)
        members = set(component)
        entering: set[Value] = set()
        closed = True
        for g in component:
            for value in (g.node.inputs[s] for s in g.input_slots):
                if value is None or value.known_constant is not None:
                    continue
                producer = gg.producer_group(value)
                if producer in members:
                    continue
                if producer is None or not p.is_low(producer):
                    closed = False
                entering.add(value)
        nodes = {g.node for g in component}
        leaving = {v for g in component for v in gg.defined_values(g)
                   if v.graph_output_uses or any(c not in nodes for c, _ in v.uses)}
        if not closed or not entering or len(leaving) >= len(entering):
            continue
        for g in sorted(component):
            p.paint(g, decisions.PROPAGATION,
                    f"{op_class(g)} op after the last allow ops, reaching only graph outputs: "
                    f"low precision moves its {len(entering)} input casts to "
                    f"{len(leaving)} at the output(s)")
            painted += 1
    return painted


def infer_after_allow(p: Painting) -> int:
    """bf16 only (Grappler does this for oneDNN bf16): an infer op fed by an allow op and by no
    deny op goes low."""
    if p.ctx.target_dtype != BFLOAT16:
        return 0
    painted = 0
    for g in p.graph.vertices:
        if not p.can_join(g, (INFER,)):
            continue
        fed = [pred for pred in p.graph.pred[g] if p.is_low(pred)]
        if fed and not any(pred in p.deny for pred in p.graph.pred[g]):
            p.paint(g, decisions.PROPAGATION,
                    f"infer op fed by low-precision {label(fed[0])} (bf16 rule)", via=fed[0])
            painted += 1
    return painted


def spread_through_clear(p: Painting) -> int:
    """Allow spreads through clear ops, both ways."""
    painted = 0
    for a in p.allow_in_order():
        reason = None
        stack = [a]
        while stack:
            g = stack.pop()
            for n in (*p.graph.succ[g], *p.graph.pred[g]):
                if p.can_join(n, (CLEAR,)):
                    reason = reason or f"clear op connected to low-precision {label(a)}"
                    p.paint(n, decisions.PROPAGATION, reason, via=g)
                    painted += 1
                    stack.append(n)
    return painted


def drop_without_kernel(p: Painting) -> int:
    """What the backend cannot run in low precision goes back to fp32."""
    dropped = 0
    for g in p.allow_in_order():
        missing = p.no_kernel(g)
        if missing:
            p.unpaint(g)
            p.note(g, decisions.BACKEND_KERNEL, missing)
            dropped += 1
    return dropped


def measured_pin(group: TypeGroup) -> bool:
    """Whether the group's node is pinned without being a barrier (`convert --auto`)."""
    node = group.node
    return bool(node.pin_reason) and not node.pin_barrier


def drop_pins_without_barrier(p: Painting) -> int:
    """Pinned nodes that are no barrier go back to fp32, their neighbours staying as they are."""
    dropped = 0
    for g in p.graph.vertices:
        if not measured_pin(g):
            continue
        if p.unpaint(g):
            dropped += 1
        p.note(g, g.node.pin_kind or decisions.PIN, g.node.pin_reason)
    return dropped


def retarget_existing_casts(p: Painting) -> int:
    """The model's own casts to fp32 whose consumers all run low precision cast to that instead."""
    retargeted = 0
    for g in p.graph.vertices:
        node = g.node
        if node.op_type != "Cast" or g.output_slots != (0,) or node.op_class == DENY \
                or measured_pin(g):
            continue
        value = node.outputs[0]
        if value is None:
            continue
        consumers = [c.input_group[s] for c, s in value.uses]
        if consumers and not value.graph_output_uses and all(p.is_low(c) for c in consumers):
            first = consumers[0]
            p.paint(g, decisions.EXISTING_CAST,
                    "existing Cast to float32 retargeted: every consumer runs low precision",
                    via=first)
            retargeted += 1
    return retargeted


def follow_producers(p: Painting) -> int:
    """Inputs that only inspect a value (the format's follow-producer inputs) take the
    producer's dtype, so no cast is needed."""
    follow = p.ctx.rules.follow_producer_inputs
    target = p.ctx.target_dtype
    painted = 0
    for g in p.graph.vertices:
        if g.name not in follow.get(g.node.op_type, ()) or g.output_slots or measured_pin(g):
            continue
        producers = [p.graph.producer_group(v) for v in
                     (g.node.inputs[s] for s in g.input_slots) if v is not None]
        if producers and all(p.is_low(q) for q in producers) and g.allowed \
                and target in g.allowed:
            p.paint(g, decisions.TYPE_GROUP, "reads its producer's dtype as is (no numeric effect)",
                    via=producers[0])
            painted += 1
    return painted


def follow_data_group(p: Painting) -> int:
    """Parameter-only groups (BatchNormalization's scale/mean/var, all constants) follow the
    node's data group, so one kernel type serves the whole node."""
    painted = 0
    for g in p.graph.vertices:
        node = g.node
        if p.is_low(g) or g.output_slots or g.inner_defs or not g.paintable or g in p.deny \
                or measured_pin(g):
            continue
        inputs = [node.inputs[s] for s in g.input_slots if node.inputs[s] is not None]
        data_groups = [d for d in node.type_groups if d.output_slots and d is not g]
        if inputs and all(v.const is not None for v in inputs if v is not None) and data_groups \
                and all(p.is_low(d) for d in data_groups):
            p.paint(g, decisions.TYPE_GROUP,
                    f"constant parameters follow the node's {data_groups[0].name} group",
                    via=data_groups[0])
            painted += 1
    return painted


#: The phases in Grappler's order; each returns how many groups it moved.
PHASES: list[Phase] = [seed_allow, spread_deny, fill_between_allow, fill_from_constants,
                       fill_tail_to_outputs, infer_after_allow,
                       spread_through_clear, drop_without_kernel, drop_pins_without_barrier,
                       retarget_existing_casts, follow_producers, follow_data_group]


def why_fp32(group: TypeGroup) -> tuple[str, str]:
    """(kind, reason) for a group no rule moved: its classification's, or its class's default."""
    if group.reason:
        return group.kind or group.node.class_kind, group.reason
    cls = op_class(group)
    if cls == INFER:
        return decisions.PROPAGATION, ("infer op not between low-precision ops: nothing would be "
                                       "gained by a cast")
    if cls == CLEAR:
        return decisions.PROPAGATION, "clear op not connected to a low-precision op"
    if cls == FP32:
        return group.node.class_kind, group.node.class_reason
    return group.node.class_kind, f"{cls} op kept fp32"


def commit(p: Painting) -> None:
    """Decide the groups the painting left alone: fp32, for the reason `why_fp32` gives (the
    others hold their decision already)."""
    for g in p.graph.vertices:
        if g.precision is None:
            kind, reason = why_fp32(g)
            g.decide(FLOAT32, kind, reason)


@register_pass("propagate_precision")
def propagate_precision(ctx: PassContext) -> tuple[int, list[str]]:
    """Paint every fp32 type group low precision or fp32, recording why (see PHASES)."""
    painting = Painting(GroupGraph(ctx.model.graph), ctx)
    moved = {phase.__name__: phase(painting) for phase in PHASES}
    commit(painting)
    low = len(painting.allow_in_order())
    notes = [f"low precision groups: {low} of {len(painting.graph.vertices)}",
             f"deny groups: {len(painting.deny)}",
             f"existing casts retargeted: {moved['retarget_existing_casts']}"]
    return low, notes
