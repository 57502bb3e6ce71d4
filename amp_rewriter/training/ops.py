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
from ..ir.rounding import NEAREST

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
    #: None for an accumulator, which reads as zeros until first written.
    initial: np.ndarray | None
    #: The format's handle (TF: the VarHandleOp node and the names a MetaGraph lists).
    handle: Any = None
    #: The nodes that write it (`TrainingOps.assign`).
    writes: list[Node] = field(default_factory=list)


@dataclass
class StoredVariable:
    """A variable the rewrite stores in a 16-bit dtype: the value that names it in the IR (a
    reference or a handle), the dtype, the name its random bits are keyed by (the same for
    every replica's copy of one variable) and the format's own handle on it."""

    value: Value
    dtype: str
    name: str
    handle: Any = None


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

    def cast(self, value: Value, dtype: str, name: str, rounding: str = NEAREST,
             key: Value | None = None) -> Value:
        """`value` converted to `dtype` (the value itself when it has that dtype), rounded as
        `rounding` says (`ir.rounding`; a stochastic cast draws its bits from `key`, an int64
        pair)."""
        ...

    def pack(self, values: list[Value], name: str) -> Value:
        """A 1-D tensor of the scalars `values` (one dtype)."""
        ...

    def zeros_like(self, value: Value, name: str) -> Value:
        """Zeros of `value`'s shape and dtype."""
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

    def accumulator(self, like: Value, name: str) -> StateVariable:
        """A variable of `like`'s shape and dtype that keeps its value between steps and reads
        as zeros until first written (a gradient accumulator)."""
        ...

    def variable(self, value: Value, dtype: str) -> StoredVariable:
        """The variable `value` names (a write's variable input), to be stored in `dtype`.
        Raises AmpError when `value` names no variable the format can store so."""
        ...

    def stored_dtype(self, value: Value) -> str | None:
        """The 16-bit dtype the input already stores the variable `value` names in (a TF2
        model built with 16-bit variables: its writes are updated in fp32 and rounded back
        like `--weights`'), or None."""
        ...

    def update_in_fp32(self, write: Node, variables: dict[int, StoredVariable]
                       ) -> dict[int, Value]:
        """Make `write` update fp32 copies of the variables its input slots `variables` name,
        each copy made from an fp32 view of the variable; returns each copy's value after the
        write (the variables themselves are not written)."""
        ...

    def write_variable(self, variable: StoredVariable, value: Value, name: str) -> Node:
        """A node that writes `value` (of the variable's dtype) into `variable`."""
        ...

    def store_variable(self, variable: StoredVariable) -> None:
        """Store `variable` in its dtype: its storage, its initializer (rounded to nearest),
        its checkpoint entry and every read (which now gives that dtype; the precision passes
        cast it where an fp32 reader needs it)."""
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
