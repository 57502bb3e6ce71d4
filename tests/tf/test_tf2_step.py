"""The TF2 training hook on one device: `amp_rewriter.tf.mixed_precision` around a tf.function
train step with tf.GradientTape (Keras 3 optimizers, plain assign_sub), against the fp32 step
and keras.optimizers.LossScaleOptimizer; its report, its checkpoints, and its one-line errors.
Tiny models and a few steps (the accuracy runs are examples/tf2_custom_loop.py and its siblings)."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import digits_data  # noqa: E402  (examples/: the user's train step as the examples write it)

from amp_rewriter.errors import AmpError  # noqa: E402
from amp_rewriter.report import explain_text, load_report  # noqa: E402
from amp_rewriter.tf import mixed_precision  # noqa: E402


def _mlp(optimizer):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, digits_data.keras_train_step(model, optimizer, loss_fn)


def _batch(seed, bad=False, rows=16):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 6)).astype(np.float32)
    if bad:
        x[3, 2] = np.inf
    return x, rng.integers(0, 3, rows).astype(np.int32)


def _values(variables):
    return [np.array(v.numpy(), copy=True) for v in variables]


def test_a_non_finite_batch_writes_nothing_halves_the_scale_and_training_goes_on():
    optimizer = keras.optimizers.Adam(1e-2)
    model, step = _mlp(optimizer)
    amp_step = mixed_precision(tf.function(step), target="fp16")
    for seed in range(3):
        assert np.isfinite(float(amp_step(*_batch(seed))))
    assert float(amp_step.loss_scale) == 2.0 ** 15 and int(amp_step.good_steps) == 3
    before = _values(model.variables + optimizer.variables)
    amp_step(*_batch(3, bad=True))
    after = _values(model.variables + optimizer.variables)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))  # bit-identical
    assert float(amp_step.loss_scale) == 2.0 ** 14 and int(amp_step.good_steps) == 0
    assert int(amp_step.skipped_steps) == 1 and int(optimizer.iterations) == 3
    amp_step(*_batch(4))
    assert not np.array_equal(model.variables[0].numpy(), after[0])
    assert int(amp_step.good_steps) == 1 and int(optimizer.iterations) == 4
    assert amp_step.rewrites == 1


def test_plain_assign_sub_updates_are_gated_too():
    weights = tf.Variable(np.linspace(-1, 1, 18, dtype=np.float32).reshape(6, 3))
    bias = tf.Variable(np.zeros(3, np.float32))

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = tf.matmul(x, weights) + bias
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        grad_w, grad_b = tape.gradient(loss, [weights, bias])
        weights.assign_sub(0.1 * grad_w)
        bias.assign_sub(0.1 * grad_b)
        return loss

    amp_step = mixed_precision(step, growth_interval=2)
    amp_step(*_batch(0))
    before = _values([weights, bias])
    x, y = _batch(1)
    x[0, 0] = np.nan
    amp_step(x, y)
    assert all(np.array_equal(a, b) for a, b in zip(before, _values([weights, bias])))
    assert float(amp_step.loss_scale) == 2.0 ** 14 and int(amp_step.good_steps) == 0
    amp_step(*_batch(2))
    assert not np.array_equal(before[0], weights.numpy())
    training = amp_step.report.training
    assert training["variable_writes"] == {"assign": 2}
    assert sorted(training["update_ops_gated"]) == ["AssignSubVariableOp",
                                                    "AssignSubVariableOp_1"]


def test_scale_and_counter_follow_keras_loss_scale_optimizer_step_by_step():
    steps = [True, True, True, False, True, True, True, True, False, False, True, True, True,
             True]
    ours_optimizer = keras.optimizers.SGD(1e-3)
    _model, step = _mlp(ours_optimizer)
    amp_step = mixed_precision(step, growth_interval=3)
    keras_model, _ = _mlp(keras.optimizers.SGD(1e-3))
    reference = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3),
                                                    dynamic_growth_steps=3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def keras_step(x, y):
        with tf.GradientTape() as tape:
            scaled = reference.scale_loss(loss_fn(y, keras_model(x, training=True)))
        grads = tape.gradient(scaled, keras_model.trainable_variables)
        reference.apply_gradients(zip(grads, keras_model.trainable_variables))

    for index, good in enumerate(steps):
        batch = _batch(index, bad=not good)
        amp_step(*batch)
        keras_step(*batch)
        assert float(amp_step.loss_scale) == float(reference.dynamic_scale.numpy()), index
        assert int(amp_step.good_steps) == int(reference.step_counter.numpy()), index


def _cnn_step(optimizer):
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3),
                              keras.layers.ReLU(), keras.layers.Conv2D(4, 3),
                              keras.layers.Flatten(), keras.layers.Dense(3)])

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return {"loss": loss}

    return model, step


def test_the_report_puts_every_matmul_and_conv_forward_and_backward_low_and_explains_them(
        tmp_path):
    _model, step = _cnn_step(keras.optimizers.SGD(0.05, momentum=0.9))
    amp_step = mixed_precision(step, target="fp16")
    x = np.random.default_rng(0).standard_normal((4, 8, 8, 1)).astype(np.float32)
    out = amp_step(x, np.arange(4, dtype=np.int32) % 3)
    assert set(out) == {"loss"} and np.isfinite(float(out["loss"]))
    counts = amp_step.report.summary["compute_ops_by_type"]
    for op in ("Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput", "MatMul"):
        low, total = counts[op]
        assert total > 0 and low == total, (op, counts)
    path = tmp_path / "step_report.json"
    path.write_text(amp_step.report.to_json())
    report = load_report(path)
    filter_grad = next(n["name"] for n in report.nodes if n["op"] == "Conv2DBackpropFilter")
    assert "precision: fp16" in explain_text(report, filter_grad)
    assert "fp32" in explain_text(report, "amp_loss_scale/update/new_scale")
    assert report.training["loss"].endswith("Mean")


def test_each_new_input_signature_is_rewritten_once_and_bf16_has_no_scale():
    optimizer = keras.optimizers.SGD(0.1)
    _model, step = _mlp(optimizer)
    amp_step = mixed_precision(step, target="bf16")
    assert amp_step.loss_scale is None and amp_step.skipped_steps is None
    for rows in (16, 16, 8, 8, 16):
        amp_step(*_batch(rows, rows=rows))
    assert amp_step.rewrites == 2 and int(optimizer.iterations) == 5
    assert amp_step.report.summary["compute_ops_by_type"]["MatMul"][0] > 0
    assert amp_step.report.training["gradient_seeds_scaled"] == []


def test_a_checkpoint_restores_model_optimizer_and_scaler_and_an_fp32_one_restores_into_it(
        tmp_path):
    optimizer = keras.optimizers.Adam(1e-2)
    model, step = _mlp(optimizer)
    fp32_step = tf.function(step)
    fp32_step(*_batch(0))
    fp32_path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(tmp_path / "fp32")
    amp_step = mixed_precision(step, growth_interval=2)
    for seed, bad in ((1, False), (2, True), (3, False)):
        amp_step(*_batch(seed, bad))
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, scaler=amp_step)
    saved = _values(model.variables + optimizer.variables + list(amp_step.variables))
    path = checkpoint.save(tmp_path / "amp")
    for seed in range(4, 8):
        amp_step(*_batch(seed, bad=seed == 5))
    checkpoint.restore(path).assert_consumed()
    restored = _values(model.variables + optimizer.variables + list(amp_step.variables))
    assert all(np.array_equal(a, b) for a, b in zip(saved, restored))
    assert float(amp_step.loss_scale) == 2.0 ** 14 and int(amp_step.good_steps) == 1
    # an fp32 checkpoint has no scaler: the wrapper keeps its state, the model is restored
    fresh = mixed_precision(step)
    tf.train.Checkpoint(model=model, optimizer=optimizer, scaler=fresh).restore(fp32_path)
    assert float(fresh.loss_scale) == 2.0 ** 15 and int(fresh.good_steps) == 0
    fresh(*_batch(9))
    assert int(optimizer.iterations) == 2


def _no_update_step(x, y):
    weights = tf.ones([6, 3])
    with tf.GradientTape() as tape:
        tape.watch(weights)
        loss = tf.reduce_sum(tf.matmul(x, weights))
    return tape.gradient(loss, weights)


_INT_LOSS_WEIGHTS = tf.Variable(tf.ones([6, 3]))


def _int_loss_step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.cast(tf.reduce_sum(tf.matmul(x, _INT_LOSS_WEIGHTS)), tf.int32)
    _INT_LOSS_WEIGHTS.assign_sub(tape.gradient(loss, _INT_LOSS_WEIGHTS))
    return loss


def _loss_scale_optimizer_step():
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    _model, step = _mlp(optimizer)
    return step


@pytest.mark.parametrize("make, options, message", [
    (lambda: _mlp(keras.optimizers.SGD())[1], {"target": "fp8"}, "unknown target 'fp8'"),
    (lambda: _mlp(keras.optimizers.SGD())[1], {"growth_factor": 0.5},
     "the growth factor must be > 1"),
    (lambda: _mlp(keras.optimizers.SGD())[1], {"outputs": ["y"]}, "no option 'outputs'"),
    (lambda: _no_update_step, {}, "applies none of them"),
    (lambda: _int_loss_step, {}, "is int32, not a float tensor"),
    (_loss_scale_optimizer_step, {}, "cannot be gated"),
    (lambda: 3, {}, "expected a tf.function or a Python function"),
])
def test_bad_use_is_one_amp_error_line(make, options, message):
    with pytest.raises(AmpError) as caught:
        amp_step = mixed_precision(make(), **options)
        amp_step(*_batch(0))
    text = str(caught.value)
    assert message in text and "\n" not in text, text


def test_an_active_summary_writer_gets_the_scale_and_the_skipped_steps(tmp_path):
    optimizer = keras.optimizers.SGD(0.1)
    _model, step = _mlp(optimizer)
    amp_step = mixed_precision(step)
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default(step=optimizer.iterations):
        for seed, bad in ((0, False), (1, True), (2, False)):
            amp_step(*_batch(seed, bad))
    writer.flush()
    logged: dict[str, list] = {}
    for path in tmp_path.iterdir():
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                number = float(tf.make_ndarray(value.tensor))
                logged.setdefault(value.tag, []).append((event.step, number))
    # the writer's step is read after the step ran: the skipped one did not count
    assert logged["amp/loss_scale"] == [(1, 2.0 ** 15), (1, 2.0 ** 14), (2, 2.0 ** 14)]
    assert logged["amp/skipped_steps"] == [(1, 0.0), (1, 1.0), (2, 1.0)]
