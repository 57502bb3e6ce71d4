"""Classify every node (allow / infer / deny / clear / fp32) and mark the groups that may be
painted."""

from __future__ import annotations

from ...ir import ALLOW, FLOAT32, FP32, decisions
from ..base import PassContext, register_pass


@register_pass("classify_ops")
def classify_ops(ctx: PassContext) -> tuple[int, list[str]]:
    """Give each node its op class with a reason, and decide which of its groups are paintable."""
    target = ctx.target_dtype
    counts: dict[str, int] = {}
    for node in ctx.model.graph.walk_nodes():
        ctx.focus = node
        if node.pin_reason and node.pin_barrier:
            # the user's --keep-node, or a loader's / front end's rule: an fp32 barrier
            node.op_class, node.class_reason = FP32, node.pin_reason
            node.class_kind = node.pin_kind or decisions.PIN
        elif not node.has_schema:
            node.op_class, node.class_kind = FP32, decisions.SCHEMA
            node.class_reason = (f"{node.qualified_op} has no schema (custom or unknown domain): "
                                 f"left as it is, an fp32 barrier")
        else:
            node.op_class, node.class_reason = ctx.lists.class_of(node.qualified_op)
            node.class_kind = ctx.lists.kind_of(node.qualified_op)
        counts[node.op_class] = counts.get(node.op_class, 0) + 1
        for group in node.type_groups:
            if group.fixed or group.dtype != FLOAT32:
                continue
            if node.op_class == FP32:
                group.reason, group.kind = node.class_reason, node.class_kind
            elif group.allowed is not None and target not in group.allowed:
                group.reason = f"the {node.op_type} schema does not allow {target} for {group.name}"
                group.kind = decisions.SCHEMA
            elif not ctx.lists.has_kernel(node.qualified_op, group.name) \
                    and node.op_class != ALLOW:
                group.reason = (f"{ctx.lists.backend} has no {ctx.options.target} kernel for "
                                f"{node.op_type}")
                group.kind = decisions.BACKEND_KERNEL
            else:
                group.paintable = True
    notes = [f"{k}: {v}" for k, v in sorted(counts.items())]
    return sum(counts.values()), notes
