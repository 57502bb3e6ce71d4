"""convert --auto and diagnose on ONNX models with planted hazards: diagnose names the culprit
first, --auto pins it (and only a few nodes) and meets the tolerance; a hazard-free model comes
out as plain convert writes it; bad calibration data is refused in one line."""

from __future__ import annotations

import base64
import io
import json
import weakref

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import describe_run

import amp_rewriter
from amp_rewriter.accuracy import calibration_for
from amp_rewriter.accuracy.calibration import CalibrationSet
from amp_rewriter.accuracy.measure import measure
from amp_rewriter.accuracy.runner import ProbePlan
from amp_rewriter.formats.onnx.accuracy import OnnxRunner
from amp_rewriter.formats.onnx.emulation import WHOLE_MODEL, emulate_low_precision
from amp_rewriter.options import AutoOptions
from testkit.builder import GraphBuilder

TOLERANCE = 1e-2


# -- models with one planted hazard each ------------------------------------------------------

def _save(builder: GraphBuilder, tmp_path, name: str, batches: list[dict]) -> tuple:
    path = tmp_path / f"{name}.onnx"
    onnx.save(builder.build(), str(path))
    folder = tmp_path / f"{name}_calibration"
    folder.mkdir()
    for index, batch in enumerate(batches):
        np.savez(folder / f"batch{index}.npz", **batch)
    return path, folder


def _x_batches(count: int = 4, features: int = 16, rows: int = 4, loud: int | None = 3,
               loud_scale: float = 8.0, seed: int = 0, **extra) -> list[dict]:
    """Normal data, one batch (`loud`) scaled up: the hazard shows only for some inputs."""
    rng = np.random.default_rng(seed)
    batches = []
    for index in range(count):
        scale = loud_scale if index == loud else 1.0
        batch = {"x": (rng.standard_normal((rows, features)) * scale).astype(np.float32)}
        batch.update({k: v(index) for k, v in extra.items()})
        batches.append(batch)
    return batches


def _overflow_chain(b: GraphBuilder, h: str, prefix: str) -> str:
    """MatMul by a large constant (|out| > 65504 only on loud batches), scaled back, Tanh."""
    big = b.op("MatMul", h, b.const(f"{prefix}_w", np.full((16, 16), 1500.0, np.float32)),
               name=f"{prefix}_big")
    scaled = b.op("Mul", big, b.const(f"{prefix}_s", np.float32(1e-5)), name=f"{prefix}_scale")
    return b.op("Tanh", scaled, name=f"{prefix}_tanh")


def matmul_overflow(tmp_path):
    b = GraphBuilder(opset=17)
    x = b.input("x", ["batch", 16])
    h = b.op("Relu", b.op("MatMul", x, b.weight("w1", [16, 16], 0.3), name="mm1"), name="relu")
    t = _overflow_chain(b, h, "hot")
    b.output(b.op("MatMul", t, b.weight("w3", [16, 8]), name="mm_out"))
    return _save(b, tmp_path, "matmul_overflow", _x_batches()), "hot_big", {}


def reduce_sum_overflow(tmp_path, op: str = "ReduceSum"):
    """A sum over 10^5 elements (moved to infer, as ORT CUDA's kernel accumulates in fp32):
    the sum itself exceeds 65504."""
    b = GraphBuilder(opset=17)
    x = b.input("x", ["batch", 8])
    wide = b.op("Relu", b.op("MatMul", x, b.weight("w_wide", [8, 100_000], 1.0), name="mm_wide"),
                name="relu")
    if op == "ReduceSum":
        total = b.op("ReduceSum", wide, b.const("axes", np.array([1], np.int64)), name="sum",
                     keepdims=1)
    else:
        total = b.op("ReduceSumSquare", wide, name="sum", axes=[1], keepdims=1)
    b.output(b.op("MatMul", total, b.weight("w_out", [1, 8], 1.0), name="mm_out"))
    batches = _x_batches(count=3, features=8, rows=2, loud=None)
    return _save(b, tmp_path, f"{op}_overflow", batches), "sum", {"infer": [op]}


