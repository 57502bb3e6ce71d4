"""Structural rules (amp_rewriter/passes/structures/) on tiny graphs: tanh-GELU's cube
in low precision, index math kept fp32, and the config's producer/consumer pattern rules.
Converted models run with real fp16 rounding (`run_as_fp16`) against fp32 in onnxruntime.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

import amp_rewriter  # noqa: E402
from amp_rewriter import AmpError  # noqa: E402
from amp_rewriter.cli import main  # noqa: E402
from amp_rewriter.formats.onnx.check import check_model  # noqa: E402
from testkit.builder import GraphBuilder, check, count_casts, precisions, run, run_as_fp16  # noqa: E402
from testkit.models import BUILDERS  # noqa: E402

SQRT_2_OVER_PI = float(np.sqrt(2 / np.pi))


#: A backend whose profile lets the RMS norm's rescaled fp16 statistic be built (ort-cuda rules
#: it out: its fp16 ReduceMax was measured slow and wrong, see onnx.toml).
RESCALING_BACKEND = "ort-cpu"


def convert(model: onnx.ModelProto, **options):
    converted, report = amp_rewriter.convert(model, **options)
    check(converted)
    return converted, report


# -- tanh-GELU ------------------------------------------------------------------------------------
def gelu_mlp(exponent: float = 3.0, c1: float = 0.044715, cube_readers: int = 1) -> onnx.ModelProto:
    """x -> MatMul(I) -> tanh-GELU as GPT-2 exports it -> MatMul(I); identities keep x visible."""
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    eye = b.const("eye", np.eye(8, dtype=np.float32))
    h = b.op("MatMul", x, eye, name="fc")
    half = b.op("Mul", h, b.const("c_half", np.float32(0.5)), name="half")
    cube = b.op("Pow", h, b.const("three", np.float32(exponent)), name="cube")
    scaled = b.op("Mul", cube, b.const("c1", np.float32(c1)), name="scale_cube")
    inner = b.op("Add", h, scaled, name="inner")
    arg = b.op("Mul", inner, b.const("c2", np.float32(SQRT_2_OVER_PI)), name="scale_inner")
    t = b.op("Tanh", arg, name="tanh")
    one_plus = b.op("Add", t, b.const("c_one", np.float32(1)), name="one_plus")
    gelu = b.op("Mul", half, one_plus, name="gelu")
    b.output(b.op("MatMul", gelu, eye, name="proj"))
    if cube_readers > 1:
        b.output(b.op("Relu", cube, name="cube_reader"))
    return b.build()


def test_tanh_gelu_cube_runs_fp16_with_its_reason():
    model = gelu_mlp()
    converted, report = convert(model)
    decided = precisions(report)
    assert set(decided.values()) == {"fp16"}, decided
    entry = report.node("cube")  # infer by structure, then painted between the MatMuls
    assert entry["class"] == "infer" and "tanh(+-inf) = +-1" in entry["class_reason"]
    assert [s["rule"] for s in report.structures] == ["tanh_gelu_cube"]
    assert count_casts(converted) == 2  # only at the graph input and output


def test_tanh_gelu_overflow_of_the_cube_gives_the_right_limits():
    """x = +-60: x^3 = +-216000 overflows fp16 to +-inf; GELU is still x (or 0), as in fp32."""
    model = gelu_mlp()
    converted, _ = convert(model)
    x = np.array([[60, -60, 45, -45, 3, -3, 0.5, 100], [-100, 41, -41, 7, 0, 12, -12, 1]],
                 np.float32)
    expected = run(model, {"x": x})[0]
    actual = run_as_fp16(converted, {"x": x})[0]
    assert np.isfinite(actual).all()
    np.testing.assert_allclose(actual, expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("variant", [{"exponent": 2.0}, {"c1": -0.044715}, {"cube_readers": 2}],
                         ids=["square", "negative-scale", "cube-read-twice"])
def test_pow_outside_the_tanh_gelu_structure_stays_deny(variant):
    model = gelu_mlp(**variant)
    _, report = convert(model)
    assert precisions(report)["cube"] == "fp32"
    assert report.node("cube")["kind"] == "op_list"
    assert report.structures == []


def test_check_accepts_the_tanh_gelu_cube(tmp_path):
    model = gelu_mlp()
    converted, _ = convert(model)
    path = tmp_path / "gelu16.onnx"
    onnx.save(converted, str(path))
    result = check_model(path)
    assert result.ok, result.problems
    assert any("tanh-GELU" in note for note in result.notes)


def test_user_deny_of_pow_wins_over_the_tanh_gelu_rule():
    _, report = convert(gelu_mlp(), deny=["Pow"])
    assert precisions(report)["cube"] == "fp32"
    assert report.node("cube")["kind"] == "user_override"


# -- index math -----------------------------------------------------------------------------------
def length_model() -> onnx.ModelProto:
    """Frames after a stride-2 conv, from a float length: Floor((len - 3) / 2 + 1) -> int64,
    beside an activation path (MatMul -> Greater -> Where, a leaky ReLU)."""
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    lengths = b.input("lengths", [2])
    h = b.op("MatMul", x, b.weight("w", [8, 8]), name="mm")
    positive = b.op("Greater", h, b.const("zero", np.float32(0)), name="positive")
    leaky = b.op("Where", positive, h, b.op("Mul", h, b.const("slope", np.float32(0.1)),
                                            name="slope_mul"), name="leaky")
    b.output(b.op("MatMul", leaky, b.weight("w2", [8, 8]), name="mm2"))
    shifted = b.op("Sub", lengths, b.const("kernel_minus_pad", np.float32(3)), name="shifted")
    halved = b.op("Div", shifted, b.const("stride", np.float32(2)), name="halved")
    plus_one = b.op("Add", halved, b.const("one", np.float32(1)), name="plus_one")
    frames = b.op("Floor", plus_one, name="floor")
    b.output(b.op("Cast", frames, name="frames", to=onnx.TensorProto.INT64))
    return b.build()


def test_float_length_arithmetic_stays_fp32_even_when_its_ops_are_allowed():
    """With Sub/Div/Add/Floor forced onto the allow list, the length formula would run fp16,
    where 4099 rounds to 4100; the index-math rule keeps it fp32 and the frame counts exact."""
    model = length_model()
    converted, report = convert(model, allow=["Sub", "Div", "Add", "Floor"])
    decided = precisions(report)
    for name in ("shifted", "halved", "plus_one", "floor"):
        assert decided[name] == "fp32", name
        assert report.node(name)["kind"] == "structure"
    assert "computes a shape, length or index (used by floor (Floor))" in report.node("halved")["reason"]
    # The activation path's comparison is not index math: it runs fp16.
    assert decided["positive"] == decided["leaky"] == decided["mm"] == "fp16"
    feeds = {"x": np.ones((2, 8), np.float32), "lengths": np.array([4099, 6001], np.float32)}
    expected = run(model, feeds)[1]
    np.testing.assert_array_equal(run_as_fp16(converted, feeds)[1], expected)
    np.testing.assert_array_equal(expected, [2049, 3000])


def test_position_buckets_from_integer_positions_stay_fp32():
    """T5-style: integer positions -> float -> Log -> scale -> Cast to int64 (bucket index)."""
    b = GraphBuilder()
    positions = b.input("positions", [6], np.int64)
    as_float = b.op("Cast", positions, name="to_float", to=onnx.TensorProto.FLOAT)
    logged = b.op("Log", as_float, name="log")
    scaled = b.op("Mul", logged, b.const("c_scale", np.float32(7.3)), name="scale")
    b.output(b.op("Cast", scaled, name="bucket", to=onnx.TensorProto.INT64))
    model = b.build()
    _, report = convert(model, allow=["Log", "Mul"])
    decided = precisions(report)
    assert decided["log"] == decided["scale"] == "fp32"
    assert [s["rule"] for s in report.structures] == ["index_math"]


# -- pattern rules --------------------------------------------------------------------------------
def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rules.toml"
    path.write_text(text)
    return path


def test_pattern_rule_keeps_the_matmul_that_feeds_softmax_fp32(tmp_path):
    config = write_config(tmp_path, """
