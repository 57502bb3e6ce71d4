"""What rewrite passes build the graph with: nodes and scalar constants they add, with their
dtypes fixed (the painting is over) and no type groups, and nodes they drop from any graph."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ...ir import Graph, LazyTensor, Model, Node, Value
from ...ir.dtypes import NUMPY_DTYPES


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
    node.op_class, node.class_kind, node.class_reason = op_class, kind, reason
    for attr, value in (attrs or {}).items():
        node.set_attr(attr, value)
    for value in inputs:
        node.add_input(value)
    output = Value(model.unique_name(output_name or f"{node.name}_out"), graph, dtype, shape)
    graph.add_value(output)
    node.add_output(output)
    node.input_group, node.output_group = [None] * len(inputs), [None]
    node.order = order
    return node


def remove_everywhere(model: Model, doomed: Iterable[Node]) -> int:
    """Remove `doomed` nodes (nothing may read them) from whichever graphs hold them, one sweep
    per graph; returns how many were removed."""
    by_graph: dict[int, list[Node]] = {}
    for node in doomed:
        by_graph.setdefault(id(node.graph), []).append(node)
    if not by_graph:
        return 0
    return sum(graph.remove_nodes(by_graph[id(graph)]) for graph in model.graph.walk_graphs()
               if id(graph) in by_graph)
