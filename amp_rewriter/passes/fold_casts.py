"""Fold cast chains and no-op casts, the model's own casts included.

- Cast(Cast(x, A), B) -> Cast(x, B) when going through A changes nothing: the first cast widens
  exactly (fp16 -> fp32, int16 -> fp32, ...), or it is int -> fp32 -> fp16, where every integer
  fp32 cannot hold exactly is beyond fp16's range anyway.
- Cast(x, dtype(x)) -> x.
- Two casts of one value to one dtype in one graph -> the first, shared.
Casts that become unused disappear.
"""

from __future__ import annotations

from ..ir import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, Graph, Node, Value
from .base import PassContext, PassResult

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


def _cast_target(node: Node) -> str | None:
    if node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
        return None
    return node.outputs[0].dtype if node.outputs and node.outputs[0] is not None else None


def _rewire_all(old: Value, new: Value) -> None:
    for consumer, slot in old.uses:
        consumer.inputs[slot] = new
        new.uses.append((consumer, slot))
    old.uses = []


def fold_casts(ctx: PassContext) -> PassResult:
    """Collapse cast chains and drop casts that change nothing; returns casts removed."""
    removed = 0
    for graph in ctx.model.graph.walk_graphs():
        dead: set[int] = set()
        first_cast: dict[tuple[int, str], Value] = {}
        for node in graph.nodes:
            target = _cast_target(node)
            if target is None or node.inputs[0] is None:
                continue
            source = node.inputs[0]
            inner = source.producer
            inner_target = _cast_target(inner) if inner is not None else None
            if (inner_target is not None and inner.inputs[0] is not None
                    and chain_is_exact(inner.inputs[0].dtype, inner_target, target)):
                source.uses.remove((node, 0))
                node.inputs[0] = inner.inputs[0]
                inner.inputs[0].uses.append((node, 0))
                source = node.inputs[0]
                if not source_in_use(inner.outputs[0]):
                    dead.add(id(inner))
            output = node.outputs[0]
            if source.dtype == target and not output.graph_output_uses:
                _rewire_all(output, source)
                dead.add(id(node))
                continue
            twin = first_cast.setdefault((id(source), target), output)
            if twin is not output and not output.graph_output_uses:
                _rewire_all(output, twin)
                dead.add(id(node))
        if dead:
            removed += _remove_nodes(graph, dead)
    ctx.casts_removed += removed
    return PassResult("fold_casts", removed)


def source_in_use(value: Value) -> bool:
    """Whether anything still reads `value`."""
    return bool(value.uses or value.graph_output_uses)


def _remove_nodes(graph: Graph, dead: set[int]) -> int:
    """Drop dead casts, first detaching them from what they read."""
    kept, removed = [], 0
    for node in graph.nodes:
        if id(node) in dead and not any(source_in_use(v) for v in node.outputs if v is not None):
            for slot, value in enumerate(node.inputs):
                if value is not None and (node, slot) in value.uses:
                    value.uses.remove((node, slot))
            for value in node.outputs:
                if value is not None:
                    graph.values.pop(value.name, None)
            removed += 1
        else:
            kept.append(node)
    graph.nodes = kept
    return removed
