"""The training core on tiny IR graphs, without any format: `IrTrainingOps` (a `TrainingOps`
whose nodes are plain IR nodes named by what they compute), `evaluate` (numpy semantics for
those nodes) and `tiny_step` (a hand-built training step and its plan).

    step = tiny_step(towers=2)
    ctx = step.context(LossScaleRule(growth_interval=3))
    run_pipeline(ctx, TRAINING_PASSES)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from amp_rewriter.ir import FP32, Graph, Model, Node, Value, decisions, present
from amp_rewriter.ir.rounding import NEAREST
from amp_rewriter.op_lists import OpLists
from amp_rewriter.options import Options
from amp_rewriter.passes import PassContext
from amp_rewriter.passes.base import FormatRules
from amp_rewriter.passes.rewrite.building import array_constant, fill_node
from amp_rewriter.training import LossScaleRule
from amp_rewriter.training.ops import SCALER_REASON, PendingNodes, StateVariable, StoredVariable
from amp_rewriter.training.passes import TrainingContext
from amp_rewriter.training.plan import GradientExit, GradientSeed, TrainingPlan, VariableWrite

#: numpy meaning of the ops IrTrainingOps makes (inputs as arrays -> the output).
SEMANTICS: dict[str, Callable[..., Any] | None] = {
    "Mul": lambda a, b: a * b,
    "Add": lambda a, b: a + b,
    "Reciprocal": lambda a: np.float32(1) / a,
    "Maximum": np.maximum,
    "AtLeast": lambda a, b: np.asarray(a >= b),
    "Both": np.logical_and,
    "Either": np.logical_or,
    "Negate": np.logical_not,
    "Select": lambda c, a, b: np.where(c, a, b),
    "IsFinite": lambda a: np.asarray(np.all(np.isfinite(a))),
    "AllFinite": lambda *values: np.asarray(all(np.all(np.isfinite(v)) for v in values)),
    "Cast": lambda a: a,
    "ReadState": None,  # a leaf: its value comes from the state given to `evaluate`
}


def _dtype(value: Value) -> str:
    if value.dtype is None:
        raise ValueError(f"{value.name} has no dtype")
    return value.dtype


class IrTrainingOps(PendingNodes):
    """A `TrainingOps` that builds plain IR nodes (see `SEMANTICS`)."""

    def __init__(self, model: Model):
        super().__init__(model.graph)
        self.model = model

    def _value(self, op: str, inputs: list[Value], dtype: str, name: str,
               waits: list[Node] | None = None, outputs: int = 1) -> Node:
        node = Node(self.model.unique_name(f"amp/{name}"), op, "", self.graph)
        values = [Value(self.model.unique_name(f"{node.name}:{i}"), self.graph, dtype)
                  for i in range(outputs)]
        fill_node(node, inputs, values, op_class=FP32, reason=SCALER_REASON,
                  kind=decisions.PIN, order=0, waits=waits or ())
        node.pin_reason, node.pin_kind = SCALER_REASON, decisions.PIN
        self.pending.append(node)
        return node

    def _out(self, op: str, inputs: list[Value], dtype: str, name: str) -> Value:
        return present(self._value(op, inputs, dtype, name).outputs[0])

    def constant(self, value: np.ndarray, name: str) -> Value:
        return array_constant(self.model, self.graph, f"amp/{name}", np.asarray(value))

    def cast(self, value: Value, dtype: str, name: str, rounding: str = NEAREST,
             key: Value | None = None) -> Value:
        if rounding != NEAREST:
            raise NotImplementedError("the tiny IR step rounds to nearest only")
        return value if value.dtype == dtype else self._out("Cast", [value], dtype, name)

    def multiply(self, a: Value, b: Value, name: str) -> Value:
        return self._out("Mul", [a, b], _dtype(a), name)

    def add(self, a: Value, b: Value, name: str) -> Value:
        return self._out("Add", [a, b], _dtype(a), name)

    def reciprocal(self, a: Value, name: str) -> Value:
        return self._out("Reciprocal", [a], _dtype(a), name)

    def maximum(self, a: Value, b: Value, name: str) -> Value:
        return self._out("Maximum", [a, b], _dtype(a), name)

    def at_least(self, a: Value, b: Value, name: str) -> Value:
        return self._out("AtLeast", [a, b], "bool", name)

    def both(self, a: Value, b: Value, name: str) -> Value:
        return self._out("Both", [a, b], "bool", name)

    def either(self, a: Value, b: Value, name: str) -> Value:
        return self._out("Either", [a, b], "bool", name)

    def negate(self, a: Value, name: str) -> Value:
        return self._out("Negate", [a], "bool", name)

    def select(self, condition: Value, if_true: Value, if_false: Value, name: str) -> Value:
        return self._out("Select", [condition, if_true, if_false], _dtype(if_true), name)

    def is_finite(self, a: Value, name: str) -> Value:
        return self._out("IsFinite", [a], "bool", name)

    def all_finite(self, values: list[Value], name: str) -> Value:
        return self._out("AllFinite", list(values), "bool", name)

    def state_variable(self, name: str, initial: np.ndarray) -> StateVariable:
        init = self._value("InitState", [self.constant(initial, f"{name}/initial")], "", name,
                           outputs=0)
        read = self._out("ReadState", [], initial.dtype.name, f"{name}/read")
        return StateVariable(name, read, init, initial)

    def assign(self, variable: StateVariable, value: Value, name: str) -> Node:
        write = self._value("WriteState", [value], "", name, outputs=0)
        variable.writes.append(write)
        return write

    # 16-bit weights and accumulation are tested through the formats, not on the tiny step.
    def pack(self, values: list[Value], name: str) -> Value:
        raise NotImplementedError("pack")

    def zeros_like(self, value: Value, name: str) -> Value:
        raise NotImplementedError("zeros_like")

    def accumulator(self, like: Value, name: str) -> StateVariable:
        raise NotImplementedError("accumulator")

    def variable(self, value: Value, dtype: str) -> StoredVariable:
        raise NotImplementedError("variable")

    def stored_dtype(self, value: Value) -> str | None:
        return None

    def update_in_fp32(self, write: Node, variables: dict[int, StoredVariable]
                       ) -> dict[int, Value]:
        raise NotImplementedError("update_in_fp32")

    def write_variable(self, variable: StoredVariable, value: Value, name: str) -> Node:
        raise NotImplementedError("write_variable")

    def store_variable(self, variable: StoredVariable) -> None:
        raise NotImplementedError("store_variable")

    def gate(self, flag: Value, name: str) -> Node:
        return self._value("Gate", [flag], "bool", name)

    def group(self, nodes: list[Node], name: str) -> Node:
        return self._value("Group", [], "", name, waits=nodes, outputs=0)

    def settle(self, gate: Node, writes: list[Node], name: str) -> Node:
        return self._value("Settle", [], "", name, waits=[gate, *writes], outputs=0)


def evaluate(value: Value, leaves: Mapping[Value, np.ndarray]) -> np.ndarray:
    """`value` computed with `SEMANTICS` from constants and `leaves` (value -> array)."""
    if value in leaves:
        return leaves[value]
    if value.const is not None:
        return np.asarray(value.const.numpy())
    producer = value.producer
    semantics = SEMANTICS.get(producer.op_type) if producer is not None else None
    if producer is None or semantics is None:
        raise KeyError(f"{value.name}: no value given and no semantics for it")
    with np.errstate(over="ignore"):
        return np.asarray(semantics(*[evaluate(present(v), leaves) for v in producer.inputs]))


def model_node(graph: Graph, name: str, op: str, inputs: list[Value], dtypes: list[str],
               waits: Sequence[Node] = ()) -> Node:
    """A node of the model (as a loader makes one: with a handle, so not "added")."""
    node = Node(name, op, "", graph)
    node.handle = object()
    for value in inputs:
        node.add_input(value)
    for index, dtype in enumerate(dtypes):
        node.add_output(graph.add_value(Value(f"{name}:{index}", graph, dtype)))
    node.add_control_inputs(waits)
    node.input_group, node.output_group = [None] * len(inputs), [None] * len(dtypes)
    graph.append_node(node)
    return node


@dataclass
class TinyStep:
    """A hand-built training step: per tower, x @ w -> loss; its gradient from a seed; the
    towers' gradients summed and applied to w; a global step counted; an init group."""

    model: Model
    plan: TrainingPlan
    nodes: dict[str, Node]

    def context(self, rule: LossScaleRule) -> PassContext:
        options = Options(target="fp16")
        lists = OpLists.load("onnx", "fp16", "ort-cuda", options.overrides)
        ctx = PassContext(self.model, lists, options, FormatRules(name="ir"))
        ctx.training = TrainingContext(self.plan, rule, IrTrainingOps(self.model))
        return ctx


