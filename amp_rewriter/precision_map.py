"""The converted model's nodes in graph order, each as one cell of `convert --plot`'s precision
map: the precision it runs in, whether it is a compute op (what decides the speed-up), and the
casts (where the precision changes). Recorded from the IR after the passes, only when asked
(`Options.precision_map`): it is the one place that still sees the casts the conversion
inserted, which the report's node entries (the original nodes) do not list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .ir import FLOAT_DTYPES, LOW_PRECISION_DTYPES, Model, Node

#: Cell kinds, in the order the picture's legend lists them.
NO_FLOAT = 0
FP32 = 1
FP32_COMPUTE = 2
LOW = 3
LOW_COMPUTE = 4
MIXED = 5
CAST = 6
KIND_NAMES = ("no float data", "fp32", "fp32 compute op", "{low}", "{low} compute op",
              "mixed", "cast")


@dataclass
class PrecisionMap:
    """Cells in graph order: a node's name, op and kind (the constants above)."""

    names: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    kinds: bytearray = field(default_factory=bytearray)
    #: (first cell, graph name) of each graph, in order: the main graph, nested bodies, and for
    #: a SavedModel its functions.
    graphs: list[tuple[int, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.kinds)

    def extend(self, other: PrecisionMap) -> None:
        """Append another graph's cells (a SavedModel's functions, one report each)."""
        offset = len(self)
        self.names.extend(other.names)
        self.ops.extend(other.ops)
        self.kinds.extend(other.kinds)
        self.graphs.extend((start + offset, name) for start, name in other.graphs)


def cell_kind(node: Node, compute_ops: frozenset[str]) -> int:
    """A node's kind from the dtypes it computes in after the conversion: its float outputs, or
    its float inputs when it has none (a comparison, a shape)."""
    if node.op_type == "Cast":
        return CAST
    dtypes = {v.dtype for v in node.outputs if v is not None and v.dtype in FLOAT_DTYPES} or \
        {v.dtype for v in node.inputs if v is not None and v.dtype in FLOAT_DTYPES}
    if not dtypes:
        return NO_FLOAT
    low = dtypes & LOW_PRECISION_DTYPES
    if low and low != dtypes:
        return MIXED
    compute = node.qualified_op in compute_ops
    if low:
        return LOW_COMPUTE if compute else LOW
    return FP32_COMPUTE if compute else FP32


def precision_map(model: Model, compute_ops: frozenset[str],
                  graph_name: Callable[[Node], str]) -> PrecisionMap:
    """Every node of the converted IR (nested graphs after their parents), as cells."""
    cells = PrecisionMap()
    for graph in model.graph.walk_graphs():
        if graph.nodes:
            cells.graphs.append((len(cells), graph_name(graph.nodes[0])))
        for node in graph.nodes:
            cells.names.append(node.name)
            cells.ops.append(node.qualified_op)
            cells.kinds.append(cell_kind(node, compute_ops))
    return cells
