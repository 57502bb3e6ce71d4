"""What a format supplies to build a training rewrite's nodes: `TrainingOps`.

The training passes say what they compute (multiply the seed by the scale, one flag over every
gradient, a state variable, a gate) and a format's `TrainingOps` says how its graphs spell it:
which ops, which attributes, where the nodes go, what a state variable and a gate are made of.
Every value it returns is in the IR already; `commit` puts the nodes made since the last commit
into the graph in a topological order. Nodes it makes carry no type groups, so the precision
passes never repaint them, and a pin (`pin_reason`, kind `pin`) that says why they are fp32.

The gate is the one form a format must choose with care (see `gate`): a write that waits for it
must be skipped whole on a bad step, in the format's graphs and wherever its front ends run them
(TF1 sessions, TF2 function bodies).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..ir import Graph, Node, Value

#: Why the nodes a `TrainingOps` makes are fp32 (their pin's reason; they have no type groups).
SCALER_REASON = "loss-scaling subgraph: fp32 by design"


@dataclass
class StateVariable:
    """A variable the scaler keeps between steps (its scale, its counters): the value a step
    reads, the node that sets it to its initial value (None where the front end initializes
    it outside the graph, as a TF2 step's captured variables are), and the format's own handle
    on it."""

    name: str
    value: Value
    initializer: Node | None
    initial: np.ndarray
    #: The format's handle (TF: the VarHandleOp node and the names a MetaGraph lists).
    handle: Any = None
    #: The nodes that write it (`TrainingOps.assign`).
    writes: list[Node] = field(default_factory=list)


class PendingNodes:
    """The nodes a `TrainingOps` made since its last commit, and the commit that puts them into
    their graph (a base for formats' TrainingOps)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.pending: list[Node] = []

    def commit(self) -> list[Node]:
        """Append the pending nodes and sort the graph again; returns them."""
        made, self.pending = self.pending, []
        for node in made:
            self.graph.append_node(node)
        self.graph.sort_nodes()
        return made


class TrainingOps(Protocol):
    """How one format builds the nodes of the training passes (every name a base that the
    format makes unique under its scope; every value float32 unless it says otherwise)."""

    def constant(self, value: np.ndarray, name: str) -> Value:
        """A constant holding `value` (its dtype: float32, int32, bool)."""
        ...

    def cast(self, value: Value, dtype: str, name: str) -> Value:
        """`value` converted to `dtype` (the value itself when it has that dtype)."""
        ...

    def multiply(self, a: Value, b: Value, name: str) -> Value:
        """a * b."""
        ...

    def add(self, a: Value, b: Value, name: str) -> Value:
        """a + b."""
        ...

    def reciprocal(self, a: Value, name: str) -> Value:
        """1 / a."""
        ...

    def maximum(self, a: Value, b: Value, name: str) -> Value:
        """max(a, b)."""
        ...

    def at_least(self, a: Value, b: Value, name: str) -> Value:
        """a >= b (bool)."""
        ...

    def both(self, a: Value, b: Value, name: str) -> Value:
        """a and b (bools)."""
        ...

    def either(self, a: Value, b: Value, name: str) -> Value:
        """a or b (bools)."""
        ...

    def negate(self, a: Value, name: str) -> Value:
        """not a (a bool)."""
        ...

    def select(self, condition: Value, if_true: Value, if_false: Value, name: str) -> Value:
        """if_true where condition holds, else if_false."""
        ...

    def is_finite(self, a: Value, name: str) -> Value:
        """Whether a (a scalar) is finite (bool)."""
        ...

    def all_finite(self, values: list[Value], name: str) -> Value:
        """One bool scalar: every element of every value is finite."""
        ...

    def state_variable(self, name: str, initial: np.ndarray) -> StateVariable:
        """A scalar variable that keeps its value between steps and reads as `initial` until
        first written."""
        ...

    def assign(self, variable: StateVariable, value: Value, name: str) -> Node:
        """A node that writes `value` into `variable`."""
        ...

    def gate(self, flag: Value, name: str) -> Node:
        """A node that completes only on a step whose `flag` holds: a node made to wait for it
        (a control edge) is skipped whole on other steps, and so is what waits for that node."""
        ...

    def group(self, nodes: list[Node], name: str) -> Node:
        """A node that waits for every node of `nodes` and does nothing else."""
        ...

    def settle(self, gate: Node, writes: list[Node], name: str) -> Node:
        """A node that completes on every step: after `writes` (which wait for `gate`) on a step
        the gate lets through, at once on the others. What must come back on every step waits
        for it instead of for the writes."""
        ...

    def commit(self) -> list[Node]:
        """Put the nodes made since the last commit into their graph, every node still after
        what it reads and waits for; returns them."""
        ...
