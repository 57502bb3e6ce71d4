"""Classify every node (allow / infer / deny / clear / fp32) and mark which groups may be painted."""

from __future__ import annotations

from ..ir import ALLOW, FLOAT32, FP32, Node
from .base import PassContext, PassResult

#: Ops whose float input slots simply take whatever dtype their producer has: their result does
#: not depend on precision (Shape, Size) or is a conversion anyway (Cast). Painting them to follow
#: the producer avoids a cast that changes nothing. Op -> the input groups concerned (ONNX type
#: constraint names and TensorFlow type attrs: TF's Cast reads `SrcT`).
FOLLOW_PRODUCER_INPUTS = {"Shape": ("T",), "Size": ("T",), "Cast": ("T1", "SrcT"),
                          "IsNaN": ("T1",), "IsInf": ("T1",), "CastLike": ("T1",)}


def _pinned(node: Node, ctx: PassContext) -> str | None:
    for pattern in ctx.options.keep_nodes:
        if pattern.fullmatch(node.name):
            return pattern.pattern
    return None


def classify_ops(ctx: PassContext) -> PassResult:
    """Give each node its op class with a reason, and decide which of its groups are paintable."""
    target = ctx.target_dtype
    counts: dict[str, int] = {}
    for node in ctx.model.graph.walk_nodes():
        pin = _pinned(node, ctx)
        if pin is not None:
            node.op_class, node.class_reason = FP32, f"pinned to fp32 by --keep-node {pin!r}"
        elif node.pin_reason:  # a loader's rule (e.g. TF fetch nodes)
            node.op_class, node.class_reason = FP32, node.pin_reason
        elif not node.has_schema:
            node.op_class = FP32
            node.class_reason = (f"{node.qualified_op} has no schema (custom or unknown domain): "
                                 f"left as it is, an fp32 barrier")
        else:
            node.op_class, node.class_reason = ctx.lists.class_of(node.qualified_op)
        counts[node.op_class] = counts.get(node.op_class, 0) + 1
        for group in node.type_groups:
            if group.fixed or group.dtype != FLOAT32:
                continue
            if node.op_class == FP32:
                group.reason = node.class_reason
            elif group.allowed is not None and target not in group.allowed:
                group.reason = f"the {node.op_type} schema does not allow {target} for {group.name}"
            elif not ctx.lists.has_kernel(node.qualified_op, group.name) \
                    and node.op_class != ALLOW:
                group.reason = (f"{ctx.lists.backend} has no {ctx.options.target} kernel for "
                                f"{node.op_type}")
            else:
                group.paintable = True
    notes = [f"{k}: {v}" for k, v in sorted(counts.items())]
    return PassResult("classify_ops", sum(counts.values()), notes)
