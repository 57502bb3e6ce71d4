"""`TrainingPlan`: one training step over IR values, the way every front end hands it to the
training passes.

A step computes a loss; the backward pass starts from gradient seeds (the ones the loss's
gradient is filled with) and ends at the frontier, where each gradient leaves it for the
optimizer path: aggregation over towers, replicas or shared weights, clipping, learning rates,
slots, and the variable writes. The step node runs the whole step (TF1's train op); what must
happen every step waits for it.

The front end finds these in its graph (TF1: `formats/tf/training/plan.py`); the passes
(`training/passes.py`) work on them and nothing else. `TrainingPlan.problems` checks that a
plan is one the passes can work on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from ..ir import FLOAT_DTYPES, Node, Value, present

#: What a variable write is: an optimizer's update kernel (it reads a gradient), a plain assign,
#: a scatter into rows, or a step counter (an integer variable counting steps).
WRITE_KINDS = ("optimizer_update", "assign", "scatter", "step_counter")


@dataclass(frozen=True)
class GradientSeed:
    """Where the backward pass starts: input `slot` of `node` reads the seed (the 1 the loss's
    gradient is filled with). Multiplying it by the scale scales every gradient."""

    node: Node
    slot: int

    @property
    def value(self) -> Value:
        return present(self.node.inputs[self.slot])


@dataclass
class GradientExit:
    """A gradient where it leaves the backward pass, and the readers outside the backward pass
    (node, input slot) that read it."""

    value: Value
    readers: list[tuple[Node, int]]


@dataclass(frozen=True)
class ScaleFold:
    """How an optimizer update takes gradients multiplied by a factor c: it makes the same step
    as with the plain gradients when its input `slot` is multiplied by c**`power` (SGD's and
    momentum's learning rate: -1; Adam's epsilon: 1; RMSProp's, under the square root: 2).
    `what` names that input for the report."""

    slot: int
    power: int
    what: str


@dataclass
class VariableWrite:
    """A node that writes a variable: its kind (`WRITE_KINDS`), the input that names the
    variable (its handle or reference; None when the front end cannot tell), the gradient
    inputs it reads (an optimizer update's `grad`), the inputs naming the optimizer state it
    writes too (momentum, Adam's m and v), whether the variable is a trainable weight, and how
    the update can absorb a factor on its gradients (None: it cannot, exactly)."""

    node: Node
    kind: str
    variable_slot: int | None = None
    gradient_slots: tuple[int, ...] = ()
    state_slots: tuple[int, ...] = ()
    weight: bool = False
    scale_fold: ScaleFold | None = None

    @property
    def reads(self) -> list[Value]:
        """Everything the write reads (its data inputs)."""
        return [v for v in self.node.inputs if v is not None]


@dataclass
class TrainingPlan:
    """The parts of one training step the passes work on (IR objects of one graph)."""

    #: The loss value, and the nodes the gradients are taken of (the loss, or what it is
    #: computed from): both stay fp32.
    loss: Value
    step: Node
    seeds: list[GradientSeed]
    frontier: list[GradientExit]
    #: Sums of frontier gradients (towers, replicas, a variable used twice), checked after they
    #: run: an inf in one tower's gradient shows there even where the frontier's does not.
    aggregations: list[Value]
    writes: list[VariableWrite]
    #: The forward and backward passes: what the precision passes may lower.
    compute: list[Node]
    #: Between the frontier and the writes (fp32: master weights, slots, optimizer constants).
    optimizer_path: list[Node]
    #: Sums inside the backward pass of the gradients of one variable read more than once: the
    #: gradients return to fp32 before they are added.
    gradient_sums: list[Node] = field(default_factory=list)
    differentiated: list[Node] = field(default_factory=list)
    #: (write, waiter): control edges by which the forward or backward pass waits for a write
    #: (TF1's UPDATE_OPS pattern). The write must wait for the all-finite flag, which waits for
    #: the backward pass: the edge moves to the step node.
    deferred: list[tuple[Node, Node]] = field(default_factory=list)
    #: Nodes that run the variables' initializers (the scaler's initializers join them).
    initializers: list[Node] = field(default_factory=list)
    #: What the step hands back on every step, skipped or not (a TF2 function's return
    #: values): they must not wait for a write that a bad step skips.
    results: list[Value] = field(default_factory=list)
    #: Whether the caller waits for the step graph's control outputs (a TF2 function, whose
    #: caller waits for its control outputs): none of them may be skipped either.
    caller_waits: bool = False
    #: The loss is neither what the gradients are taken of nor computed from it (a warning).
    loss_unrelated: bool = False
    #: Every frontier gradient reaches the writes' gradient inputs only through sums, means
    #: and copies, and nothing else reads it: a factor on the gradients reaches the updates
    #: unchanged (what folding the loss scale into the optimizer needs).
    linear_gradient_path: bool = False

    def problems(self) -> list[str]:
        """What makes this plan one the passes cannot work on ([] when it is sound): nodes
        that are not in the step's graph, seeds or gradients that are not float, readers that
        do not read their gradient, writes inside the forward or backward pass."""
        graph = self.step.graph
        live: set[Node] = set(graph.nodes) if graph is not None else set()
        found: list[str] = []

        def check_node(node: Node, role: str) -> None:
            if node not in live:
                found.append(f"{role} {node.name} is not a node of the step's graph")

        check_node(self.step, "the step")
        for seed in self.seeds:
            check_node(seed.node, "seed reader")
            if seed.slot >= len(seed.node.inputs) or seed.node.inputs[seed.slot] is None:
                found.append(f"seed {seed.node.name} input {seed.slot} does not exist")
            elif seed.value.dtype not in FLOAT_DTYPES:
                found.append(f"seed {seed.node.name} input {seed.slot} is not float")
        for exit_ in self.frontier:
            if exit_.value.dtype not in FLOAT_DTYPES:
                found.append(f"frontier gradient {exit_.value.name} is not float")
            for reader, slot in exit_.readers:
                check_node(reader, "gradient reader")
                if slot >= len(reader.inputs) or reader.inputs[slot] is not exit_.value:
                    found.append(f"{reader.name} input {slot} does not read {exit_.value.name}")
        compute: set[Node] = set(self.compute)
        for write in self.writes:
            check_node(write.node, "write")
            if write.kind not in WRITE_KINDS:
                found.append(f"write {write.node.name}: unknown kind {write.kind!r}")
            if write.node in compute:
                found.append(f"write {write.node.name} is inside the forward or backward pass")
        for writer, waiter in self.deferred:
            if not any(node is writer for node in waiter.control_inputs):
                found.append(f"{waiter.name} does not wait for {writer.name}")
        return found


def _walk(roots: Iterable[Node], neighbours: Callable[[Node], Iterable[Node]]) -> set[Node]:
    """`roots` and every node reached from them through `neighbours` (iterative: graphs are
    big)."""
    seen: set[Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(neighbours(node))
    return seen


def nodes_before(roots: Iterable[Node], data_only: bool = False,
                 ignored: frozenset[Node] = frozenset()) -> set[Node]:
    """`roots` and everything they wait for, by data and control edges (or data edges only),
    leaving out control edges from the nodes in `ignored`."""
    def waited(node: Node) -> Iterator[Node]:
        yield from (v.producer for v in node.inputs if v is not None and v.producer is not None)
        if not data_only:
            yield from (n for n in node.control_inputs if n not in ignored)
    return _walk(roots, waited)


def nodes_after(roots: Iterable[Node]) -> set[Node]:
    """`roots` and everything that runs after them (data and control edges)."""
    def waiting(node: Node) -> Iterator[Node]:
        yield from (c for v in node.outputs if v is not None for c, _slot in v.uses)
        yield from node.control_users
    return _walk(roots, waiting)
