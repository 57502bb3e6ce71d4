"""Fold cast chains and no-op casts, the model's own casts included.

- Cast(Cast(x, A), B) -> Cast(x, B) when going through A changes nothing: the first cast widens
  exactly (fp16 -> fp32, int16 -> fp32, ...), or it is int -> fp32 -> fp16, where every integer
  fp32 cannot hold exactly is beyond fp16's range anyway.
- Cast(x, dtype(x)) -> x.
- Two casts of one value to one dtype in one graph -> the first, shared.
Casts that become unused disappear.
"""

from __future__ import annotations

from ...ir import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, Node, Value
from ...ir.rounding import NEAREST, rounding_of
from ..base import PassContext, register_pass
from .building import CAST

#: (from, to) pairs where every value of `from` is exactly representable in `to`.
EXACT_WIDENINGS = {
    (FLOAT16, FLOAT32), (FLOAT16, FLOAT64), (BFLOAT16, FLOAT32), (BFLOAT16, FLOAT64),
    (FLOAT32, FLOAT64),
}
#: Integer types every value of which fp32 holds exactly.
SMALL_INTEGERS = {"bool", "int8", "uint8", "int16", "uint16"}
WIDE_INTEGERS = {"int32", "uint32", "int64", "uint64"}


def chain_is_exact(source: str | None, middle: str, target: str) -> bool:
    """Whether Cast(Cast(x: source, middle), target) always equals Cast(x, target)."""
    if (source, middle) in EXACT_WIDENINGS:
        return True
    if middle == FLOAT32 and source in SMALL_INTEGERS:
        return True
    # Integers of 2^24 and above may round in fp32, but they overflow fp16 (max 65504) either way.
    return middle == FLOAT32 and target == FLOAT16 and source in WIDE_INTEGERS


def cast_target(node: Node) -> str | None:
    """The dtype a cast node produces, or None when `node` is not a cast of the default domain
    that rounds to nearest (a stochastic rounding cast is never folded: it draws its bits)."""
    if node.op_type != CAST or node.domain not in ("", "ai.onnx") \
            or rounding_of(node.attrs) != NEAREST:
        return None
    out = node.outputs[0] if node.outputs else None
    return out.dtype if out is not None else None


@register_pass("fold_casts")
def fold_casts(ctx: PassContext) -> tuple[int, list[str]]:
    """Collapse cast chains and drop casts that change nothing; returns casts removed."""
    removed = 0
    for graph in list(ctx.model.graph.walk_graphs()):
        dead: list[Node] = []
        first_cast: dict[tuple[Value, str], Value] = {}
        for node in graph.nodes:
            target = cast_target(node)
            source = node.inputs[0] if node.inputs else None
            if target is None or source is None:
                continue
            ctx.focus = node
            inner = source.producer
            inner_target = cast_target(inner) if inner is not None else None
            if (inner is not None and inner_target is not None and inner.inputs[0] is not None
                    and chain_is_exact(inner.inputs[0].dtype, inner_target, target)):
                node.set_input(0, inner.inputs[0])
                source = inner.inputs[0]
                if not inner.is_used:
                    dead.append(inner)
            output = node.outputs[0]
            assert output is not None
            if source.dtype == target and not output.graph_output_uses:
                output.replace_all_uses_with(source)
                dead.append(node)
                continue
            twin = first_cast.setdefault((source, target), output)
            if twin is not output and not output.graph_output_uses:
                output.replace_all_uses_with(twin)
                dead.append(node)
        # A cast found dead may have been made the shared twin of a later one: it stays.
        removed += graph.remove_nodes(n for n in dead if not n.is_used)
    return removed, []


@register_pass("drop_identity_casts")
def drop_identity_casts(ctx: PassContext) -> tuple[int, list[str]]:
    """Drop the model's casts of a value to its own dtype before precision is decided.

    Exports write them (a norm's `.to(float32)` of an fp32 tensor); left in place, each one is an
    fp32 barrier in the middle of the graph (a cast's target is fixed), so a residual stream
    read through one could not run in low precision. A cast that is a graph output stays.
    """
    removed = 0
    for graph in list(ctx.model.graph.walk_graphs()):
        dead: list[Node] = []
        for node in graph.nodes:
            target = cast_target(node)
            source = node.inputs[0] if node.inputs else None
            output = node.outputs[0] if node.outputs else None
            if target is None or source is None or output is None or source.dtype != target \
                    or output.graph_output_uses:
                continue
            ctx.focus = node
            output.replace_all_uses_with(source)
            dead.append(node)
        removed += graph.remove_nodes(dead)
    return removed, []
