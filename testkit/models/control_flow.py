"""A model with an ``If`` and a ``Loop`` whose subgraphs do float math on outer-scope values.

Input ``x`` float32 [4,8]; output ``y`` float32 [4,8]::

    h = MatMul(x, W_in)
    branch = If(ReduceSum(x) > 0,
                then: Relu(MatMul(h, W_then)),       # h and W_then captured from the parent graph
                else: Tanh(MatMul(h, W_else)))
    state = Loop(3, state0 = h,
                 body: state = Tanh(MatMul(state, W_loop) + branch))   # W_loop, branch captured
    y = Add(state, branch)

Both branches can be exercised: pass ``x`` and ``-x``.
Subgraphs reference the parent's initializers by name, so a converter that changes an
initializer's dtype must also account for every subgraph that reads it.

Run ``python -m testkit.models.control_flow OUT.onnx`` to write the model.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper

from testkit.models._common import (
    finish_model,
    float_initializer,
    int64_initializer,
    normal_weights,
    seeded_rng,
    write_model_cli,
)

ROWS = 4
FEATURES = 8
LOOP_TRIP_COUNT = 3


def _float_info(name: str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [ROWS, FEATURES])


def _branch_graph(name: str, weight: str, activation: str) -> onnx.GraphProto:
    """An If branch: ``activation(MatMul(h, weight))``, both operands from the parent graph."""
    matmul_out = f"{name}/matmul_out"
    return helper.make_graph(
        [
            helper.make_node("MatMul", ["h", weight], [matmul_out], name=f"{name}/matmul"),
            helper.make_node(
                activation, [matmul_out], [f"{name}/out"], name=f"{name}/{activation.lower()}"
            ),
        ],
        name,
        inputs=[],
        outputs=[_float_info(f"{name}/out")],
    )


def _loop_body_graph() -> onnx.GraphProto:
    """Loop body: ``state = Tanh(MatMul(state, W_loop) + branch_out)``; the condition passes
    through."""
    return helper.make_graph(
        [
            helper.make_node(
                "Identity", ["body/cond_in"], ["body/cond_out"], name="body/keep_going"
            ),
            helper.make_node(
                "MatMul", ["body/state_in", "loop.weight"], ["body/matmul_out"], name="body/matmul"
            ),
            # branch_out is an outer-scope tensor (not an initializer) captured by the body.
            helper.make_node(
                "Add", ["body/matmul_out", "branch_out"], ["body/add_out"], name="body/add"
            ),
            # Tanh keeps the state bounded however many iterations run.
            helper.make_node("Tanh", ["body/add_out"], ["body/state_out"], name="body/tanh"),
        ],
        "loop_body",
        inputs=[
            helper.make_tensor_value_info("body/iteration", TensorProto.INT64, []),
            helper.make_tensor_value_info("body/cond_in", TensorProto.BOOL, []),
            _float_info("body/state_in"),
        ],
        outputs=[
            helper.make_tensor_value_info("body/cond_out", TensorProto.BOOL, []),
            _float_info("body/state_out"),
        ],
    )


def build_model(seed: int = 2) -> onnx.ModelProto:
    """Build the control-flow test model; ``seed`` fixes the weights."""
    rng = seeded_rng(seed)
    std = 1.0 / math.sqrt(FEATURES)
    initializers = [
        float_initializer("input.weight", normal_weights(rng, (FEATURES, FEATURES), std)),
        float_initializer("then.weight", normal_weights(rng, (FEATURES, FEATURES), std)),
        float_initializer("else.weight", normal_weights(rng, (FEATURES, FEATURES), std)),
        float_initializer("loop.weight", normal_weights(rng, (FEATURES, FEATURES), std)),
        float_initializer("zero", np.array(0.0)),
        int64_initializer("loop.trip_count", np.array(LOOP_TRIP_COUNT)),
        # Loop's `cond` input must be given when trip count alone should decide; true means "run all
        # trips".
        helper.make_tensor("loop.keep_going", TensorProto.BOOL, [], [True]),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "input.weight"], ["h"], name="input_matmul"),
        helper.make_node("ReduceSum", ["x"], ["x_sum"], name="x_sum", keepdims=0),
        helper.make_node("Greater", ["x_sum", "zero"], ["x_sum_positive"], name="x_sum_positive"),
        helper.make_node(
            "If",
            ["x_sum_positive"],
            ["branch_out"],
            name="branch",
            then_branch=_branch_graph("then", "then.weight", "Relu"),
            else_branch=_branch_graph("else", "else.weight", "Tanh"),
        ),
        helper.make_node(
            "Loop",
            ["loop.trip_count", "loop.keep_going", "h"],
            ["loop_out"],
            name="loop",
            body=_loop_body_graph(),
        ),
        helper.make_node("Add", ["loop_out", "branch_out"], ["y"], name="output_add"),
    ]
    graph = helper.make_graph(
        nodes,
        "control_flow",
        inputs=[_float_info("x")],
        outputs=[_float_info("y")],
        initializer=initializers,
    )
    return finish_model(graph)


if __name__ == "__main__":
    raise SystemExit(write_model_cli(build_model))
