"""Small SavedModels for amp-rewriter's TensorFlow path, as tests/tf/test_tf_saved_model.py builds
them.

    from testkit.models.tf_saved_models import EXPORTERS
    EXPORTERS["keras_cnn"]("out/keras_cnn")        # writes the SavedModel directory

- `keras_cnn`: Conv2D, BatchNormalization, ReLU, MaxPooling2D, DepthwiseConv2D, Dense + softmax,
  exported with Keras' `model.export`;
- `keras_encoder`: Embedding, MultiHeadAttention, LayerNormalization, GELU Dense layers, exported
  with `tf.saved_model.save`;
- `nested_module`: a tf.Module whose signature calls another tf.function (a separate FunctionDef)
  and returns an asset path (`assets/vocab.txt`);
- `tf1_simple_save`: a TF1 graph with a ref variable saved with `simple_save` (the compute lives in
  the MetaGraph's own graph).

Weights are seeded. Within one TensorFlow version the files are the same on every export, except
`fingerprint.pb`, whose `uuid` field TensorFlow fills at random: `normalise_fingerprint` sets it
to a fixed value (each exporter calls it), so the whole directory is byte-identical. Function names
carry a per-process counter (`__inference_serve_123`), so run each exporter in a fresh process (or
always in the same order) to get the same bytes.

Run `python -m testkit.models.tf_saved_models OUT_DIR [NAME ...]` to write them as OUT_DIR/<name>.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

#: Written into fingerprint.pb's uuid field instead of TensorFlow's random one.
FIXED_UUID = "00000000000000000000000000000000"


def normalise_fingerprint(saved_model_dir: str | os.PathLike) -> None:
    """Replace the random `uuid` of `fingerprint.pb` (if there is one) with FIXED_UUID."""
    path = Path(saved_model_dir) / "fingerprint.pb"
    if not path.is_file():
        return
    from tensorflow.core.protobuf import fingerprint_pb2

    fingerprint = fingerprint_pb2.FingerprintDef()
    fingerprint.ParseFromString(path.read_bytes())
    if "uuid" in fingerprint.DESCRIPTOR.fields_by_name:
        fingerprint.uuid = FIXED_UUID
    path.write_bytes(fingerprint.SerializeToString(deterministic=True))


def _fresh(path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _variables_in_name_order() -> Iterator[None]:
    """Make Keras' `model.export` list the variables it saves in name order.

    Keras collects them from the traced functions' captures, whose order changes from process to
    process (it follows object identity), and that order numbers the checkpoint keys
    (`_all_variables/N`) and the object graph: the same model would give different files on
    every export. Sorting by name gives one order. Without that Keras helper, nothing changes.
    """
    try:
        from keras.src.export import saved_model_export_archive as archive
    except ImportError:
        yield
        return
    original = getattr(archive, "_list_variables_used_by_fns", None)
    if original is None:
        yield
        return

    def sorted_variables(fns):
        trainable, non_trainable = original(fns)

        def key(variable):
            return getattr(variable, "path", None) or variable.name

        return sorted(trainable, key=key), sorted(non_trainable, key=key)

    archive._list_variables_used_by_fns = sorted_variables
    try:
        yield
    finally:
        archive._list_variables_used_by_fns = original


def export_keras_cnn(path: str | os.PathLike, seed: int = 0) -> Path:
    """A small Keras CNN exported with `model.export` (input `image` [batch, 16, 16, 3])."""
    import keras

    path = _fresh(path)
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16, 16, 3), name="image")
    x = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.DepthwiseConv2D(3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(5, activation="softmax")(x)
    model = keras.Model(inputs, outputs)
    with _variables_in_name_order():
        model.export(str(path), verbose=False)
    normalise_fingerprint(path)
    return path


def export_keras_encoder(path: str | os.PathLike, seed: int = 0) -> Path:
    """A one-block Keras transformer encoder saved with `tf.saved_model.save` (int32 `tokens`)."""
    import keras

    path = _fresh(path)
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((16,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(50, 32)(tokens)
    attention = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8)(x, x)
    x = keras.layers.LayerNormalization()(x + attention)
    ff = keras.layers.Dense(64, activation="gelu")(x)
    ff = keras.layers.Dense(32)(ff)
    x = keras.layers.LayerNormalization()(x + ff)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(tokens, outputs)
    tf.saved_model.save(model, str(path))
    normalise_fingerprint(path)
    return path


class _Nested(tf.Module):
    """A module whose exported function calls another tf.function (a separate FunctionDef)."""

    def __init__(self, vocab: Path, seed: int):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.w1 = tf.Variable(rng.standard_normal((8, 8)).astype(np.float32) * 0.3)
        self.w2 = tf.Variable(rng.standard_normal((8, 4)).astype(np.float32) * 0.3)
        self.vocab = tf.saved_model.Asset(str(vocab))

    @tf.function(autograph=False)
    def layer(self, x):
        return tf.nn.relu(tf.matmul(x, self.w1))

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32, name="x")], autograph=False)
    def serve(self, x):
        h = self.layer(x)
        return {"y": tf.matmul(h, self.w2), "vocab_file": self.vocab.asset_path}


def export_nested_module(path: str | os.PathLike, seed: int = 0) -> Path:
    """Signature -> serve -> layer (three FunctionDefs) and an asset file."""
    path = _fresh(path)
    with tempfile.TemporaryDirectory() as tmp:
        vocab = Path(tmp) / "vocab.txt"
        vocab.write_text("a\nb\n")
        module = _Nested(vocab, seed)
        tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})
    normalise_fingerprint(path)
    return path


def export_tf1_simple_save(path: str | os.PathLike, seed: int = 0) -> Path:
    """A TF1 SavedModel (simple_save): x -> MatMul(w) -> MatMul(w) -> Relu -> y, w a VariableV2."""
    v1 = tf.compat.v1
    path = _fresh(path)
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 8], name="x")
        w = v1.Variable(
            np.random.default_rng(seed).random((8, 8)).astype(np.float32),
            name="w",
            use_resource=False,
        )
        y = tf.identity(tf.nn.relu(tf.matmul(tf.matmul(x, w), w)), name="y")
        with v1.Session() as session:
            session.run(v1.global_variables_initializer())
            v1.saved_model.simple_save(session, str(path), {"x": x}, {"y": y})
    normalise_fingerprint(path)
    return path


#: Every exporter by name, in a stable order.
EXPORTERS: dict[str, Callable[..., Path]] = {
    "keras_cnn": export_keras_cnn,
    "keras_encoder": export_keras_encoder,
    "nested_module": export_nested_module,
    "tf1_simple_save": export_tf1_simple_save,
}


def main(argv: list[str] | None = None) -> int:
    """`python -m testkit.models.tf_saved_models OUT_DIR`: write each SavedModel there."""
    args = sys.argv[1:] if argv is None else argv
    unknown = [name for name in args[1:] if name not in EXPORTERS]
    if not args or unknown:
        print("usage: python -m testkit.models.tf_saved_models OUT_DIR [NAME ...], NAME one of "
              + ", ".join(EXPORTERS), file=sys.stderr)
        return 2
    out, names = Path(args[0]), args[1:] or list(EXPORTERS)
    for name in names:
        print(f"{name}: {EXPORTERS[name](out / name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