[[rules]]
op = "MatMul"
feeds = "Softmax"
through = ["Div", "Add"]
precision = "fp32"
""")
    _, report = convert(BUILDERS["transformer_block"](), config=config)
    decided = precisions(report)
    assert decided["attn/scores"] == "fp32"
    assert report.node("attn/scores")["kind"] == "user_override"
    assert "MatMul that feeds Softmax through Add/Div -> fp32" in report.node("attn/scores")["reason"]
    others = [e for e in report.nodes if e["op"] == "MatMul" and e["name"] != "attn/scores"]
    assert others and all(e["precision"] == "fp16" for e in others)
    assert [s["nodes"] for s in report.structures if s["rule"] == "pattern_rule"] == [["attn/scores"]]


def test_pattern_rule_leaves_pinned_nodes_pinned(tmp_path):
    config = write_config(tmp_path, '[[rules]]\nop = "Pow"\nfed_by = "MatMul"\nclass = "allow"\n')
    _, report = convert(gelu_mlp(exponent=2.0), config=config, keep_nodes=["cube"])
    assert precisions(report)["cube"] == "fp32"
    assert report.node("cube")["reason"].startswith("pinned to fp32 by --keep-node")


def test_pattern_rule_without_through_matches_direct_consumers_only(tmp_path):
    config = write_config(tmp_path, '[[rules]]\nop = "MatMul"\nfeeds = "Softmax"\n'
                                    'precision = "fp32"\n')
    _, report = convert(BUILDERS["transformer_block"](), config=config)
    assert precisions(report)["attn/scores"] == "fp16"  # a Div and an Add stand between


def test_pattern_rule_by_producer_and_name_sets_a_class(tmp_path):
    config = write_config(tmp_path, """
