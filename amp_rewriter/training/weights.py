"""The training passes for 16-bit weights and optimizer slots (`UpdateOptions.weights`,
`UpdateOptions.slots`), in order:

- `update_weights_in_fp32` makes every write of a variable stored in 16 bits update an fp32 copy
  made from an fp32 view of it, and writes the copy back through a rounding Cast (stochastic:
  keyed by the rounding seed, the variable and the step; nearest otherwise). The write-backs
  join the plan's writes, so the gate covers them like every other update.
- `store_weights_in_low_precision` then stores those variables in 16 bits: storage,
  initializer, checkpoint entry and every read (the precision passes cast a read to fp32 where
  an fp32 reader needs it).

The first runs before the second so that the only writes left on a 16-bit variable are the
write-backs, which already carry its dtype.
"""

from __future__ import annotations

import zlib

import numpy as np

from ..errors import AmpError
from ..ir import FLOAT32, Value
from ..ir.rounding import STOCHASTIC
from ..passes.base import PassContext, register_pass
from .ops import StoredVariable
from .passes import TrainingContext, commit, training_of
from .plan import VariableWrite


def rounding_key(seed: int, name: str, occurrence: int = 0) -> int:
    """The first half of a variable's random key (the step is the second): the same for the
    same seed and variable name on every run and every replica, different between variables."""
    return zlib.crc32(f"{seed}:{name}:{occurrence}".encode())


def _stored_variables(training: TrainingContext) -> dict[Value, StoredVariable]:
    """The variables the options store in 16 bits: each weight an optimizer updates, and with
    `slots` the state its update keeps, by the value that names them."""
    update, ops = training.update_options, training.ops
    weight_dtype, slot_dtype = update.weight_dtype, update.slot_dtype
    stored: dict[Value, StoredVariable] = {}

    def store(value: Value | None, dtype: str) -> None:
        if value is not None and value not in stored:
            stored[value] = ops.variable(value, dtype)

    for write in training.plan.writes:
        for value in write.node.inputs:  # a variable the caller made 16-bit: every write
            stored_as = ops.stored_dtype(value) if value is not None else None
            if stored_as is not None:
                store(value, stored_as)
        if not write.weight or write.variable_slot is None:
            continue
        if weight_dtype is not None:
            store(write.node.inputs[write.variable_slot], weight_dtype)
        if slot_dtype is not None and write.kind == "optimizer_update":
            for slot in write.state_slots:
                store(write.node.inputs[slot], slot_dtype)
    return stored


def _writes_of(writes: list[VariableWrite], stored: dict[Value, StoredVariable]
               ) -> list[tuple[VariableWrite, dict[int, StoredVariable]]]:
    """Each write that writes a stored variable, with its input slots that name one. A variable
    written twice in one step is refused: its second update would start from the first's
    rounded value, which the plan does not order."""
    found: list[tuple[VariableWrite, dict[int, StoredVariable]]] = []
    writers: dict[Value, list[str]] = {}
    for write in writes:
        touched = {slot: value for slot, value in enumerate(write.node.inputs)
                   if value is not None and value in stored}
        if touched:
            found.append((write, {slot: stored[value] for slot, value in touched.items()}))
            for value in touched.values():
                writers.setdefault(value, []).append(write.node.name)
    for value, variable in stored.items():
        names = writers.get(value, [])
        if len(names) > 1:
            raise AmpError(f"16-bit variable {variable.name} is written by {len(names)} ops in "
                           f"one step ({', '.join(names)}): each needs its own fp32 update")
    return found


@register_pass("update_weights_in_fp32")
def update_weights_in_fp32(ctx: PassContext) -> tuple[int, list[str]]:
    """Make each write of a weight or slot stored in 16 bits update an fp32 copy of it and write
    the copy back through a rounding Cast; the write-backs join the plan's gated writes."""
    training = training_of(ctx)
    update, ops, plan = training.update_options, training.ops, training.plan
    if update.weight_dtype is None and update.slot_dtype is None:
        return 0, []
    stored = _stored_variables(training)
    if not stored:
        return 0, ["no trainable variable is written by the step"]
    mode = update.rounding_mode
    step: Value | None = None
    if mode == STOCHASTIC:
        training.rounding_step = ops.state_variable("rounding_step", np.asarray(0, np.int64))
        step = training.rounding_step.value
    write_backs: list[VariableWrite] = []
    for write, touched in _writes_of(plan.writes, stored):
        ctx.focus = write.node
        fresh = ops.update_in_fp32(write.node, touched)
        for slot, variable in touched.items():
            key = None
            if step is not None:
                first = ops.constant(np.asarray(rounding_key(update.rounding_seed, variable.name),
                                                np.int64), "round/variable_key")
                key = ops.pack([first, step], "round/key")
            assert fresh[slot].dtype == FLOAT32
            rounded = ops.cast(fresh[slot], variable.dtype, "round/rounded", rounding=mode,
                               key=key)
            node = ops.write_variable(variable, rounded, "round/write_back")
            write_backs.append(VariableWrite(node, "assign", variable_slot=0,
                                             weight=write.weight and slot == write.variable_slot))
    if training.rounding_step is not None and step is not None:
        one = ops.constant(np.asarray(1, np.int64), "round/one")
        plan.step.add_control_input(ops.assign(training.rounding_step,
                                               ops.add(step, one, "round/next_step"),
                                               "round/count_step"))
    changed = commit(training)
    for write_back in write_backs:
        plan.step.add_control_input(write_back.node)
    plan.writes.extend(write_backs)
    training.stored = list(stored.values())
    ctx.model.graph.sort_nodes()
    names = ", ".join(sorted(v.name for v in training.stored))
    return changed, [f"{len(write_backs)} write-backs rounded {mode}: {names}"]


@register_pass("store_weights_in_low_precision")
def store_weights_in_low_precision(ctx: PassContext) -> tuple[int, list[str]]:
    """Store the weights and slots `update_weights_in_fp32` rounds in their 16-bit dtype:
    storage, initializer, checkpoint entry and reads."""
    training = training_of(ctx)
    for variable in training.stored:
        ctx.focus = variable.value.producer
        training.ops.store_variable(variable)
    commit(training)
    ctx.model.graph.sort_nodes()
    return len(training.stored), [f"{v.name}: {v.dtype}" for v in training.stored]
