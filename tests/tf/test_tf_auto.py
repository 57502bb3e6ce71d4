"""convert --auto and diagnose on TF1 GraphDefs and a TF2 SavedModel with planted hazards (fp16
on TensorFlow's CPU kernels): diagnose names the culprit first, --auto pins it and meets the
tolerance; a hazard-free graph comes out as plain convert writes it; bad calibration data is one
line."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")

import amp_rewriter  # noqa: E402
from amp_rewriter import cli  # noqa: E402
from amp_rewriter.formats.tf import compare_graphdefs, read_graphdef  # noqa: E402

v1 = tf.compat.v1
TOLERANCE = 1e-2


def _graph(tmp_path, name, fn, batches):
    rng = np.random.default_rng(0)
    graph = tf.Graph()
    with graph.as_default():
        fn(lambda *shape, scale=0.3: tf.constant(
            (rng.standard_normal(shape) * scale).astype(np.float32)))
    path = tmp_path / f"{name}.pb"
    path.write_bytes(graph.as_graph_def().SerializeToString())
    folder = tmp_path / f"{name}_calibration"
    folder.mkdir()
    for index, batch in enumerate(batches):
        np.savez(folder / f"batch{index}.npz", **batch)
    return path, folder


def _batches(loud=3, scale=8.0, count=4):
    rng = np.random.default_rng(1)
    return [{"x": (rng.standard_normal((4, 16)) * (scale if i == loud else 1.0)
                   ).astype(np.float32)} for i in range(count)]


def matmul_overflow(tmp_path):
    def model(w):
        x = v1.placeholder(tf.float32, [None, 16], name="x")
        h = tf.nn.relu(tf.matmul(x, w(16, 16), name="mm1"), name="relu")
        big = tf.matmul(h, tf.constant(np.full((16, 16), 1500.0, np.float32)), name="hot_big")
        t = tf.tanh(tf.multiply(big, 1e-5, name="hot_scale"), name="hot_tanh")
        tf.identity(tf.matmul(t, w(16, 8), name="mm_out"), name="y")
    return _graph(tmp_path, "matmul", model, _batches()), "hot_big"


def exp_large(tmp_path):
    def model(w):
        x = v1.placeholder(tf.float32, [None, 16], name="x")
        e = tf.exp(tf.matmul(x, w(16, 16, scale=0.6), name="mm1"), name="exp")
        tf.identity(tf.matmul(e, w(16, 8, scale=1e-3), name="mm_exp"), name="y")
    return _graph(tmp_path, "exp", model, _batches(scale=2.5)), "mm_exp"


def division_by_tiny(tmp_path):
    def model(w):
        x = v1.placeholder(tf.float32, [None, 16], name="x")
        numerator = tf.matmul(x, w(16, 16), name="mm_num")
        tiny = tf.multiply(tf.sigmoid(tf.matmul(x, w(16, 16), name="mm_den")), 1e-7, name="tiny")
        ratio = tf.math.truediv(numerator, tiny, name="divide")
        back = tf.multiply(ratio, 1e-7, name="back")
        tf.identity(tf.matmul(back, w(16, 8), name="mm_out"), name="y")
    return _graph(tmp_path, "division", model, _batches(loud=None)), "divide"


HAZARDS = {"matmul": matmul_overflow, "exp": exp_large, "division": division_by_tiny}


def _max_relative(model, converted, folder) -> float:
    worst = 0.0
    for path in sorted(folder.glob("*.npz")):
        with np.load(path) as data:
            feeds = {k: data[k] for k in data.files}
        for comparison in compare_graphdefs(read_graphdef(model), read_graphdef(converted), ["y"],
                                            feeds):
            worst = max(worst, comparison.relative)
    return worst


@pytest.mark.parametrize("hazard", sorted(HAZARDS))
def test_diagnose_names_the_culprit_and_auto_pins_it(hazard, tmp_path):
    (model, folder), culprit = HAZARDS[hazard](tmp_path)
    options = {"target": "fp16", "outputs": ["y"]}
    report = amp_rewriter.diagnose(model, [folder], **options)
    assert report["nodes"][0]["node"] == culprit, [r["node"] for r in report["nodes"][:4]]
    plain = tmp_path / "plain.pb"
    amp_rewriter.convert_file(model, plain, **options)
    assert _max_relative(model, plain, folder) > TOLERANCE
    out = tmp_path / "auto.pb"
    auto = amp_rewriter.convert_auto(model, out, [folder], max_error=TOLERANCE, **options)
    pinned = [entry["node"] for entry in auto.auto["pinned"]]
    assert culprit in pinned and len(pinned) <= 3, pinned
    assert _max_relative(model, out, folder) <= TOLERANCE
    assert auto.node(culprit)["kind"] == "measurement"


def test_a_hazard_free_graph_comes_out_as_plain_convert_writes_it(tmp_path):
    def model(w):
        x = v1.placeholder(tf.float32, [None, 16], name="x")
        h = tf.nn.relu(tf.matmul(x, w(16, 16), name="mm1"), name="relu")
        tf.identity(tf.matmul(h, w(16, 8), name="mm2"), name="y")
    model_path, folder = _graph(tmp_path, "benign", model, _batches(loud=None))
    plain, auto_out = tmp_path / "plain.pb", tmp_path / "auto.pb"
    assert cli.main(["convert", str(model_path), str(plain), "--target", "bf16", "--quiet"]) == 0
    assert cli.main(["convert", str(model_path), str(auto_out), "--target", "bf16", "--auto",
                     "--max-error", "0.1", "--inputs", str(folder), "--quiet"]) == 0
    assert auto_out.read_bytes() == plain.read_bytes()


def test_bad_calibration_input_is_one_line(tmp_path, capsys):
    (model, _folder), _ = matmul_overflow(tmp_path)
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.ones((4, 16), np.int32))
    out = tmp_path / "out.pb"
    code = cli.main(["convert", str(model), str(out), "--target", "fp16", "--outputs", "y",
                     "--auto", "--max-error", "0.01", "--inputs", str(bad)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is int32, the model takes float32" in err[0]
    assert not out.exists()


class _HotModule(tf.Module):
    """matmul_overflow as a TF2 SavedModel: variables, and the compute inside a called function."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.w1 = tf.Variable((rng.standard_normal((16, 16)) * 0.3).astype(np.float32))
        self.big = tf.Variable(np.full((16, 16), 1500.0, np.float32))
        self.w2 = tf.Variable((rng.standard_normal((16, 8)) * 0.3).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32, name="x")],
                 autograph=False)
    def __call__(self, x):
        h = tf.nn.relu(tf.matmul(x, self.w1, name="mm1"), name="relu")
        big = tf.matmul(h, self.big, name="hot_big")
        t = tf.tanh(tf.multiply(big, 1e-5, name="hot_scale"), name="hot_tanh")
        return {"y": tf.matmul(t, self.w2, name="mm_out")}


