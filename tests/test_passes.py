"""Unit tests of the precision passes through `amp_rewriter.convert`, on tiny hand-built graphs.

Each test builds a few-node model with `testkit/builder.py`, converts it, and asserts the decisions
(`report.nodes[*].precision`), the casts in the result, that the result passes the ONNX checker
(full check) and, where the graph runs on onnxruntime's CPU provider, that its outputs stay close to
fp32. The scenarios follow the rules in `amp_rewriter/passes/propagate.py` (after TensorFlow
Grappler's auto_mixed_precision pass).

Op classes used below (amp_rewriter/op_lists/onnx.toml, fp16): allow MatMul/Conv; infer Add, Mul,
Tanh, Sum; deny Exp; clear Relu, Transpose, Resize, Dropout, Loop, If. On backend ort-cuda,
Softmax / ReduceMean / LayerNormalization are infer (fp32-accumulating kernels); on ort-cpu they
are deny.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import amp_rewriter  # noqa: E402
from amp_rewriter.formats.onnx.convert import convert_model_ir  # noqa: E402
from amp_rewriter.report import explain_text  # noqa: E402
from testkit.builder import (  # noqa: E402
    GraphBuilder,
    all_nodes,
    assert_close,
    casts,
    check,
    count_casts,
    feeds_for,
    initializer,
    node_by_name,
    precisions,
    producers,
    run,
)

FLOAT, FLOAT16, BFLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16


def convert(model: onnx.ModelProto, **options):
    """Convert and run the checks every test wants: full ONNX check of the result."""
    converted, report = amp_rewriter.convert(model, **options)
    check(converted)
    return converted, report


def cast_to(node: onnx.NodeProto) -> int:
    return next(a.i for a in node.attribute if a.name == "to")


def casts_reading(model: onnx.ModelProto, value: str) -> list[onnx.NodeProto]:
    return [n for n in casts(model) if n.input[0] == value]


def input_producer(model: onnx.ModelProto, node_name: str, slot: int = 0) -> onnx.NodeProto | None:
    """The node producing input `slot` of `node_name` (None for graph inputs/initializers)."""
    return producers(model).get(node_by_name(model, node_name).input[slot])


def output_type(model: onnx.ModelProto, index: int = 0) -> int:
    return model.graph.output[index].type.tensor_type.elem_type


# -- basic propagation ---------------------------------------------------------------------------
def allow_clear_allow() -> onnx.ModelProto:
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    h = b.op("MatMul", x, b.weight("w1", [8, 8]), name="mm1")
    r = b.op("Relu", h, name="relu")
    b.output(b.op("MatMul", r, b.weight("w2", [8, 8]), name="mm2"))
    return b.build()


def test_allow_clear_allow_runs_fp16_with_casts_only_at_the_io():
    model = allow_clear_allow()
    converted, report = convert(model)
    assert precisions(report) == {"mm1": "fp16", "relu": "fp16", "mm2": "fp16"}
    assert count_casts(converted) == 2
    (cast_in,) = casts_reading(converted, "x")
    assert cast_to(cast_in) == FLOAT16
    out_cast = producers(converted)["mm2"]
    assert out_cast.op_type == "Cast" and cast_to(out_cast) == FLOAT
    # Nothing between the MatMuls: relu reads mm1 directly, mm2 reads relu directly.
    assert input_producer(converted, "relu").name == "mm1"
    assert input_producer(converted, "mm2").name == "relu"
    assert initializer(converted, "w1").data_type == FLOAT16
    assert initializer(converted, "w2").data_type == FLOAT16
    assert output_type(converted) == FLOAT
    assert_close(model, converted, feeds_for(model))


def test_deny_spreads_through_infer_and_clear_until_an_allow_op():
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    h = b.op("MatMul", x, b.weight("w1", [8, 8]), name="mm1")
    e = b.op("Exp", h, name="exp")
    a1 = b.op("Add", e, b.weight("b1", [8]), name="add1")
    r = b.op("Relu", a1, name="relu")
    a2 = b.op("Add", r, b.weight("b2", [8]), name="add2")
    b.output(b.op("MatMul", a2, b.weight("w2", [8, 8]), name="mm2"))
    model = b.build()
    converted, report = convert(model)
    assert precisions(report) == {"mm1": "fp16", "exp": "fp32", "add1": "fp32", "relu": "fp32",
                                  "add2": "fp32", "mm2": "fp16"}
    # x -> fp16, mm1 -> fp32 (for exp), add2 -> fp16 (for mm2), mm2 -> fp32 (output).
    assert count_casts(converted) == 4
    assert [cast_to(c) for c in casts_reading(converted, "mm1")] == [FLOAT]
    assert [cast_to(c) for c in casts_reading(converted, "add2")] == [FLOAT16]
    assert initializer(converted, "b1").data_type == FLOAT
    assert initializer(converted, "b2").data_type == FLOAT
    assert_close(model, converted, feeds_for(model))


def grappler_example() -> onnx.ModelProto:
    """deny -> infer -> clear -> infer -> clear -> allow -> infer (Grappler's documented chain)."""
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    e = b.op("Exp", x, name="deny")
    i1 = b.op("Add", e, b.weight("b1", [8]), name="infer1")
    c1 = b.op("Relu", i1, name="clear1")
    i2 = b.op("Mul", c1, b.weight("s", [8]), name="infer2")
    c2 = b.op("Relu", i2, name="clear2")
    a = b.op("MatMul", c2, b.weight("w", [8, 8]), name="allow")
    b.output(b.op("Add", a, b.weight("b2", [8]), name="infer3"))
    return b.build()


def test_grappler_documented_example_fp16():
    # Deny spreads only into infer/clear ops that are upstream of a deny or infer op: infer1,
    # clear1 and infer2 are; clear2 (feeding only the allow op) is not, so it stays clear and then
    # joins the allow op through the clear rule. infer3 after the last allow op stays fp32 (fp16).
    model = grappler_example()
    converted, report = convert(model)
    assert precisions(report) == {"deny": "fp32", "infer1": "fp32", "clear1": "fp32",
                                  "infer2": "fp32", "clear2": "fp16", "allow": "fp16",
                                  "infer3": "fp32"}
    for name in ("infer1", "clear1", "infer2"):
        assert "deny op deny (Exp)" in report.node(name)["reason"]
    assert report.node("clear2")["reason"].startswith("clear op connected to low-precision")
    # infer2 -> fp16 before clear2, allow -> fp32 for infer3: the only casts.
    assert count_casts(converted) == 2
    assert [cast_to(c) for c in casts_reading(converted, "infer2")] == [FLOAT16]
    assert [cast_to(c) for c in casts_reading(converted, "allow")] == [FLOAT]
    assert_close(model, converted, feeds_for(model))


def test_grappler_documented_example_bf16_infer_after_allow():
    model = grappler_example()
    converted, report = convert(model, target="bf16", backend="ort-cuda")
    got = precisions(report)
    assert got["infer3"] == "bf16" and got["allow"] == "bf16" and got["clear2"] == "bf16"
    assert [got[n] for n in ("deny", "infer1", "clear1", "infer2")] == ["fp32"] * 4
    assert "bf16 rule" in report.node("infer3")["reason"]
    # The output cast now follows infer3, which keeps the graph output float32.
    assert producers(converted)["infer3"].op_type == "Cast"
    assert output_type(converted) == FLOAT
    assert initializer(converted, "b2").data_type == BFLOAT16
    # (bf16 MatMul/Relu have no onnxruntime CPU kernels, so this graph is not run here.)


@pytest.mark.parametrize("target, expected", [("fp16", "fp32"), ("bf16", "bf16")])
def test_infer_after_last_allow_op(target, expected):
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    h = b.op("MatMul", x, b.weight("w", [8, 8]), name="mm")
    b.output(b.op("Add", h, b.weight("bias", [8]), name="add"))
    model = b.build()
    converted, report = convert(model, target=target, backend="ort-cuda")
    assert precisions(report) == {"mm": target, "add": expected}
    assert count_casts(converted) == 2
    assert output_type(converted) == FLOAT
    if target == "fp16":
        assert_close(model, converted, feeds_for(model))


def test_infer_between_allow_ops_joins_them():
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    h = b.op("MatMul", x, b.weight("w1", [8, 8]), name="mm1")
    t = b.op("Tanh", b.op("Add", h, b.weight("bias", [8]), name="add"), name="tanh")
    b.output(b.op("MatMul", t, b.weight("w2", [8, 8]), name="mm2"))
    model = b.build()
    converted, report = convert(model)
    assert set(precisions(report).values()) == {"fp16"}
    assert "between allow ops" in report.node("add")["reason"]
    assert count_casts(converted) == 2
    assert_close(model, converted, feeds_for(model))


# -- backend profiles ----------------------------------------------------------------------------
def test_allow_op_without_backend_kernel_pulls_no_neighbour_into_low_precision():
    b = GraphBuilder()
    x = b.input("x", [8, 8])
    h = b.op("MatMul", x, b.weight("w1", [8, 8]), name="mm1")
    t = b.op("Transpose", h, name="transpose", perm=[1, 0])
    b.output(b.op("MatMul", t, b.weight("w2", [8, 8]), name="mm2"))
    model = b.build()
    converted, report = convert(model, target="bf16", backend="ort-cpu")
    assert precisions(report)["mm1"] == precisions(report)["mm2"] == "fp32"
    assert precisions(report)["transpose"] == "fp32"
    assert count_casts(converted) == 0


def matmul_op_matmul(op: str) -> onnx.ModelProto:
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    h = b.op("MatMul", x, b.weight("w1", [8, 8]), name="mm1")
    if op == "Softmax":
        mid = b.op("Softmax", h, name="mid", axis=-1)
    elif op == "ReduceMean":
        mid = b.op("ReduceMean", h, name="mid", axes=[-1], keepdims=1)
    else:
        mid = b.op("LayerNormalization", h, b.const("gamma", np.ones(8)),
                   b.const("beta", np.zeros(8)), name="mid", axis=-1)
    w2 = [1, 8] if op == "ReduceMean" else [8, 8]
    b.output(b.op("MatMul", mid, b.weight("w2", w2), name="mm2"))
    return b.build()


@pytest.mark.parametrize("op", ["Softmax", "ReduceMean", "LayerNormalization"])
@pytest.mark.parametrize("backend, expected, n_casts", [("ort-cuda", "fp16", 2),
                                                        ("ort-cpu", "fp32", 4)])
def test_accumulating_ops_follow_the_backend_profile(op, backend, expected, n_casts):
    """ORT CUDA's Softmax and LayerNormalization keep fp32 statistics: fp16 there. Its fp16
    ReduceMean accumulates in fp32 too but overflows once a row's sum passes 65504 (measured), so
    it keeps the generic deny on both backends, and ort-cuda's reason says why."""
    if op == "ReduceMean" and backend == "ort-cuda":
        expected, n_casts = "fp32", 4
    model = matmul_op_matmul(op)
    converted, report = convert(model, backend=backend)
    assert precisions(report) == {"mm1": "fp16", "mid": expected, "mm2": "fp16"}
    assert count_casts(converted) == n_casts
    mid_input = input_producer(converted, "mid")
    if expected == "fp16":
        assert mid_input.name == "mm1"
        assert "ORT CUDA" in report.node("mid")["class_reason"]
    else:
        assert mid_input.op_type == "Cast" and cast_to(mid_input) == FLOAT
        assert report.node("mid")["class"] == "deny"
        if backend == "ort-cuda":
            assert "overflows once the row's sum passes" in report.node("mid")["class_reason"]
    if op == "LayerNormalization":
        wanted = FLOAT16 if expected == "fp16" else FLOAT
        assert initializer(converted, "gamma").data_type == wanted
        assert initializer(converted, "beta").data_type == wanted
    assert_close(model, converted, feeds_for(model))


# -- the model's own casts -----------------------------------------------------------------------
@pytest.mark.parametrize("source_dtype", [np.int64, np.bool_])
def test_existing_cast_to_float_is_retargeted(source_dtype):
    b = GraphBuilder()
    ids = b.input("ids", [2, 8], source_dtype)
    c = b.op("Cast", ids, name="cast_in", to=FLOAT)
    b.output(b.op("MatMul", c, b.weight("w1", [8, 8]), name="mm1"),
             b.op("MatMul", c, b.weight("w2", [8, 4]), name="mm2"))
    model = b.build()
    converted, report = convert(model)
    assert precisions(report) == {"cast_in": "fp16", "mm1": "fp16", "mm2": "fp16"}
    assert cast_to(node_by_name(converted, "cast_in")) == FLOAT16
    assert node_by_name(converted, "mm1").input[0] == "cast_in"
    assert node_by_name(converted, "mm2").input[0] == "cast_in"
    assert casts_reading(converted, "cast_in") == []
    # Only the two output casts are new.
    assert report.summary["casts_inserted"] == 2
    assert count_casts(converted) == 3
    assert "retargeted" in report.node("cast_in")["reason"]
    feeds = {"ids": (np.arange(16).reshape(2, 8) % 3).astype(source_dtype)}
    assert_close(model, converted, feeds)


def test_existing_cast_feeding_a_graph_output_is_not_retargeted():
    b = GraphBuilder()
    ids = b.input("ids", [2, 8], np.int64)
    c = b.op("Cast", ids, name="cast_in", to=FLOAT)
    b.output(b.op("MatMul", c, b.weight("w", [8, 8]), name="mm"), c)
    model = b.build()
    converted, _ = convert(model)
    assert cast_to(node_by_name(converted, "cast_in")) == FLOAT
    assert [o.type.tensor_type.elem_type for o in converted.graph.output] == [FLOAT, FLOAT]
    assert_close(model, converted, {"ids": np.arange(16).reshape(2, 8) % 4})


def test_noop_casts_between_low_precision_ops_are_folded():
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    n0 = b.op("Cast", x, name="noop0", to=FLOAT)
    h = b.op("MatMul", n0, b.weight("w1", [8, 8]), name="mm1")
    n1 = b.op("Cast", h, name="noop1", to=FLOAT)
    b.output(b.op("MatMul", n1, b.weight("w2", [8, 8]), name="mm2"))
    model = b.build()
    converted, report = convert(model)
    names = {n.name for n in all_nodes(converted)}
    # Both float -> float casts go before anything is decided (drop_identity_casts): only the
    # input and output casts of the conversion remain.
    assert "noop0" not in names and "noop1" not in names
    assert count_casts(converted) == 2
    assert node_by_name(converted, "mm2").input[0] == "mm1"
    assert {p["name"]: p["changed"] for p in report.passes}["drop_identity_casts"] == 2
    assert_close(model, converted, feeds_for(model))


def test_noop_cast_between_fp32_ops_is_folded():
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    n = b.op("Cast", b.op("Exp", x, name="exp"), name="noop", to=FLOAT)
    b.output(b.op("Exp", n, name="exp2"))
    model = b.build()
    converted, report = convert(model)
    assert count_casts(converted) == 0
    assert node_by_name(converted, "exp2").input[0] == "exp"
    assert report.summary["casts_removed"] == 1
    assert_close(model, converted, feeds_for(model), tol=1e-6)


def test_fp32_fp16_fp32_chain_between_fp16_ops_is_folded():
    # mm1 -> Cast(fp16) -> Cast(fp32) -> mm2: mm1 now produces fp16, so the first cast is a no-op,
    # the second is retargeted to fp16 (its consumer runs fp16) and then is a no-op too.
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    h = b.op("MatMul", x, b.weight("w1", [8, 8]), name="mm1")
    c16 = b.op("Cast", h, name="to16", to=FLOAT16)
    c32 = b.op("Cast", c16, name="to32", to=FLOAT)
    b.output(b.op("MatMul", c32, b.weight("w2", [8, 8]), name="mm2"))
    model = b.build()
    converted, report = convert(model)
    names = {n.name for n in all_nodes(converted)}
    assert "to16" not in names and "to32" not in names
    assert node_by_name(converted, "mm2").input[0] == "mm1"
    assert count_casts(converted) == 2  # input and output only
    assert report.summary["casts_removed"] == 2
    assert_close(model, converted, feeds_for(model))


def test_fp16_fp32_fp16_chain_on_an_fp16_input_is_folded_away():
    # Widening fp16 -> fp32 is exact, so Cast(Cast(x, fp32), fp16) == x.
    b = GraphBuilder()
    x = b.input("x", [2, 8], np.float16)
    c32 = b.op("Cast", x, name="up", to=FLOAT)
    c16 = b.op("Cast", c32, name="down", to=FLOAT16)
    b.output(b.op("Neg", c16, name="neg"), dtype=np.float16, shape=[2, 8])
    model = b.build()
    converted, _ = convert(model)
    assert count_casts(converted) == 0
    assert node_by_name(converted, "neg").input[0] == "x"
    feeds = {"x": np.linspace(-2, 2, 16, dtype=np.float16).reshape(2, 8)}
    assert np.array_equal(run(converted, feeds)[0], run(model, feeds)[0])


def test_narrowing_cast_chain_in_fp32_code_keeps_its_rounding():
    # Cast(Cast(x, fp16), fp32) rounds x to fp16 on purpose: folding it would change the result.
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    c16 = b.op("Cast", x, name="to16", to=FLOAT16)
    c32 = b.op("Cast", c16, name="to32", to=FLOAT)
    b.output(b.op("Exp", c32, name="exp"))
    model = b.build()
    converted, _ = convert(model)
    feeds = {"x": np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8) + 1e-4}
    assert np.array_equal(run(converted, feeds)[0], run(model, feeds)[0])
    assert cast_to(node_by_name(converted, "to16")) == FLOAT16


