"""16-bit weight storage in TF2: a Keras model built with 16-bit variables (`dtype="bfloat16"` /
`"float16"`: Keras makes the optimizer's slots in the same dtype), trained through
`mixed_precision(step, weights=...)`, the update computed in fp32 and rounded back
stochastically into the 16-bit variables. Compared with the same step in fp32: accuracy and the
checkpoint's bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import digits_data  # noqa: E402

from amp_rewriter.errors import AmpError  # noqa: E402
from amp_rewriter.tf import mixed_precision  # noqa: E402

STEPS = 150
SIXTEEN = {"float16": tf.float16, "bfloat16": tf.bfloat16}


def _train(tmp_path: Path, dtype: str | None, optimizer: str, weights: str | None = None):
    """The digits MLP (its layers built in `dtype`), `STEPS` steps, through the wrapper when
    `weights` is given; test accuracy, the checkpoint's variables (name -> (dtype, bytes)) and
    the model's variables. Keras 3 checkpoints the weights under the optimizer
    (`_trainable_variables`), the slots under its `_variables`."""
    x_train, y_train, x_test, y_test = digits_data.digits()
    model = digits_data.mlp(dtype=dtype)
    # epsilon 1e-4: Keras keeps Adam's second moment in the variables' type, where it
    # underflows in fp16 below 6e-8 (1e-7, Keras's default, then makes the steps huge)
    opt = (keras.optimizers.Adam(1e-3, epsilon=1e-4) if optimizer == "adam"
           else keras.optimizers.SGD(0.05, momentum=0.9))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = tf.function(digits_data.keras_train_step(model, opt, loss_fn))
    run = step if weights is None else mixed_precision(step, weights, weights=weights)
    stream = digits_data.batches(x_train, y_train, 64)
    for _ in range(STEPS):
        run(*next(stream))
    path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / f"{dtype}"))
    reader = tf.train.load_checkpoint(path)
    dtypes = reader.get_variable_to_dtype_map()
    entries = {name: (dtypes[name], int(np.prod(shape)) * dtypes[name].size)
               for name, shape in tf.train.list_variables(path)
               if name.endswith(".ATTRIBUTES/VARIABLE_VALUE") and "/_trainable_variables/" in name}
    return digits_data.accuracy(model, x_test, y_test), entries, model, run


@pytest.mark.parametrize("dtype, weights, optimizer", [("bfloat16", "bf16", "adam"),
                                                       ("float16", "fp16", "adam"),
                                                       ("float16", "fp16", "sgd")])
def test_a_model_built_in_16_bits_trains_like_fp32_at_half_the_checkpoint(
        tmp_path, dtype, weights, optimizer):
    reference, full, _, _ = _train(tmp_path / "fp32", None, optimizer)
    accuracy, half, model, run = _train(tmp_path / "16", dtype, optimizer, weights)
    assert abs(accuracy - reference) <= 2.0, (accuracy, reference)
    assert set(half) == set(full) and len(full) == 4  # two kernels, two biases
    assert all(d == tf.float32 for d, _ in full.values())
    assert all(d == SIXTEEN[dtype] for d, _ in half.values())
    assert sum(b for _, b in half.values()) * 2 == sum(b for _, b in full.values())
    assert all(v.dtype == dtype for v in model.trainable_variables)
    built = run.report.training["variables_built_16bit"]
    assert len(built["variables"]) == (12 if optimizer == "adam" else 8)  # weights + slots
    # the rewrite runs the step as its fp32 equivalent: every matmul (forward 2, backward 3)
    # in the target, low of total
    assert run.report.summary["compute_ops_by_type"]["MatMul"] == [5, 5]


def test_the_16_bit_update_is_not_keras_own_16_bit_arithmetic(tmp_path):
    """Keras updates a float16 variable in float16 (SGD's lr x g rounds to nearest); through
    the wrapper the weights move by the fp32 update, rounded stochastically."""
    w = keras.Variable(np.full([1000], 0.25, np.float16), dtype="float16")
    opt = keras.optimizers.SGD(1e-4)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = -tf.reduce_sum(tf.matmul(tf.ones([2, 1000], tf.float16),
                                            tf.reshape(w.value, [1000, 1]))) / 2.0
        grads = tape.gradient(loss, [w.value])
        opt.apply_gradients(zip(grads, [w]))
        return loss

    run = mixed_precision(step, "fp16", weights="fp16", loss_scale=1024)
    for _ in range(100):
        run()
    values = w.numpy()
    assert values.dtype == np.float16
    assert abs(values.astype(np.float64).mean() - (0.25 + 100 * 1e-4)) < 1e-3  # not stalled


def test_fp32_variables_with_16_bit_weights_warn_that_storage_stays_fp32(tmp_path):
    model = digits_data.mlp()
    opt = keras.optimizers.SGD(0.05)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    run = mixed_precision(tf.function(digits_data.keras_train_step(model, opt, loss_fn)),
                          "fp16", weights="fp16")
    x, y = next(digits_data.batches(*digits_data.digits()[:2], 16))
    with pytest.warns(UserWarning, match="keep float32 storage.*build them in float16") as caught:
        run(x, y)
    assert all(v.dtype == "float32" for v in model.trainable_variables)
    # the warning names the user's call, not a line inside TensorFlow's tracing or ours
    assert [w.filename for w in caught] == [__file__]


def test_weights_of_another_16_bit_dtype_are_one_line_errors():
    model = digits_data.mlp(dtype="bfloat16")
    opt = keras.optimizers.SGD(0.05)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    run = mixed_precision(tf.function(digits_data.keras_train_step(model, opt, loss_fn)),
                          "fp16", weights="fp16")
    x, y = next(digits_data.batches(*digits_data.digits()[:2], 16))
    with pytest.raises(AmpError, match="built in bfloat16: build the model in float16 or pass "
                                       "weights='bf16'") as error:
        run(x, y)
    assert "\n" not in str(error.value)


def test_slots_of_another_16_bit_dtype_are_one_line_errors():
    """Keras makes the momentum in the weights' dtype: slots='bf16' cannot hold, and says so
    instead of being ignored."""
    model = digits_data.mlp(dtype="float16")
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    run = mixed_precision(tf.function(digits_data.keras_train_step(model, opt, loss_fn)),
                          "fp16", weights="fp16", slots="bf16")
    x, y = next(digits_data.batches(*digits_data.digits()[:2], 16))
    with pytest.raises(AmpError, match=r"slots='bf16' but variable .* is built in float16 "
                                       r"\(Keras makes .*pass slots='fp16'") as error:
        run(x, y)
    assert "\n" not in str(error.value)
