"""SavedModels through the TensorFlow path: Keras models exported with `model.export` and
`tf.saved_model.save`, a module whose functions call other functions, and assets."""

from __future__ import annotations

import os
from pathlib import Path
from xml.etree import ElementTree

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from amp_rewriter import cli  # noqa: E402
from amp_rewriter.formats.tf import compare_saved_models, convert_saved_model, read_saved_model  # noqa: E402
from testkit.models import tf_saved_models  # noqa: E402


def _function_signatures(path: Path) -> dict[str, tuple]:
    saved = read_saved_model(path)
    return {f.signature.name: (tuple((a.name, a.type) for a in f.signature.input_arg),
                               tuple((a.name, a.type) for a in f.signature.output_arg))
            for mg in saved.meta_graphs for f in mg.graph_def.library.function}


def _serving_dtypes(path: Path) -> dict[str, tuple]:
    loaded = tf.saved_model.load(str(path))
    result = {}
    for name, fn in loaded.signatures.items():
        inputs = {k: v.dtype for k, v in fn.structured_input_signature[1].items()}
        outputs = {k: v.dtype for k, v in fn.structured_outputs.items()}
        result[name] = (inputs, outputs)
    return result


def _check_common(src: Path, dst: Path, report) -> None:
    """What every converted SavedModel must keep: signatures, dtypes, variable values (in bf16
    where stored low), assets."""
    assert _function_signatures(src) == _function_signatures(dst)
    assert _serving_dtypes(src) == _serving_dtypes(dst)
    original = tf.train.load_checkpoint(str(src / "variables" / "variables"))
    converted = tf.train.load_checkpoint(str(dst / "variables" / "variables"))
    assert original.get_variable_to_shape_map() == converted.get_variable_to_shape_map()
    for key, dtype in converted.get_variable_to_dtype_map().items():
        expected = original.get_tensor(key)
        if dtype == tf.bfloat16:
            expected = tf.cast(expected, tf.bfloat16).numpy()
        else:
            assert dtype == original.get_variable_to_dtype_map()[key]
        assert np.array_equal(converted.get_tensor(key), expected), key
    for comparison in compare_saved_models(src, dst):
        assert comparison.relative < 5e-2 and not comparison.nonfinite_new, comparison


@pytest.fixture(scope="module")
def keras_cnn(tmp_path_factory) -> Path:
    return tf_saved_models.export_keras_cnn(tmp_path_factory.mktemp("cnn") / "saved")


@pytest.fixture(scope="module")
def keras_encoder(tmp_path_factory) -> Path:
    return tf_saved_models.export_keras_encoder(tmp_path_factory.mktemp("encoder") / "saved")


def test_keras_cnn_bf16(keras_cnn, tmp_path):
    dst = tmp_path / "cnn_bf16"
    report = convert_saved_model(keras_cnn, dst, target="bf16", backend="tf-cpu")
    precisions = {}
    for entry in report.nodes:
        precisions.setdefault(entry["op"], set()).add(entry["precision"])
    assert precisions["Conv2D"] == {"bf16"}
    assert precisions["DepthwiseConv2dNative"] == {"bf16"}
    assert precisions["MatMul"] == {"bf16"}
    assert precisions["StatefulPartitionedCall"] == {"fp32"}  # call boundaries keep their types
    assert report.summary["graphs_converted"] >= 2
    _check_common(keras_cnn, dst, report)


def test_keras_encoder_bf16(keras_encoder, tmp_path):
    dst = tmp_path / "encoder_bf16"
    report = convert_saved_model(keras_encoder, dst, target="bf16", backend="tf-cpu")
    low = {e["op"] for e in report.nodes if e["precision"] == "bf16"}
    assert {"MatMul", "Softmax"} <= low
    assert low & {"Einsum", "BatchMatMulV2", "BatchMatMulV3"}
    _check_common(keras_encoder, dst, report)


def test_keras_encoder_fp16_tf_gpu_lists_keep_reductions_fp32(keras_encoder, tmp_path):
    dst = tmp_path / "encoder_fp16"
    report = convert_saved_model(keras_encoder, dst, target="fp16", backend="tf-gpu", check=False)
    means = {e["precision"] for e in report.nodes if e["op"] == "Mean"}
    assert means == {"fp32"}  # deny in Grappler's fp16 list
    assert any(e["op"] == "MatMul" and e["precision"] == "fp16" for e in report.nodes)
    assert _function_signatures(keras_encoder) == _function_signatures(dst)