# -- barriers and overrides ----------------------------------------------------------------------
CUSTOM_DOMAIN = "my.ops"


def custom_op_model() -> onnx.ModelProto:
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    h = b.op("MatMul", x, b.weight("w1", [8, 8]), name="mm1")
    b.function(CUSTOM_DOMAIN, "Swish", ["X"], ["Y"],
               [helper.make_node("Sigmoid", ["X"], ["S"]), helper.make_node("Mul", ["X", "S"], ["Y"])])
    s = b.op("Swish", h, name="swish", domain=CUSTOM_DOMAIN)
    b.output(b.op("MatMul", s, b.weight("w2", [8, 8]), name="mm2"))
    return b.build()


def test_unknown_custom_domain_op_is_an_fp32_barrier():
    model = custom_op_model()
    converted, report = convert(model)
    assert precisions(report) == {"mm1": "fp16", "swish": "fp32", "mm2": "fp16"}
    assert report.node("swish")["op"] == "my.ops.Swish"
    assert "no schema" in report.node("swish")["reason"]
    node = node_by_name(converted, "swish")
    assert node.domain == CUSTOM_DOMAIN and node.op_type == "Swish"
    before = input_producer(converted, "swish")
    assert before.op_type == "Cast" and cast_to(before) == FLOAT and before.input[0] == "mm1"
    after = casts_reading(converted, "swish")
    assert [cast_to(c) for c in after] == [FLOAT16]
    assert count_casts(converted) == 4
    # The function and the domain import are kept untouched.
    assert [f.name for f in converted.functions] == ["Swish"]
    assert converted.functions[0] == model.functions[0]
    assert any(o.domain == CUSTOM_DOMAIN for o in converted.opset_import)
    assert_close(model, converted, feeds_for(model))


