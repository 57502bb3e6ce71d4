"""Loop back edges: the value a loop carries back must have one dtype at both ends."""

from __future__ import annotations

from ...ir import FLOAT32, TypeGroup, decisions
from ..base import PassContext, register_pass


@register_pass("match_recurrent_edges")
def match_recurrent_edges(ctx: PassContext) -> tuple[int, list[str]]:
    """Make each loop back edge (TF1: NextIteration -> Merge) agree on one dtype.

    As Grappler's ForceColorMatchOnRecurrentEdges: if any op fed by the back edge stays fp32, the
    back-edge op and all of them stay fp32; otherwise the back-edge op follows them into low
    precision. Which ops form back edges is the format's rule (`FormatRules.recurrent_edges`).
    """
    target = ctx.target_dtype
    edges = ctx.rules.recurrent_edges
    changed = 0
    for node in ctx.model.graph.walk_nodes():
        joins = edges.get(node.op_type)
        if joins is None or not node.outputs or node.outputs[0] is None:
            continue
        ctx.focus = node
        group = node.output_group[0]
        if group is None or group.precision is None:
            continue  # not a float loop variable
        merges: list[TypeGroup] = []
        for consumer, slot in node.outputs[0].uses:
            g = consumer.input_group[slot]
            if consumer.op_type in joins and g is not None and g.precision is not None:
                merges.append(g)
        if not merges:
            continue
        stays_fp32 = [m for m in merges if m.precision != target]
        if stays_fp32:
            culprit = stays_fp32[0]
            for g in [group] + merges:
                if g.precision != FLOAT32:
                    g.decide(FLOAT32, decisions.TYPE_GROUP,
                             f"loop back edge {node.name} -> {culprit.node.name}: "
                             f"{node.op_type} and the ops it feeds back into must agree, and "
                             f"{culprit.node.name} stays fp32", via=culprit)
                    changed += 1
        elif group.precision != target:
            group.decide(target, decisions.TYPE_GROUP,
                         f"loop back edge: follows {merges[0].node.op_type} "
                         f"{merges[0].node.name} into {ctx.options.target}", via=merges[0])
            changed += 1
    return changed, []