[[rules]]
op = "Pow"
fed_by = "MatMul"
name = "cu.*"
class = "infer"
""")
    model = gelu_mlp(exponent=2.0)  # not a tanh-GELU cube: deny unless a rule says otherwise
    _, report = convert(model, config=config)
    assert precisions(report)["cube"] == "fp16"
    entry = report.node("cube")
    assert entry["class"] == "infer" and entry["class_reason"].startswith("pattern rule: Pow")


@pytest.mark.parametrize(("text", "message"), [
    ('[[rules]]\nfeeds = "Softmax"\nprecision = "fp32"\n', "'op'"),
    ('[[rules]]\nop = "MatMul"\nfeeds = "Softmax"\n', "exactly one of 'precision'"),
    ('[[rules]]\nop = "MatMul"\nfeeds = "Softmax"\nprecision = "fp32"\nclass = "allow"\n',
     "exactly one of 'precision'"),
    ('[[rules]]\nop = "MatMul"\nfeeds = "Softmax"\nprecision = "fp16"\n', "not supported"),
    ('[[rules]]\nop = "MatMul"\nfeeds = "Softmax"\nclass = "always"\n', "not one of"),
    ('[[rules]]\nop = "MatMul"\nprecision = "fp32"\n', "needs 'feeds', 'fed_by' or 'name'"),
    ('[[rules]]\nop = "MatMul"\nfeeds = 3\nprecision = "fp32"\n', "'feeds' must be"),
    ('[[rules]]\nop = "MatMul"\nname = "(unclosed"\nprecision = "fp32"\n', "not a valid regex"),
    ('[[rules]]\nop = "MatMul"\nfeed = "Softmax"\nprecision = "fp32"\n', "unknown key(s) 'feed'"),
    ('rules = "MatMul"\n', "array of tables"),
])
def test_bad_pattern_rules_are_one_line_errors(tmp_path, text, message):
    config = write_config(tmp_path, text)
    with pytest.raises(AmpError, match=None) as caught:
        amp_rewriter.Options(config=config)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert "rules.toml" in str(caught.value)


def test_bad_pattern_rule_on_the_cli_exits_2(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    model.write_bytes(BUILDERS["transformer_block"]().SerializeToString())
    config = write_config(tmp_path, '[[rules]]\nop = "MatMul"\nprecision = "fp32"\n')
    out = tmp_path / "out.onnx"
    assert main(["convert", str(model), str(out), "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs 'feeds'" in err
    assert not out.exists()


# -- RMS norm -------------------------------------------------------------------------------------
def rms_norm_block(form: str = "reciprocal", eps: float = 1e-6, identity_cast: bool = False,
                   opset: int = 17, constant_shape: tuple[int, ...] = ()) -> onnx.ModelProto:
    """x -> MatMul -> h; RMSNorm(h) as exports write it -> MatMul -> residual Add(h, .) -> MatMul.
    From opset 18 on, the mean takes its axes as an input (torch's exports: a Constant node).
    `constant_shape`: the shape of the exponent 2 and of eps (one element each)."""
    b = GraphBuilder(opset=opset)
    x = b.input("x", [2, 3, 8])
    eye = b.const("eye", np.eye(8, dtype=np.float32))
    h = b.op("MatMul", x, eye, name="fc")
    hx = b.op("Cast", h, to=onnx.TensorProto.FLOAT, name="to_float") if identity_cast else h
    square = b.op("Pow", hx, b.const("two", np.full(constant_shape, 2, np.float32)),
                  name="square")
    if opset >= 18:
        axes = b.op("Constant", value=onnx.numpy_helper.from_array(np.array([-1], np.int64)),
                    name="axes")
        mean = b.op("ReduceMean", square, axes, name="mean")
    else:
        mean = b.op("ReduceMean", square, axes=[-1], name="mean")
    shifted = b.op("Add", mean, b.const("eps", np.full(constant_shape, eps, np.float32)),
                   name="add_eps")
    root = b.op("Sqrt", shifted, name="root")
    if form == "reciprocal":
        normed = b.op("Mul", hx, b.op("Reciprocal", root, name="inverse"), name="scale")
    elif form == "one_over":
        inverse = b.op("Div", b.const("one", np.float32(1)), root, name="inverse")
        normed = b.op("Mul", inverse, hx, name="scale")
    else:
        normed = b.op("Div", hx, root, name="scale")
    weighted = b.op("Mul", normed, b.const("gamma", np.full(8, 0.5, np.float32)), name="gamma_mul")
    proj = b.op("MatMul", weighted, eye, name="proj")
    residual = b.op("Add", hx, proj, name="residual")
    b.output(b.op("MatMul", residual, eye, name="head"))
    return b.build()


def test_rms_norm_with_constants_that_raise_the_rank_is_left_alone():
    """A one-element exponent and eps of shape [1, 1, 1, 1] broadcast the norm (and the model's
    output) to rank 4; the rescaled statistic, rebuilt without them, would lose that. The rule
    takes constants of rank 0 or 1 only."""
    model = rms_norm_block(constant_shape=(1, 1, 1, 1))
    converted, report = convert(model, backend=RESCALING_BACKEND)  # the checker's full check passes
    assert all(s["rule"] != "rms_norm" for s in report.structures)
    x = _rms_rows() / 1000
    assert run(converted, {"x": x})[0].shape == run(model, {"x": x})[0].shape == (1, 2, 3, 8)
    # A [1] exponent and eps keep the rank: the rule applies as to scalars.
    _, report = convert(rms_norm_block(constant_shape=(1,)))
    assert [s["rule"] for s in report.structures] == ["rms_norm"]


@pytest.mark.parametrize("eps,whole", [(6e7, True), (1e8, False)])
def test_rms_norm_inverse_root_runs_low_only_while_its_floor_is_finite(eps, whole):
    """The whole statistic in fp16 needs the clip's floor, 8 sqrt(eps), to be a finite fp16
    number (8 sqrt(1e8) = 8e4 is not): above that eps the inverse root stays fp32, and no
    constant of the converted model is infinite."""
    model = rms_norm_block(eps=eps)
    converted, report = convert(model, backend=RESCALING_BACKEND)
    detail = next(s["detail"] for s in report.structures if s["rule"] == "rms_norm")
    assert ("run in fp16" in detail) == whole, detail
    floats = [onnx.numpy_helper.to_array(t).astype(np.float64) for t in converted.graph.initializer
              if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)]
    assert all(np.isfinite(values).all() for values in floats)
    x = _rms_rows() / 1000
    assert_close_per_row(run(converted, {"x": x})[0], run(model, {"x": x})[0], 1e-2)


def _rms_rows() -> np.ndarray:
    """Rows whose squares overflow fp16 (1000^2 > 65504), rows whose squares underflow it
    (1e-3^2 < 2^-24), one dominated by a single element, and an all-zero row."""
    x = np.zeros((2, 3, 8), np.float32)
    x[0, 0] = np.linspace(-1000, 1000, 8)
    x[0, 1] = np.linspace(-1e-3, 2e-3, 8)
    x[0, 2] = [30000, 1e-2, -1e-2, 0.5, -0.5, 1, 2, 3]
    x[1, 0] = np.random.default_rng(0).standard_normal(8) * 300
    x[1, 1] = 7.0
    return x  # x[1, 2] stays zero


def assert_close_per_row(actual: np.ndarray, expected: np.ndarray, tolerance: float) -> None:
    """Each element within `tolerance` of its row's largest |value| (rows differ by 1e6 here)."""
    scale = np.abs(expected).max(axis=-1, keepdims=True)
    worst = np.abs(actual - expected) - tolerance * scale
    assert (worst <= 0).all(), np.abs(actual - expected).max(axis=-1) / np.maximum(scale[..., 0],
                                                                                   1e-30)


def _fp32_tensors_of_row_shape(converted: onnx.ModelProto) -> list[str]:
    inferred = onnx.shape_inference.infer_shapes(converted)
    return [v.name for v in inferred.graph.value_info
            if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
            and [d.dim_value for d in v.type.tensor_type.shape.dim] == [2, 3, 8]]


@pytest.mark.parametrize("form,opset", [("reciprocal", 17), ("one_over", 17), ("div", 17),
                                        ("reciprocal", 18)])
def test_rms_norm_runs_its_mean_square_fp16_on_the_rescaled_row(form, opset):
    model = rms_norm_block(form, opset=opset)
    converted, report = convert(model, backend=RESCALING_BACKEND)
    decided = precisions(report)
    assert decided["residual"] == decided["gamma_mul"] == decided["proj"] == "fp16", decided
    # x * 1/sqrt(.): the inverse root is rebuilt in fp16 too; x / sqrt(.) keeps it fp32.
    whole = form != "div"
    assert decided["root"] == decided["add_eps"] == ("fp16" if whole else "fp32"), decided
    assert decided["scale"] == "fp16", decided
    assert [s["rule"] for s in report.structures] == ["rms_norm"]
    record = report.structures[0]
    assert "divided by 2^-7 of its largest |x|" in record["detail"] and record["added"]
    assert decided["square"] == decided["mean"] == "fp16", decided  # what replaced them
    assert "replaced by the rescaled mean square" in report.node("mean")["reason"]
    assert "scaling step of an RMS norm" in report.node("scale")["class_reason"]
    ops = [n.op_type for n in converted.graph.node]
    assert "Pow" not in ops and ops.count("ReduceMax") == 1 and ops.count("ReduceMean") == 1
    # No fp32 copy of the row: the statistics are fp32 on one value per row only, or not at all.
    assert _fp32_tensors_of_row_shape(converted) == []
    if whole:
        assert "replaced by the rescaled mean square" in report.node("add_eps")["reason"]
        assert "no fp32 tensor" in record["detail"]
        inferred = onnx.shape_inference.infer_shapes(converted)
        assert not [v.name for v in inferred.graph.value_info
                    if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT]
        assert {n.op_type for n in converted.graph.node} >= {"Sqrt", "Reciprocal"}
    # The graph's input and output (and, with an fp32 inverse root: the scaled mean and the
    # row's scale up, the inverse down).
    assert count_casts(converted) == (2 if whole else 5)
    x = _rms_rows()
    expected = run(model, {"x": x})[0]
    for actual in (run_as_fp16(converted, {"x": x})[0], run(converted, {"x": x})[0]):
        assert np.isfinite(actual).all()
        assert_close_per_row(actual, expected, 3e-3)


def test_rms_norm_keeps_its_statistics_fp32_where_the_backend_cannot_rescale():
    """bf16 on ORT's CPU provider has no kernels for the rescaled statistic's ops: the square
    and the mean stay fp32, reading the low-precision x through one cast."""
    model = rms_norm_block()
    converted, report = convert(model, target="bf16", backend="ort-cpu")
    assert "square overflows fp16" in report.structures[0]["detail"]
    assert "ReduceMax" not in [n.op_type for n in converted.graph.node]
    assert precisions(report)["square"] == "fp32"


def test_rms_norm_keeps_its_statistics_fp32_where_the_profile_rules_a_rescale_op_out():
    """ort-cuda's profile keeps ReduceMax out of rewrites (measured slow and wrong there): the
    statistics stay fp32, the explanation says which op and why, and the model's own ReduceMax
    nodes still run fp16 (the rule is about what a pass builds)."""
    converted, report = convert(rms_norm_block(), backend="ort-cuda")
    detail = report.structures[0]["detail"]
    assert "square overflows fp16" in detail and "ReduceMean: its fp16 kernel overflows" in detail, detail
    assert "ReduceMax" not in [n.op_type for n in converted.graph.node]
    assert precisions(report)["square"] == "fp32"
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    h = b.op("MatMul", x, b.const("eye", np.eye(8, dtype=np.float32)), name="fc")
    b.output(b.op("ReduceMax", b.op("Abs", h, name="abs"), axes=[-1], name="row_max"))
    _, own = convert(b.build(), backend="ort-cuda")
    assert precisions(own)["row_max"] == "fp16"


def test_rms_norm_keeps_its_statistics_fp32_on_fp16_without_the_rescale(monkeypatch):
    """The pre-rescale form, reached by dropping the pass from the pipeline: one cast of x
    into the fp32 statistics, one of the per-row scale out of them, plus the graph's input and
    output; squares that overflow fp16 stay exact."""
    from amp_rewriter.passes.pipeline import PIPELINES

    model = rms_norm_block()
    monkeypatch.setitem(PIPELINES, "onnx", [name for name in PIPELINES["onnx"]
                                            if name != "rescale_rms_statistics"])
    converted, report = convert(model, backend=RESCALING_BACKEND)
    decided = precisions(report)
    assert decided["square"] == decided["mean"] == decided["root"] == "fp32", decided
    assert count_casts(converted) == 4
    x = _rms_rows()
    expected = run(model, {"x": x})[0]
    actual = run_as_fp16(converted, {"x": x})[0]
    assert np.isfinite(actual).all()
    assert_close_per_row(actual, expected, 3e-3)


def test_rms_norm_with_an_eps_too_small_for_fp16_keeps_its_scaling_fp32():
    """1/sqrt(1e-12) = 1e6 > 65504: an all-zero row would scale by inf in fp16."""
    model = rms_norm_block(eps=1e-12)
    converted, report = convert(model, backend=RESCALING_BACKEND)
    decided = precisions(report)
    assert decided["scale"] == decided["root"] == "fp32", decided
    assert decided["square"] == "fp16", decided  # the mean square is still rescaled
    assert decided["residual"] == "fp16"
    assert "outside fp16's normal range" in report.node("scale")["reason"]
    x = np.zeros((2, 3, 8), np.float32)
    x[0] = 1e-4
    expected = run(model, {"x": x})[0]
    actual = run_as_fp16(converted, {"x": x})[0]
    assert np.isfinite(actual).all()
    np.testing.assert_allclose(actual, expected, rtol=3e-3, atol=3e-3 * np.abs(expected).max())


def test_identity_cast_before_an_rms_norm_is_dropped_so_the_residual_runs_fp16():
    model = rms_norm_block(identity_cast=True)
    converted, report = convert(model, backend=RESCALING_BACKEND)
    assert "to_float" not in {n.name for n in converted.graph.node}
    assert precisions(report)["residual"] == "fp16"
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    np.testing.assert_allclose(run_as_fp16(converted, {"x": x})[0], run(model, {"x": x})[0],
                               rtol=5e-3, atol=5e-3)


def test_a_norm_like_step_without_an_epsilon_is_not_an_rms_norm():
    """Without +eps the pattern is not recognised: the square stays deny, an fp32 barrier."""
    _, report = convert(rms_norm_block(eps=0.0), backend=RESCALING_BACKEND)
    assert precisions(report)["square"] == "fp32"
    assert report.node("square")["kind"] == "op_list"
    assert report.structures == []


def test_symbolic_shape_inference_follows_the_rescaled_norm_at_opset_18():
    """ORT's symbolic shape inference (the cost summary's, for models with contrib ops) has no
    rule for ReduceMax with axes as an input; ours adds it, so shapes go on past the norm."""
    from amp_rewriter.formats.onnx.shapes import _symbolic_shapes

    converted, _ = convert(rms_norm_block(opset=18), backend=RESCALING_BACKEND)
    assert "ReduceMax" in [n.op_type for n in converted.graph.node]
    inferred = _symbolic_shapes(converted)
    shaped = {v.name for v in inferred.graph.value_info if v.type.tensor_type.HasField("shape")}
    outputs = {o for n in converted.graph.node for o in n.output}
    assert outputs - {o.name for o in converted.graph.output} <= shaped


def test_rms_rescale_keeps_fp32s_nonfinite_pattern_and_long_rows_exact():
    """An infinite element: NaN there only and 0 elsewhere, as fp32 gives (the row's scale is
    clipped to a finite number). A row of 384000 elements with one large element: its mean
    square stays a normal fp16 number (squares scaled up to 2^14, not to 1)."""
    b = GraphBuilder()
    x_in = b.input("x", [2, 8])
    shift = b.input("shift", [8])
    h = b.op("Add", b.op("MatMul", x_in, b.const("eye8", np.eye(8, dtype=np.float32)),
                         name="fc"), shift, name="shifted")
    mean = b.op("ReduceMean", b.op("Pow", h, b.const("two", np.float32(2)), name="square"),
                axes=[-1], name="mean")
    root = b.op("Sqrt", b.op("Add", mean, b.const("eps", np.float32(1e-6)), name="add_eps"),
                name="root")
    normed = b.op("Div", h, root, name="scale")
    b.output(normed)
    b.output(b.op("MatMul", normed, b.const("eye8b", np.eye(8, dtype=np.float32)), name="proj"))
    inf_model = b.build()
    inf_converted, _ = convert(inf_model, backend=RESCALING_BACKEND)
    assert "ReduceMax" in [n.op_type for n in inf_converted.graph.node]
    feeds = {"x": np.arange(16, dtype=np.float32).reshape(2, 8),
             "shift": np.array([0, 0, 0, np.inf, 0, 0, 0, 0], np.float32)}
    expected = run(inf_model, feeds)[0]
    assert np.isnan(expected).sum() == 2
    for actual in (run_as_fp16(inf_converted, feeds)[0], run(inf_converted, feeds)[0]):
        np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    b = GraphBuilder(opset=18)
    x_in = b.input("x", [1, 384, 1000])
    h = b.op("MatMul", x_in, b.const("eye", np.eye(1000, dtype=np.float32)), name="fc")
    square = b.op("Mul", h, h, name="square")
    mean = b.op("ReduceMean", square, b.const("axes", np.array([-2, -1], np.int64)),
                name="mean")
    root = b.op("Sqrt", b.op("Add", mean, b.const("eps", np.float32(1e-6)), name="add_eps"),
                name="root")
    b.output(b.op("Div", h, root, name="scale"))
    long_model = b.build()
    long_converted, _ = convert(long_model, backend=RESCALING_BACKEND)
    assert "ReduceMax" in [n.op_type for n in long_converted.graph.node]
    row = np.zeros((1, 384, 1000), np.float32)
    row[0, 0, 0] = 1000.0
    expected = run(long_model, {"x": row})[0]
    actual = run_as_fp16(long_converted, {"x": row})[0]
    assert abs(actual[0, 0, 0] - expected[0, 0, 0]) <= 2e-3 * expected[0, 0, 0]


def test_rms_norms_sharing_a_mean_each_keep_their_statistics_fp32():
    """Two norms (eps 1e-6 and 1e-5) read one mean square: the second's +eps, root and inverse
    stay fp32 too (the mean square of a row holding 30000 overflows fp16)."""
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    h = b.op("MatMul", x, b.const("eye", np.eye(8, dtype=np.float32)), name="fc")
    mean = b.op("ReduceMean", b.op("Pow", h, b.const("two", np.float32(2)), name="square"),
                axes=[-1], name="mean")
    for index, eps in enumerate((1e-6, 1e-5)):
        root = b.op("Sqrt", b.op("Add", mean, b.const(f"eps{index}", np.float32(eps)),
                                 name=f"add_eps{index}"), name=f"root{index}")
        scaled = b.op("Mul", h, b.op("Reciprocal", root, name=f"inverse{index}"),
                      name=f"scale{index}")
        b.output(b.op("MatMul", scaled, b.const(f"eye{index}", np.eye(8, dtype=np.float32)),
                      name=f"proj{index}"))
    model = b.build()
    converted, report = convert(model, backend=RESCALING_BACKEND)
    decided = precisions(report)
    assert decided["add_eps1"] == decided["root1"] == decided["inverse1"] == "fp32", decided
    x_value = np.ones((2, 8), np.float32)
    x_value[0, 0] = 30000.0
    expected = run(model, {"x": x_value})
    for actual, wanted in zip(run_as_fp16(converted, {"x": x_value}), expected):
        assert_close_per_row(actual, wanted, 3e-3)


def test_rms_rescale_leaves_a_mean_that_is_a_graph_output_alone():
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    h = b.op("MatMul", x, b.const("eye", np.eye(8, dtype=np.float32)), name="fc")
    mean = b.op("ReduceMean", b.op("Pow", h, b.const("two", np.float32(2)), name="square"),
                axes=[-1], name="mean")
    root = b.op("Sqrt", b.op("Add", mean, b.const("eps", np.float32(1e-6)), name="add_eps"),
                name="root")
    b.output(b.op("Div", h, root, name="scale"))
    b.output(mean)
    model = b.build()
    converted, _ = convert(model, backend=RESCALING_BACKEND)
    assert "ReduceMax" not in [n.op_type for n in converted.graph.node]
    x_value = np.linspace(-500, 500, 16, dtype=np.float32).reshape(2, 8)
    for actual, wanted in zip(run_as_fp16(converted, {"x": x_value}), run(model, {"x": x_value})):
        np.testing.assert_allclose(actual, wanted, rtol=3e-3)


# -- rotary angles --------------------------------------------------------------------------------
#: A rotary embedding's frequencies, 10000^(-2i/d) for d = 8, as fp32 (what the model holds).
ROTARY_FREQUENCIES = (10000.0 ** -(np.arange(0, 8, 2) / 8)).astype(np.float32)
#: Positions from the start to where fp32 itself stops holding integers (2^24).
ROTARY_POSITIONS = np.array([[0, 1, 2047, 2049, 100003, 2**24 - 1]], np.int64)


def rotary_block(positions_dtype: Any = np.int64, angle_output: bool = False) -> onnx.ModelProto:
    """h = x @ I; emb = Concat(angle, angle), angle = float(positions[..., None]) * frequencies
    (as torch exports LLaMA's rotary embedding); out = (h * cos(emb) + h * sin(emb)) @ I; cos
    and sin are outputs too."""
    b = GraphBuilder(opset=17)
    x = b.input("x", [1, 6, 8])
    positions = b.input("positions", [1, 6], dtype=positions_dtype)
    eye = b.const("eye", np.eye(8, dtype=np.float32))
    h = b.op("MatMul", x, eye, name="q")
    column = b.op("Unsqueeze", positions, b.const("last", np.array([-1], np.int64)),
                  name="column")
    floats = b.op("Cast", column, to=onnx.TensorProto.FLOAT, name="to_float")
    angle = b.op("Mul", floats, b.const("inv_freq", ROTARY_FREQUENCIES), name="angle")
    emb = b.op("Concat", angle, angle, axis=-1, name="emb")
    cos = b.op("Cos", emb, name="cos")
    sin = b.op("Sin", emb, name="sin")
    rotated = b.op("Add", b.op("Mul", h, cos, name="q_cos"), b.op("Mul", h, sin, name="q_sin"),
                   name="rotated")
    b.output(b.op("MatMul", rotated, eye, name="out"), cos, sin)
    if angle_output:
        b.output(angle)
    return b.build()


def _exact_cos_sin(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of emb in float64, from the fp32 frequencies the model holds."""
    angle = positions[..., None].astype(np.float64) * ROTARY_FREQUENCIES.astype(np.float64)
    emb = np.concatenate([angle, angle], axis=-1)
    return np.cos(emb), np.sin(emb)


@pytest.mark.parametrize("positions_dtype", [np.int64, np.int32])
def test_rotary_angle_runs_fp16_reduced_modulo_two_pi_in_integers(positions_dtype):
    model = rotary_block(positions_dtype)
    converted, report = convert(model)
    decided = precisions(report)
    assert decided["emb"] == decided["cos"] == decided["sin"] == "fp16", decided
    assert [s["rule"] for s in report.structures] == ["rotary_angle"]
    record = report.structures[0]
    assert "reduced modulo 2*pi in int64" in record["detail"] and record["added"]
    assert "replaced by the angle reduced modulo 2*pi" in report.node("angle")["reason"]
    ops = [n.op_type for n in converted.graph.node]
    assert ops.count("Mod") == 2 and "to_float" not in {n.name for n in converted.graph.node}
    # No fp32 tensor between the positions and the rotation: the casts are x's, the three
    # outputs' and the reduced angle's (int32 positions: one more, to int64).
    inferred = onnx.shape_inference.infer_shapes(converted)
    fp32_inside = [v.name for v in inferred.graph.value_info
                   if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT]
    assert fp32_inside == [], fp32_inside
    assert count_casts(converted) == 5 + (positions_dtype == np.int32)
    x = np.random.default_rng(0).standard_normal((1, 6, 8)).astype(np.float32)
    feeds = {"x": x, "positions": ROTARY_POSITIONS.astype(positions_dtype)}
    exact_cos, exact_sin = _exact_cos_sin(ROTARY_POSITIONS)
    for out, cos, sin in (run_as_fp16(converted, feeds), run(converted, feeds)):
        # 2^-10 rad for the angle, plus fp16's rounding of cos and sin, at every position.
        assert np.abs(cos - exact_cos).max() < 1.5e-3 and np.abs(sin - exact_sin).max() < 1.5e-3
        assert np.isfinite(out).all()
    # Where an fp16 product goes (ORT's float16 tool, onnxconverter-common): position 2049 is
    # 2048 in fp16, an angle off by 1 rad (and past 65504 it is infinite).
    naive = (ROTARY_POSITIONS[:, :4, None].astype(np.float16) *
             ROTARY_FREQUENCIES.astype(np.float16)).astype(np.float64)
    assert np.abs(np.cos(naive) - exact_cos[:, :4, :4]).max() > 0.1
    # The fp32 model agrees where fp32 holds the angle to better than fp16's rounding.
    fp32_out, fp32_cos, _ = run(model, feeds)
    assert np.abs(run(converted, feeds)[1] - fp32_cos)[:, :4].max() < 1.5e-3


@pytest.mark.parametrize("positions_dtype", [np.int64, np.int32])
def test_rotary_angle_stays_in_int64_for_positions_past_2_to_the_24(positions_dtype):
    """p * round(f 2^38) alone would pass 2^63 from p = 2^25 on (f near 1, as LLaMA's first
    frequency): the reduction splits p into a * 2^24 + b. Out to int32's ends the angle is then
    within p * (2^-39 + 2^-41) rad plus fp16's rounding of exact; fp32 itself rounds the
    position there (by up to 64 at 2^31)."""
    far = np.array([[2**25, 2**26 + 3, 2**30 + 12345, 2**31 - 1, -2**31, -(2**26) - 5]],
                   np.int64)
    converted, _ = convert(rotary_block(positions_dtype))
    feeds = {"x": np.ones((1, 6, 8), np.float32), "positions": far.astype(positions_dtype)}
    exact_cos, exact_sin = _exact_cos_sin(far)
    bound = np.abs(far)[..., None] * (2.0**-39 + 2.0**-41) + 1.5e-3
    for _, cos, sin in (run_as_fp16(converted, feeds), run(converted, feeds)):
        assert np.all(np.abs(cos - exact_cos) < bound) and np.all(np.abs(sin - exact_sin) < bound)


def test_rotary_angle_before_opset_10_is_left_to_the_painting():
    """Mod, which the reduction is built with, came with opset 10: an opset-9 model keeps its
    angle as painted (and stays valid), with a note saying why."""
    b = GraphBuilder(opset=9)
    x = b.input("x", [1, 6, 8])
    positions = b.input("positions", [1, 6], dtype=np.int64)
    eye = b.const("eye", np.eye(8, dtype=np.float32))
    h = b.op("MatMul", x, eye, name="q")
    floats = b.op("Cast", b.op("Unsqueeze", positions, axes=[2], name="column"),
                  to=onnx.TensorProto.FLOAT, name="to_float")
    angle = b.op("Mul", floats, b.const("inv_freq", ROTARY_FREQUENCIES), name="angle")
    emb = b.op("Concat", angle, angle, axis=2, name="emb")
    rotated = b.op("Add", b.op("Mul", h, b.op("Cos", emb, name="cos"), name="q_cos"),
                   b.op("Mul", h, b.op("Sin", emb, name="sin"), name="q_sin"), name="rotated")
    b.output(b.op("MatMul", rotated, eye, name="out"))
    converted, report = convert(b.build())  # the checker's full check passes
    assert "Mod" not in {n.op_type for n in converted.graph.node}
    assert all(s["rule"] != "rotary_angle" for s in report.structures)
    notes = next(p["notes"] for p in report.passes if p["name"] == "recognize_rotary_angles")
    assert notes == ["rotary angles are left to the painting: the model's format version has "
                     "no Mod to reduce them with"]
    feeds = {"x": np.ones((1, 6, 8), np.float32), "positions": ROTARY_POSITIONS[:, :6] % 1000}
    assert np.isfinite(run(converted, feeds)[0]).all()


def test_rotary_angle_read_by_anything_else_is_left_to_the_painting():
    """The angle is also a graph output: its value, not only its cos and sin, is observable, so
    it is not reduced (it stays fp32, read by the fp32 output)."""
    converted, report = convert(rotary_block(angle_output=True))
    assert report.structures == [] or all(s["rule"] != "rotary_angle"
                                          for s in report.structures)
    assert "Mod" not in {n.op_type for n in converted.graph.node}
    assert precisions(report)["angle"] == "fp32"


@pytest.mark.parametrize("options", [dict(target="bf16"), dict(keep_nodes=["cos"]),
                                     dict(keep_nodes=["to_float"])])
def test_rotary_angle_stays_as_before_for_bf16_and_for_kept_readers(options):
    """bf16 holds an angle in [-pi, pi) only to 2^-7 rad: the exact fp32 angle is better. A user
    pin on a reader, or on the positions' cast the reduction would remove, leaves the rule out
    as well."""
    converted, report = convert(rotary_block(), **options)
    assert all(s["rule"] != "rotary_angle" for s in report.structures)
    assert "Mod" not in {n.op_type for n in converted.graph.node}
    assert precisions(report)["angle"] == "fp32"


def test_rms_norm_inverse_root_in_fp16_keeps_tiny_rows():
    """Rows below sqrt(eps) (where eps, not the mean square, sets the scale, 1/sqrt(eps) = 1000
    here; fp16 normal numbers, so that x itself is exact enough) and a row near fp16's largest
    values: the inverse root rebuilt in fp16 follows fp32 on each (the floor on s keeps
    (sqrt(eps)/s)^2 finite: without it these rows come out 0)."""
    model = rms_norm_block("reciprocal")
    converted, _ = convert(model, backend=RESCALING_BACKEND)
    x = np.zeros((2, 3, 8), np.float32)
    x[0, 0] = np.linspace(-1e-4, 1e-4, 8)
    x[0, 1] = np.linspace(1e-4, 4e-4, 8)
    x[0, 2] = [3e-4, -2e-4, 0, 0, 0, 0, 0, 1e-4]
    x[1, 0] = np.linspace(-4e-4, 5e-4, 8)
    x[1, 1] = np.linspace(-60000, 60000, 8)
    x[1, 2] = [1e-3, 0, 0, 0, 0, 0, 0, 0]
    expected = run(model, {"x": x})[0]
    for actual in (run_as_fp16(converted, {"x": x})[0], run(converted, {"x": x})[0]):
        assert np.isfinite(actual).all()
        assert_close_per_row(actual, expected, 3e-3)


# -- check passes what convert wrote, rule by rule (issue 39) -------------------------------------
def _t5_attention() -> onnx.ModelProto:
    from test_attention_masks import t5_model

    return t5_model()


STRUCTURE_MODELS = {
    "tanh_gelu": (gelu_mlp, "tanh_gelu", {}),
    "index_math": (length_model, "index_math", {}),
    "rms_norm": (rms_norm_block, "rms_norm", {"backend": RESCALING_BACKEND}),
    "rotary_angles": (rotary_block, "rotary_angle", {}),
    "attention_mask": (_t5_attention, "attention_mask", {}),
}


@pytest.mark.parametrize("name", sorted(STRUCTURE_MODELS))
def test_check_passes_what_convert_wrote_for_each_structural_rule(name, tmp_path, capsys):
    """Every structural rule convert applies is one check knows: check exits 0 on the output,
    alone and against the fp32 model, with the backend convert had."""
    build, rule, options = STRUCTURE_MODELS[name]
    source, output = tmp_path / f"{name}.onnx", tmp_path / f"{name}_fp16.onnx"
    onnx.save(build(), str(source))
    backend = ["--backend", options["backend"]] if options else []
    report = tmp_path / "report.json"
    assert main(["convert", str(source), str(output), "--report", str(report), *backend]) == 0
    applied = {entry["rule"] for entry in json.loads(report.read_text())["structures"]}
    assert any(rule in applied_rule for applied_rule in applied), applied
    capsys.readouterr()
    for reference in ([], ["--reference", str(source)]):
        code = main(["check", str(output), *reference, *backend])
        assert code == 0, capsys.readouterr().out
