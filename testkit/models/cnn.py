"""A small image classifier: Conv/BatchNorm/Relu blocks, MaxPool, linear Resize and a Gemm head.

Graph (input ``image`` float32 [N,3,32,32], symbolic batch ``N``)::

    Conv -> BatchNormalization -> Relu -> MaxPool            (C,   16x16)
    Conv -> BatchNormalization -> Relu -> Resize(linear, x2) (2C,  32x32)
    Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm     (logits [N,10])
    Softmax                                                  (probs  [N,10])

``logits`` is both a graph output and the input of the Softmax, a pattern that breaks
converters which assume a graph output has no consumers inside the graph.

Run ``python -m testkit.models.cnn OUT.onnx`` to write the model. The bundled README example
``examples/tiny_cnn.onnx`` is ``build_tiny_model()``; regenerate it with
``python -c "from testkit.models.cnn import write_tiny_example; write_tiny_example()"``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from testkit.models._common import (
    finish_model,
    float_initializer,
    normal_weights,
    seeded_rng,
    write_model_cli,
)

NUM_CLASSES = 10
IMAGE_SIZE = 32
#: Width of the bundled example model; keeps the committed file around 16 KB.
TINY_CHANNELS = 8
TINY_EXAMPLE_PATH = Path(__file__).resolve().parents[2] / "examples" / "tiny_cnn.onnx"


def _conv_weights(
    rng: np.random.Generator, out_channels: int, in_channels: int, kernel: int
) -> np.ndarray:
    """He-initialised conv weights, so activations stay O(1) through the Relu stack."""
    fan_in = in_channels * kernel * kernel
    return normal_weights(rng, (out_channels, in_channels, kernel, kernel), math.sqrt(2.0 / fan_in))


def _conv_params(
    rng: np.random.Generator, prefix: str, out_channels: int, in_channels: int
) -> list[onnx.TensorProto]:
    """Weight (3x3 kernels) and bias for one Conv."""
    return [
        float_initializer(f"{prefix}.weight", _conv_weights(rng, out_channels, in_channels, 3)),
        float_initializer(f"{prefix}.bias", rng.normal(0.0, 0.05, out_channels)),
    ]


def _batch_norm_params(
    rng: np.random.Generator, prefix: str, channels: int
) -> list[onnx.TensorProto]:
    """Scale, bias, running mean and (strictly positive) running variance for one
    BatchNormalization."""
    return [
        float_initializer(f"{prefix}.scale", rng.uniform(0.8, 1.2, channels)),
        float_initializer(f"{prefix}.bias", rng.normal(0.0, 0.1, channels)),
        float_initializer(f"{prefix}.mean", rng.normal(0.0, 0.1, channels)),
        float_initializer(f"{prefix}.var", rng.uniform(0.5, 1.5, channels)),
    ]


def build_model(channels: int = 16, seed: int = 0) -> onnx.ModelProto:
    """Build the CNN test model.

    Args:
        channels: width of the first conv block; the later blocks use ``2 * channels``.
        seed: seed for the weight generator (same seed, same bytes).
    """
    rng = seeded_rng(seed)
    wide = 2 * channels
    initializers = [
        *_conv_params(rng, "conv1", channels, 3),
        *_batch_norm_params(rng, "bn1", channels),
        *_conv_params(rng, "conv2", wide, channels),
        *_batch_norm_params(rng, "bn2", wide),
        float_initializer("resize.scales", [1.0, 1.0, 2.0, 2.0]),
        *_conv_params(rng, "conv3", wide, wide),
        float_initializer(
            "fc.weight", normal_weights(rng, (NUM_CLASSES, wide), 1.0 / math.sqrt(wide))
        ),
        float_initializer("fc.bias", rng.normal(0.0, 0.05, NUM_CLASSES)),
    ]

    def conv(name: str, x: str) -> onnx.NodeProto:
        # Padding one pixel keeps the 3x3 convolutions' spatial size.
        return helper.make_node(
            "Conv",
            [x, f"{name}.weight", f"{name}.bias"],
            [f"{name}_out"],
            name=name,
            pads=[1, 1, 1, 1],
        )

    def batch_norm(name: str, x: str, prefix: str, y: str) -> onnx.NodeProto:
        params = [f"{prefix}.scale", f"{prefix}.bias", f"{prefix}.mean", f"{prefix}.var"]
        return helper.make_node("BatchNormalization", [x, *params], [y], name=name, epsilon=1e-5)

    nodes = [
        conv("conv1", "image"),
        batch_norm("bn1", "conv1_out", "bn1", "bn1_out"),
        helper.make_node("Relu", ["bn1_out"], ["relu1_out"], name="relu1"),
        helper.make_node(
            "MaxPool",
            ["relu1_out"],
            ["pool1_out"],
            name="pool1",
            kernel_shape=[2, 2],
            strides=[2, 2],
        ),
        conv("conv2", "pool1_out"),
        batch_norm("bn2", "conv2_out", "bn2", "bn2_out"),
        helper.make_node("Relu", ["bn2_out"], ["relu2_out"], name="relu2"),
        # The empty input name is the "absent optional input" spelling of roi.
        helper.make_node(
            "Resize",
            ["relu2_out", "", "resize.scales"],
            ["resize_out"],
            name="upsample",
            mode="linear",
        ),
        conv("conv3", "resize_out"),
        helper.make_node("Relu", ["conv3_out"], ["relu3_out"], name="relu3"),
        helper.make_node("GlobalAveragePool", ["relu3_out"], ["gap_out"], name="global_pool"),
        helper.make_node("Flatten", ["gap_out"], ["flat_out"], name="flatten", axis=1),
        helper.make_node(
            "Gemm", ["flat_out", "fc.weight", "fc.bias"], ["logits"], name="fc", transB=1
        ),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        inputs=[
            helper.make_tensor_value_info(
                "image", TensorProto.FLOAT, ["N", 3, IMAGE_SIZE, IMAGE_SIZE]
            )
        ],
        outputs=[
            helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", NUM_CLASSES]),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", NUM_CLASSES]),
        ],
        initializer=initializers,
    )
    return finish_model(graph)


def build_tiny_model() -> onnx.ModelProto:
    """The narrow CNN saved as ``examples/tiny_cnn.onnx`` for the README demo."""
    return build_model(channels=TINY_CHANNELS)


def write_tiny_example(path: Path = TINY_EXAMPLE_PATH) -> Path:
    """(Re)write the bundled example model and return its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(build_tiny_model().SerializeToString())
    return path


if __name__ == "__main__":
    raise SystemExit(write_model_cli(build_model))
