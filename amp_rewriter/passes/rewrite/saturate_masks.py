"""Saturate masked attention sums before their Softmax (the attention-mask rule's rewrite).

`find_attention_masks` keeps a mask's construction fp32 and plans, per accepted mask, the Softmax
inputs its sums reach. Where any part of that path runs in low precision (so a masked score can be
-inf), each Softmax input is clipped to the target's finite range: -inf becomes -max, and a fully
masked row is uniform as in fp32. See passes/analysis/attention_masks.py for the proof per case.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...ir import FLOAT32, LOW_PRECISION_DTYPES, Graph, LazyTensor, Node, Value, present
from ...ir.dtypes import FINITE_MAX, NUMPY_DTYPES
from ..base import PassContext, register_pass


def _returning(data: np.ndarray) -> Callable[[], np.ndarray]:
    return lambda: data


def _bound(ctx: PassContext, graph: Graph, dtype: str, sign: int,
           cache: dict[tuple[int, str, int], Value]) -> Value:
    """The constant -max or +max of the target, in `dtype`, one per graph."""
    key = (id(graph), dtype, sign)
    if key not in cache:
        limit = sign * FINITE_MAX[ctx.target_dtype]
        data = np.asarray(limit, dtype=NUMPY_DTYPES[dtype])
        name = ctx.model.unique_name(f"mask_saturation_{'max' if sign > 0 else 'min'}_"
                                     f"{dtype}")
        value = Value(name, graph, dtype, ())
        value.const = LazyTensor(dtype, (), _returning(data))
        graph.add_initializer(value)
        cache[key] = value
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
                step = Node(ctx.model.unique_name(f"{sink.name}/saturate"), step_op, "", graph)
                step.op_class, step.class_reason = "saturation", plan.record.detail
                output = Value(ctx.model.unique_name(f"{source.name}_saturated"), graph, dtype,
                               source.shape)
                graph.add_value(output)
                step.add_input(value)
                for sign in bounds:
                    step.add_input(_bound(ctx, graph, dtype, sign, cache))
                step.add_output(output)
                step.input_group, step.output_group = [None] * (1 + len(bounds)), [None]
                step.order = sink.order
                nodes.append(step)
                value = output
            sink.set_input(0, value)
            graph.insert_before(sink, nodes)
            plan.record.added.extend(n.name for n in nodes)
            added += 1
    return added, []
