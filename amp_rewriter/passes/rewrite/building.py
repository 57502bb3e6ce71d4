"""What rewrite passes build the graph with: nodes and scalar constants they add, with their
dtypes fixed (the painting is over) and no type groups, and nodes they drop from any graph.
`PlanBuilder`, `GraphEdits` and `rewrite_plans` serve the passes that replace a recognised
structure (an RMS norm's statistics, a rotary angle) by nodes of their own."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from ...ir import Graph, LazyTensor, Model, Node, Value, decisions, present
from ...ir.dtypes import NUMPY_DTYPES
from ..base import PassContext

#: The IR's cast op: every loader reads its format's cast as this, every emitter writes it back.
CAST = "Cast"


def scalar_constant(model: Model, graph: Graph, base_name: str, value: float,
                    dtype: str) -> Value:
    """A new scalar initializer of `dtype` (a float dtype) in `graph`."""
    return array_constant(model, graph, base_name, np.asarray(value, dtype=NUMPY_DTYPES[dtype]))


def array_constant(model: Model, graph: Graph, base_name: str, data: np.ndarray) -> Value:
    """A new initializer in `graph` holding `data`, typed by its numpy dtype's name (float16,
    int64, ...: the IR's dtype names)."""
    dtype = data.dtype.name
    constant = Value(model.unique_name(base_name), graph, dtype, tuple(data.shape))
    constant.const = LazyTensor(dtype, tuple(data.shape), lambda: data)
    graph.add_initializer(constant)
    return constant


def new_node(model: Model, graph: Graph, name: str, op: str, inputs: list[Value | None],
             output_name: str | None, dtype: str, shape: tuple | None, *, op_class: str,
             reason: str, order: int, kind: str = "", attrs: Mapping[str, Any] | None = None
             ) -> Node:
    """A node a rewrite pass adds (not yet placed in `graph`'s node list): `inputs`, one
    output of `dtype` and `shape`, and the class and reason the report shows for it. `name`
    and `output_name` (None: the node's name + "_out") are bases made unique in the model, in
    that order."""
    node = Node(model.unique_name(name), op, "", graph)
    output = Value(model.unique_name(output_name or f"{node.name}_out"), graph, dtype, shape)
    return fill_node(node, inputs, [output], op_class=op_class, reason=reason, order=order,
                     kind=kind, attrs=attrs)


def fill_node(node: Node, inputs: Sequence[Value | None], outputs: Sequence[Value], *,
              op_class: str, reason: str, order: int, kind: str = "",
              attrs: Mapping[str, Any] | None = None, waits: Iterable[Node] = ()) -> Node:
    """Give a node a pass made its inputs, outputs (registered in the node's graph), control
    inputs (`waits`), attributes, and the class and reason the report shows for it; it has no
    type groups, so the painting leaves it as it is."""
    assert node.graph is not None
    node.op_class, node.class_kind, node.class_reason = op_class, kind, reason
    for attr, value in (attrs or {}).items():
        node.set_attr(attr, value)
    for value in inputs:
        node.add_input(value)
    for output in outputs:
        node.graph.add_value(output)
        node.add_output(output)
    node.add_control_inputs(waits)
    node.input_group, node.output_group = [None] * len(node.inputs), [None] * len(outputs)
    node.order = order
    return node


def remove_everywhere(model: Model, doomed: Iterable[Node]) -> int:
    """Remove `doomed` nodes (nothing may read them) from whichever graphs hold them, one sweep
    per graph; returns how many were removed."""
    by_graph: dict[Graph, list[Node]] = {}
    for node in doomed:
        if node.graph is not None:  # (a node no graph holds is in none of the sweeps)
            by_graph.setdefault(node.graph, []).append(node)
    if not by_graph:
        return 0
    return sum(graph.remove_nodes(by_graph[graph]) for graph in model.graph.walk_graphs()
               if graph in by_graph)