def division_by_tiny(tmp_path):
    """x / d where d = sigmoid(...) * 1e-7 is computed: in fp16 d flushes or loses its digits."""
    b = GraphBuilder(opset=17)
    x = b.input("x", ["batch", 16])
    numerator = b.op("MatMul", x, b.weight("wa", [16, 16]), name="mm_num")
    gate = b.op("Sigmoid", b.op("MatMul", x, b.weight("wb", [16, 16]), name="mm_den"),
                name="gate")
    tiny = b.op("Mul", gate, b.const("tiny_value", np.float32(1e-7)), name="tiny")
    ratio = b.op("Div", numerator, tiny, name="divide")
    back = b.op("Mul", ratio, b.const("back_value", np.float32(1e-7)), name="scale_back")
    b.output(b.op("MatMul", back, b.weight("wc", [16, 8]), name="mm_out"))
    return _save(b, tmp_path, "division", _x_batches(loud=None)), "divide", {}


def layernorm_large(tmp_path):
    """LayerNorm fed activations around 1e4: fp16's step there (8) erases the row's variation."""
    b = GraphBuilder(opset=17)
    x = b.input("x", ["batch", 16])
    h = b.op("MatMul", x, b.weight("w1", [16, 16], 0.3), name="mm1")
    shifted = b.op("Add", h, b.const("offset_value", np.float32(1e4)), name="offset")
    normed = b.op("LayerNormalization", shifted, b.const("gamma", np.ones(16, np.float32)),
                  b.const("beta", np.zeros(16, np.float32)), name="layernorm", axis=-1)
    b.output(b.op("MatMul", normed, b.weight("w2", [16, 8]), name="mm_out"), dtype=np.float32,
             shape=["batch", 8])
    return _save(b, tmp_path, "layernorm", _x_batches(loud=None)), "layernorm", {}


def exp_large(tmp_path):
    """Exp (fp32 by the deny list) of values up to ~15 feeds a MatMul that reads it in fp16."""
    b = GraphBuilder(opset=17)
    x = b.input("x", ["batch", 16])
    h = b.op("MatMul", x, b.weight("w1", [16, 16], 0.6), name="mm1")
    e = b.op("Exp", h, name="exp")
    b.output(b.op("MatMul", e, b.weight("w2", [16, 8], 1e-3), name="mm_exp"))
    return _save(b, tmp_path, "exp", _x_batches(loud_scale=2.5)), "mm_exp", {}


def overflow_in_if(tmp_path):
    b = GraphBuilder(opset=17)
    x = b.input("x", ["batch", 16])
    cond = b.input("cond", [], np.bool_)
    h = b.op("Relu", b.op("MatMul", x, b.weight("w1", [16, 16], 0.3), name="mm1"), name="relu")
    then = b.subgraph("then")
    then.output(_overflow_chain(then, h, "then"), dtype=np.float32, shape=["batch", 16])
    other = b.subgraph("else")
    other.output(other.op("Mul", h, other.const("half", np.float32(0.5)), name="else_half"),
                 dtype=np.float32, shape=["batch", 16])
    branch = b.op("If", cond, name="branch", then_branch=then.graph(), else_branch=other.graph())
    b.output(b.op("MatMul", branch, b.weight("w3", [16, 8]), name="mm_out"), dtype=np.float32,
             shape=["batch", 8])
    batches = _x_batches(cond=lambda i: np.array(i != 1))
    return _save(b, tmp_path, "if_overflow", batches), "then_big", {}


def overflow_in_loop(tmp_path):
    b = GraphBuilder(opset=17)
    x = b.input("x", ["batch", 16])
    h = b.op("Relu", b.op("MatMul", x, b.weight("w1", [16, 16], 0.3), name="mm1"), name="relu")
    body = b.subgraph("body")
    body.input("iteration", [], np.int64)
    keep = body.input("keep_in", [], np.bool_)
    state = body.input("state_in", ["batch", 16])
    body.output(body.op("Identity", keep, name="keep_out"), dtype=np.bool_, shape=[])
    body.output(_overflow_chain(body, body.op("Add", state, h, name="loop_add"), "loop"),
                dtype=np.float32, shape=["batch", 16])
    looped = b.op("Loop", b.const("trips", np.array(2, np.int64)), b.const("go", np.array(True)),
                  h, name="loop", body=body.graph())
    b.output(b.op("MatMul", looped, b.weight("w3", [16, 8]), name="mm_out"), dtype=np.float32,
             shape=["batch", 8])
    return _save(b, tmp_path, "loop_overflow", _x_batches()), "loop_big", {}


