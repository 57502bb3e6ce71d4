"""A small, format-neutral graph IR for precision rewriting.

A `Graph` holds `Node`s in topological order and the `Value`s that flow between them. Every node
carries `TypeGroup`s: the sets of its input and output slots that must share one dtype (an ONNX
type constraint such as ``T``, a TensorFlow type attribute). A type group is the unit that the
passes paint low precision or fp32. Loaders fill the IR from a model file and keep a handle to the
original proto on every node, so emitters can write back everything the passes did not touch.

Nothing here imports onnx or tensorflow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

FLOAT32 = "float32"
FLOAT16 = "float16"
BFLOAT16 = "bfloat16"
FLOAT64 = "float64"
#: Dtypes the passes may repaint (only fp32 is ever lowered; the others are recognised as floats).
FLOAT_DTYPES = frozenset({FLOAT32, FLOAT16, BFLOAT16, FLOAT64})
LOW_PRECISION_DTYPES = frozenset({FLOAT16, BFLOAT16})

#: Op classes, after Grappler: always low precision / follows its inputs / numerically dangerous /
#: no numeric effect. `FP32` is the conservative default for unlisted ops: never painted, and a
#: barrier to propagation in both directions.
ALLOW, INFER, DENY, CLEAR, FP32 = "allow", "infer", "deny", "clear", "fp32"


class LazyTensor:
    """Constant data that is only read when a pass needs the values (big weights stay on disk)."""

    __slots__ = ("dtype", "shape", "_load", "_array", "handle")

    def __init__(self, dtype: str, shape: tuple[int, ...], load: Callable[[], np.ndarray],
                 handle: Any = None):
        self.dtype = dtype
        self.shape = shape
        self._load = load
        self._array: np.ndarray | None = None
        #: The loader's original tensor proto; None for tensors a pass created.
        self.handle = handle

    @property
    def size(self) -> int:
        """Number of elements, known without reading the data."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    def numpy(self) -> np.ndarray:
        """The values, read (and cached) on first use."""
        if self._array is None:
            self._array = self._load()
        return self._array


class Value:
    """A tensor: produced by one node output (or a graph input / initializer), used by many."""

    __slots__ = ("name", "dtype", "shape", "producer", "producer_slot", "uses", "graph_output_uses",
                 "const", "graph", "is_graph_input", "original_dtype", "origin")

    def __init__(self, name: str, graph: "Graph", dtype: str | None = None,
                 shape: tuple | None = None):
        self.name = name
        self.graph = graph
        self.dtype = dtype
        self.original_dtype = dtype
        self.shape = shape
        self.producer: Node | None = None
        self.producer_slot = -1
        #: (consumer node, input slot); consumers may sit in nested graphs (captured values).
        self.uses: list[tuple[Node, int]] = []
        #: (graph, output index) for every graph output this value is.
        self.graph_output_uses: list[tuple[Graph, int]] = []
        #: Set for initializers and Constant-node outputs whose data is known.
        self.const: LazyTensor | None = None
        self.is_graph_input = False
        #: For a constant a pass made (a converted copy), the value it was made from.
        self.origin: Value | None = None

    def __repr__(self) -> str:
        return f"Value({self.name!r}, {self.dtype})"

    @property
    def is_initializer(self) -> bool:
        return self.const is not None and self.producer is None


@dataclass(eq=False)
class TypeGroup:
    """Slots of one node that must share a dtype, and the precision decision made for them.

    `inner_defs` are subgraph values whose dtype follows the group (a Loop body's loop-carried
    input); `inner_uses` are subgraph outputs that must have the group's dtype (a Loop body's
    loop-carried output, an If branch's output).
    """

    node: "Node"
    name: str
    input_slots: list[int] = field(default_factory=list)
    output_slots: list[int] = field(default_factory=list)
    allowed: frozenset[str] | None = None
    #: True when the slots' dtype is fixed by meaning (Resize scales, Dropout ratio): never painted.
    fixed: bool = False
    inner_defs: list[Value] = field(default_factory=list)
    inner_uses: list[tuple["Graph", int]] = field(default_factory=list)
    #: Decision: the dtype the group runs in, and why.
    precision: str | None = None
    reason: str = ""
    #: The group whose decision led to this one (propagation path), for `explain`.
    via: "TypeGroup | None" = None
    #: Set by classification: may this group be painted, and if not, why not.
    paintable: bool = False
    #: Forced fp32 before propagation (an fp16-overflowing constant input), with the reason.
    forced_deny: str = ""

    def __repr__(self) -> str:
        return f"TypeGroup({self.node.name}.{self.name}, {self.precision})"

    def __lt__(self, other: "TypeGroup") -> bool:  # stable ordering for worklists
        return (self.node.order, self.name) < (other.node.order, other.name)

    @property
    def dtype(self) -> str | None:
        """The dtype the group's slots carry in the input model."""
        return self._first_known("original_dtype")

    @property
    def current_dtype(self) -> str | None:
        """The dtype the group's slots carry now (after the passes' decisions)."""
        return self._first_known("dtype")

    def _first_known(self, attribute: str) -> str | None:
        # Plain loops: this runs for every group in every pass, at 100k+ nodes.
        node = self.node
        for slot in self.output_slots:
            value = node.outputs[slot]
            if value is not None and getattr(value, attribute) is not None:
                return getattr(value, attribute)
        for slot in self.input_slots:
            value = node.inputs[slot]
            if value is not None and getattr(value, attribute) is not None:
                return getattr(value, attribute)
        for value in self.inner_defs:
            if getattr(value, attribute) is not None:
                return getattr(value, attribute)
        return None

    def values(self) -> Iterator[Value]:
        """Every value bound to this group's slots."""
        for slot in self.input_slots:
            if self.node.inputs[slot] is not None:
                yield self.node.inputs[slot]
        for slot in self.output_slots:
            if self.node.outputs[slot] is not None:
                yield self.node.outputs[slot]


