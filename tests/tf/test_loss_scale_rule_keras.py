"""The loss-scale rule's step function against Keras's own LossScaleOptimizer: the same scale and
counter after every step of a random good/bad sequence."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from amp_rewriter.training import LossScaleRule  # noqa: E402


@pytest.mark.parametrize("growth_interval", [1, 3])
def test_step_function_equals_keras_loss_scale_optimizer(growth_interval):
    # Keras grows x2 and backs off x0.5 with no floor and no inf guard: a floor far below
    # anything 200 steps reach and a sequence that never grows to inf make the two rules one.
    rule = LossScaleRule(initial_scale=2.0 ** 15, growth_interval=growth_interval,
                         min_scale=2.0 ** -100)
    steps = [bool(s) for s in np.random.default_rng(growth_interval).random(200) < 0.7]
    variable = keras.Variable(np.zeros(2, np.float32))
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate=0.0), initial_scale=2.0 ** 15,
        dynamic_growth_steps=growth_interval)
    good, bad = tf.constant([1.0, 2.0]), tf.constant([1.0, np.inf])
    keras_states = []
    for finite in steps:
        optimizer.apply([good if finite else bad], [variable])
        keras_states.append((float(optimizer.dynamic_scale.numpy()),
                             int(optimizer.step_counter.numpy())))
    ours = [(state.scale, state.good_steps) for state in rule.run(steps)]
    assert ours == keras_states
    assert len({scale for scale, _ in ours}) > 10  # the scale moved both ways many times