def test_function_calls_and_assets(tmp_path):
    src = tf_saved_models.export_nested_module(tmp_path / "nested")
    saved = read_saved_model(src)
    callers = [n for f in saved.meta_graphs[0].graph_def.library.function for n in f.node_def
               if n.op in ("StatefulPartitionedCall", "PartitionedCall")]
    assert len(callers) >= 2  # signature wrapper -> serve -> layer
    dst = tmp_path / "nested_bf16"
    report = convert_saved_model(src, dst, target="bf16", backend="tf-cpu")
    matmuls = [e for e in report.nodes if e["op"] == "MatMul"]
    assert {e["precision"] for e in matmuls} == {"bf16"}
    # In the caller's body and in the called function's body (saved once per trace).
    assert len({e.get("graph") for e in matmuls}) >= 2
    assert (dst / "assets" / "vocab.txt").read_text() == "a\nb\n"
    loaded = tf.saved_model.load(str(dst))
    out = loaded.signatures["serving_default"](x=tf.ones([2, 8]))
    assert out["vocab_file"].numpy().decode().endswith("vocab.txt")
    assert out["y"].dtype == tf.float32
    _check_common(src, dst, report)


def test_cli_saved_model(keras_cnn, tmp_path, capsys):
    dst = tmp_path / "cli_out"
    code = cli.main(["convert", str(keras_cnn), str(dst), "--target", "bf16", "--validate"])
    printed = capsys.readouterr()
    assert code == 0, printed
    assert "backend tf-cpu" in printed.out
    assert "validate serving_default/output_0" in printed.out
    # Converting again into the same folder replaces it; a non-SavedModel folder is refused.
    assert cli.main(["convert", str(keras_cnn), str(dst), "--target", "bf16", "--quiet"]) == 0
    capsys.readouterr()  # warnings of that run (bf16 on a CPU without it: slower than fp32)
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    code = cli.main(["convert", str(keras_cnn), str(other), "--quiet"])
    assert code == 2 and (other / "keep.txt").exists()
    assert capsys.readouterr().err.count("\n") == 1


def test_tf1_saved_model_main_graph(tmp_path):
    """A TF1 SavedModel keeps its compute in the MetaGraph's own graph (ref variables, saver)."""
    src = tf_saved_models.export_tf1_simple_save(tmp_path / "tf1")
    dst = tmp_path / "tf1_bf16"
    report = convert_saved_model(src, dst, target="bf16", backend="tf-cpu")
    entries = {e["name"]: e for e in report.nodes if e.get("graph") == "main graph"}
    assert entries["MatMul"]["precision"] == entries["Relu"]["precision"] == "bf16"
    assert entries["w/read"]["precision"] == "fp32"  # ref-variable read
    assert entries["y"]["precision"] == "fp32"  # a signature output: preserved
    for comparison in compare_saved_models(src, dst):
        assert comparison.relative < 5e-2, comparison


# -- issue 13: check, explain and the summary agree with convert on SavedModels ------------------

