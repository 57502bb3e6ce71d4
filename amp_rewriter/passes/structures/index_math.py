"""The index-math rule.

`keep_index_math_fp32`: float arithmetic that computes a shape, length or index (from integers
  and constants, feeding a Cast to an integer, a comparison, Floor/Ceil or a shape input) stays
  fp32: fp16 holds integers exactly only up to 2048.
"""

from __future__ import annotations

from collections.abc import Iterator

from ...ir import FLOAT32, FLOAT_DTYPES, Graph, Node, TypeGroup, Value, decisions
from ..base import FormatRules, PassContext, StructureRecord, register_pass
from .matching import heavy, is_float


def index_math_values(graph: Graph, rules: FormatRules) -> set[Value]:
    """The float values of the main graph computed without a heavy (allow-class) op, a
    table lookup (an embedding row is data) or a control-flow op: from graph inputs, constants
    and integers (shapes, positions, lengths, boolean masks) through light arithmetic."""
    known: set[Value] = set()
    for value in list(graph.inputs) + list(graph.initializers.values()):
        if is_float(value):
            known.add(value)
    for node in graph.nodes:
        if node.subgraphs or heavy(node):
            continue
        if node.op_type in rules.lookup_ops and is_float(node.inputs[0] if node.inputs
                                                         else None):
            continue  # an embedding row: data
        inputs = [v for v in node.inputs if v is not None]
        if not inputs and node.op_type not in rules.constant_fill_attrs \
                and not (node.outputs and node.outputs[0] is not None
                         and node.outputs[0].const is not None):
            continue  # random ops and the like
        if all(v in known or not is_float(v) for v in inputs):
            for out in node.outputs:
                if out is not None and is_float(out):
                    known.add(out)
    return known


def _index_seeds(graph: Graph, rules: FormatRules) -> Iterator[tuple[Node, int]]:
    """(node, input slot) where a float value is used as a shape, size, index or integer."""
    index_ops = {op for op, _slot in rules.index_slots}
    for node in graph.nodes:
        op = node.op_type
        if op in rules.metadata_ops or node.subgraphs:
            continue
        # Cheapest first: most nodes turn floats into floats and take no index (at a million
        # nodes each test here costs a tenth of a second).
        if op in rules.rounding_ops or op in index_ops:
            outputs = [v for v in node.outputs if v is not None]
            to_integers = bool(outputs) and not any(is_float(v) for v in outputs)
        else:
            dtypes = [v.original_dtype for v in node.outputs if v is not None]
            if not dtypes or not FLOAT_DTYPES.isdisjoint(dtypes):
                continue
            to_integers = True
        for slot, value in enumerate(node.inputs):
            if is_float(value) and (to_integers or op in rules.rounding_ops
                                     or (op, slot) in rules.index_slots):
                yield node, slot


@register_pass("keep_index_math_fp32")
def keep_index_math_fp32(ctx: PassContext) -> tuple[int, list[str]]:
    """Keep fp32 the float arithmetic that computes shapes, lengths or indices.

    Walks back from every float input that becomes an integer or a shape (Cast to an integer
    type, comparisons, Floor/Ceil/Round, the format's index slots) through the float values
    computed without a heavy op or a lookup (`index_math_values`): fp16 represents integers
    exactly only up to 2048 (bf16: 256), so a length, position or bucket computed there could
    round to a neighbour. A comparison or rounding of activations (downstream of a MatMul or
    Conv) is not index math and is left alone.
    """
    graph = ctx.model.graph
    rules = ctx.rules
    seeds = list(_index_seeds(graph, rules))
    if not seeds:  # a graph without shape arithmetic (most of a large export) ends here
        return 0, []
    index_math = index_math_values(graph, rules)
    follow = rules.follow_producer_inputs
    pinned = 0
    visited: set[Node] = set()
    for seed_node, slot in seeds:
        ctx.focus = seed_node
        seed = seed_node.inputs[slot]
        if seed is None or seed not in index_math or seed.const is not None:
            continue
        use = f"{seed_node.name} ({seed_node.op_type})"
        why = (f"computes a shape, length or index (used by {use}), without a heavy op: "
               f"kept fp32, which holds integers exactly up to 2^24 ({ctx.options.target}: "
               f"{2048 if ctx.options.target == 'fp16' else 256})")
        names: list[str] = []
        group = seed_node.input_group[slot] if slot < len(seed_node.input_group) else None
        if group is not None and group.name not in follow.get(seed_node.op_type, ()) \
                and seed_node not in ctx.user_rule_nodes:
            pinned += _pin(group, why, names)
        stack = [seed]
        while stack:
            value = stack.pop()
            producer = value.producer
            if producer is None or producer in visited or producer.graph is not graph:
                continue
            visited.add(producer)
            if producer in ctx.user_rule_nodes:
                continue  # the user's pattern rule decided this node
            for g in producer.type_groups:
                pinned += _pin(g, why, names)
            stack.extend(v for v in producer.inputs
                         if v is not None and v in index_math and v.const is None)
        if names:
            ctx.structures.append(StructureRecord("index_math", names, why))
    return pinned, []


def _pin(group: TypeGroup, why: str, names: list[str]) -> int:
    """Keep a paintable float group fp32 for the index-math rule; 1 when it changed."""
    if not group.paintable or group.dtype != FLOAT32:
        return 0
    group.paintable = False
    group.reason, group.kind = why, decisions.STRUCTURE
    if group.node.name not in names:
        names.append(group.node.name)
    return 1