def three_matmuls() -> onnx.ModelProto:
    """mm1 -> relu -> mm2 -> exp -> mm3"""
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    h = b.op("MatMul", x, b.weight("w1", [8, 8]), name="mm1")
    r = b.op("Relu", h, name="relu")
    h2 = b.op("MatMul", r, b.weight("w2", [8, 8]), name="mm2")
    e = b.op("Exp", h2, name="exp")
    b.output(b.op("MatMul", e, b.weight("w3", [8, 8]), name="mm3"))
    return b.build()


@pytest.mark.parametrize("options, expected", [
    ({}, dict(mm1="fp16", relu="fp16", mm2="fp16", exp="fp32", mm3="fp16")),
    (dict(keep_nodes=["mm2"]), dict(mm1="fp16", relu="fp16", mm2="fp32", exp="fp32", mm3="fp16")),
    (dict(keep_nodes=["mm[23]"]), dict(mm1="fp16", relu="fp16", mm2="fp32", exp="fp32",
                                        mm3="fp32")),
    # A plain name is anchored: "mm" pins nothing.
    (dict(keep_nodes=["mm"]), dict(mm1="fp16", relu="fp16", mm2="fp16", exp="fp32", mm3="fp16")),
    (dict(deny=["MatMul"]), dict(mm1="fp32", relu="fp32", mm2="fp32", exp="fp32", mm3="fp32")),
    (dict(allow=["Exp"]), dict(mm1="fp16", relu="fp16", mm2="fp16", exp="fp16", mm3="fp16")),
    (dict(clear=["Exp"]), dict(mm1="fp16", relu="fp16", mm2="fp16", exp="fp16", mm3="fp16")),
    (dict(deny=["Relu"]), dict(mm1="fp16", relu="fp32", mm2="fp16", exp="fp32", mm3="fp16")),
])
def test_keep_nodes_and_class_overrides(options, expected):
    model = three_matmuls()
    converted, report = convert(model, **options)
    assert precisions(report) == expected
    for name, precision in expected.items():
        entry = report.node(name)
        if "keep_nodes" in options and precision == "fp32" and name.startswith("mm"):
            assert entry["class"] == "fp32" and "--keep-node" in entry["reason"]
    for op_class in ("allow", "deny", "clear"):
        for op in options.get(op_class, []):
            entry = next(n for n in report.nodes if n["op"] == op)
            assert entry["class"] == op_class
            assert f"--{op_class}" in (entry.get("class_reason") or entry["reason"])
    # Fewer fp16 islands, fewer casts; an all-fp32 model has none.
    if set(expected.values()) == {"fp32"}:
        assert count_casts(converted) == 0
        assert converted.graph == model.graph
    assert_close(model, converted, feeds_for(model))