def layernorm_in_if(tmp_path):
    """The LayerNorm hazard inside an If branch (taken on some batches only)."""
    b = GraphBuilder(opset=17)
    x = b.input("x", ["batch", 16])
    cond = b.input("cond", [], np.bool_)
    h = b.op("MatMul", x, b.weight("w1", [16, 16], 0.3), name="mm1")
    then = b.subgraph("then")
    shifted = then.op("Add", h, then.const("offset_value", np.float32(1e4)), name="then_offset")
    then.output(then.op("LayerNormalization", shifted, then.const("gamma", np.ones(16, np.float32)),
                        then.const("beta", np.zeros(16, np.float32)), name="then_layernorm",
                        axis=-1), dtype=np.float32, shape=["batch", 16])
    other = b.subgraph("else")
    other.output(other.op("Mul", h, other.const("half", np.float32(0.5)), name="else_half"),
                 dtype=np.float32, shape=["batch", 16])
    branch = b.op("If", cond, name="branch", then_branch=then.graph(), else_branch=other.graph())
    b.output(b.op("MatMul", branch, b.weight("w3", [16, 8]), name="mm_out"), dtype=np.float32,
             shape=["batch", 8])
    batches = _x_batches(loud=None, cond=lambda i: np.array(i != 1))
    return _save(b, tmp_path, "if_layernorm", batches), "then_layernorm", {}


def division_in_loop(tmp_path):
    """The division by a tiny computed value inside a Loop body (the state stays bounded)."""
    b = GraphBuilder(opset=17)
    x = b.input("x", ["batch", 16])
    h = b.op("MatMul", x, b.weight("w1", [16, 16], 0.3), name="mm1")
    body = b.subgraph("body")
    body.input("iteration", [], np.int64)
    keep = body.input("keep_in", [], np.bool_)
    state = body.input("state_in", ["batch", 16])
    rng = np.random.default_rng(3)
    gate = body.op("Sigmoid", body.op("MatMul", h, body.const(
        "wb", (rng.standard_normal((16, 16)) * 0.1).astype(np.float32)), name="loop_den"),
        name="loop_gate")
    tiny = body.op("Mul", gate, body.const("tiny_value", np.float32(1e-7)), name="loop_tiny")
    ratio = body.op("Div", body.op("Add", state, h, name="loop_add"), tiny, name="loop_divide")
    body.output(body.op("Identity", keep, name="keep_out"), dtype=np.bool_, shape=[])
    back = body.op("Mul", ratio, body.const("back_value", np.float32(1e-7)), name="loop_back")
    body.output(body.op("Tanh", back, name="loop_tanh"), dtype=np.float32, shape=["batch", 16])
    looped = b.op("Loop", b.const("trips", np.array(2, np.int64)), b.const("go", np.array(True)),
                  h, name="loop", body=body.graph())
    b.output(b.op("MatMul", looped, b.weight("w3", [16, 8]), name="mm_out"), dtype=np.float32,
             shape=["batch", 8])
    return _save(b, tmp_path, "loop_division", _x_batches(loud=None)), "loop_divide", {}


HAZARDS = {
    "matmul": matmul_overflow,
    "reduce_sum": reduce_sum_overflow,
    "reduce_sum_square": lambda tmp: reduce_sum_overflow(tmp, "ReduceSumSquare"),
    "division": division_by_tiny,
    "layernorm": layernorm_large,
    "exp": exp_large,
    "if_body": overflow_in_if,
    "loop_body": overflow_in_loop,
    "if_body_layernorm": layernorm_in_if,
    "loop_body_division": division_in_loop,
}