def tiny_step(towers: int = 1, batch_norm: bool = False) -> TinyStep:
    """The step of `TinyStep`; with `batch_norm` the backward pass waits for a moving-average
    assign by a control edge (TF1's UPDATE_OPS)."""
    graph = Graph("step")
    model = Model(graph, "ir")
    nodes: dict[str, Node] = {}
    x = graph.add_value(Value("x", graph, "float32"))
    graph.add_input(x)
    nodes["w"] = model_node(graph, "w", "Variable", [], ["float32"])
    nodes["step_counter"] = model_node(graph, "step_counter", "Variable", [], ["int64"])
    nodes["init"] = model_node(graph, "init", "Group", [], [], waits=[nodes["w"]])
    w = present(nodes["w"].outputs[0])
    one = array_constant(model, graph, "one", np.asarray(1.0, np.float32))
    moving = None
    if batch_norm:
        moving = model_node(graph, "moving_mean/assign", "Assign", [w], [])
    seeds, exits, losses, grads = [], [], [], []
    for tower in range(towers):
        mm = model_node(graph, f"t{tower}/mm", "MatMul", [x, w], ["float32"])
        loss = model_node(graph, f"t{tower}/loss", "Mean", [present(mm.outputs[0])], ["float32"])
        fill = model_node(graph, f"t{tower}/gradients/Fill", "Fill",
                          [present(loss.outputs[0]), one], ["float32"],
                          waits=[moving] if moving is not None and tower == 0 else [])
        grad = model_node(graph, f"t{tower}/gradients/mm_grad", "MatMulGrad",
                          [present(fill.outputs[0]), x], ["float32"])
        seeds.append(GradientSeed(fill, 1))
        losses.append(loss)
        grads.append(grad)
        nodes.update({f"mm{tower}": mm, f"fill{tower}": fill, f"grad{tower}": grad})
    lr = array_constant(model, graph, "lr", np.asarray(0.1, np.float32))
    summed = grads[0]
    aggregations = []
    if towers > 1:
        summed = model_node(graph, "sum_towers", "AddN",
                            [present(g.outputs[0]) for g in grads], ["float32"])
        aggregations.append(present(summed.outputs[0]))
        nodes["sum"] = summed
    apply = model_node(graph, "apply_w", "ApplyGradientDescent",
                       [w, lr, present(summed.outputs[0])], ["float32"])
    for grad in grads:
        value = present(grad.outputs[0])
        exits.append(GradientExit(value, list(value.uses)))
    step_one = array_constant(model, graph, "step_one", np.asarray(1, np.int64))
    count = model_node(graph, "count_step", "AssignAdd",
                       [present(nodes["step_counter"].outputs[0]), step_one], ["int64"],
                       waits=[apply])
    writes = [VariableWrite(apply, "optimizer_update", 0, (2,)),
              VariableWrite(count, "step_counter", 0, ())]
    if moving is not None:
        writes.append(VariableWrite(moving, "assign", 0, ()))
    train = model_node(graph, "train", "Group", [], [], waits=[apply, count])
    nodes.update({"apply": apply, "count": count, "train": train})
    if moving is not None:
        nodes["moving"] = moving
    compute = [n for n in graph.nodes if n.name.startswith("t") and n.name != "train"]
    compute += [nodes["w"]]
    optimizer_path = [n for n in (nodes.get("sum"), apply, count, nodes.get("moving"))
                      if n is not None]
    plan = TrainingPlan(
        loss=present(losses[0].outputs[0]), step=train, seeds=seeds, frontier=exits,
        aggregations=aggregations, writes=writes, compute=compute,
        optimizer_path=optimizer_path, differentiated=losses,
        deferred=[(moving, nodes["fill0"])] if moving is not None else [],
        initializers=[nodes["init"]])
    return TinyStep(model, plan, nodes)
