"""The loss-scale rule on its own (no TensorFlow): its defaults, its checks and its step
function."""

from __future__ import annotations

import pytest

from amp_rewriter.errors import AmpError
from amp_rewriter.options import TrainingOptions
from amp_rewriter.training import LossScaleRule, ScalerState


def test_defaults_are_tensorflows_and_the_target_picks_the_mode():
    rule = LossScaleRule.from_spec(None, "fp16")
    assert (rule.mode, rule.initial_scale, rule.growth_interval, rule.growth_factor,
            rule.backoff_factor, rule.min_scale, rule.hysteresis) == (
        "dynamic", 32768.0, 2000, 2.0, 0.5, 1.0, 1)
    assert LossScaleRule.from_spec(None, "bf16").mode == "none"
    fixed = LossScaleRule.from_spec("1024", "bf16", initial_scale=8.0)
    assert (fixed.mode, fixed.initial_scale) == ("fixed", 1024.0)  # the number wins
    assert LossScaleRule.from_spec("Dynamic", "fp16", growth_interval=3.0).growth_interval == 3


@pytest.mark.parametrize("knobs, message", [
    (dict(backoff_factor=2), "backoff factor must be in (0, 1)"),
    (dict(growth_factor=1), "growth factor must be > 1"),
    (dict(growth_interval=2.5), "growth interval must be an integer from 1 to 2147483647"),
    (dict(growth_interval=float("inf")), "growth interval must be an integer from 1 to"),
    (dict(growth_interval=1e23), "growth interval must be an integer from 1 to"),
    (dict(hysteresis=0), "hysteresis must be an integer from 1 to 2147483647"),
    (dict(min_scale=-1), "minimum scale must be a finite number > 0"),
    (dict(initial_scale="big"), "initial scale must be a number"),
    (dict(initial_scale=True), "initial scale must be a number"),
])
def test_bad_knobs_are_one_error_naming_them(knobs, message):
    with pytest.raises(AmpError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LossScaleRule.from_spec(None, "fp16", **knobs)


def test_bad_specs_and_unknown_options():
    with pytest.raises(AmpError, match="dynamic, none or a number"):
        LossScaleRule.from_spec("often", "fp16")
    with pytest.raises(AmpError, match="no option 'growth'"):
        TrainingOptions(rule={"growth": 2})
    training, rest = TrainingOptions.from_kwargs({"loss": "l", "growth_interval": 5,
                                                  "allow": ["Exp"]})
    assert training.rule == {"growth_interval": 5} and rest == {"allow": ["Exp"]}
    assert training.given_flags() == ["--loss", "--growth-interval"]
    assert training.loss_scale_rule("fp16").growth_interval == 5


def test_good_steps_grow_the_scale_at_the_interval_and_never_to_inf():
    rule = LossScaleRule(initial_scale=2.0 ** 126, growth_interval=2, growth_factor=4.0)
    states = rule.run([True, True, True, True])
    # 2^126 * 4 is inf in float32: the scale stays, the counter restarts all the same
    assert states == [ScalerState(2.0 ** 126, 1), ScalerState(2.0 ** 126, 0),
                      ScalerState(2.0 ** 126, 1), ScalerState(2.0 ** 126, 0)]
    grown = LossScaleRule(initial_scale=3.0, growth_interval=2, growth_factor=1.5).run([True] * 2)
    assert grown[-1] == ScalerState(4.5, 0)


def test_bad_steps_back_off_to_the_floor_and_restart_the_counter():
    rule = LossScaleRule(initial_scale=3.0, backoff_factor=0.25, min_scale=0.5,
                         growth_interval=10)
    states = rule.run([True, True, False, False, False])
    assert [(s.scale, s.good_steps) for s in states] == [(3.0, 1), (3.0, 2), (0.75, 0),
                                                         (0.5, 0), (0.5, 0)]


def test_hysteresis_backs_off_after_that_many_bad_steps_in_a_row():
    rule = LossScaleRule(initial_scale=64.0, hysteresis=2, growth_interval=100)
    states = rule.run([False, True, False, False, False, False])
    assert [(s.scale, s.good_steps, s.bad_steps) for s in states] == [
        (64.0, 0, 1), (64.0, 1, 0), (64.0, 0, 1), (32.0, 0, 0), (32.0, 0, 1), (16.0, 0, 0)]
    assert rule.counts_bad_steps and not LossScaleRule().counts_bad_steps


def test_a_fixed_or_absent_scale_never_moves():
    for mode in ("fixed", "none"):
        rule = LossScaleRule(mode=mode, initial_scale=8.0)
        assert rule.run([False, True, False]) == [ScalerState(8.0)] * 3
    assert not LossScaleRule(mode="none").scales and LossScaleRule(mode="fixed").scales