def _max_relative(model_path, converted_path, folder) -> float:
    """The converted model's worst max-rel error on the calibration batches, run emulated (fp32
    compute, every fp16 tensor rounded where it is produced): an independent check of --auto."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    reference = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    emulated = emulate_low_precision(onnx.load(str(converted_path)), policy=WHOLE_MODEL).model
    candidate = ort.InferenceSession(emulated.SerializeToString(), options,
                                     providers=["CPUExecutionProvider"])
    worst = 0.0
    for path in sorted(folder.glob("*.npz")):
        with np.load(path) as data:
            feeds = {k: data[k] for k in data.files}
        for ref, new in zip(reference.run(None, feeds), candidate.run(None, feeds)):
            if not np.isfinite(new).all():
                return float("inf")
            worst = max(worst, float(np.abs(ref - new).max() / np.abs(ref).max()))
    return worst


@pytest.mark.parametrize("hazard", sorted(HAZARDS))
def test_diagnose_names_the_culprit_first_and_auto_pins_it(hazard, tmp_path):
    (model, folder), culprit, options = HAZARDS[hazard](tmp_path)
    report = amp_rewriter.diagnose(model, [folder], **options)
    low = [row for row in report["nodes"] if row["precision"] != "fp32"]
    assert report["nodes"][0]["node"] == culprit, [r["node"] for r in report["nodes"][:4]]
    # The plain conversion really is broken here (else there is nothing to find).
    assert _max_relative(model, _plain(model, tmp_path, options), folder) > TOLERANCE
    out = tmp_path / "auto.onnx"
    auto = amp_rewriter.convert_auto(model, out, [folder], max_error=TOLERANCE, **options)
    pinned = [entry["node"] for entry in auto.auto["pinned"]]
    assert culprit in pinned
    assert len(pinned) <= 3, pinned  # the culprit and what it feeds or reads, not the graph
    assert len(pinned) < len(low)
    assert auto.auto["passed"]
    assert _max_relative(model, out, folder) <= TOLERANCE
    entry = auto.node(culprit)
    assert entry["kind"] == "measurement" and entry["precision"] == "fp32"
    # The reason is the measurement itself.
    assert any(word in entry["reason"] for word in ("absmax", "NaN/Inf", "relative error",
                                                      "flush"))


def _plain(model, tmp_path, options) -> str:
    out = tmp_path / "plain.onnx"
    amp_rewriter.convert_file(model, out, **options)
    return str(out)


def test_overflow_reason_counts_the_batches_it_happened_on(tmp_path):
    (model, folder), culprit, _ = matmul_overflow(tmp_path)
    report = amp_rewriter.convert_auto(model, tmp_path / "out.onnx", [folder],
                                       max_error=TOLERANCE)
    reason = report.node(culprit)["reason"]
    assert "> 65504 on 1/4 calibration batches" in reason, reason


def test_a_hazard_free_model_comes_out_as_plain_convert_writes_it(tmp_path):
    b = GraphBuilder(opset=17)
    x = b.input("x", ["batch", 16])
    h = b.op("Relu", b.op("MatMul", x, b.weight("w1", [16, 16], 0.3), name="mm1"), name="relu")
    b.output(b.op("MatMul", h, b.weight("w2", [16, 8]), name="mm2"))
    model, folder = _save(b, tmp_path, "benign", _x_batches(loud=None))
    plain = tmp_path / "plain.onnx"
    amp_rewriter.convert_file(model, plain)
    auto_out = tmp_path / "auto.onnx"
    report = amp_rewriter.convert_auto(model, auto_out, [folder], max_error=TOLERANCE)
    assert auto_out.read_bytes() == plain.read_bytes()
    assert report.auto["same_as_plain_convert"] is True
    assert report.auto["reference_runs"] == 1 and report.auto["verification_runs"] == 1
    assert report.auto["pinned"] == []


def test_release_gives_back_ranked_pins_the_metric_does_not_need(tmp_path):
    """An error spread over a deep chain (no hazard): bisection finds a passing top-k of the
    ranking; the trials left then give pins back, each step verified, and the model written
    still meets the tolerance (checked independently)."""
    rng = np.random.default_rng(0)
    b = GraphBuilder(opset=17)
    h = b.input("x", [4, 16])
    for index in range(24):
        weight = (np.eye(16) + rng.standard_normal((16, 16)) * 0.05).astype(np.float32)
        h = b.op("MatMul", h, b.const(f"w{index}", weight), name=f"mm{index}")
        h = b.op("Tanh", h, name=f"t{index}")
    b.output(h)
    batches = [{"x": rng.standard_normal((4, 16)).astype(np.float32)} for _ in range(3)]
    model, folder = _save(b, tmp_path, "deep", batches)
    out = tmp_path / "auto.onnx"
    report = amp_rewriter.convert_auto(model, out, [folder], max_error=1e-3)
    trials = report.auto["trials"]
    bisected = min(t["pinned"] for t in trials if t["step"].startswith("top") and t["passed"])
    released = [t for t in trials if t["step"].startswith("release") and t["passed"]]
    assert released, [(t["step"], t["pinned"], t["passed"]) for t in trials]
    assert len(report.auto["pinned"]) == released[-1]["pinned"] < bisected
    assert report.auto["passed"] and len(trials) <= 20
    assert _max_relative(model, out, folder) <= 1e-3


def test_layer_norms_are_tried_fp32_first_and_the_matmuls_stay_low(tmp_path):
    """A post-LN residual stream of 12 layers: fp16 rounding of the stream itself, not any one
    node's own error, breaks a tight tolerance. Keeping the LayerNorms (which write the stream)
    fp32 meets it, with every MatMul still fp16."""
    rng = np.random.default_rng(0)
    b = GraphBuilder(opset=17)
    h = b.input("x", [4, 64])
    for index in range(12):
        weight = (rng.standard_normal((64, 64)) * 0.125).astype(np.float32)
        update = b.op("Mul", b.op("MatMul", h, b.const(f"w{index}", weight), name=f"mm{index}"),
                      b.const(f"s{index}", np.float32(0.05)), name=f"scale{index}")
        residual = b.op("Add", h, update, name=f"residual{index}")
        h = b.op("LayerNormalization", residual, b.const(f"g{index}", np.ones(64, np.float32)),
                 b.const(f"b{index}", np.zeros(64, np.float32)), name=f"norm{index}", axis=-1)
    b.output(h)
    batches = [{"x": rng.standard_normal((4, 64)).astype(np.float32)} for _ in range(3)]
    model, folder = _save(b, tmp_path, "post_ln", batches)
    out = tmp_path / "auto.onnx"
    report = amp_rewriter.convert_auto(model, out, [folder], max_error=1e-3)
    trials = report.auto["trials"]
    assert not trials[0]["passed"]  # the plain conversion misses the tolerance
    assert trials[1]["step"] == "normalizations (12)" and trials[1]["passed"], trials[:2]
    pinned = [entry["node"] for entry in report.auto["pinned"]]
    assert pinned and all(name.startswith("norm") for name in pinned), pinned
    assert "residual stream" in report.node(pinned[0])["reason"]
    assert all(report.node(f"mm{index}")["precision"] == "fp16" for index in range(12))
    assert _max_relative(model, out, folder) <= 1e-3


def test_a_tight_tolerance_ends_in_fp32_and_never_fails(tmp_path):
    (model, folder), _, _ = layernorm_large(tmp_path)
    out = tmp_path / "out.onnx"
    report = amp_rewriter.convert_auto(model, out, [folder], max_error=0.0, max_trials=3)
    assert report.auto["passed"]
    assert report.summary["low_precision_nodes"] == 0
    assert _max_relative(model, out, folder) == 0.0


def test_a_user_metric_module_function(tmp_path):
    (model, folder), _, _ = layernorm_large(tmp_path)
    metric_file = tmp_path / "task_metric.py"
    metric_file.write_text(
        "import numpy as np\n"
        "def allclose_ratio(reference_outputs, outputs):\n"
        "    return max(float(np.max(np.abs(outputs[k] - r) / (1e-3 + 1e-2 * np.abs(r))))\n"
        "               for k, r in reference_outputs.items())\n")
    report = amp_rewriter.convert_auto(model, tmp_path / "out.onnx", [folder], max_error=1.0,
                                       metric=f"{metric_file}:allclose_ratio")
    assert report.auto["metric"].endswith(":allclose_ratio")
    assert report.auto["passed"] and report.auto["final_metric"] <= 1.0
    assert "layernorm" in [p["node"] for p in report.auto["pinned"]]


def test_cosine_metric_and_random_inputs_warn(tmp_path):
    (model, _folder), _, _ = matmul_overflow(tmp_path)
    report = amp_rewriter.convert_auto(model, tmp_path / "out.onnx", max_error=1e-4,
                                       metric="cosine")
    assert report.auto["random_inputs"] is True
    assert any("coverage decides" in w for w in report.warnings)


def test_polygraphy_json_inputs(tmp_path):
    (model, folder), culprit, _ = matmul_overflow(tmp_path)
    feeds = []
    for path in sorted(folder.glob("*.npz")):
        with np.load(path) as data:
            entry = {}
            for key in data.files:
                buffer = io.BytesIO()
                np.save(buffer, data[key], allow_pickle=False)
                entry[key] = {"array": base64.b64encode(buffer.getvalue()).decode(),
                              "polygraphy_class": "ndarray"}
            feeds.append(entry)
    json_path = tmp_path / "inputs.json"
    json_path.write_text(json.dumps(feeds))
    report = amp_rewriter.diagnose(model, [json_path])
    assert report["batches"] == 4 and report["nodes"][0]["node"] == culprit


def test_statistics_are_streamed_one_batch_at_a_time(tmp_path):
    """No batch's activations outlive it: when the probe runs batch i, every array it returned
    for batch i-1 is already gone, and the statistics are a few numbers per tensor."""
    (model, folder), _, _ = matmul_overflow(tmp_path)
    runner = OnnxRunner(model, amp_rewriter.OnnxOptions())
    calibration, _ = calibration_for(runner, [str(folder)], AutoOptions())
    real_prepare = runner.prepare_probe
    alive: list[weakref.ref] = []
    runs = []

    def prepare_probe(conv, plan):
        probe = real_prepare(conv, plan)
        real_run = probe.run

        def run(batch):
            runs.append(sum(ref() is not None for ref in alive))
            result = real_run(batch)
            alive.clear()
            # (the model outputs are kept on purpose, for the verification runs)
            activations = [a for name, a in result.reference.items() if name != "mm_out"]
            activations += list(result.candidate.values())
            activations += [a for arrays in result.local.values() for a in arrays]
            activations += [a for per_input in result.rounded.values()
                            for arrays in per_input.values() for a in arrays]
            alive.extend(weakref.ref(a) for a in activations if a is not None)
            return result

        probe.run = run
        return probe

    runner.prepare_probe = prepare_probe
    measurement = measure(runner, lambda: runner.convert({}), calibration, "float16",
                          ProbePlan(candidate_tensors=True))
    assert runs == [0, 0, 0, 0]
    assert measurement.batches == 4
    assert all(ref() is None for ref in alive)
    # The reference outputs kept for verification are outputs only.
    assert all(set(o) == {"mm_out"} for o in measurement.reference_outputs)


def test_the_big_model_path_gives_the_same_answer(tmp_path, monkeypatch):
    """Models too big to hold twice go to onnxruntime as files with their weights on disk (the
    model's external data copied into a work folder, the shadows' constants spilled as they are
    made) and measure local errors in several passes: the thresholds lowered so that a tiny model
    takes that path, it gives the bytes, pins and ranking of the in-memory path."""
    import importlib

    measure_module = importlib.import_module("amp_rewriter.accuracy.measure")
    onnx_accuracy = importlib.import_module("amp_rewriter.formats.onnx.accuracy")

    (model, folder), culprit, _ = matmul_overflow(tmp_path)
    in_memory = amp_rewriter.convert_auto(model, tmp_path / "memory.onnx", [folder],
                                          max_error=TOLERANCE)
    ranking = [row["node"] for row in amp_rewriter.diagnose(model, [folder])["nodes"]]
    external = tmp_path / "external" / "model.onnx"
    external.parent.mkdir()
    onnx.save_model(onnx.load(str(model)), str(external), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.data", size_threshold=256)
    monkeypatch.setattr(onnx_accuracy, "SMALL_MODEL", 0)
    monkeypatch.setattr(measure_module, "BIG_MODEL_BYTES", 0)
    monkeypatch.setattr(measure_module, "SHADOW_SHARE", 1e-6)  # one node's shadows per pass
    for source in (model, external):
        out = tmp_path / f"disk_{source.parent.name}.onnx"
        on_disk = amp_rewriter.convert_auto(source, out, [folder], max_error=TOLERANCE)
        assert on_disk.auto["pinned"] == in_memory.auto["pinned"]
        assert on_disk.auto["reference_runs"] > 1  # the local errors took several passes
        if source == model:
            assert out.read_bytes() == (tmp_path / "memory.onnx").read_bytes()
        report = amp_rewriter.diagnose(source, [folder])
        assert [row["node"] for row in report["nodes"]] == ranking
        assert report["nodes"][0]["node"] == culprit
        assert any("passes" in note for note in report["notes"]), report["notes"]


def test_a_probe_holds_only_the_weights_of_the_nodes_it_measures(tmp_path):
    """Local errors of a big model are measured a group of nodes per pass so that the shadows'
    low-precision weights fit beside the model's: a pass must not carry the other groups'
    weights (or their casts) along."""
    from amp_rewriter.formats.onnx.accuracy import PREFIX

    (model, _folder), culprit, _ = matmul_overflow(tmp_path)
    runner = OnnxRunner(model, amp_rewriter.OnnxOptions())

    def probe_parts(plan: ProbePlan) -> tuple[int, int]:
        probe = runner.prepare_probe(runner.convert({}), plan).written
        assert isinstance(probe, onnx.ModelProto)  # a small model stays in memory
        constants = sum(t.name.startswith(f"{PREFIX}const") for t in probe.graph.initializer)
        casts = sum(n.name.startswith(f"{PREFIX}cast") for n in probe.graph.node)
        return constants, casts

    everything = probe_parts(ProbePlan(rounding=frozenset()))
    one = probe_parts(ProbePlan(rounding=frozenset(), local_nodes=frozenset({culprit})))
    none = probe_parts(ProbePlan(rounding=frozenset(), local_nodes=frozenset()))
    assert everything[0] >= 3  # the weights of mm1, hot_big, mm_out (and the scale)
    assert one == (1, 1)  # hot_big's weight, and its input cast to fp16
    assert none == (0, 0)


# -- the command line ---------------------------------------------------------------------------

def test_cli_auto_report_and_explain(amp_cli, tmp_path):
    (model, folder), culprit, _ = matmul_overflow(tmp_path)
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    result = amp_cli("convert", model, out, "--auto", "--max-error", "1e-2", "--inputs", folder,
                     "--report", report)
    assert result.returncode == 0, describe_run(result)
    assert f"{culprit} (MatMul): output" in result.stdout
    explained = amp_cli("explain", report, culprit)
    assert "decided by: measurement" in explained.stdout, describe_run(explained)
    diag_json = tmp_path / "diag.json"
    diagnosed = amp_cli("diagnose", model, "--inputs", folder, "--json", diag_json)
    assert diagnosed.returncode == 0, describe_run(diagnosed)
    lines = diagnosed.stdout.splitlines()
    first_row = lines[next(i for i, line in enumerate(lines) if line.startswith("-----")) + 1]
    assert first_row.startswith(culprit), diagnosed.stdout
    assert json.loads(diag_json.read_text())["nodes"][0]["node"] == culprit
    # The runner's work folder is removed when the run ends, not left to the collector (which
    # warned "Implicitly cleaning up <TemporaryDirectory ...>" on stderr).
    assert "cleaning up" not in result.stderr + diagnosed.stderr, result.stderr + diagnosed.stderr


def _bad_inputs(tmp_path, kind):
    folder = tmp_path / f"bad_{kind}"
    folder.mkdir()
    good = np.ones((4, 16), np.float32)
    if kind == "name":
        np.savez(folder / "a.npz", y=good)
    elif kind == "dtype":
        np.savez(folder / "a.npz", x=good.astype(np.float64))
    elif kind == "shape":
        np.savez(folder / "a.npz", x=np.ones((4, 12), np.float32))
    elif kind == "nan":
        bad = good.copy()
        bad[1, 2] = np.nan
        np.savez(folder / "a.npz", x=bad)
    elif kind == "not_npz":
        (folder / "a.npz").write_bytes(b"not an npz")
    return folder


@pytest.mark.parametrize("kind, message", [
    ("name", "'y' not in the model"),
    ("dtype", "is float64, the model takes float32"),
    ("shape", "has shape [4, 12], the model takes [?, 16]"),
    ("nan", "NaN or Inf"),
    ("empty", "no .npz files in this folder"),
    ("not_npz", "not an .npz file"),
])
def test_bad_calibration_input_is_one_line_and_writes_nothing(amp_cli, tmp_path, kind, message):
    (model, _folder), _, _ = matmul_overflow(tmp_path)
    bad = _bad_inputs(tmp_path, kind)
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    result = amp_cli("convert", model, out, "--auto", "--max-error", "1e-2", "--inputs", bad,
                     "--report", report)
    assert result.returncode == 2, describe_run(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not out.exists() and not report.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".amp")) == []
    diagnosed = amp_cli("diagnose", model, "--inputs", bad)
    assert diagnosed.returncode == 2 and message in diagnosed.stderr


@pytest.mark.parametrize("args, message", [
    (["--auto"], "--auto needs --max-error"),
    (["--max-error", "0.1"], "--max-error only apply with --auto"),
    (["--auto", "--max-error", "-1"], "--max-error must be a number >= 0"),
    (["--auto", "--max-error", "0.1", "--metric", "nope"], "expected max-rel, cosine"),
    (["--auto", "--max-error", "0.1", "--metric", "no_such_module_x:f"], "cannot import"),
    (["--auto", "--max-error", "0.1", "--validate"], "--validate does not combine with --auto"),
])
def test_auto_option_errors(amp_cli, tmp_path, args, message):
    (model, _folder), _, _ = matmul_overflow(tmp_path)
    out = tmp_path / "out.onnx"
    result = amp_cli("convert", model, out, *args)
    assert result.returncode == 2, describe_run(result)
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_the_metric_must_hold_for_the_fp32_model_itself(tmp_path):
    (model, folder), _, _ = matmul_overflow(tmp_path)
    metric_file = tmp_path / "never.py"
    metric_file.write_text("def never(reference_outputs, outputs):\n    return 1.0\n")
    with pytest.raises(amp_rewriter.AmpError, match="comparing the fp32 model with itself"):
        amp_rewriter.convert_auto(model, tmp_path / "out.onnx", [folder], max_error=0.5,
                                  metric=f"{metric_file}:never")
    assert not (tmp_path / "out.onnx").exists()


def test_calibration_set_reads_batches_lazily(tmp_path):
    (model, folder), _, _ = matmul_overflow(tmp_path)
    runner = OnnxRunner(model, amp_rewriter.OnnxOptions())
    calibration = CalibrationSet.from_paths([folder, folder / "batch0.npz"],
                                            runner.input_specs())
    assert len(calibration) == 5
    (folder / "batch2.npz").write_bytes(b"broken later")
    with pytest.raises(amp_rewriter.AmpError, match="batch2.npz: not an .npz file"):
        list(calibration)


def test_error_statistics_of_mask_sized_values_do_not_overflow():
    """An attention mask's -3.4e38 squared overflows a float32 sum (numpy warned "overflow
    encountered in dot" on stderr); the sums are float64."""
    import warnings

    from amp_rewriter.accuracy.stats import ErrorStats

    mask = np.where(np.arange(64) % 3 == 0, np.float32(-3.4e38), np.float32(0)).reshape(4, 16)
    stats = ErrorStats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats.update(mask, mask)
    assert np.isfinite(stats.sum_sq_ref) and stats.relative == 0.0
