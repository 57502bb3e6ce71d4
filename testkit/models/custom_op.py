"""A model with a custom-domain node that onnxruntime can run through a model-local function.

Input ``x`` float32 [N,16]; output ``y`` float32 [N,8]::

    a = Relu(MatMul(x, W1) + b1)
    s = custom.fp32only::ScaledTanh(a, alpha=1.5)     # = alpha * Tanh(a / alpha)
    y = Relu(MatMul(s, W2) + b2)

``ScaledTanh`` is defined by ``model.functions`` (body in ai.onnx ops), and the model imports
the ``custom.fp32only`` domain at version 1. A converter knows nothing about this op, so it
must leave the node alone and feed it fp32 tensors, while still converting the MatMuls around it.

Run ``python -m testkit.models.custom_op OUT.onnx`` to write the model.
"""

from __future__ import annotations

import math

import onnx
from onnx import TensorProto, helper

from testkit.models._common import (
    OPSET,
    finish_model,
    float_initializer,
    normal_weights,
    seeded_rng,
    write_model_cli,
)

CUSTOM_DOMAIN = "custom.fp32only"
CUSTOM_OP = "ScaledTanh"
CUSTOM_NODE_NAME = "scaled_tanh"
IN_FEATURES = 16
HIDDEN = 32
OUT_FEATURES = 8


def scaled_tanh_function() -> onnx.FunctionProto:
    """The model-local function ``ScaledTanh(X; alpha) = alpha * Tanh(X / alpha)``."""
    # A Constant whose value_float refers to the function attribute `alpha`.
    # Built by hand because helper.make_attribute_ref only gained `ref_attr_name` in recent onnx.
    alpha_reference = onnx.AttributeProto(
        name="value_float", type=onnx.AttributeProto.FLOAT, ref_attr_name="alpha"
    )
    alpha_constant = helper.make_node("Constant", [], ["alpha"], name="alpha_constant")
    alpha_constant.attribute.append(alpha_reference)
    return helper.make_function(
        CUSTOM_DOMAIN,
        CUSTOM_OP,
        inputs=["X"],
        outputs=["Y"],
        nodes=[
            alpha_constant,
            helper.make_node("Div", ["X", "alpha"], ["scaled_in"], name="scale_in"),
            helper.make_node("Tanh", ["scaled_in"], ["tanh_out"], name="tanh"),
            helper.make_node("Mul", ["tanh_out", "alpha"], ["Y"], name="scale_out"),
        ],
        opset_imports=[helper.make_opsetid("", OPSET)],
        attributes=["alpha"],
    )


def build_model(seed: int = 3) -> onnx.ModelProto:
    """Build the custom-op test model; ``seed`` fixes the weights."""
    rng = seeded_rng(seed)
    initializers = [
        float_initializer(
            "fc1.weight", normal_weights(rng, (IN_FEATURES, HIDDEN), math.sqrt(2.0 / IN_FEATURES))
        ),
        float_initializer("fc1.bias", normal_weights(rng, (HIDDEN,), 0.05)),
        float_initializer(
            "fc2.weight", normal_weights(rng, (HIDDEN, OUT_FEATURES), math.sqrt(2.0 / HIDDEN))
        ),
        float_initializer("fc2.bias", normal_weights(rng, (OUT_FEATURES,), 0.05)),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "fc1.weight"], ["fc1_matmul_out"], name="fc1_matmul"),
        helper.make_node("Add", ["fc1_matmul_out", "fc1.bias"], ["fc1_out"], name="fc1_add"),
        helper.make_node("Relu", ["fc1_out"], ["relu1_out"], name="relu1"),
        helper.make_node(
            CUSTOM_OP,
            ["relu1_out"],
            ["custom_out"],
            name=CUSTOM_NODE_NAME,
            domain=CUSTOM_DOMAIN,
            alpha=1.5,
        ),
        helper.make_node(
            "MatMul", ["custom_out", "fc2.weight"], ["fc2_matmul_out"], name="fc2_matmul"
        ),
        helper.make_node("Add", ["fc2_matmul_out", "fc2.bias"], ["fc2_out"], name="fc2_add"),
        helper.make_node("Relu", ["fc2_out"], ["y"], name="relu2"),
    ]
    graph = helper.make_graph(
        nodes,
        "custom_op",
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", IN_FEATURES])],
        outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", OUT_FEATURES])],
        initializer=initializers,
        # The custom node's output type is stated so tools need not run the function to learn it.
        value_info=[helper.make_tensor_value_info("custom_out", TensorProto.FLOAT, ["N", HIDDEN])],
    )
    return finish_model(graph, extra_opsets={CUSTOM_DOMAIN: 1}, functions=[scaled_tanh_function()])


if __name__ == "__main__":
    raise SystemExit(write_model_cli(build_model))
