"""The attention-mask rule (amp_rewriter/passes/structures/attention_masks.py) on tiny graphs run in
onnxruntime against fp32: masks built from -3.4e38 run the scores path in fp16 with a saturated
sum, and every case of the proof holds on real numbers: partially and fully masked rows, two masks
added, large negative scores; masks the rule cannot take keep the constant-range rule.

Each model: scores = MatMul(x, I) (so the scores are the input, chosen per test), a mask added,
Softmax over the last axis (its probabilities are an output), then a MatMul. Converted models run
with every fp16 tensor rounded where it is produced (`run_as_fp16`): ORT's CPU provider would run
the fp16 ops in fp32 and never see the -inf.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import amp_rewriter  # noqa: E402
from testkit.builder import GraphBuilder, check, count_casts, precisions, run, run_as_fp16  # noqa: E402

B, S = 4, 6
MIN = np.float32(-3.4028234663852886e38)
MAX16 = 65504.0
#: A uniform row of S in fp32, and in fp16 (read back through the fp32 output).
UNIFORM32, UNIFORM16 = float(np.float32(1 / S)), float(np.float16(1 / S))


def convert(model: onnx.ModelProto, **options):
    converted, report = amp_rewriter.convert(model, **options)
    check(converted)
    return converted, report


def scores_model(mask_builder, name: str = "masked") -> onnx.ModelProto:
    """x [B,S,S] -> MatMul(x, I) = scores; mask_builder(b, scores) -> the Softmax input."""
    b = GraphBuilder()
    x = b.input("x", [B, S, S])
    scores = b.op("MatMul", x, b.const("eye", np.eye(S, dtype=np.float32)), name="scores")
    logits = mask_builder(b, scores)
    probs = b.op("Softmax", logits, name="softmax", axis=-1)
    b.output(probs)
    b.output(b.op("MatMul", probs, b.weight("wv", [S, 4]), name="context"))
    return b.build()


def where_mask(b: GraphBuilder, scores: str) -> str:
    """Where(keep, 0, min): the padding mask today's transformers exports build (bool [B,1,S])."""
    keep = b.input("keep", [B, 1, S], np.bool_)
    mask = b.op("Where", keep, b.const("zero", np.float32(0)), b.const("min", MIN), name="mask")
    return b.op("Add", scores, mask, name="join")


def mul_mask(b: GraphBuilder, scores: str) -> str:
    """(1 - m) * min: the older HuggingFace padding mask (float m [B,1,S], 1 = keep)."""
    m = b.input("m", [B, 1, S])
    inverted = b.op("Sub", b.const("one", np.float32(1)), m, name="invert")
    mask = b.op("Mul", inverted, b.const("min", MIN), name="mask")
    return b.op("Add", scores, mask, name="join")


def causal_constant() -> np.ndarray:
    causal = np.zeros((1, S, S), np.float32)
    causal[0][np.triu_indices(S, 1)] = MIN
    return causal


def two_masks_in_a_row(b: GraphBuilder, scores: str) -> str:
    """scores + causal + padding, the masks added to the scores one after the other."""
    joined = b.op("Add", scores, b.const("causal", causal_constant()), name="join")
    return b.op("Add", joined, mul_mask_value(b), name="join2")


def two_masks_combined(b: GraphBuilder, scores: str) -> str:
    """scores + (causal + padding), the masks combined first (in the mask construction)."""
    combined = b.op("Add", b.const("causal", causal_constant()), mul_mask_value(b), name="combine")
    return b.op("Add", scores, combined, name="join")


def mul_mask_value(b: GraphBuilder) -> str:
    m = b.input("m", [B, 1, S])
    inverted = b.op("Sub", b.const("one", np.float32(1)), m, name="invert")
    return b.op("Mul", inverted, b.const("min", MIN), name="mask")


def triangle_mask(b: GraphBuilder, scores: str) -> str:
    """TorchScript-style causal mask: ConstantOfShape(fill=min) -> Trilu(upper, k=1)."""
    full = b.op("ConstantOfShape", b.const("square", np.array([S, S], np.int64)), name="fill",
                value=helper.make_tensor("v", TensorProto.FLOAT, [1], [float(MIN)]))
    causal = b.op("Trilu", full, b.const("k", np.array(1, np.int64)), name="triangle", upper=1)
    return b.op("Add", scores, causal, name="join")