def test_config_file_overrides(tmp_path):
    model = three_matmuls()
    config = tmp_path / "amp.toml"
    config.write_text('deny = ["Relu"]\n')
    _, report = convert(model, config=config)
    assert precisions(report) == dict(mm1="fp16", relu="fp32", mm2="fp16", exp="fp32", mm3="fp16")
    assert "config amp.toml" in report.node("relu")["reason"]

    config.write_text('[ops]\nallow = ["Exp"]\nkeep_nodes = ["mm1"]\n')
    converted, report = convert(model, config=str(config))
    assert precisions(report) == dict(mm1="fp32", relu="fp16", mm2="fp16", exp="fp16", mm3="fp16")
    assert_close(model, converted, feeds_for(model))
    # Explicit options win over the config file.
    _, report = convert(model, config=config, deny=["Exp"])
    assert precisions(report)["exp"] == "fp32"
    assert "--deny" in report.node("exp")["reason"]


def test_unknown_config_key_is_refused(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('alow = ["Exp"]\n')
    with pytest.raises(amp_rewriter.AmpError, match="unknown key"):
        amp_rewriter.convert(three_matmuls(), config=config)


# -- slots whose dtype is fixed by meaning -------------------------------------------------------
def test_resize_scales_and_dropout_ratio_stay_float32():
    b = GraphBuilder()
    x = b.input("x", [1, 2, 4, 4])
    c = b.op("Conv", x, b.weight("w1", [4, 2, 3, 3]), name="conv1", pads=[1, 1, 1, 1])
    rs = b.op("Resize", c, "", b.const("scales", np.array([1, 1, 2, 2], np.float32)),
              name="resize", mode="nearest")
    d = b.op("Dropout", rs, b.const("ratio", np.array(0.5, np.float32)), name="drop")
    b.output(b.op("Conv", d, b.weight("w2", [2, 4, 3, 3]), name="conv2", pads=[1, 1, 1, 1]))
    model = b.build()
    converted, report = convert(model)
    assert precisions(report) == {"conv1": "fp16", "resize": "fp16", "drop": "fp16",
                                  "conv2": "fp16"}
    assert initializer(converted, "scales").data_type == FLOAT
    assert initializer(converted, "ratio").data_type == FLOAT
    resize = node_by_name(converted, "resize")
    assert resize.input[0] == "conv1" and resize.input[2] == "scales"
    assert node_by_name(converted, "drop").input == ["resize", "ratio"]
    assert count_casts(converted) == 2
    assert_close(model, converted, feeds_for(model))


# -- cast placement ------------------------------------------------------------------------------
def test_one_cast_per_producer_output_and_dtype():
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    e = b.op("Exp", x, name="exp")
    outs = [b.op("MatMul", e, b.weight(f"w{i}", [8, 8]), name=f"mm{i}") for i in range(3)]
    b.output(b.op("Relu", b.op("Concat", *outs, name="cat", axis=1), name="relu"))
    model = b.build()
    converted, report = convert(model)
    assert precisions(report) == {"exp": "fp32", "mm0": "fp16", "mm1": "fp16", "mm2": "fp16",
                                  "cat": "fp16", "relu": "fp16"}
    (shared,) = casts_reading(converted, "exp")
    assert cast_to(shared) == FLOAT16
    for i in range(3):
        assert node_by_name(converted, f"mm{i}").input[0] == shared.output[0]
    assert count_casts(converted) == 2  # exp -> fp16, relu -> fp32 output
    assert_close(model, converted, feeds_for(model))


def test_graph_output_also_consumed_inside_keeps_name_and_dtype():
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    h = b.op("MatMul", x, b.weight("w1", [8, 8]), name="mm1")
    b.output(h, b.op("MatMul", h, b.weight("w2", [8, 8]), name="mm2"))
    model = b.build()
    converted, report = convert(model)
    assert precisions(report) == {"mm1": "fp16", "mm2": "fp16"}
    assert [o.name for o in converted.graph.output] == ["mm1", "mm2"]
    assert [output_type(converted, i) for i in range(2)] == [FLOAT, FLOAT]
    mm1 = node_by_name(converted, "mm1")
    # mm2 reads the fp16 value mm1 produces, not the fp32 graph output.
    assert node_by_name(converted, "mm2").input[0] == mm1.output[0] != "mm1"
    out_cast = producers(converted)["mm1"]
    assert out_cast.op_type == "Cast" and out_cast.input[0] == mm1.output[0]
    assert count_casts(converted) == 3
    assert_close(model, converted, feeds_for(model))


def test_value_listed_twice_as_graph_output_keeps_its_name():
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    h = b.op("MatMul", x, b.weight("w", [8, 8]), name="mm")
    b.output(h, h)
    model = b.build()
    converted, _ = convert(model)
    assert [o.name for o in converted.graph.output] == ["mm", "mm"]


# -- constants -----------------------------------------------------------------------------------
def mask_mul_model() -> onnx.ModelProto:
    """scores = MatMul(x); Softmax(scores + mask * -3.4e38) -> MatMul (attention-mask style)."""
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    mask = b.input("mask", [2, 8])
    h = b.op("MatMul", x, b.weight("w1", [8, 8]), name="mm1")
    bias = b.op("Mul", mask, b.const("neg", np.array(-3.4e38, np.float32)), name="mask_mul")
    r = b.op("Relu", b.op("Add", h, bias, name="mask_add"), name="relu")
    s = b.op("Softmax", r, name="softmax", axis=-1)
    b.output(b.op("MatMul", s, b.weight("w2", [8, 8]), name="mm2"))
    return b.build()


MASK = np.array([[0] * 6 + [1] * 2, [0] * 3 + [1] * 5], np.float32)


def test_overflowing_constant_keeps_its_op_and_the_path_after_it_fp32():
    model = mask_mul_model()
    converted, report = convert(model)
    # mask_mul is forced deny by its constant; the taint runs through the infer/clear ops that
    # lead to the Softmax (infer on ort-cuda) and stops at the allow op.
    assert precisions(report) == {"mm1": "fp16", "mask_mul": "fp32", "mask_add": "fp32",
                                  "relu": "fp32", "softmax": "fp32", "mm2": "fp16"}
    assert "'neg'" in report.node("mask_mul")["reason"]
    assert "mask_mul (Mul)" in report.node("softmax")["reason"]
    neg = initializer(converted, "neg")
    assert neg.data_type == FLOAT and numpy_helper.to_array(neg) == np.float32(-3.4e38)
    assert report.summary["constants_kept_fp32"] == 1
    record = next(c for c in report.constants if c["name"] == "neg")
    assert record["action"] == "kept_fp32" and record["overflowed"] == 1
    assert_close(model, converted, feeds_for(model, mask=MASK))


def additive_mask_model() -> onnx.ModelProto:
    """Softmax(MatMul(x) + const_mask) -> MatMul, the mask holding -3.4e38 for masked columns."""
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    h = b.op("MatMul", x, b.weight("w1", [8, 8]), name="mm1")
    mask = np.zeros((2, 8), np.float32)
    mask[:, 6:] = -3.4e38
    a = b.op("Add", h, b.const("mask_bias", mask), name="mask_add")
    s = b.op("Softmax", a, name="softmax", axis=-1)
    b.output(b.op("MatMul", s, b.weight("w2", [8, 8]), name="mm2"))
    return b.build()


def test_overflowing_mask_constant_stays_exact_and_its_sum_is_saturated():
    """The attention-mask rule (tests/test_attention_masks.py has the cases): the constant keeps
    its fp32 value, the scores path runs fp16 and the Softmax input is clipped to +-65504."""
    model = additive_mask_model()
    converted, report = convert(model)
    assert precisions(report) == {"mm1": "fp16", "mask_add": "fp16", "softmax": "fp16",
                                  "mm2": "fp16"}
    tensor = initializer(converted, "mask_bias")
    assert tensor.data_type == FLOAT
    assert numpy_helper.to_array(tensor).min() == np.float32(-3.4e38)
    assert report.summary["constants_clamped"] == 0
    assert [n.op_type for n in converted.graph.node if n.op_type == "Clip"] == ["Clip"]
    assert [s["rule"] for s in report.structures] == ["attention_mask"]
    assert_close(model, converted, feeds_for(model))


def test_clamp_saturates_the_constant_and_lets_the_path_go_fp16():
    model = additive_mask_model()
    converted, report = convert(model, clamp=True)
    assert precisions(report) == {"mm1": "fp16", "mask_add": "fp16", "softmax": "fp16",
                                  "mm2": "fp16"}
    tensor = initializer(converted, "mask_bias")
    assert tensor.data_type == FLOAT16
    values = numpy_helper.to_array(tensor)
    assert values.min() == np.float16(-65504) and np.isfinite(values).all()
    assert np.count_nonzero(values == np.float16(-65504)) == 4
    assert report.summary["constants_clamped"] == 1
    assert count_casts(converted) == 2
    assert_close(model, converted, feeds_for(model))


def pass_changes(report) -> dict[str, int]:
    return {p["name"]: p["changed"] for p in report.passes}


def test_weights_read_only_in_low_precision_are_stored_low_before_any_cast():
    """convert_constant_inputs stores each weight its readers all want fp16 in fp16, in its own
    place and name: no cast of a weight is made for convert_constants to fold."""
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    h = b.op("MatMul", x, b.weight("w1", [8, 8]), name="mm1")
    h = b.op("Add", h, b.weight("bias", [8]), name="add")
    b.output(b.op("MatMul", b.op("Relu", h, name="relu"), b.weight("w2", [8, 4]), name="mm2"))
    model = b.build()
    converted, report = convert(model)
    assert [t.name for t in converted.graph.initializer] == ["w1", "bias", "w2"]
    assert {t.name: t.data_type for t in converted.graph.initializer} == {
        "w1": FLOAT16, "bias": FLOAT16, "w2": FLOAT16}
    assert pass_changes(report)["convert_constant_inputs"] == 3
    assert pass_changes(report)["insert_casts"] == 2  # the graph's input and output only
    assert pass_changes(report)["convert_constants"] == 0
    assert sorted((c["name"], c["action"]) for c in report.constants) == [
        ("bias", "converted"), ("w1", "converted"), ("w2", "converted")]
    assert_close(model, converted, feeds_for(model))


def test_a_weight_read_in_both_precisions_keeps_fp32_and_gets_a_low_copy():
    """A weight one fp32 node reads too is left to the casts: fp32 for that node, a converted
    copy for the fp16 ones (folded by convert_constants)."""
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    w = b.weight("w", [8, 8])
    low = b.op("MatMul", x, w, name="mm_low")
    kept = b.op("MatMul", x, w, name="mm_kept")
    b.output(b.op("Add", low, kept, name="add"))
    model = b.build()
    converted, report = convert(model, keep_nodes=["mm_kept"])
    assert precisions(report)["mm_low"] == "fp16" and precisions(report)["mm_kept"] == "fp32"
    types = {t.name: t.data_type for t in converted.graph.initializer}
    assert types.pop("w") == FLOAT and list(types.values()) == [FLOAT16]
    assert pass_changes(report)["convert_constant_inputs"] == 0
    assert pass_changes(report)["convert_constants"] == 1
    assert node_by_name(converted, "mm_low").input[1] in types
    assert_close(model, converted, feeds_for(model))


def test_tiny_weights_flush_to_zero_and_are_counted():
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    w = (np.random.default_rng(1).standard_normal((8, 8)) * 0.1).astype(np.float32)
    w[0, :3] = 1e-9
    w[1, 0] = -1e-9
    h = b.op("MatMul", x, b.const("w1", w), name="mm1")
    b.output(b.op("MatMul", h, b.weight("w2", [8, 8]), name="mm2"))
    model = b.build()
    converted, report = convert(model)
    assert report.summary["values_flushed_to_zero"] == 4
    record = next(c for c in report.constants if c["name"] == "w1")
    assert record["flushed_to_zero"] == 4 and record["action"] == "converted"
    values = numpy_helper.to_array(initializer(converted, "w1"))
    assert values.dtype == np.float16
    assert np.count_nonzero(values[0, :3]) == 0 and values[1, 0] == 0
    assert_close(model, converted, feeds_for(model))


def test_weight_shared_by_fp16_and_fp32_ops_is_copied_once():
    b = GraphBuilder()
    x = b.input("x", [8, 8])
    w = b.weight("w", [8, 8])
    h1 = b.op("MatMul", x, w, name="mm1")
    h2 = b.op("MatMul", h1, w, name="mm2")
    b.output(b.op("Add", b.op("Exp", w, name="exp_w"), h2, name="add"))
    model = b.build()
    converted, report = convert(model)
    assert precisions(report)["exp_w"] == "fp32"
    assert initializer(converted, "w").data_type == FLOAT
    low = [t for t in converted.graph.initializer if t.data_type == FLOAT16]
    assert len(low) == 1  # one fp16 copy shared by both MatMuls
    assert node_by_name(converted, "mm1").input[1] == node_by_name(converted, "mm2").input[1] \
        == low[0].name
    assert_close(model, converted, feeds_for(model))


# -- control flow --------------------------------------------------------------------------------
def loop_model() -> onnx.ModelProto:
    """state = MatMul(x); Loop 3x: state = Tanh(MatMul(state, w_loop)); MatMul(state)."""
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    h = b.op("MatMul", x, b.weight("w_in", [8, 8]), name="mm_in")
    w_loop = b.weight("w_loop", [8, 8], scale=0.3)  # outer-scope initializer read by the body
    body = b.subgraph("body")
    body.input("i", [], np.int64)
    body.input("cond", [], np.bool_)
    body.input("s_in", [2, 8])
    t = body.op("Tanh", body.op("MatMul", "s_in", w_loop, name="body/mm"), name="body/tanh")
    body.output(body.op("Identity", "cond", name="body/cond"), dtype=np.bool_, shape=[])
    body.output(t, dtype=np.float32, shape=[2, 8])
    out = b.op("Loop", b.const("trip", np.array(3, np.int64)), "", h, name="loop",
               body=body.graph())
    b.output(b.op("MatMul", out, b.weight("w_out", [8, 8]), name="mm_out"), shape=[2, 8])
    return b.build()


def _body(model: onnx.ModelProto) -> onnx.GraphProto:
    return next(a.g for a in node_by_name(model, "loop").attribute if a.name == "body")


def test_loop_body_matmul_on_outer_initializer_goes_fp16():
    model = loop_model()
    converted, report = convert(model)
    got = precisions(report)
    assert got["body/mm"] == "fp16" and got["body/tanh"] == "fp16"
    assert got["loop"] == "fp16" and got["mm_in"] == "fp16" and got["mm_out"] == "fp16"
    assert report.node("body/mm")["graph"] == "loop/body"
    body = _body(converted)
    carried_in = body.input[2].type.tensor_type.elem_type
    carried_out = body.output[1].type.tensor_type.elem_type
    assert carried_in == carried_out == FLOAT16
    assert initializer(converted, "w_loop").data_type == FLOAT16
    # No cast inside the body or around the Loop: only the graph input and output casts.
    assert not any(n.op_type == "Cast" for n in body.node)
    assert count_casts(converted) == 2
    assert_close(model, converted, feeds_for(model))


def test_loop_with_deny_op_in_body_keeps_carried_dtype_consistent():
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    body = b.subgraph("body")
    body.input("i", [], np.int64)
    body.input("cond", [], np.bool_)
    body.input("s_in", [2, 8])
    mm = body.op("MatMul", "s_in", b.weight("w_loop", [8, 8]), name="body/mm")
    t = body.op("Tanh", body.op("Exp", mm, name="body/exp"), name="body/tanh")
    body.output(body.op("Identity", "cond", name="body/cond"), dtype=np.bool_, shape=[])
    body.output(t, dtype=np.float32, shape=[2, 8])
    body.output(mm, dtype=np.float32, shape=[2, 8])  # a scan output
    final, stacked = b.op("Loop", b.const("trip", np.array(3, np.int64)), "", x, name="loop",
                          outputs=2, body=body.graph())
    b.output(final, shape=[2, 8])
    b.output(stacked, shape=[3, 2, 8])
    model = b.build()
    converted, report = convert(model)
    got = precisions(report)
    assert got["body/exp"] == "fp32" and got["body/tanh"] == "fp32" and got["body/mm"] == "fp16"
    body = _body(converted)
    assert body.input[2].type.tensor_type.elem_type == body.output[1].type.tensor_type.elem_type
    assert [o.name for o in converted.graph.output] == list(o.name for o in model.graph.output)
    assert [output_type(converted, i) for i in range(2)] == [FLOAT, FLOAT]
    assert_close(model, converted, feeds_for(model))


def test_if_branches_share_the_output_dtype():
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    cond = b.input("c", [], np.bool_)
    h = b.op("MatMul", x, b.weight("w1", [8, 8]), name="mm1")
    then = b.subgraph("then")
    then.output(then.op("Relu", then.op("MatMul", h, b.weight("wt", [8, 8]), name="then/mm"),
                        name="then/relu"), dtype=np.float32, shape=[2, 8])
    other = b.subgraph("else")
    other.output(other.op("Exp", h, name="else/exp"), dtype=np.float32, shape=[2, 8])
    out = b.op("If", cond, name="if", then_branch=then.graph(), else_branch=other.graph())
    b.output(b.op("MatMul", out, b.weight("w2", [8, 8]), name="mm2"), shape=[2, 8])
    model = b.build()
    converted, report = convert(model)
    got = precisions(report)
    assert got["if"] == "fp16" and got["then/mm"] == "fp16" and got["else/exp"] == "fp32"
    branches = {a.name: a.g for a in node_by_name(converted, "if").attribute}
    assert branches["then_branch"].output[0].type.tensor_type.elem_type == FLOAT16
    assert branches["else_branch"].output[0].type.tensor_type.elem_type == FLOAT16
    assert output_type(converted) == FLOAT
    for flag in (True, False):
        assert_close(model, converted, feeds_for(model, c=np.array(flag)))


def test_report_names_of_unnamed_nodes_are_unique():
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    cond = b.input("c", [], np.bool_)
    branches = {}
    for label in ("then", "else"):
        sub = b.subgraph(label)
        sub.output(sub.op("MatMul", x, b.weight(f"w_{label}", [8, 8])), shape=[2, 8],
                   dtype=np.float32)
        for node in sub.nodes:
            node.name = ""
        branches[f"{label}_branch"] = sub.graph()
    b.output(b.op("If", cond, name="if", **branches), shape=[2, 8])
    model = b.build()
    _, report = convert(model)
    names = [n["name"] for n in report.nodes]
    assert len(names) == len(set(names)), names


# -- io types, determinism, input safety, report -------------------------------------------------
def test_keep_io_types_false_lowers_graph_inputs_and_outputs():
    model = allow_clear_allow()
    converted, _ = convert(model, keep_io_types=False)
    assert converted.graph.input[0].type.tensor_type.elem_type == FLOAT16
    assert output_type(converted) == FLOAT16
    assert count_casts(converted) == 0
    assert [o.name for o in converted.graph.output] == ["mm2"]
    assert_close(model, converted, feeds_for(model))  # run() feeds float16


def test_keep_io_types_false_keeps_an_input_fp32_when_an_fp32_op_reads_it():
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    b.output(b.op("MatMul", x, b.weight("w", [8, 8]), name="mm"), b.op("Exp", x, name="exp"))
    model = b.build()
    converted, _ = convert(model, keep_io_types=False)
    assert converted.graph.input[0].type.tensor_type.elem_type == FLOAT
    assert [output_type(converted, i) for i in range(2)] == [FLOAT16, FLOAT]
    assert_close(model, converted, feeds_for(model))


@pytest.mark.parametrize("build", [allow_clear_allow, grappler_example, loop_model,
                                   custom_op_model, mask_mul_model])
def test_conversion_is_deterministic(build):
    first, report1 = convert(build())
    second, report2 = convert(build())
    assert first.SerializeToString() == second.SerializeToString()
    assert first.SerializeToString(deterministic=True) == \
        second.SerializeToString(deterministic=True)
    assert report1.to_json() == report2.to_json()


@pytest.mark.parametrize("build", [allow_clear_allow, grappler_example, loop_model,
                                   custom_op_model, mask_mul_model])
def test_convert_does_not_modify_its_input(build):
    """The in-memory model is read, not copied (see test_ir_roundtrip): every byte stays, and
    the result is what converting a private copy in place gives."""
    model = build()
    before = model.SerializeToString()
    converted, _ = convert(model)
    assert model.SerializeToString() == before
    assert converted is not model
    on_copy, _, _ = convert_model_ir(model, amp_rewriter.OnnxOptions())
    assert converted.SerializeToString() == on_copy.SerializeToString()
    converted.graph.node[0].name = "changed"  # and the result shares nothing with the input
    assert model.SerializeToString() == before


def test_converting_a_converted_model_changes_nothing():
    model = three_matmuls()
    once, _ = convert(model)
    twice, _ = convert(once)
    assert twice.SerializeToString() == once.SerializeToString()


def test_report_explains_every_node():
    model = grappler_example()
    _, report = convert(model)
    assert [n["name"] for n in report.nodes] == [n.name for n in model.graph.node]
    for entry in report.nodes:
        assert {"name", "op", "precision", "class", "reason"} <= entry.keys()
        assert entry["precision"] in ("fp16", "fp32")
        assert entry["class"] in ("allow", "infer", "deny", "clear", "fp32")
        assert entry["reason"]
    tainted = report.node("infer2")
    assert tainted["class"] == "infer" and tainted["precision"] == "fp32"
    assert "deny op deny (Exp)" in tainted["reason"]
    # The via links lead back to the deny op, and explain prints that chain.
    via = tainted["groups"][0]["via"]
    assert via["node"] in ("clear1", "infer1", "deny")
    text = explain_text(report, "infer2")
    assert "because deny (Exp, T): fp32" in text
    assert report.summary["nodes"] == 7
    assert report.summary["low_precision_nodes"] == 2
    assert report.summary["casts_inserted"] == 2


def test_duplicate_casts_already_in_the_model_are_merged():
    """Exporters sometimes cast one value to one dtype twice; the converted model keeps one."""
    b = GraphBuilder(opset=17)
    ids = b.input("ids", [2, 4], dtype=TensorProto.INT64)
    first = b.op("Cast", ids, to=TensorProto.FLOAT, name="cast_a")
    second = b.op("Cast", ids, to=TensorProto.FLOAT, name="cast_b")
    b.output(b.op("Add", first, second, name="add"))
    converted, _report = convert(b.build())
    onnx.checker.check_model(converted, full_check=True)
    casts_of_ids = [n for n in converted.graph.node if n.op_type == "Cast" and n.input[0] == "ids"]
    assert len(casts_of_ids) == 1


def test_custom_op_output_without_value_info_gets_a_cast_before_fp16_consumers():
    """A com.microsoft op's output has no declared dtype: it is taken as its consumer's fp32."""
    nodes = [helper.make_node("Gelu", ["x"], ["g"], domain="com.microsoft", name="gelu"),
             helper.make_node("MatMul", ["g", "w"], ["o"], name="mm")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    converted, report = convert(model)
    assert precisions(report)["mm"] == "fp16"
    (cast,) = casts_reading(converted, "g")
    assert cast_to(cast) == FLOAT16
    feeds = {"x": np.linspace(-2, 2, 8, dtype=np.float32).reshape(2, 4)}
    assert_close(model, converted, feeds, 1e-2)


def test_a_divisor_that_would_flush_to_zero_stays_fp32():
    """y * eps / eps with eps = 1e-9: in fp16 eps is 0 and every output would be NaN."""
    b = GraphBuilder(opset=17)
    x = b.input("x", [2, 4])
    eps = b.const("eps", np.full([4], 1e-9, np.float32))
    y = b.op("MatMul", x, b.weight("w", [4, 4]), name="mm")
    scaled = b.op("Mul", y, eps, name="mul")
    back = b.op("Div", scaled, eps, name="div")
    b.output(b.op("MatMul", back, b.weight("w2", [4, 4]), name="mm2"))
    model = b.build()
    converted, report = convert(model)
    assert precisions(report)["div"] == "fp32" and precisions(report)["mul"] == "fp32"
    assert "flush to zero" in report.node("mul")["reason"]
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)}
    assert_close(model, converted, feeds, 2e-2)


