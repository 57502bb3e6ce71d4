"""The TF2 front end's reading of a traced train step: a `TrainingPlan` over the IR of a
`tf.function` body that takes gradients with `tf.GradientTape`.

A tape's gradient ops in a function body live under the `gradient_tape/` name scope, followed by
the scope the forward op was made in (`gradient_tape/dense/MatMul/MatMul`,
`gradient_tape/replica_1/...` for a distribution strategy's second replica). `tape.gradient`
seeds each target's gradient with ones made in the caller's scope (`ones`, `replica_1/ones`: a
Const, a Fill or an OnesLike) that only those ops read: the seeds are the slots that read them.
The loss is the last float op made in the seed readers' forward scope before the seed (the
target was computed just before `tape.gradient` was called). The frontier is every value a
gradient op makes that an op outside the tape reads (the optimizer, clipping, a strategy's
all-reduce); the writes are the ops the optimizer tables (`formats/tf/optimizers.py`) know,
anywhere in the body; the aggregations are the sums and collective reductions between the
frontier and the writes, so a strategy's replicas and workers all take the flag after the
all-reduce. The step node is a new NoOp among the function's control outputs; the results are
its return values.

Variable updates made inside a nested function or functional control flow (a
LossScaleOptimizer's or gradient accumulation's `tf.cond`) cannot be seen or gated: the plan
refuses them, as it refuses a step whose gradients no update reads.
"""

from __future__ import annotations

import re

import numpy as np

from ....errors import AmpError
from ....ir import FLOAT_DTYPES, Model, Node, Value, present
from ....training.plan import GradientSeed, TrainingPlan, nodes_after
from .ops import TfTrainingOps
from .plan import assemble_plan, gradient_exits, write_of

#: The tape's scope for the gradient ops (absolute; a second tape in one function gets the same).
TAPE_SCOPE = re.compile(r"(?:^|/)gradient_tape(?:_\d+)?/")
#: Ops that make the ones a tape seeds a gradient with.
_SEED_OPS = frozenset({"Const", "Fill", "OnesLike"})
#: Ops that run other functions (their bodies stay as they are: the plan cannot look inside).
_CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall", "If", "StatelessIf",
                       "While", "StatelessWhile", "Case", "StatelessCase"})
#: The step's own control output (what waits for the scaler's update).
STEP_KEY = "amp_loss_scale/step"


def _holds_ones(node: Node) -> bool:
    """Whether `node` makes a float tensor of ones (a tape's seed)."""
    if node.op_type not in _SEED_OPS or not node.outputs \
            or present(node.outputs[0]).dtype not in FLOAT_DTYPES:
        return False
    if node.op_type == "OnesLike":
        return True
    constant = present(node.outputs[0]) if node.op_type == "Const" else node.inputs[-1]
    if constant is None or constant.const is None:
        return False
    try:
        data = np.asarray(constant.const.numpy())
    except Exception:  # a malformed constant is no seed
        return False
    return data.size > 0 and bool(np.all(data == 1))


def _forward_scope(name: str) -> str | None:
    """The forward op's scope of a gradient op's name (`gradient_tape/a/b/Mul` -> `a/b/`), or
    None outside a tape's scope."""
    matches = list(TAPE_SCOPE.finditer(name))
    if not matches:
        return None
    rest = name[matches[-1].end():]
    return rest.rpartition("/")[0] + "/" if "/" in rest else ""


def _loss_of(seed: Node, readers: list[Node], nodes: list[Node], in_scope: set[Node]) -> Node:
    """The target whose gradient `seed` seeds: the last float op of the seed's dtype made before
    the seed in the readers' forward scope (any scope when none fits)."""
    scopes = [s for s in (_forward_scope(r.name) for r in readers) if s is not None]
    scope = min(scopes, key=len) if scopes else ""
    dtype = present(seed.outputs[0]).dtype
    before = nodes[:nodes.index(seed)]

    def float_op(node: Node) -> bool:
        return node not in in_scope and node.op_type not in ("Const", "ReadVariableOp") \
            and bool(node.outputs) and node.outputs[0] is not None \
            and node.outputs[0].dtype == dtype

    def in_forward_scope(node: Node) -> bool:
        return node.name == scope[:-1] or (node.name.startswith(scope)
                                            and "/" not in node.name[len(scope):])

    for candidates in ([n for n in before if float_op(n) and in_forward_scope(n)],
                       [n for n in before if float_op(n)]):
        if candidates:
            return candidates[-1]
    raise AmpError(f"the gradient seeded by {seed.name!r} is taken of no float value computed "
                   f"before it: is the loss a float tensor?")


