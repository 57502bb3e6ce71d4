"""Hostile TensorFlow inputs, in process (issue 13, items 5, 6, 8): recursive function
libraries refused before TF sees them, compressed constants that stay compact, declared counts
checked against the proto. The crashes and memory bombs themselves run through the CLI under a
memory cap in tests/test_fuzz.py."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")

from tensorflow.core.framework import graph_pb2, types_pb2  # noqa: E402

from amp_rewriter.errors import AmpError  # noqa: E402
from amp_rewriter.formats.tf import (  # noqa: E402
    compare_graphdefs,
    convert_graphdef,
    read_graphdef,
)

FLOAT = types_pb2.DT_FLOAT


def _placeholder(graph_def: graph_pb2.GraphDef, name: str, shape: list[int]) -> None:
    node = graph_def.node.add(name=name, op="Placeholder")
    node.attr["dtype"].type = FLOAT
    for size in shape:
        node.attr["shape"].shape.dim.add().size = size


def _function(graph_def: graph_pb2.GraphDef, name: str, body_op: str, **func_attrs: str) -> None:
    """float -> float function `name` whose one node is `body_op`, with `func` attributes."""
    fdef = graph_def.library.function.add()
    fdef.signature.name = name
    fdef.signature.input_arg.add(name="x", type=FLOAT)
    fdef.signature.output_arg.add(name="y", type=FLOAT)
    node = fdef.node_def.add(name="inner", op=body_op)
    node.input.append("x")
    for attr, callee in func_attrs.items():
        node.attr[attr].func.name = callee
    fdef.ret["y"] = "inner:output:0"


def _with_call(graph_def: graph_pb2.GraphDef, function: str) -> graph_pb2.GraphDef:
    _placeholder(graph_def, "x", [2])
    graph_def.node.add(name="call", op=function).input.append("x")
    return graph_def


@pytest.mark.parametrize("shape", ["direct", "mutual", "call_attr", "while_body", "nested_attr"])
def test_function_library_that_recurses_is_refused_by_the_reader(tmp_path: Path,
                                                                  shape: str) -> None:
    graph_def = graph_pb2.GraphDef()
    if shape == "direct":
        _function(graph_def, "f", "f")
    elif shape == "mutual":
        _function(graph_def, "f", "g")
        _function(graph_def, "g", "h")
        _function(graph_def, "h", "f")
    elif shape == "call_attr":
        _function(graph_def, "f", "PartitionedCall", f="f")
    elif shape == "while_body":
        _function(graph_def, "f", "While", cond="g", body="f")
        _function(graph_def, "g", "Identity")
    else:
        _function(graph_def, "f", "PartitionedCall", f="g")
        graph_def.library.function[0].node_def[0].attr["f"].func.attr["then"].func.name = "f"
        _function(graph_def, "g", "Identity")
    path = tmp_path / "recursive.pb"
    path.write_bytes(_with_call(graph_def, "f").SerializeToString())
    with pytest.raises(AmpError, match=r"function '\w' calls itself \(\w( -> \w)+\)"):
        read_graphdef(path)


def test_function_library_that_only_shares_callees_is_accepted(tmp_path: Path) -> None:
    graph_def = graph_pb2.GraphDef()
    _function(graph_def, "f", "g")
    _function(graph_def, "h", "g")
    _function(graph_def, "g", "Identity")
    path = tmp_path / "diamond.pb"
    path.write_bytes(_with_call(graph_def, "f").SerializeToString())
    assert len(read_graphdef(path).library.function) == 3


def _compact_matmul_graph(value: float, size: int) -> graph_pb2.GraphDef:
    """y = Relu(MatMul(x, c)) with c a size x size Const stored as one value (TF's compressed
    form, as tf.constant(value, shape=...) and Grappler's constant folding write it)."""
    graph_def = graph_pb2.GraphDef()
    _placeholder(graph_def, "x", [2, size])
    const = graph_def.node.add(name="c", op="Const")
    const.attr["dtype"].type = FLOAT
    tensor = const.attr["value"].tensor
    tensor.dtype = FLOAT
    tensor.float_val.append(value)
    for dim in (size, size):
        tensor.tensor_shape.dim.add().size = dim
    matmul = graph_def.node.add(name="mm", op="MatMul")
    matmul.input.extend(["x", "c"])
    matmul.attr["T"].type = FLOAT
    relu = graph_def.node.add(name="y", op="Relu")
    relu.input.append("mm")
    relu.attr["T"].type = FLOAT
    return graph_def


def test_compressed_constant_converts_compact_and_runs_the_same() -> None:
    graph_def = _compact_matmul_graph(0.5, 1000)
    converted, report = convert_graphdef(graph_def, ["y"], target="fp16", backend="tf-gpu")
    const = next(n for n in converted.node if n.op == "Const")
    tensor = const.attr["value"].tensor
    assert tensor.dtype == types_pb2.DT_HALF
    assert not tensor.tensor_content and len(tensor.half_val) == 1  # not 2 MB of halves
    assert [d.size for d in tensor.tensor_shape.dim] == [1000, 1000]
    assert np.asarray(tensor.half_val, np.uint16).view(np.float16)[0] == np.float16(0.5)
    assert const.ByteSize() < 200
    assert report.constants[0]["elements"] == 1_000_000
    comparisons = compare_graphdefs(graph_def, converted, ["y"])
    assert comparisons[0].relative < 1e-2


def test_compressed_constant_that_overflows_counts_every_element() -> None:
    _, report = convert_graphdef(_compact_matmul_graph(1e6, 300), ["y"], target="fp16",
                                 backend="tf-gpu")
    kept = [c for c in report.constants if c["name"] == "c"]
    assert kept and kept[0]["action"] == "kept_fp32" and kept[0]["overflowed"] == 90_000


def test_constant_whose_content_does_not_match_its_shape_is_refused() -> None:
    graph_def = _compact_matmul_graph(0.5, 4)
    tensor = graph_def.node[1].attr["value"].tensor
    tensor.ClearField("float_val")
    tensor.tensor_content = np.ones(5, np.float32).tobytes()
    with pytest.raises(AmpError, match=r"Const 'c': tensor_content holds 20 bytes, its shape "
                                       r"\[4, 4\] of float32 needs 64"):
        convert_graphdef(graph_def, ["y"], target="fp16", backend="tf-gpu")
    tensor.ClearField("tensor_content")
    tensor.float_val.extend([1.0] * 17)
    with pytest.raises(AmpError, match="holds 17 value"):
        convert_graphdef(graph_def, ["y"], target="fp16", backend="tf-gpu")


def test_type_attribute_without_a_valid_dtype_is_refused() -> None:
    graph_def = _compact_matmul_graph(0.5, 4)
    graph_def.node[2].attr["T"].type = 0
    with pytest.raises(AmpError, match=r"node 'mm' \(MatMul\): attr T holds no valid dtype"):
        convert_graphdef(graph_def, ["y"], target="fp16", backend="tf-gpu")
    del graph_def.node[2].attr["T"]
    with pytest.raises(AmpError, match="attr T is missing"):
        convert_graphdef(graph_def, ["y"], target="fp16", backend="tf-gpu")