class Node:
    """One operation. `handle` is the loader's original proto, kept so emitters can patch it."""

    __slots__ = ("name", "op_type", "domain", "inputs", "outputs", "attrs", "subgraphs",
                 "type_groups", "input_group", "output_group", "graph", "handle", "op_class",
                 "class_reason", "order", "has_schema", "pin_reason")

    def __init__(self, name: str, op_type: str, domain: str = "", graph: "Graph | None" = None):
        self.name = name
        self.op_type = op_type
        self.domain = domain
        self.graph = graph
        self.inputs: list[Value | None] = []
        self.outputs: list[Value | None] = []
        self.attrs: dict[str, Any] = {}
        self.subgraphs: dict[str, Graph] = {}
        self.type_groups: list[TypeGroup] = []
        #: slot -> TypeGroup (None for slots of no group, e.g. variadic extras of unknown ops).
        self.input_group: list[TypeGroup | None] = []
        self.output_group: list[TypeGroup | None] = []
        self.handle: Any = None
        self.op_class = FP32
        self.class_reason = ""
        self.order = 0
        self.has_schema = True
        #: Why a loader or front end pinned this node to fp32 ("" when it did not).
        self.pin_reason = ""

    def __repr__(self) -> str:
        return f"Node({self.name!r}, {self.op_type})"

    @property
    def qualified_op(self) -> str:
        """The op name as users write it in op lists: `Op` for the default domain, else `domain.Op`."""
        return self.op_type if self.domain in ("", "ai.onnx") else f"{self.domain}.{self.op_type}"

    def float_groups(self) -> list[TypeGroup]:
        """Groups that carry fp32 in the input model and may be repainted."""
        return [g for g in self.type_groups if not g.fixed and g.dtype == FLOAT32]


class Graph:
    """A list of nodes in topological order with its inputs, outputs and initializers.

    Nested graphs (If/Loop/Scan bodies) have `parent` and `owner` set; their nodes may use values
    of enclosing graphs directly (captures), which is why `Value.uses` can point into subgraphs.
    """

    def __init__(self, name: str, parent: "Graph | None" = None, owner: Node | None = None):
        self.name = name
        self.parent = parent
        self.owner = owner
        self.nodes: list[Node] = []
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.initializers: dict[str, Value] = {}
        self.values: dict[str, Value] = {}
        self.handle: Any = None

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, {len(self.nodes)} nodes)"

    def lookup(self, name: str) -> Value | None:
        """Find a value by name in this graph or any enclosing one (ONNX scoping)."""
        graph: Graph | None = self
        while graph is not None:
            value = graph.values.get(name)
            if value is not None:
                return value
            graph = graph.parent
        return None

    def walk_graphs(self) -> Iterator["Graph"]:
        """This graph and every nested graph, outer before inner, without recursion."""
        stack = [self]
        while stack:
            graph = stack.pop()
            yield graph
            nested = [sub for node in graph.nodes if node.subgraphs
                      for sub in node.subgraphs.values()]
            stack.extend(reversed(nested))

    def walk_nodes(self) -> Iterator[Node]:
        """Every node of this graph and its nested graphs."""
        for graph in self.walk_graphs():
            yield from graph.nodes

    def depth(self) -> int:
        depth, graph = 0, self.parent
        while graph is not None:
            depth, graph = depth + 1, graph.parent
        return depth


@dataclass
class Model:
    """The IR of a whole model file: the main graph plus what the loader needs to write it back."""

    graph: Graph
    format: str
    handle: Any = None
    #: Names already taken anywhere in the model (values and nodes), for unique new names.
    used_names: set[str] = field(default_factory=set)
    #: Whether an initializer that is also a graph input is a default the caller may override
    #: (ONNX IR >= 4). Below that, every initializer is listed as an input by rule: a constant.
    initializers_overridable: bool = True

    def unique_name(self, base: str) -> str:
        """A deterministic name not used anywhere in the model yet."""
        return unique_name(base, self.used_names)


def unique_name(base: str, taken: set[str]) -> str:
    """`base`, or `base_1`, `base_2`, ... : the first not in `taken`, which then records it."""
    name, k = base, 1
    while name in taken:
        name = f"{base}_{k}"
        k += 1
    taken.add(name)
    return name


def lint(graph: Graph) -> list[str]:
    """Structural problems in a graph (use lists out of sync, nodes out of order); [] when sound."""
    problems: list[str] = []
    for g in graph.walk_graphs():
        defined: set[int] = {id(v) for v in g.inputs} | {id(v) for v in g.initializers.values()}
        for node in g.nodes:
            for slot, value in enumerate(node.inputs):
                if value is None:
                    continue
                if (node, slot) not in value.uses:
                    problems.append(f"{node.name}: input {slot} missing from uses of {value.name}")
                if value.graph is g and value.producer is not None and id(value) not in defined:
                    problems.append(f"{node.name}: input {value.name} used before it is produced")
            for value in node.outputs:
                if value is not None:
                    defined.add(id(value))
    return problems
