"""Low-precision weights in converted SavedModels: variables read only in bf16 are stored in bf16
and read without a cast; the model still loads (tf.saved_model.load and the TF1 loader TF
Serving uses), serves the same dtypes and gives the outputs the cast-on-every-call model gives."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from amp_rewriter import cli  # noqa: E402
from amp_rewriter.formats.tf import convert_saved_model, read_saved_model  # noqa: E402

BF16 = tf.bfloat16.as_datatype_enum


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A Keras CNN exported with `model.export` (each variable tracked twice)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3), name="image")
    # Named layers: Keras numbers unnamed ones per process (conv2d_3 after other tests).
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv2d")(inputs)
    x = keras.layers.BatchNormalization(name="batch_normalization")(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(5, name="dense")(x)
    path = tmp_path_factory.mktemp("cnn") / "saved"
    keras.Model(inputs, outputs).export(str(path), verbose=False)
    return path


@pytest.fixture(scope="module")
def converted(exported, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    low = out / "weights_bf16"
    cast = out / "weights_fp32"
    return (low, convert_saved_model(exported, low, target="bf16", backend="tf-cpu"),
            cast, convert_saved_model(exported, cast, target="bf16", backend="tf-cpu",
                                      keep_fp32_weights=True))


def _serve(path: Path, images: np.ndarray) -> np.ndarray:
    serve = tf.saved_model.load(str(path)).signatures["serving_default"]
    return next(iter(serve(image=tf.constant(images)).values())).numpy()


def _serve_tf1(path: Path, images: np.ndarray) -> np.ndarray:
    """Serve through the TF1 loader, which runs the MetaGraph's restore op as TF Serving does."""
    with tf.compat.v1.Session(graph=tf.Graph()) as session:
        meta = tf.compat.v1.saved_model.loader.load(session, ["serve"], str(path))
        signature = meta.signature_def["serving_default"]
        feed = {signature.inputs["image"].name: images}
        return session.run(next(iter(signature.outputs.values())).name, feed)


def _weight_casts(path: Path) -> int:
    """Casts that read a ReadVariableOp directly, in the converted functions."""
    count = 0
    for fdef in read_saved_model(path).meta_graphs[0].graph_def.library.function:
        reads = {nd.name for nd in fdef.node_def if nd.op == "ReadVariableOp"}
        count += sum(1 for nd in fdef.node_def
                     if nd.op == "Cast" and nd.input[0].split(":")[0] in reads)
    return count


def test_weights_read_only_in_bf16_are_stored_in_bf16(exported, converted):
    low, report, cast, _cast_report = converted
    names = set(report.weights["variables"])
    assert {"conv2d/kernel", "conv2d/bias", "dense/kernel", "dense/bias"} <= names
    # Batch-norm statistics feed fp32 arithmetic (rsqrt of the variance): they stay fp32.
    assert not names & {"batch_normalization/moving_variance", "batch_normalization/gamma"}
    reader = tf.train.load_checkpoint(str(low / "variables" / "variables"))
    dtypes = reader.get_variable_to_dtype_map()
    assert sum(1 for d in dtypes.values() if d == tf.bfloat16) == report.weights["objects"] == 8
    assert report.weights["bytes_after"] * 2 == report.weights["bytes_before"]
    assert _weight_casts(low) < _weight_casts(cast)
    loaded = tf.saved_model.load(str(low))
    assert {v.name: v.dtype for v in loaded.variables}["conv2d/kernel:0"] == tf.bfloat16
    reads = {e["precision"] for e in report.nodes if e["op"] == "ReadVariableOp"}
    assert reads == {"bf16", "fp32"}  # the batch-norm statistics are still read in fp32


def test_same_outputs_as_casting_on_every_call_through_both_loaders(exported, converted):
    low, _report, cast, _ = converted
    images = np.random.default_rng(1).standard_normal((2, 16, 16, 3)).astype(np.float32)
    expected = _serve(cast, images)
    assert np.array_equal(_serve(low, images), expected)
    assert np.array_equal(_serve_tf1(low, images), _serve_tf1(cast, images))
    fp32 = _serve(exported, images)
    assert np.abs(expected - fp32).max() / np.abs(fp32).max() < 5e-2


def test_keep_fp32_weights_copies_the_checkpoint(exported, converted):
    _low, _report, cast, cast_report = converted
    assert cast_report.weights is None
    for name in ("variables.index", "variables.data-00000-of-00001"):
        assert (cast / "variables" / name).read_bytes() == \
            (exported / "variables" / name).read_bytes()