def _seeds(nodes: list[Node], in_scope: set[Node]
           ) -> tuple[list[GradientSeed], list[Node]]:
    """The slots that read a tape's seed, and the targets (losses) seeded, in order."""
    seeds: list[GradientSeed] = []
    losses: list[Node] = []
    for node in nodes:
        if node in in_scope or not node.outputs or node.outputs[0] is None:
            continue
        uses = present(node.outputs[0]).uses
        if not uses or any(reader not in in_scope for reader, _slot in uses) \
                or not _holds_ones(node):
            continue
        seeds.extend(GradientSeed(reader, slot) for reader, slot in uses)
        loss = _loss_of(node, [reader for reader, _slot in uses], nodes, in_scope)
        if loss not in losses:
            losses.append(loss)
    return seeds, losses


def _opaque(node: Node, library: frozenset[str]) -> bool:
    """Whether `node` runs code the IR does not show (a function call, functional control flow,
    an op with no OpDef)."""
    return node.op_type in _CALL_OPS or node.op_type in library or not node.has_schema


def find_step_plan(model: Model, ops: TfTrainingOps, library: frozenset[str] = frozenset(),
                   trainable: frozenset[str] | None = None) -> TrainingPlan:
    """The plan of a traced train step's function body (see the module docstring); `ops` makes
    the step node, `library` names the functions the body may call, `trainable` the arguments
    that take trainable variables' handles (None: not known).

    Raises AmpError when the body takes no gradient with a tape, applies none of its gradients,
    or applies them where the plan cannot see (a nested function, tf.cond, a custom op)."""
    graph = model.graph
    nodes = list(graph.nodes)
    in_scope = {n for n in nodes if TAPE_SCOPE.search(n.name)}
    seeds, losses = _seeds(nodes, in_scope)
    if not seeds:
        raise AmpError("the step takes no gradient with tf.GradientTape (no tape.gradient "
                       "seeded with ones in its body): not a train step?")
    exits = gradient_exits(nodes, in_scope)
    readers = nodes_after(reader for e in exits for reader, _ in e.readers)
    hidden = sorted((n for n in readers if _opaque(n, library)), key=lambda n: n.name)
    if hidden:
        raise AmpError(f"the gradients reach {hidden[0].op_type} {hidden[0].name!r}, a nested "
                       f"function or control flow whose variable updates cannot be gated (a "
                       f"LossScaleOptimizer or gradient accumulation applies them under "
                       f"tf.cond): apply the gradients in the step's own body with a plain "
                       f"optimizer")
    writes = [w for w in map(write_of, nodes) if w is not None]
    for write in writes:
        # a trainable variable written from the gradients (an optimizer's update,
        # assign_sub(lr * g)) is a weight; the optimizer's slots and counters are not
        variable = write.node.inputs[write.variable_slot] \
            if write.variable_slot is not None else None
        write.weight = write.node in readers and write.kind != "step_counter" \
            and variable is not None and (trainable is None or variable.name in trainable)
    step = ops.group([], "step")
    ops.commit()
    graph.set_control_output(STEP_KEY, step)
    plan = assemble_plan(step, seeds, exits, losses[0], losses, writes, in_scope,
                         backward=[n for n in nodes if n in in_scope])
    if not any(write.node in readers for write in plan.writes):
        raise AmpError("the step takes gradients with tf.GradientTape but applies none of them: "
                       "no variable update (optimizer.apply_gradients, assign_sub, ...) reads "
                       "them")
    plan.results = [value for value in graph.outputs if isinstance(value, Value)]
    plan.caller_waits = True
    return plan
