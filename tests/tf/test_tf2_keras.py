"""Keras 3 fit, evaluate and predict through `amp_rewriter.keras.enable`: the rewritten steps
run (a custom layer's tf.matmul on an autocast=False weight included, in fp16 forward and
backward), the losses follow fp32 fit, the History carries the scale; misuse is one AmpError.
The digits accuracy run is examples/tf2_keras_fit.py."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import amp_rewriter.keras  # noqa: E402
from amp_rewriter.errors import AmpError  # noqa: E402


class RawMatMul(keras.layers.Layer):
    """TensorFlow ops on a weight Keras's policy would not cast."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 3), initializer="glorot_uniform",
                                      autocast=False)

    def call(self, inputs):
        return tf.matmul(inputs, self.kernel)


def _model(compiled=True):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              RawMatMul()])
    if compiled:
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((96, 6)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1).astype(np.int32)


def test_fit_evaluate_and_predict_run_the_rewritten_steps_and_follow_fp32():
    x, y = _data()
    reference = _model()
    expected = reference.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False)
    model = _model()
    step = amp_rewriter.keras.enable(model, target="fp16")
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], atol=0.02)
    assert history.history["loss_scale"] == [2.0 ** 15] * 3
    assert history.history["skipped_steps"] == [0] * 3 and int(step.good_steps) == 9
    matmuls = {n["name"]: n["precision"] for n in step.report.nodes if n["op"] == "MatMul"}
    custom = [name for name in matmuls if "raw_mat_mul" in name]
    assert len(custom) == 3 and set(matmuls.values()) == {"fp16"}  # forward, both gradients
    loss, accuracy = model.evaluate(x, y, verbose=0)
    assert np.isclose(loss, reference.evaluate(x, y, verbose=0)[0], atol=0.02)
    predicted = model.predict(x, verbose=0)
    np.testing.assert_allclose(predicted, reference.predict(x, verbose=0), atol=0.05)
    for function in (model.test_step, model.predict_step):
        counts = function.report.summary["compute_ops_by_type"]["MatMul"]
        assert counts[0] == counts[1] == 2


def test_enable_refuses_an_uncompiled_model_and_a_second_call():
    with pytest.raises(AmpError, match="compile the model"):
        amp_rewriter.keras.enable(_model(compiled=False))
    model = _model()
    amp_rewriter.keras.enable(model)
    with pytest.raises(AmpError, match="already called"):
        amp_rewriter.keras.enable(model)
    with pytest.raises(AmpError, match="expected a Keras model"):
        amp_rewriter.keras.enable(object())