class _Shared(tf.Module):
    """One weight read twice: by a MatMul (bf16) and by an fp32 sum of squares (deny)."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        self.w = tf.Variable(rng.standard_normal((8, 8)).astype(np.float32), name="w")
        self.v = tf.Variable(rng.standard_normal((8, 4)).astype(np.float32), name="v")

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32, name="x")],
                 autograph=False)
    def serve(self, x):
        h = tf.matmul(tf.matmul(x, self.w), self.v)
        return {"y": h, "norm": tf.reduce_sum(self.w * self.w)}


def test_a_variable_also_read_in_fp32_stays_fp32(tmp_path):
    module = _Shared()
    src = tmp_path / "shared"
    tf.saved_model.save(module, str(src), signatures={"serving_default": module.serve})
    report = convert_saved_model(src, tmp_path / "out", target="bf16", backend="tf-cpu")
    assert report.weights is not None and report.weights["variables"] == ["v"]
    loaded = tf.saved_model.load(str(tmp_path / "out"))
    out = loaded.signatures["serving_default"](x=tf.ones([2, 8]))
    assert out["norm"].dtype == tf.float32
    assert np.isclose(out["norm"].numpy(), float(np.sum(module.w.numpy() ** 2)), rtol=1e-6)


def test_cli_reports_the_weights_and_opts_out(exported, tmp_path, capsys):
    assert cli.main(["convert", str(exported), str(tmp_path / "a"), "--target", "bf16",
                     "--report", str(tmp_path / "a.json")]) == 0
    assert "variables stored in bf16" in capsys.readouterr().out
    assert cli.main(["convert", str(exported), str(tmp_path / "b"), "--target", "bf16",
                     "--keep-fp32-weights", "--quiet"]) == 0
    assert (tmp_path / "b" / "variables" / "variables.index").read_bytes() == \
        (exported / "variables" / "variables.index").read_bytes()


class _Saliency(tf.Module):
    """A signature that takes a gradient through a nested function: TensorFlow's `__forward_*`
    function returns the weight's read (its backward pass needs it), declared float32."""

    def __init__(self):
        super().__init__()
        self.w = tf.Variable(np.random.default_rng(0).standard_normal((4, 4)).astype("float32"))

    @tf.function
    def inner(self, x):
        return tf.tanh(tf.matmul(x, self.w))

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
    def saliency(self, x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(self.inner(x))
        return {"g": tape.gradient(y, x)}


def test_a_read_a_function_returns_keeps_its_variable_fp32(tmp_path):
    module = _Saliency()
    src = tmp_path / "saliency"
    tf.saved_model.save(module, str(src),
                        signatures={"saliency": module.saliency.get_concrete_function()})
    convert_saved_model(src, tmp_path / "out", target="bf16", backend="tf-cpu")
    x = tf.ones([2, 4])
    expected = tf.saved_model.load(str(src)).signatures["saliency"](x=x)["g"].numpy()
    got = tf.saved_model.load(str(tmp_path / "out")).signatures["saliency"](x=x)["g"].numpy()
    assert np.allclose(got, expected, atol=0.05)


class _WithState(tf.Module):
    """Two read variables and one no function reads, all named "Variable" (the default), the
    unread one with the same value as a read one."""

    def __init__(self):
        super().__init__()
        self.w = tf.Variable(np.random.default_rng(0).standard_normal((4, 4)).astype("float32"))
        self.b = tf.Variable(tf.zeros([4]))
        self.running_total = tf.Variable(tf.zeros([4]))

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
    def serve(self, x):
        return {"y": tf.matmul(x, self.w) + self.b}


def test_a_variable_no_function_reads_keeps_its_dtype(tmp_path, capsys):
    module = _WithState()
    src = tmp_path / "state"
    tf.saved_model.save(module, str(src), signatures={"serving_default": module.serve})
    out = tmp_path / "out"
    assert cli.main(["convert", str(src), str(out), "--target", "bf16"]) == 0
    assert "weights: 2 variables stored in bf16" in capsys.readouterr().out
    dtypes = tf.train.load_checkpoint(str(out / "variables" / "variables")).get_variable_to_dtype_map()
    assert dtypes["running_total/.ATTRIBUTES/VARIABLE_VALUE"] == tf.float32
    assert dtypes["w/.ATTRIBUTES/VARIABLE_VALUE"] == tf.bfloat16
    loaded = tf.saved_model.load(str(out))
    loaded.running_total.assign_add(tf.ones([4]))  # still a float32 variable
    assert np.array_equal(loaded.running_total.numpy(), np.ones(4, np.float32))


class _Huge(tf.Module):
    def __init__(self):
        super().__init__()
        self.w = tf.Variable(np.full((4, 4), 1e5, np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
    def serve(self, x):
        return {"y": tf.matmul(x, self.w) * 1e-5}


def test_a_variable_beyond_fp16_stays_fp32_and_so_do_its_readers(tmp_path):
    """The variable stays fp32 in the checkpoint, and the MatMul reading it runs fp32 (a cast
    of it to fp16 on every call would give inf), with or without --keep-fp32-weights."""
    module = _Huge()
    src = tmp_path / "huge"
    tf.saved_model.save(module, str(src), signatures={"serving_default": module.serve})
    x = tf.constant(np.ones((1, 4), np.float32))
    expected = tf.saved_model.load(str(src)).signatures["serving_default"](x=x)["y"].numpy()
    for out, keep in ((tmp_path / "out", False), (tmp_path / "kept", True)):
        report = convert_saved_model(src, out, target="fp16", backend="tf-gpu",
                                     keep_fp32_weights=keep)
        dtypes = tf.train.load_checkpoint(
            str(out / "variables" / "variables")).get_variable_to_dtype_map()
        assert dtypes["w/.ATTRIBUTES/VARIABLE_VALUE"] == tf.float32
        served = tf.saved_model.load(str(out)).signatures["serving_default"](x=x)["y"].numpy()
        assert np.isfinite(served).all()
        assert np.allclose(served, expected, rtol=1e-3)
        matmuls = [n for n in report.nodes if n["op"] == "MatMul"]
        assert matmuls and all(n["precision"] == "fp32" for n in matmuls)
        assert all("beyond fp16's finite range" in n["reason"] for n in matmuls)
        assert {(c["name"], c["action"]) for c in report.constants} == {("Variable", "kept_fp32")}