def _saved_relative(original, converted, folder) -> float:
    reference = tf.saved_model.load(str(original)).signatures["serving_default"]
    candidate = tf.saved_model.load(str(converted)).signatures["serving_default"]
    worst = 0.0
    for path in sorted(folder.glob("*.npz")):
        with np.load(path) as data:
            x = tf.constant(data["x"])
        expected, actual = reference(x=x)["y"].numpy(), candidate(x=x)["y"].numpy()
        worst = max(worst, float(np.abs(actual.astype(np.float64) - expected).max()
                                 / np.abs(expected).max()))
    return worst


def test_saved_model_diagnose_and_auto_through_the_frozen_signature(tmp_path):
    saved = tmp_path / "saved"
    module = _HotModule()
    tf.saved_model.save(module, str(saved), signatures=module.__call__)
    folder = tmp_path / "calibration"
    folder.mkdir()
    for index, batch in enumerate(_batches()):
        np.savez(folder / f"batch{index}.npz", **batch)
    before = sorted((p.relative_to(saved), p.stat().st_size) for p in saved.rglob("*"))
    report = amp_rewriter.diagnose(saved, [folder], target="fp16")
    first = report["nodes"][0]["node"]
    assert first.endswith("/hot_big"), [r["node"] for r in report["nodes"][:4]]
    plain = tmp_path / "plain"
    amp_rewriter.convert_file(saved, plain, target="fp16")
    assert _saved_relative(saved, plain, folder) > TOLERANCE
    out = tmp_path / "auto"
    auto = amp_rewriter.convert_auto(saved, out, [folder], max_error=TOLERANCE, target="fp16")
    pinned = [entry["node"] for entry in auto.auto["pinned"]]
    assert first in pinned and len(pinned) <= 3, pinned
    assert _saved_relative(saved, out, folder) <= TOLERANCE
    assert any(entry["name"] == "hot_big" and entry["kind"] == "measurement"
               for entry in auto.nodes), "the pin reached the function's node"
    assert sorted((p.relative_to(saved), p.stat().st_size) for p in saved.rglob("*")) == before


def test_saved_model_with_outputs_option_is_one_line(tmp_path, capsys):
    saved = tmp_path / "saved"
    module = tf.Module()
    module.f = tf.function(lambda x: x * 2.0, input_signature=[tf.TensorSpec([2], tf.float32)])
    tf.saved_model.save(module, str(saved))
    assert cli.main(["diagnose", str(saved), "--outputs", "y"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--outputs is for GraphDefs" in err[0]


def test_tf1_saved_model_auto_pins_the_main_graph_node(tmp_path):
    """A TF1 SavedModel (simple_save) keeps its compute in the MetaGraph's own graph: the
    frozen signature's node names are the graph's, and the pin lands there."""
    saved = tmp_path / "tf1"
    graph = tf.Graph()
    rng = np.random.default_rng(0)
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 16], name="x")
        w1 = v1.get_variable("w1", initializer=(rng.standard_normal((16, 16)) * 0.3
                                                ).astype(np.float32))
        big = v1.get_variable("big", initializer=np.full((16, 16), 1500.0, np.float32))
        w2 = v1.get_variable("w2", initializer=(rng.standard_normal((16, 8)) * 0.3
                                                ).astype(np.float32))
        h = tf.nn.relu(tf.matmul(x, w1, name="mm1"))
        t = tf.tanh(tf.multiply(tf.matmul(h, big, name="hot_big"), 1e-5, name="hot_scale"))
        y = tf.matmul(t, w2, name="y")
        with v1.Session(graph=graph) as session:
            session.run(v1.global_variables_initializer())
            v1.saved_model.simple_save(session, str(saved), inputs={"x": x}, outputs={"y": y})
    folder = tmp_path / "calibration"
    folder.mkdir()
    for index, batch in enumerate(_batches()):
        np.savez(folder / f"batch{index}.npz", **batch)
    report = amp_rewriter.diagnose(saved, [folder], target="fp16")
    assert report["nodes"][0]["node"] == "hot_big"
    auto = amp_rewriter.convert_auto(saved, tmp_path / "out", [folder], max_error=TOLERANCE,
                                     target="fp16")
    assert [entry["node"] for entry in auto.auto["pinned"]] == ["hot_big"]
    assert auto.node("hot_big")["kind"] == "measurement"
