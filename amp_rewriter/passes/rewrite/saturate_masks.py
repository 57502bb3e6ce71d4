"""Saturate masked attention sums before their Softmax (the attention-mask rule's rewrite).

`find_attention_masks` keeps a mask's construction fp32 and plans, per accepted mask, the Softmax
inputs its sums reach. Where any part of that path runs in low precision (so a masked score can be
-inf), each Softmax input is clipped to the target's finite range: -inf becomes -max, and a fully
masked row is uniform as in fp32. See passes/analysis/attention_masks.py for the proof per case.
"""

from __future__ import annotations

from ...ir import FLOAT32, LOW_PRECISION_DTYPES, Graph, Node, Value, present
from ...ir.dtypes import FINITE_MAX, NUMPY_DTYPES
from ..base import PassContext, register_pass
from .building import new_node, scalar_constant


def _bound(ctx: PassContext, graph: Graph, dtype: str, sign: int,
           cache: dict[tuple[int, str, int], Value]) -> Value:
    """The constant -max or +max of the target, in `dtype`, one per graph."""
    key = (id(graph), dtype, sign)
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
    cache: dict[tuple[int, str, int], Value] = {}
    added = 0
    for plan in ctx.saturations:
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