def keep_rows() -> np.ndarray:
    """[B,1,S] keep flags: all kept, padded after 3, only the first kept, nothing kept."""
    keep = np.ones((B, 1, S), np.float32)
    keep[1, 0, 3:] = 0
    keep[2, 0, 1:] = 0
    keep[3, 0, :] = 0
    return keep


def scores_input(seed: int = 0, scale: float = 4.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((B, S, S)) * scale).astype(np.float32)


def probabilities(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    """The Softmax output; an fp16 model runs with fp16 rounding (run_as_fp16)."""
    low = any(t.data_type == TensorProto.FLOAT16 for t in model.graph.initializer)
    return (run_as_fp16 if low else run)(model, feeds)[0].astype(np.float64)


def assert_low_precision_path(report, joins=("join",)) -> None:
    decided = precisions(report)
    for name in (*joins, "softmax", "scores", "context"):
        assert decided[name] == "fp16", (name, decided)
    assert [s["rule"] for s in report.structures] == ["attention_mask"]
    assert report.structures[0]["added"] == ["softmax/saturate"]


@pytest.mark.parametrize("builder", [where_mask, mul_mask], ids=["where", "mul"])
def test_padding_mask_runs_fp16_and_masked_rows_match_fp32(builder):
    model = scores_model(builder)
    converted, report = convert(model)
    assert_low_precision_path(report)
    entry = report.node("mask")
    if builder is mul_mask:
        # Arithmetic on the mask stays fp32, by structure, with the reason naming the constant
        # ((1 - m) * -inf would be NaN where m is 1).
        assert entry["precision"] == "fp32" and entry["kind"] == "structure"
        assert "'min'" in entry["reason"] and "saturated" in entry["reason"]
    else:
        # Where only selects: it runs fp16, the constant entering it as -inf (a runtime cast).
        assert entry["precision"] == "fp16"
        assert "mask" in report.structures[0]["nodes"]
    # Casts: x in, the mask (or its constant) into the fp16 path, the two outputs back to fp32.
    assert count_casts(converted) == 4
    keep = keep_rows()
    feeds = {"x": scores_input(), "keep": keep.astype(bool), "m": keep}
    feeds = {i.name: feeds[i.name] for i in model.graph.input}
    expected, actual = probabilities(model, feeds), probabilities(converted, feeds)
    assert np.isfinite(actual).all()
    masked = np.broadcast_to(keep == 0, expected.shape)
    # Masked positions of rows with a kept position get weight 0, as in fp32.
    partial = masked & (keep.sum(-1, keepdims=True) > 0)
    assert np.all(expected[partial] == 0) and np.all(actual[partial] == 0)
    np.testing.assert_allclose(actual[~masked], expected[~masked], atol=2e-3)
    # A fully masked row is uniform in fp32 (-3.4e38 absorbs every score) and here exactly too.
    np.testing.assert_array_equal(expected[3], np.full((S, S), UNIFORM32))
    np.testing.assert_array_equal(actual[3], UNIFORM16)


def t5_model() -> onnx.ModelProto:
    """T5's attention as its TorchScript export writes it: a learned relative position bias,
    looked up (Gather) from positions counted off the keys' shape, masked with
    Where(keep, bias, min) and added to the scores. The positions come from a Shape of the
    scores' producer, so the bias must not count as an activation for the mask to be seen."""
    b = GraphBuilder()
    x = b.input("x", [B, S, S])
    keep = b.input("keep", [B, 1, S], np.bool_)
    scores = b.op("MatMul", x, b.const("eye", np.eye(S, dtype=np.float32)), name="scores")
    length = b.op("Gather", b.op("Shape", scores, name="scores_shape"),
                  b.const("last", np.array(2, np.int64)), name="key_length")
    positions = b.op("Range", b.const("start", np.array(0, np.int64)), length,
                     b.const("step", np.array(1, np.int64)), name="positions")
    relative = b.op("Sub", b.op("Unsqueeze", positions, b.const("axis0", np.array([0])),
                                name="memory"),
                    b.op("Unsqueeze", positions, b.const("axis1", np.array([1])),
                         name="context"), name="relative")
    buckets = b.op("Add", relative, b.const("offset", np.array(S, np.int64)), name="buckets")
    table = b.const("bias_table", np.random.default_rng(3).standard_normal(2 * S)
                    .astype(np.float32))
    bias = b.op("Unsqueeze", b.op("Gather", table, buckets, name="bias_lookup"),
                b.const("axis_batch", np.array([0])), name="bias")
    masked_bias = b.op("Where", keep, bias, b.const("min", MIN), name="mask")
    logits = b.op("Add", scores, masked_bias, name="join")
    probs = b.op("Softmax", logits, name="softmax", axis=-1)
    b.output(probs)
    b.output(b.op("MatMul", probs, b.weight("wv", [S, 4]), name="context_out"))
    return b.build()


def test_t5_relative_bias_mask_takes_the_mask_rule():
    """Issue 39: T5's Softmaxes were kept fp32 (the bias, counted from the scores' shape, was
    taken for an activation and the mask refused). Now they run fp16 with the mask rule's
    guarantees: masked positions weight 0, fully masked rows uniform as in fp32, no NaN."""
    model = t5_model()
    converted, report = convert(model)
    decided = precisions(report)
    assert decided["softmax"] == decided["join"] == "fp16", decided
    assert [s["rule"] for s in report.structures if s["rule"] == "attention_mask"] \
        == ["attention_mask"]
    keep = keep_rows().astype(bool)
    feeds = {"x": scores_input(), "keep": keep}
    expected, actual = probabilities(model, feeds), probabilities(converted, feeds)
    assert np.isfinite(actual).all()
    masked = np.broadcast_to(~keep, expected.shape)
    partial = masked & (keep.sum(-1, keepdims=True) > 0)
    assert np.all(actual[partial] == 0)
    np.testing.assert_allclose(actual[~masked], expected[~masked], atol=2e-3)
    np.testing.assert_array_equal(expected[3], np.full((S, S), UNIFORM32))
    np.testing.assert_array_equal(actual[3], UNIFORM16)


def test_without_the_saturation_fully_masked_rows_would_be_nan():
    """The Clip is load-bearing: the same converted model without it gives NaN rows."""
    model = scores_model(where_mask)
    converted, _ = convert(model)
    clip = next(n for n in converted.graph.node if n.op_type == "Clip")
    softmax = next(n for n in converted.graph.node if n.op_type == "Softmax")
    softmax.input[0] = clip.input[0]
    converted.graph.node.remove(clip)
    keep = keep_rows().astype(bool)
    actual = probabilities(converted, {"x": scores_input(), "keep": keep})
    assert np.isnan(actual[3]).all() and np.isfinite(actual[:3]).all()


def test_clamping_the_mask_instead_breaks_uniform_rows():
    """Why the mask enters as -inf: with --clamp (-65504 + score, rounded to steps of 32) a fully
    masked row is not uniform, unlike fp32 and the rule."""
    model = scores_model(where_mask)
    clamped, report = convert(model, clamp=True)
    assert report.structures == []
    feeds = {"x": scores_input(scale=40.0), "keep": keep_rows().astype(bool)}
    row = probabilities(clamped, feeds)[3]
    assert not np.allclose(row, 1 / S, atol=1e-2)
    ruled, _ = convert(model)
    np.testing.assert_array_equal(probabilities(ruled, feeds)[3], UNIFORM16)


@pytest.mark.parametrize("builder", [two_masks_in_a_row, two_masks_combined],
                         ids=["in-a-row", "combined"])
def test_two_masks_added(builder):
    """Causal + padding: -inf + -inf stays -inf, saturated like one mask. Rows with a kept
    position match fp32; fully masked rows are uniform over the row, where fp32 (whose
    -3.4e38 + -3.4e38 overflows to -inf) spreads over the positions masked once, or is NaN."""
    model = scores_model(builder)
    converted, report = convert(model)
    assert_low_precision_path(report, ("join", "join2") if builder is two_masks_in_a_row
                              else ("join",))
    assert report.node("mask")["precision"] == "fp32"
    keep = np.ones((B, 1, S), np.float32)
    keep[1, 0, :2] = 0   # left padding: query rows 0-1 see only padding
    keep[2, 0, :] = 0    # nothing kept
    feeds = {"x": scores_input(1), "m": keep}
    expected, actual = probabilities(model, feeds), probabilities(converted, feeds)
    assert np.isfinite(actual).all()
    causal_ok = np.tril(np.ones((S, S), bool))
    visible = causal_ok[None] & (keep > 0)
    has_visible = visible.any(-1)
    np.testing.assert_allclose(actual[has_visible], expected[has_visible], atol=2e-3)
    # Batch 2, query 5: every key padded, keys 0-5 masked once -> fp32 uniform over all six.
    np.testing.assert_array_equal(expected[2, 5], UNIFORM32)
    np.testing.assert_array_equal(actual[2, 5], UNIFORM16)
    # Batch 2, query 0: key 0 masked once, keys 1-5 twice -> fp32 puts all weight on key 0.
    np.testing.assert_array_equal(expected[2, 0], np.eye(S)[0])
    np.testing.assert_array_equal(actual[2, 0], UNIFORM16)
    # Batch 1, query 0 (left padding): key 1 masked twice, keys 0, 2-5 once -> fp32 spreads over
    # those five, the rule over all six.
    once = np.array([1, 0, 1, 1, 1, 1]) / 5
    np.testing.assert_allclose(expected[1, 0], once, rtol=1e-6)
    np.testing.assert_array_equal(actual[1, 0], UNIFORM16)


def test_causal_triangle_from_a_constant_fill():
    model = scores_model(triangle_mask)
    converted, report = convert(model)
    assert_low_precision_path(report)
    assert {"fill", "triangle"} <= {n for s in report.structures for n in s["nodes"]}
    assert report.node("triangle")["precision"] == "fp32"
    feeds = {"x": scores_input(2)}
    expected, actual = probabilities(model, feeds), probabilities(converted, feeds)
    np.testing.assert_allclose(actual, expected, atol=2e-3)
    assert np.all(actual[:, np.triu_indices(S, 1)[0], np.triu_indices(S, 1)[1]] == 0)


def test_large_negative_scores_stay_finite_and_exact():
    """Scores near -40000 (exact in fp16): -40000 + -65504 would overflow to -inf before the
    Softmax; the rule saturates it and unmasked positions keep their score."""
    model = scores_model(where_mask)
    converted, _ = convert(model)
    rng = np.random.default_rng(3)
    x = (-40000 + 32 * rng.integers(-4, 4, (B, S, S))).astype(np.float32)
    keep = keep_rows().astype(bool)
    expected, actual = probabilities(model, {"x": x, "keep": keep}), \
        probabilities(converted, {"x": x, "keep": keep})
    assert np.isfinite(actual).all() and np.isfinite(expected).all()
    np.testing.assert_allclose(actual, expected, atol=2e-3)


def test_a_masked_sum_read_elsewhere_keeps_the_constant_range_rule():
    """The masked sum is also a graph output: fp32 sees -3.4e38 there, so the rule refuses and
    the join and Softmax stay fp32, as before."""
    b = GraphBuilder()
    x = b.input("x", [B, S, S])
    scores = b.op("MatMul", x, b.const("eye", np.eye(S, dtype=np.float32)), name="scores")
    logits = where_mask(b, scores)
    probs = b.op("Softmax", logits, name="softmax", axis=-1)
    b.output(logits)
    b.output(b.op("MatMul", probs, b.weight("wv", [S, 4]), name="context"))
    model = b.build()
    converted, report = convert(model)
    decided = precisions(report)
    assert decided["join"] == decided["softmax"] == "fp32"
    assert report.structures == []
    notes = next(p["notes"] for p in report.passes if p["name"] == "find_attention_masks")
    assert any("graph output" in note for note in notes)
    assert not any(n.op_type == "Clip" for n in converted.graph.node)


def test_ort_cpu_keeps_the_softmax_fp32_without_a_saturation():
    model = scores_model(where_mask)
    converted, report = convert(model, backend="ort-cpu")
    assert precisions(report)["softmax"] == "fp32"
    assert not any(n.op_type == "Clip" for n in converted.graph.node)
    feeds = {"x": scores_input(), "keep": keep_rows().astype(bool)}
    np.testing.assert_allclose(probabilities(converted, feeds), probabilities(model, feeds),
                               atol=2e-3)


def test_bf16_saturates_at_bf16s_range():
    """ORT CUDA has no bf16 Clip (measured), so on ort-cuda bf16 saturates with Max then Min."""
    model = scores_model(where_mask)
    converted, report = convert(model, target="bf16")
    assert not [n for n in converted.graph.node if n.op_type == "Clip"]
    steps = [n for n in converted.graph.node if n.op_type in ("Max", "Min")]
    assert [n.op_type for n in steps] == ["Max", "Min"]
    assert steps[1].input[0] == steps[0].output[0]
    bounds = {t.name: t for t in converted.graph.initializer
              if t.name in {steps[0].input[1], steps[1].input[1]}}
    assert {t.data_type for t in bounds.values()} == {TensorProto.BFLOAT16}
    assert len(bounds) == 2
    assert report.structures[0]["rule"] == "attention_mask"
    assert "3.38953e+38" in report.structures[0]["detail"]


def test_opset_10_writes_clip_bounds_as_attributes():
    model = scores_model(where_mask)
    model.opset_import[0].version = 10
    del model.graph.output[:]
    model.graph.output.extend([helper.make_tensor_value_info("context", TensorProto.FLOAT,
                                                             [B, S, 4])])
    converted, _ = convert(model)
    clip = next(n for n in converted.graph.node if n.op_type == "Clip")
    assert len(clip.input) == 1
    assert {a.name: a.f for a in clip.attribute} == {"min": -MAX16, "max": MAX16}
    feeds = {"x": scores_input(), "keep": keep_rows().astype(bool)}
    assert np.isfinite(run_as_fp16(converted, feeds)[0]).all()


def test_mask_conversion_is_deterministic():
    model = scores_model(two_masks_combined)
    first, _ = convert(model)
    second, _ = convert(model)
    assert first.SerializeToString(deterministic=True) == \
        second.SerializeToString(deterministic=True)


def test_user_allowed_join_before_an_fp32_softmax_gets_the_saturation_too():
    """Regression: with Add moved to the allow list and the Softmax fp32 (ort-cpu), the mask Add
    ran fp16 (s + -inf) and the fp32 Softmax saw a row of -inf: NaN. The Clip now saturates the
    masked sum in front of the fp32 Softmax too."""
    model = scores_model(where_mask)
    converted, report = convert(model, backend="ort-cpu", allow=["Add"])
    decided = precisions(report)
    assert decided["join"] == "fp16" and decided["softmax"] == "fp32"
    feeds = {"x": scores_input(), "keep": keep_rows().astype(bool)}
    actual = probabilities(converted, feeds)
    assert np.isfinite(actual).all()
    np.testing.assert_array_equal(actual[3], UNIFORM32)


@pytest.mark.parametrize("builder", [where_mask, mul_mask])
def test_auto_takes_a_saturated_mask_for_no_hazard(builder, tmp_path):
    """The mask's -3.4e38 is beyond fp16 in the fp32 reference run, but the structure rule runs
    it as -inf and saturates the sums: `--auto` finds no data-range hazard there and writes the
    plain conversion, fully masked rows included in the calibration."""
    model_path = tmp_path / "masked.onnx"
    onnx.save(scores_model(builder), str(model_path))
    folder = tmp_path / "calibration"
    folder.mkdir()
    keep = keep_rows()
    names = {i.name for i in onnx.load(str(model_path)).graph.input}
    for index in range(2):
        batch = {"x": scores_input(seed=index)}
        if "keep" in names:
            batch["keep"] = keep.astype(bool)
        if "m" in names:
            batch["m"] = keep
        np.savez(folder / f"batch{index}.npz", **batch)
    plain, auto_out = tmp_path / "plain.onnx", tmp_path / "auto.onnx"
    amp_rewriter.convert_file(model_path, plain)
    report = amp_rewriter.convert_auto(model_path, auto_out, [folder], max_error=5e-2)
    assert report.auto["pinned"] == [], report.auto["pinned"]
    assert report.auto["reference_runs"] == 1 and report.auto["verification_runs"] == 1
    assert auto_out.read_bytes() == plain.read_bytes()
