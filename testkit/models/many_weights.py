"""A chain of Adds, each adding its own weight: ``x + w0 + w1 + ...`` (input ``x`` and output
``y`` float32 [side, side]), for layouts with one external data file per weight
(``--external-data per-tensor``): scripts/bench_external_layouts.py times them, the fuzzer's
``many_tensors`` family converts them.

Run ``python -m testkit.models.many_weights OUT.onnx [COUNT]`` to write the model.
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build_model(count: int = 300, side: int = 32) -> onnx.ModelProto:
    """`count` distinct seeded float32 weights of [side, side] (4 KiB each at 32: 2 KiB in
    fp16, over onnx's 1 KiB external-data threshold)."""
    rng = np.random.default_rng(count)
    nodes, weights, previous = [], [], "x"
    for index in range(count):
        weights.append(numpy_helper.from_array(
            rng.standard_normal((side, side)).astype(np.float32), f"w{index}"))
        output = "y" if index == count - 1 else f"h{index}"
        nodes.append(helper.make_node("Add", [previous, f"w{index}"], [output],
                                      name=f"add{index}"))
        previous = output
    graph = helper.make_graph(
        nodes, "many_weights",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [side, side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [side, side])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


if __name__ == "__main__":
    count = sys.argv[2] if len(sys.argv) == 3 else "300"
    if len(sys.argv) not in (2, 3) or not count.isdigit():
        print("usage: python -m testkit.models.many_weights OUT.onnx [COUNT]", file=sys.stderr)
        raise SystemExit(2)
    onnx.save(build_model(int(count)), sys.argv[1])