@pytest.mark.parametrize("opset", [13, 14, 18])
def test_identity_between_allow_ops_converts_at_every_opset(opset):
    """Identity's constraint admits sequences from opset 14 on; tensors still convert."""
    b = GraphBuilder(opset=opset)
    x = b.input("x", [2, 4])
    h = b.op("MatMul", x, b.weight("w", [4, 4]), name="mm1")
    i = b.op("Identity", h, name="id")
    b.output(b.op("MatMul", i, b.weight("w2", [4, 4]), name="mm2"))
    converted, report = convert(b.build())
    assert precisions(report)["id"] == "fp16"
    assert count_casts(converted) == 2


def test_int_to_float_cast_read_by_fp16_and_fp32_ops_is_not_cast_twice():
    b = GraphBuilder(opset=17)
    ix = b.input("ix", [2, 4], dtype=TensorProto.INT64)
    fx = b.op("Cast", ix, to=TensorProto.FLOAT, name="c")
    y = b.op("MatMul", fx, b.weight("w", [4, 4]), name="mm")
    b.output(b.op("Add", y, fx, name="add"))
    converted, _report = convert(b.build())
    for node in converted.graph.node:
        if node.op_type == "Cast":
            assert producers(converted).get(node.input[0]) is None or \
                producers(converted)[node.input[0]].op_type != "Cast", "cast of a cast"