def _tree(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Relative path -> (mode, bytes) for every file under `folder` (hidden ones included)."""
    return {str(p.relative_to(folder)): (p.stat().st_mode, p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_check_passes_what_validate_accepted_on_the_same_inputs(keras_cnn, keras_encoder,
                                                                 tmp_path, capsys, target):
    rng = np.random.default_rng(3)
    feeds = {keras_cnn: {"image": rng.standard_normal((3, 16, 16, 3)).astype(np.float32)},
             keras_encoder: {"inputs": rng.integers(0, 50, (3, 16)).astype(np.int32)}}
    for source, inputs in feeds.items():
        npz = tmp_path / f"{source.parent.name}.npz"
        np.savez(npz, **inputs)
        dst = tmp_path / f"{source.parent.name}_{target}"
        code = cli.main(["convert", str(source), str(dst), "--target", target, "--validate",
                         "--inputs", str(npz)])
        printed = capsys.readouterr()
        assert code == 0, printed
        assert cli.main(["check", str(dst)]) == 0  # the SavedModel itself: deny ops, constants
        code = cli.main(["check", str(dst), "--reference", str(source), "--inputs", str(npz)])
        printed = capsys.readouterr()
        assert code == 0, printed
        assert "check: ok" in printed.out and "relative error" in printed.out


def test_check_fails_a_saved_model_that_does_not_match_its_reference(keras_cnn, keras_encoder,
                                                                      tmp_path, capsys):
    dst = tmp_path / "cnn_fp16"
    assert cli.main(["convert", str(keras_cnn), str(dst), "--quiet"]) == 0
    code = cli.main(["check", str(dst), "--reference", str(keras_encoder)])
    printed = capsys.readouterr()
    assert code == 1 and "run_failed" in printed.out  # another model's signature inputs
    code = cli.main(["check", str(dst), "--reference", str(keras_cnn), "--rtol", "0"])
    assert code == 1 and "output_mismatch" in capsys.readouterr().out


def test_check_takes_a_saved_model_by_its_saved_model_pb_with_other_models(keras_cnn, tmp_path,
                                                                          capsys):
    """What a pre-commit hook passes when a SavedModel changes: its saved_model.pb, among other
    files; each is checked, the SavedModel as a whole, one JUnit suite each."""
    dst = tmp_path / "cnn_fp16"
    assert cli.main(["convert", str(keras_cnn), str(dst), "--quiet"]) == 0
    capsys.readouterr()
    junit = tmp_path / "check.xml"
    code = cli.main(["check", str(dst / "saved_model.pb"), str(keras_cnn), "--junit", str(junit)])
    printed = capsys.readouterr()
    assert code == 0, printed
    assert f"{dst}:" in printed.out and f"{keras_cnn}:" in printed.out
    assert printed.out.splitlines()[-1] == "check: ok (2 models)"
    suites = [suite.get("name") for suite in ElementTree.parse(junit).getroot()]
    assert suites == [str(dst), str(keras_cnn)]


def test_a_failed_run_keeps_the_earlier_saved_model_and_a_second_run_is_identical(keras_cnn,
                                                                                  tmp_path, capsys):
    dst = tmp_path / "cnn_out"
    assert cli.main(["convert", str(keras_cnn), str(dst), "--quiet"]) == 0
    first = _tree(dst)
    assert cli.main(["convert", str(keras_cnn), str(dst), "--quiet"]) == 0
    assert _tree(dst) == first  # fingerprint.pb included: its uuid is not random
    code = cli.main(["convert", str(keras_cnn), str(dst), "--target", "bf16", "--validate",
                     "--rtol", "0"])
    capsys.readouterr()
    assert code == 1 and _tree(dst) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cnn_out"]
    for report in (keras_cnn / "report.json", keras_cnn / "saved_model.pb"):
        assert cli.main(["convert", str(keras_cnn), str(tmp_path / "x"), "--report",
                         str(report)]) == 2
        assert "inside the input SavedModel" in capsys.readouterr().err


def test_explain_shows_every_function_that_has_the_node(keras_encoder, capsys):
    assert cli.main(["explain", str(keras_encoder), "Identity"]) == 0
    out = capsys.readouterr().out
    graphs = [line[3:-1] for line in out.splitlines() if line.startswith("in ")]
    assert len(graphs) >= 2 and out.startswith(f"Identity: {len(graphs)} nodes have this name")
    assert cli.main(["explain", str(keras_encoder), f"{graphs[1]}/Identity"]) == 0
    picked = capsys.readouterr().out
    assert f"graph:     {graphs[1]}" in picked and "nodes have this name" not in picked


class _WithGradient(tf.Module):
    """A served function, and a training step whose gradient functions land in the library."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        self.w = tf.Variable(rng.standard_normal((8, 8)).astype(np.float32) * 0.3)

    @tf.function(autograph=False)
    def layer(self, x):
        return tf.nn.relu(tf.matmul(tf.matmul(x, self.w), self.w))

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32, name="x")],
                 autograph=False)
    def serve(self, x):
        return {"y": self.layer(x)}

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32)], autograph=False)
    def train_step(self, x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(self.layer(x))
        return tape.gradient(loss, self.w)


def test_summary_counts_the_functions_the_signatures_run(tmp_path, capsys):
    module = _WithGradient()
    src = tmp_path / "with_gradient"
    tf.saved_model.save(module, str(src), signatures={"serving_default": module.serve})
    names = [f.signature.name for f in read_saved_model(src).meta_graphs[0].graph_def.library.function]
    assert any("backward" in name for name in names), names
    assert cli.main(["convert", str(src), str(tmp_path / "out"), "--target", "bf16"]) == 0
    out = capsys.readouterr().out
    # Two MatMuls in the served `layer`; the training step's forward/backward copies are
    # converted but not counted.
    assert "compute ops 2/2 (MatMul 2/2)" in out and "other functions converted, not counted" in out


def test_a_converted_saved_model_that_does_not_run_is_a_validation_failure(tmp_path):
    """Validation blames the converted SavedModel (exit 1: validation failed) when it cannot
    load, and the input (exit 2: bad input) when the fp32 one cannot."""
    from amp_rewriter.errors import AmpError, CheckFailed

    class Scale(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(np.ones((4, 4), np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
        def serve(self, x):
            return {"y": tf.matmul(x, self.w)}

    module = Scale()
    src, broken = tmp_path / "src", tmp_path / "broken"
    tf.saved_model.save(module, str(src), signatures={"serving_default": module.serve})
    convert_saved_model(src, broken, target="fp16", backend="tf-gpu")
    (broken / "saved_model.pb").write_bytes(b"not a SavedModel")
    with pytest.raises(CheckFailed, match="does not load") as failed:
        compare_saved_models(src, broken)
    assert failed.value.exit_code == 1
    with pytest.raises(AmpError, match="does not load") as bad_input:
        compare_saved_models(broken, src)
    assert bad_input.value.exit_code == 2
