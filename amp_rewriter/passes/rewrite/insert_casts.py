"""Apply the precision decisions: set dtypes and insert the casts they need.

One cast per (value, dtype), placed right after the value's producer and shared by every consumer
that needs it. Graph inputs and outputs keep their dtype when `keep_io_types` is on; a graph output
whose producer now runs low precision gets a cast that takes over the output's name.
"""

from __future__ import annotations

from ...ir import FLOAT_DTYPES, Graph, Model, Node, Value, present, short_name
from ..base import PassContext, register_pass
from .building import CAST, new_node


class CastBuilder:
    """Creates cast nodes and remembers where each goes, to splice them in one sweep."""

    def __init__(self, model: Model):
        self.model = model
        self.cache: dict[tuple[Value, str], Value] = {}
        #: graph -> {producer node -> casts right after it}; graph -> casts at start.
        self.after_node: dict[Graph, dict[Node, list[Node]]] = {}
        self.at_start: dict[Graph, list[Node]] = {}
        self.created = 0

    def cast(self, value: Value, dtype: str) -> Value:
        """The value converted to `dtype`, creating the cast on first request."""
        key = (value, dtype)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        graph, producer = value.graph, value.producer
        in_graph = producer is not None and producer.graph is graph
        cast = new_node(self.model, graph, f"{value.name}/cast_to_{short_name(dtype)}", CAST,
                        [value], f"{value.name}_{short_name(dtype)}", dtype, value.shape,
                        op_class="cast", reason="inserted at a precision boundary",
                        order=producer.order if producer is not None and in_graph else 0,
                        attrs={"to": dtype})
        output = present(cast.outputs[0])
        if producer is not None and in_graph:
            self.after_node.setdefault(graph, {}).setdefault(
                producer, []).append(cast)
        else:
            self.at_start.setdefault(graph, []).append(cast)
        self.cache[key] = output
        self.created += 1
        return output

    def splice(self, root: Graph) -> None:
        """Put the new casts into the node lists, keeping them topologically sorted."""
        for graph in list(root.walk_graphs()):
            after = self.after_node.get(graph, {})
            start = self.at_start.get(graph, [])
            if after or start:
                graph.insert_nodes(after=after, at_start=start)


def required_dtype(value: Value, consumer: Node, slot: int) -> str | None:
    """The dtype `consumer` wants its input `slot` (reading `value`) in, after the decisions."""
    group = consumer.input_group[slot] if slot < len(consumer.input_group) else None
    if group is not None and group.precision is not None:
        return group.precision
    return value.original_dtype


@register_pass("insert_casts")
def insert_casts(ctx: PassContext) -> tuple[int, list[str]]:
    """Set every value's dtype from its group's decision and cast where producer and user differ."""
    model = ctx.model
    builder = CastBuilder(model)
    root = model.graph

    # Values defined by painted groups take the group's dtype.
    for node in root.walk_nodes():
        for group in node.type_groups:
            if group.precision is None or group.precision == group.dtype:
                continue
            for slot in group.output_slots:
                output = node.outputs[slot]
                if output is not None:
                    output.dtype = group.precision
            for value in group.inner_defs:
                value.dtype = group.precision

    if not ctx.options.keep_io_types:
        _lower_graph_inputs(root)

    for graph in list(root.walk_graphs()):
        candidates = list(graph.inputs) + list(graph.initializers.values())
        for node in graph.nodes:
            candidates.extend(v for v in node.outputs if v is not None)
        for value in candidates:
            if value.dtype not in FLOAT_DTYPES:
                continue
            ctx.focus = value.producer
            users = list(value.uses)  # before any cast of ours becomes a user too
            # Outputs first: their cast takes over the public name, and internal users share it.
            # (Few values are graph outputs: no copy of the empty rest.)
            for sub, index in list(value.graph_output_uses) if value.graph_output_uses else ():
                needed = _graph_output_dtype(sub, index, value, ctx.options.keep_io_types)
                if needed is not None and needed != value.dtype:
                    _retarget_graph_output(model, builder, value, sub, index, needed)
            for consumer, slot in users:
                needed = required_dtype(value, consumer, slot)
                if needed is not None and needed != value.dtype and needed in FLOAT_DTYPES:
                    consumer.set_input(slot, builder.cast(value, needed))

    builder.splice(root)
    return builder.created, []


def _graph_output_dtype(sub: Graph, index: int, value: Value, keep_io_types: bool) -> str | None:
    if sub.parent is None:
        return value.original_dtype if keep_io_types else value.dtype
    owner = sub.owner
    for group in owner.type_groups if owner is not None else ():
        if (sub, index) in group.inner_uses:
            return group.precision or group.dtype
    return value.original_dtype


def _retarget_graph_output(model: Model, builder: CastBuilder, value: Value, sub: Graph,
                           index: int, dtype: str) -> None:
    """Make output `index` of `sub` carry `dtype`: the cast takes over the output's name."""
    original_name = value.name
    cast_out = builder.cache.get((value, dtype))
    if cast_out is not None:  # the same value listed as an output twice
        pass
    elif value.producer is not None and value.producer.graph is sub and not value.is_graph_input:
        # The producer's value gets a fresh name; the cast output carries the public name.
        value.rename(model.unique_name(f"{original_name}_{short_name(value.dtype)}"))
        cast_out = builder.cast(value, dtype)
        cast_out.rename(original_name)
    else:
        cast_out = builder.cast(value, dtype)
    sub.set_output(index, cast_out)


def _lower_graph_inputs(root: Graph) -> None:
    """Without keep-io-types, a float input whose every user wants one low dtype takes it."""
    for value in root.inputs:
        if (value.dtype not in FLOAT_DTYPES or not value.uses or value.graph_output_uses
                or value.const is not None):
            continue
        wanted = {required_dtype(value, c, s) for c, s in value.uses}
        if len(wanted) == 1:
            (dtype,) = wanted
            if dtype is not None and dtype != value.dtype:
                value.dtype = dtype