def test_api_takes_a_single_string_and_refuses_conflicting_classes():
    model = allow_clear_allow()
    _converted, report = convert(model, keep_nodes="mm2")
    assert precisions(report)["mm2"] == "fp32"
    with pytest.raises(amp_rewriter.AmpError, match="both name"):
        convert(model, allow=["Relu"], deny=["Relu"])


def test_a_divisor_that_partly_flushes_keeps_the_division_fp32():
    """relu(x @ w) / c with one element of c (1e-9) below fp16's smallest subnormal: in fp16 that
    element is 0, and 0 / 0 is NaN where fp32 gives 0, so the Div stays fp32 (the TF twin is in
    tests/tf)."""
    b = GraphBuilder(opset=17)
    x = b.input("x", [2, 4])
    c = b.const("c", np.array([1.0, 1e-9, 2.0, 4.0], np.float32))
    y = b.op("Relu", b.op("MatMul", x, b.weight("w", [4, 4]), name="mm"), name="relu")
    q = b.op("Tanh", b.op("Div", y, c, name="div"), name="tanh")
    b.output(b.op("MatMul", q, b.weight("w2", [4, 4]), name="mm2"))
    model = b.build()
    converted, report = convert(model)
    entry = report.node("div")
    assert entry["precision"] == "fp32" and entry["kind"] == "constant_range"
    assert "a divisor" in entry["reason"]
    assert precisions(report)["mm"] == "fp16"
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)}
    assert_close(model, converted, feeds, 2e-2)