class PlanBuilder:
    """Makes the new nodes of one planned rewrite, in order, in `anchor`'s graph: named after
    `anchor` (the node they are placed before), with the plan's class and reason."""

    def __init__(self, model: Model, anchor: Node, node_prefix: str, constant_prefix: str,
                 op_class: str, reason: str):
        assert anchor.graph is not None, "the anchor is still in its graph"
        self.model, self.anchor, self.graph = model, anchor, anchor.graph
        self.node_prefix, self.constant_prefix = node_prefix, constant_prefix
        self.op_class, self.reason = op_class, reason
        self.nodes: list[Node] = []

    def node(self, op: str, inputs: list[Value | None], dtype: str, shape: tuple | None,
             attrs: dict | None = None) -> Value:
        """One new node reading `inputs`, with one output of `dtype` and `shape`."""
        node = new_node(self.model, self.graph, f"{self.anchor.name}/{self.node_prefix}_"
                        f"{op.lower()}", op, inputs, None, dtype, shape, op_class=self.op_class,
                        reason=self.reason, kind=decisions.STRUCTURE, order=self.anchor.order,
                        attrs=attrs)
        self.nodes.append(node)
        return present(node.outputs[0])

    def constant(self, label: str, data: np.ndarray) -> Value:
        """A new constant holding `data`."""
        return array_constant(self.model, self.graph,
                              f"{self.anchor.name}/{self.constant_prefix}_{label}", data)


class GraphEdits:
    """Nodes to put before others and nodes to drop, applied with one sweep per graph (one
    search per insertion would make a pass quadratic in the graph's size)."""

    def __init__(self) -> None:
        self.doomed: list[Node] = []
        self._before: dict[Graph, dict[Node, list[Node]]] = {}

    def insert_before(self, anchor: Node, nodes: list[Node]) -> None:
        assert anchor.graph is not None, "the anchor is still in its graph"
        self._before.setdefault(anchor.graph, {})[anchor] = nodes

    def apply(self, model: Model) -> None:
        for graph, before in self._before.items():
            graph.insert_nodes(before=before)
        remove_everywhere(model, self.doomed)


class _AnchoredPlan(Protocol):
    """A structural rule's plan: the node its rewrite's nodes go before."""

    @property
    def anchor(self) -> Node: ...


Plan = TypeVar("Plan", bound=_AnchoredPlan)


def rewrite_plans(ctx: PassContext, plans: Iterable[Plan],
                  applies: Callable[[Plan], list[Node] | None],
                  rewrite: Callable[[PassContext, Plan, list[Node], GraphEdits], None]) -> int:
    """Rewrite each plan the painting left in its planned shape (`applies`: the casts the
    rewrite takes over, None to leave the plan), its new nodes and removals applied in one sweep
    at the end; returns how many were rewritten."""
    done = 0
    edits = GraphEdits()
    for plan in plans:
        ctx.focus = plan.anchor
        casts = applies(plan)
        if casts is None:
            continue
        rewrite(ctx, plan, casts, edits)
        done += 1
    ctx.focus = None
    edits.apply(ctx.model)
    return done


def dropped_sources(value: Value | None) -> list[Node]:
    """Nodes left computing only `value` once its readers are gone: the casts of it back to
    where it was made, and the constant node that made it; an initializer nothing reads any
    more leaves its graph. Each dropped node stops reading its inputs."""
    doomed: list[Node] = []
    while value is not None and not value.is_used and not value.graph_output_uses:
        producer = value.producer
        if producer is None:
            if value.const is not None and value.graph is not None \
                    and value.graph.initializers.get(value.name) is value:
                value.graph.remove_initializer(value)
            break
        if producer.op_type != CAST and (producer.inputs or value.const is None):
            break
        doomed.append(producer)
        source = producer.inputs[0] if producer.inputs else None
        producer.detach_inputs()
        value = source
    return doomed
