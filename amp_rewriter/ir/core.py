"""The IR's objects: values, nodes, graphs, type groups, and the mutators that keep them in sync.

A `Graph` holds `Node`s in topological order and the `Value`s that flow between them. Every node
carries `TypeGroup`s: the sets of its input and output slots that must share one dtype (an ONNX
type constraint such as ``T``, a TensorFlow type attribute). A type group is the unit that the
passes paint low precision or fp32. Loaders fill the IR from a model file and keep a handle to the
original proto on every node, so emitters can write back everything the passes did not touch.

Use lists (`Value.uses`, `Value.graph_output_uses`), node inputs and outputs, control edges
(`Node.control_inputs` / `Node.control_users`, `Graph.control_outputs`) and node order are read
freely but changed only through the methods here (`Node.add_input`, `Node.set_input`,
`Node.add_control_input`, `Value.replace_all_uses_with`, `Graph.append_node`,
`Graph.insert_nodes`, `Graph.remove_nodes`, ...), which keep both ends of every edge in step;
`lint` checks that they are.

A control edge says "run after" without passing a value (TensorFlow's `^name` inputs, a
function's control outputs). Removing a node hands the nodes that waited for it over to what it
waited for itself (the producers it read and its own control inputs), so an order the model
asked for survives a folded cast or a replaced constant.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .dtypes import FLOAT32
from .tensors import LazyTensor

#: Op classes, after Grappler: always low precision / follows its inputs / numerically dangerous /
#: no numeric effect. `FP32` is the conservative default for unlisted ops: never painted, and a
#: barrier to propagation in both directions.
ALLOW, INFER, DENY, CLEAR, FP32 = "allow", "infer", "deny", "clear", "fp32"


#: What a node without attributes or subgraphs holds: one shared, read-only empty mapping
#: instead of two empty dicts per node (128 bytes, times a million nodes).
_NONE: Mapping[str, Any] = MappingProxyType({})


#: The pass inserting nodes now (innermost last): what `Node.created_by` records.
_creator: list[str] = []


@contextmanager
def nodes_created_by(pass_name: str) -> Iterator[None]:
    """While this lasts, nodes a graph's insertion methods add are recorded as made by
    `pass_name` (the pass manager wraps each pass in it)."""
    _creator.append(pass_name)
    try:
        yield
    finally:
        _creator.pop()


def _mark_created(node: Node) -> None:
    """Record the running pass as the maker of a node a graph adds, unless it has a proto
    (the model's own node) or a maker already."""
    if _creator and node.created_by is None and node.handle is None:
        node.created_by = _creator[-1]


class IRError(Exception):
    """A mutation that would break the IR's invariants (a bug in the caller, not bad input)."""


class Value:
    """A tensor: produced by one node output (or a graph input / initializer), used by many."""

    __slots__ = ("name", "dtype", "shape", "producer", "producer_slot", "uses", "graph_output_uses",
                 "const", "graph", "is_graph_input", "original_dtype", "origin", "overridable",
                 "loop_back")

    def __init__(self, name: str, graph: Graph, dtype: str | None = None,
                 shape: tuple | None = None):
        self.name = name
        self.graph = graph
        self.dtype = dtype
        self.original_dtype = dtype
        self.shape = shape
        self.producer: Node | None = None
        self.producer_slot = -1
        #: (consumer node, input slot); consumers may sit in nested graphs (captured values).
        #: Read-only outside the IR: change it through Node.set_input and friends.
        self.uses: list[tuple[Node, int]] = []
        #: (graph, output index) for every graph output this value is. A shared empty tuple
        #: until the value becomes one (few do): an empty list per value costs 56 bytes.
        self.graph_output_uses: Sequence[tuple[Graph, int]] = ()
        #: Set for initializers and Constant-node outputs whose data is known.
        self.const: LazyTensor | None = None
        self.is_graph_input = False
        #: An initializer a caller may replace by feeding an input of the same name: its value
        #: is not a constant the conversion may fold.
        self.overridable = False
        #: For a constant a pass made (a converted copy), the value it was made from.
        self.origin: Value | None = None
        #: Carried back by a loop to nodes that run before its producer (TF1 NextIteration ->
        #: Merge): the one kind of value read before it is produced.
        self.loop_back = False

    def __repr__(self) -> str:
        return f"Value({self.name!r}, {self.dtype})"

    @property
    def known_constant(self) -> LazyTensor | None:
        """The value's data when it is known and fixed, so that a pass may read and fold it
        (an initializer no caller can replace by feeding an input, a Constant node's output);
        else None."""
        return None if self.overridable else self.const

    @property
    def is_used(self) -> bool:
        """Whether any node or graph output still reads this value."""
        return bool(self.uses or self.graph_output_uses)

    def replace_all_uses_with(self, new: Value) -> None:
        """Make every node that reads this value read `new` instead (graph outputs stay)."""
        if new is self:
            return
        for consumer, slot in self.uses:
            consumer.inputs[slot] = new
            consumer.edges_changed = True
            new.uses.append((consumer, slot))
        self.uses = []

    def trim(self) -> None:
        """Give up the spare room the uses list kept while it grew (a loader's last step: at a
        million values, ~25 MB)."""
        self.uses = self.uses[:]

    def add_graph_output_use(self, graph: Graph, index: int) -> None:
        """Record that this value is output `index` of `graph` (use `Graph.add_output`)."""
        self.graph_output_uses = [*self.graph_output_uses, (graph, index)]

    def release(self) -> None:
        """Let go of the nodes and graphs this value refers to (see `Model.release`)."""
        self.uses.clear()
        self.graph_output_uses = ()
        self.producer = None
        self.origin = None

    def rename(self, new_name: str) -> None:
        """Give the value a new name (its graph's name table follows)."""
        if self.graph.values.get(self.name) is self:
            del self.graph.values[self.name]
        self.name = new_name
        self.graph.values[new_name] = self
        if self.producer is not None:
            self.producer.edges_changed = True
        for consumer, _ in self.uses:
            consumer.edges_changed = True


@dataclass(eq=False, slots=True)
class TypeGroup:
    """Slots of one node that must share a dtype, and the precision decision made for them.

    `inner_defs` are subgraph values whose dtype follows the group (a Loop body's loop-carried
    input); `inner_uses` are subgraph outputs that must have the group's dtype (a Loop body's
    loop-carried output, an If branch's output).
    """

    node: Node
    name: str
    #: Tuples: a loader shares one per (op, filled slots) between all its nodes' groups.
    input_slots: tuple[int, ...] = ()
    output_slots: tuple[int, ...] = ()
    allowed: frozenset[str] | None = None
    #: True when the slots' dtype is fixed by meaning (Resize scales, Dropout ratio): never painted.
    fixed: bool = False
    #: Tuples, empty for all but control-flow nodes: one shared empty tuple costs nothing per
    #: group, where two empty lists cost 112 bytes (a million-node graph has a million groups).
    inner_defs: tuple[Value, ...] = ()
    inner_uses: tuple[tuple[Graph, int], ...] = ()
    #: Decision: the dtype the group runs in, what kind of rule decided it, and why.
    precision: str | None = None
    reason: str = ""
    kind: str = ""
    #: The group whose decision led to this one (propagation path), for `explain`.
    via: TypeGroup | None = None
    #: Set by classification: may this group be painted, and if not, why not.
    paintable: bool = False
    #: Forced fp32 before propagation (an fp16-overflowing constant input), with the reason.
    forced_deny: str = ""

    def __repr__(self) -> str:
        return f"TypeGroup({self.node.name}.{self.name}, {self.precision})"

    def __lt__(self, other: TypeGroup) -> bool:  # stable ordering for worklists
        return (self.node.order, self.name) < (other.node.order, other.name)

    def decide(self, precision: str, kind: str, reason: str,
               via: TypeGroup | None = None) -> None:
        """Record the group's precision with the kind of rule that chose it and the reason."""
        self.precision, self.kind, self.reason, self.via = precision, kind, reason, via

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
        for value in [self.node.inputs[s] for s in self.input_slots] + \
                [self.node.outputs[s] for s in self.output_slots]:
            if value is not None:
                yield value


class Node:
    """One operation. `handle` is the loader's original proto, kept so emitters can patch it."""

    __slots__ = ("name", "op_type", "domain", "inputs", "outputs", "attrs", "subgraphs",
                 "type_groups", "input_group", "output_group", "graph", "handle", "op_class",
                 "class_reason", "class_kind", "order", "has_schema", "pin_reason", "pin_kind",
                 "pin_barrier", "scopes", "edges_changed", "control_inputs", "control_users",
                 "created_by")

    def __init__(self, name: str, op_type: str, domain: str = "", graph: Graph | None = None):
        self.name = name
        self.op_type = op_type
        self.domain = domain
        self.graph = graph
        #: Read-only outside the IR: change through add_input / set_input / add_output.
        self.inputs: list[Value | None] = []
        self.outputs: list[Value | None] = []
        #: Nodes this one runs after without reading a value of theirs (control edges), in the
        #: model's order, and the nodes that run after this one so. Shared empty tuples until a
        #: node has one (few do). Read-only outside the IR: change through add_control_input /
        #: remove_control_input.
        self.control_inputs: Sequence[Node] = ()
        self.control_users: Sequence[Node] = ()
        #: Read-only outside the IR: change through set_attr / add_subgraph.
        self.attrs: Mapping[str, Any] = _NONE
        self.subgraphs: Mapping[str, Graph] = _NONE
        self.type_groups: list[TypeGroup] = []
        #: slot -> TypeGroup (None for slots of no group, e.g. variadic extras of unknown ops).
        self.input_group: list[TypeGroup | None] = []
        self.output_group: list[TypeGroup | None] = []
        self.handle: Any = None
        self.op_class = FP32
        self.class_reason = ""
        #: The kind of rule that gave the node its class (see `decisions`).
        self.class_kind = ""
        self.order = 0
        self.has_schema = True
        #: Why a loader, front end or the user pinned this node to fp32 ("" when nothing did),
        #: and the kind of that rule.
        self.pin_reason = ""
        self.pin_kind = ""
        #: A pin is an fp32 barrier to propagation unless a front end says otherwise (then only
        #: the node itself returns to fp32 and its neighbours are decided as without the pin).
        self.pin_barrier = True
        #: The source modules an exporter recorded for the node, outermost first (torch's
        #: dynamo exporter: "model.encoder", "model.encoder.layer.0", ...); --keep-node
        #: matches them as well as the name.
        self.scopes: tuple[str, ...] = ()
        #: Set when an input slot was given another value or a value read or written was
        #: renamed since the node was built (`add_input` and `add_output` build it): an
        #: emitter compares the names of such nodes only with their proto's.
        self.edges_changed = False
        #: The pass that inserted the node (set when the graph's insertion methods add it while
        #: a pass runs, see `nodes_created_by`); None for the model's own nodes.
        self.created_by: str | None = None

    def __repr__(self) -> str:
        return f"Node({self.name!r}, {self.op_type})"

    @property
    def qualified_op(self) -> str:
        """The op name as users write it in op lists: `Op` (default domain) or `domain.Op`."""
        return self.op_type if self.domain in ("", "ai.onnx") else f"{self.domain}.{self.op_type}"

    def float_groups(self) -> list[TypeGroup]:
        """Groups that carry fp32 in the input model and may be repainted."""
        return [g for g in self.type_groups if not g.fixed and g.dtype == FLOAT32]

    def set_attr(self, name: str, value: Any) -> None:
        """Set attribute `name` (the IR keeps the attributes passes read: ints, floats, tensors,
        a cast's target dtype)."""
        attrs = self.attrs if isinstance(self.attrs, dict) else {}
        attrs[name] = value
        self.attrs = attrs

    def add_subgraph(self, name: str, graph: Graph) -> None:
        """Attach a nested graph (an If branch, a Loop body) under its attribute name."""
        subgraphs = self.subgraphs if isinstance(self.subgraphs, dict) else {}
        subgraphs[name] = graph
        self.subgraphs = subgraphs

    # -- edges ------------------------------------------------------------------------------
    def add_input(self, value: Value | None) -> None:
        """Append an input slot reading `value` (None: an omitted optional input)."""
        self.inputs.append(value)
        if value is not None:
            value.uses.append((self, len(self.inputs) - 1))

    def set_input(self, slot: int, value: Value | None) -> None:
        """Make input `slot` read `value` instead of what it reads now."""
        old = self.inputs[slot]
        if old is value:
            return
        if old is not None:
            old.uses.remove((self, slot))
        self.inputs[slot] = value
        self.edges_changed = True
        if value is not None:
            value.uses.append((self, slot))

    def add_output(self, value: Value | None) -> None:
        """Append an output slot producing `value` (None: an omitted optional output)."""
        if value is not None:
            value.producer, value.producer_slot = self, len(self.outputs)
        self.outputs.append(value)

    def add_control_input(self, node: Node) -> None:
        """Make this node run after `node` (no change when it already does)."""
        self.add_control_inputs([node])

    def add_control_inputs(self, nodes: Iterable[Node]) -> None:
        """Make this node run after each of `nodes`, in order (those it already waits for, and
        repeats, are skipped): one call for a group of thousands stays linear."""
        waited = set(self.control_inputs)
        added = []
        for node in nodes:
            if node is self:
                raise IRError(f"{self.name!r} cannot wait for itself")
            if node in waited:
                continue
            waited.add(node)
            added.append(node)
            users = node.control_users
            if not isinstance(users, list):  # the shared empty tuple: its own list now
                users = node.control_users = list(users)
            users.append(self)
        if added:
            self.control_inputs = [*self.control_inputs, *added]
            self.edges_changed = True

    def remove_control_input(self, node: Node) -> None:
        """Stop waiting for `node` (IRError when this node does not wait for it)."""
        if not any(n is node for n in self.control_inputs):
            raise IRError(f"{self.name!r} does not wait for {node.name!r}")
        self.control_inputs = [n for n in self.control_inputs if n is not node]
        node.control_users = [n for n in node.control_users if n is not self]
        self.edges_changed = True

    def predecessors(self) -> list[Node]:
        """What this node waits for: the nodes of its graph whose outputs it reads, then its
        control inputs, each once, in that order (what a node waiting for it is handed over
        to when it is removed)."""
        found: list[Node] = []
        seen: set[Node] = set()
        for value in self.inputs:
            producer = value.producer if value is not None else None
            if producer is not None and producer.graph is self.graph and producer not in seen:
                seen.add(producer)
                found.append(producer)
        for node in self.control_inputs:
            if node not in seen:
                seen.add(node)
                found.append(node)
        return found

    def trim(self) -> None:
        """Give up the spare room the node's lists kept while they grew by appends (a loader's
        last step for each node: ~60 bytes a node)."""
        self.inputs, self.outputs = self.inputs[:], self.outputs[:]
        self.type_groups = self.type_groups[:]

    def detach_inputs(self) -> None:
        """Stop reading every input (before the node is removed)."""
        for slot, value in enumerate(self.inputs):
            if value is not None:
                value.uses.remove((self, slot))
                self.inputs[slot] = None
                self.edges_changed = True

    def release(self) -> None:
        """Let go of what the node refers to and what refers to it through its outputs (values,
        type groups, proto, bodies), once nothing will read it again: one node of
        `Model.release`, for an emitter that writes a model a node at a time. Its name, op and
        class stay (a type group's `via` may still name it)."""
        for body in self.subgraphs.values():
            body.release()
        for value in self.outputs:
            if value is not None:
                value.release()
        self.inputs.clear()
        self.outputs.clear()
        self.control_inputs = self.control_users = ()
        self.type_groups.clear()
        self.input_group.clear()
        self.output_group.clear()
        self.subgraphs = _NONE
        self.graph = None
        self.handle = None

    @property
    def is_used(self) -> bool:
        """Whether anything reads one of the node's outputs."""
        return any(v is not None and v.is_used for v in self.outputs)


class Graph:
    """A list of nodes in topological order with its inputs, outputs and initializers.

    Nested graphs (If/Loop/Scan bodies) have `parent` and `owner` set; their nodes may use values
    of enclosing graphs directly (captures), which is why `Value.uses` can point into subgraphs.
    """

    def __init__(self, name: str, parent: Graph | None = None, owner: Node | None = None):
        self.name = name
        self.parent = parent
        self.owner = owner
        #: Read-only outside the IR: change through append_node / insert_nodes / remove_nodes.
        self.nodes: list[Node] = []
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.initializers: dict[str, Value] = {}
        self.values: dict[str, Value] = {}
        #: Nodes the graph's caller waits for though it reads nothing of theirs (a TF
        #: function's control outputs: its stateful ops), by the name the format gives each.
        #: Read-only outside the IR: change through set_control_output.
        self.control_outputs: dict[str, Node] = {}
        self.handle: Any = None
        #: Formats where every initializer must also be listed as a graph input (ONNX IR < 4).
        self.initializers_are_inputs = False

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

    def walk_graphs(self) -> Iterator[Graph]:
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

    # -- values -----------------------------------------------------------------------------
    def add_value(self, value: Value) -> Value:
        """Register a value of this graph under its name."""
        self.values[value.name] = value
        return value

    def add_input(self, value: Value) -> None:
        """Append a graph input."""
        value.is_graph_input = True
        self.inputs.append(value)

    def replace_input(self, old: Value, new: Value) -> None:
        """Put `new` where `old` is in the input list."""
        new.is_graph_input = True
        self.inputs[self.inputs.index(old)] = new

    def add_initializer(self, value: Value, replacing: Value | None = None) -> None:
        """Add a constant to the graph. Where the format lists initializers as inputs too, it
        takes the input place of `replacing` (a constant it supersedes) or is appended."""
        self.values[value.name] = value
        self.initializers[value.name] = value
        if self.initializers_are_inputs:
            if replacing is not None and replacing in self.inputs:
                self.replace_input(replacing, value)
            else:
                self.add_input(value)

    def remove_initializer(self, value: Value) -> None:
        """Drop an initializer nothing reads any more."""
        if value.is_used:
            raise IRError(f"initializer {value.name!r} is still used")
        if self.values.get(value.name) is value:
            del self.values[value.name]
        if self.initializers.get(value.name) is value:
            del self.initializers[value.name]

    def add_output(self, value: Value) -> None:
        """Append a graph output."""
        value.add_graph_output_use(self, len(self.outputs))
        self.outputs.append(value)

    def set_control_output(self, name: str, node: Node) -> None:
        """Make `node` (a node of this graph) the control output called `name`."""
        if node.graph is not self:
            raise IRError(f"control output {name!r}: {node.name!r} is not a node of "
                          f"graph {self.name}")
        self.control_outputs[name] = node

    def remove_control_output(self, name: str) -> None:
        """Stop listing the control output called `name` (its node stays in the graph)."""
        del self.control_outputs[name]

    def set_output(self, index: int, value: Value) -> None:
        """Make graph output `index` be `value`."""
        old = self.outputs[index]
        remaining = list(old.graph_output_uses)
        remaining.remove((self, index))
        old.graph_output_uses = remaining
        value.add_graph_output_use(self, index)
        self.outputs[index] = value

    # -- node order -------------------------------------------------------------------------
    def append_node(self, node: Node) -> None:
        """Add a node at the end (its inputs must already be produced)."""
        node.graph = self
        _mark_created(node)
        self.nodes.append(node)

    def insert_nodes(self, after: dict[Node, list[Node]] | None = None,
                     at_start: Iterable[Node] = (),
                     before: dict[Node, list[Node]] | None = None) -> None:
        """Insert many nodes in one sweep: `after` / `before` map anchor node -> nodes to
        put right after / before it (in order); `at_start` go before every node."""
        after, before = after or {}, before or {}
        start = list(at_start)
        nodes = list(start)
        for node in self.nodes:
            nodes.extend(before.get(node, ()))
            nodes.append(node)
            nodes.extend(after.get(node, ()))
        for node in nodes:
            node.graph = self
        if _creator:
            for node in [*start, *(n for new in after.values() for n in new),
                         *(n for new in before.values() for n in new)]:
                _mark_created(node)
        self.nodes = nodes

    def insert_after(self, anchor: Node, new_nodes: Iterable[Node]) -> None:
        """Insert `new_nodes` right after `anchor`."""
        self.insert_nodes(after={anchor: list(new_nodes)})

    def insert_before(self, anchor: Node, new_nodes: Iterable[Node]) -> None:
        """Insert `new_nodes` right before `anchor`."""
        index = self.nodes.index(anchor)
        new = list(new_nodes)
        for node in new:
            node.graph = self
            _mark_created(node)
        self.nodes[index:index] = new

    def remove_nodes(self, doomed: Iterable[Node]) -> int:
        """Remove nodes whose outputs nothing reads; they stop reading their inputs. Returns how
        many were removed. Removing a node that is still read raises IRError.

        A node that waited for a removed one (a control edge) waits for what the removed node
        waited for instead (`Node.predecessors`, through other removed nodes); a control output
        goes to the first of those, or away when there is none. A removed node keeps its
        `control_inputs` (nothing points back at it), so a constant made from its output
        (`Value.origin`) can still be placed where it was."""
        doomed_set = set(doomed)
        if not doomed_set:
            return 0
        mine = [node for node in self.nodes if node in doomed_set]
        for node in mine:
            if node.is_used:
                raise IRError(f"cannot remove {node.name!r} ({node.op_type}): its output is "
                              f"still used")
        for node in mine:
            if node.control_users or any(n is node for n in self.control_outputs.values()):
                self._hand_over_waiters(node, doomed_set)
        kept = []
        for node in self.nodes:
            if node not in doomed_set:
                kept.append(node)
                continue
            node.detach_inputs()
            for waited in node.control_inputs:
                waited.control_users = [n for n in waited.control_users if n is not node]
            node.control_users = ()
            for value in node.outputs:
                if value is not None and self.values.get(value.name) is value:
                    del self.values[value.name]
        removed = len(self.nodes) - len(kept)
        self.nodes = kept
        return removed

    def _hand_over_waiters(self, node: Node, doomed_set: set[Node]) -> None:
        """Make what waits for `node` (about to be removed) wait for what it waited for."""
        replacements: list[Node] = []
        seen: set[Node] = set()
        stack = list(reversed(node.predecessors()))
        while stack:
            waited = stack.pop()
            if waited in seen:
                continue
            seen.add(waited)
            if waited in doomed_set:
                stack.extend(reversed(waited.predecessors()))
            else:
                replacements.append(waited)
        for user in list(node.control_users):
            if user in doomed_set:
                continue
            merged: list[Node] = []
            merged_set: set[Node] = set()
            for waited in user.control_inputs:
                for candidate in (replacements if waited is node else [waited]):
                    if candidate is not user and candidate not in merged_set:
                        merged_set.add(candidate)
                        merged.append(candidate)
            for candidate in replacements:
                if candidate in merged_set and not any(u is user
                                                       for u in candidate.control_users):
                    users = candidate.control_users
                    if not isinstance(users, list):
                        users = candidate.control_users = list(users)
                    users.append(user)
            user.control_inputs = merged
            user.edges_changed = True
        node.control_users = ()
        for name, output in list(self.control_outputs.items()):
            if output is node:
                if replacements:
                    self.control_outputs[name] = replacements[0]
                else:
                    del self.control_outputs[name]

    def sort_nodes(self) -> None:
        """Order the nodes topologically again, by their data and control edges (a loop's back
        edge aside), keeping the current order wherever it already is one: for a pass whose new
        edges point back in the list (a node made to wait for one placed after it). IRError
        when the edges form a cycle."""
        position = {node: i for i, node in enumerate(self.nodes)}
        waiting = [0] * len(self.nodes)
        followers: list[list[int]] = [[] for _ in self.nodes]
        for i, node in enumerate(self.nodes):
            before = {position.get(v.producer, -1) for v in node.inputs
                      if v is not None and v.producer is not None and not v.loop_back}
            before |= {position.get(n, -1) for n in node.control_inputs
                       if not any(v is not None and v.loop_back for v in n.outputs)}
            before.discard(-1)
            waiting[i] = len(before)
            for j in before:
                followers[j].append(i)
        order = stable_topological_order(followers, waiting)
        if len(order) != len(self.nodes):
            stuck = self.nodes[first_unplaced(order, len(self.nodes))].name
            raise IRError(f"graph {self.name}: the edges form a cycle (at {stuck!r})")
        self.nodes = [self.nodes[i] for i in order]

    def take_nodes(self) -> list[Node]:
        """Hand the node list over, leaving the graph without nodes: for an emitter that writes
        the nodes and releases each (`Node.release`) as it goes, before `Model.release`."""
        nodes, self.nodes = self.nodes, []
        return nodes

    def release(self) -> None:
        """Empty the graph and its nested graphs (see `Model.release`)."""
        for node in self.nodes:
            node.release()
        for value in list(self.values.values()) + self.inputs + self.outputs:
            value.release()
        self.nodes = []
        self.values.clear()
        self.initializers.clear()
        self.inputs.clear()
        self.outputs.clear()
        self.control_outputs.clear()
        self.parent = self.owner = None
        self.handle = None


@dataclass
class Model:
    """The IR of a whole model file: the main graph plus what the loader needs to write it back."""

    graph: Graph
    format: str
    handle: Any = None
    #: Names already taken anywhere in the model (values and nodes), for unique new names.
    used_names: set[str] = field(default_factory=set)
    #: The handles of the main graph and its nodes belong to the caller (a model given in
    #: memory, not copied): an emitter writes changes into copies, never into them.
    borrowed: bool = False
    #: Some of the model's tensors keep their data in files beside it (read a chunk at a
    #: time); the writer copies or converts that data into the output's own files.
    external_data: bool = False

    def unique_name(self, base: str) -> str:
        """A deterministic name not used anywhere in the model yet."""
        return unique_name(base, self.used_names)

    def forget_names(self) -> None:
        """Drop the name tables (names in use, the main graph's values by name) once no name is
        looked up or made any more (emitting, before `release`): at a million nodes they are
        ~150 MB."""
        self.used_names.clear()
        self.graph.values.clear()

    def release(self) -> None:
        """Empty the model, breaking the reference cycles its objects form (node <-> value,
        node <-> type group, value <-> graph), once nothing will read it again (after emitting).

        Freed by reference counting, the IR's memory (gigabytes at a million nodes) returns at
        once, even while the cyclic collector is paused; the collector would otherwise have to
        scan every object to find these cycles.
        """
        self.graph.release()
        self.handle = None
        self.used_names.clear()


class ValueNames:
    """Every value's name at one moment (after loading), kept so that tools comparing a
    converted model with its original can map values back when a pass renamed them (a graph
    output's producer hands its name to the cast that now produces the output)."""

    def __init__(self, model: Model):
        self._names = {value: name for graph in model.graph.walk_graphs()
                       for name, value in graph.values.items()}

    def original_name(self, value: Value) -> str | None:
        """The name `value` had then (None for a value made since)."""
        return self._names.get(value)


def stable_topological_order(followers: Sequence[Sequence[int]], waiting: list[int]
                             ) -> list[int]:
    """Kahn's algorithm over positions 0..n-1 that keeps their order wherever it can: position
    i runs before each of `followers[i]`, and `waiting[j]` counts what j runs after (one per
    entry of followers; it is used up). Shorter than n when the edges form a cycle."""
    ready = [i for i, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in followers[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    return order


def first_unplaced(order: Sequence[int], count: int) -> int:
    """The first position of 0..count-1 that `order` (a partial order: a cycle) leaves out."""
    placed = set(order)
    return next(i for i in range(count) if i not in placed)


def present(value: Value | None) -> Value:
    """`value`, for slots that cannot be empty (an omitted optional slot there is a bug)."""
    if value is None:
        raise IRError("an empty slot where a value is required")
    return value


def unique_name(base: str, taken: set[str]) -> str:
    """`base`, or `base_1`, `base_2`, ... : the first not in `taken`, which then records it."""
    name, k = base, 1
    while name in taken:
        name = f"{base}_{k}"
        k += 1
    taken.add(name)
    return name
