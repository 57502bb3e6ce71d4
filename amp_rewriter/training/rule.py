"""The loss-scale rule, declared once: its knobs (each with its command-line flag), their checks,
and `LossScaleRule.step`, the pure function of one training step that the tests use as their
oracle and that the emitted scaler computes in the graph (`training/passes.py` builds it from the
same arithmetic: every product and comparison in float32, as the graph does it).

A step is good when every gradient is finite after aggregation. A good step adds one to the
good-step counter; at `growth_interval` good steps in a row the scale is multiplied by
`growth_factor` (unless that gives inf: the scale stays) and the counter restarts. A bad step
restarts the counter and adds one to the bad-step counter; at `hysteresis` bad steps in a row the
scale is multiplied by `backoff_factor`, never below `min_scale`, and the bad-step counter
restarts (a good step restarts it too). Defaults are TensorFlow's DynamicLossScale: 2^15, x2
after 2000 good steps, x0.5 on a bad one, floor 1.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import AmpError
from ..flags import flag_field

#: Loss scale by target when none is asked for: bf16 has fp32's range, so its gradients do not
#: underflow where fp32's would not (every framework turns loss scaling off for it).
DEFAULT_MODE = {"fp16": "dynamic", "bf16": "none"}
MODES = ("dynamic", "fixed", "none")


@dataclass(frozen=True)
class ScalerState:
    """The scaler's state between steps: the scale (a float32 value) and the counters of good
    and bad steps in a row."""

    scale: float
    good_steps: int = 0
    bad_steps: int = 0


@dataclass(frozen=True)
class LossScaleRule:
    """How the loss scale moves (see the module docstring).

    mode: "dynamic" (the scale follows `step`; the fp16 default), "fixed" (`initial_scale` is a
    constant scale; bad steps are still skipped) or "none" (no scaling, no check; the bf16
    default).
    """

    mode: str = "dynamic"
    initial_scale: float = flag_field(2.0 ** 15, "--initial-scale", "default 32768", type=float)
    growth_interval: int = flag_field(2000, "--growth-interval", "default 2000", type=int)
    growth_factor: float = flag_field(2.0, "--growth-factor", "default 2", type=float)
    backoff_factor: float = flag_field(0.5, "--backoff-factor", "default 0.5", type=float)
    min_scale: float = flag_field(1.0, "--min-scale", "default 1", type=float)
    hysteresis: int = flag_field(1, "--hysteresis", "default 1: back off at the first bad step",
                                 type=int)

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.mode not in MODES:
            problems.append(f"mode must be dynamic, fixed or none, not {self.mode!r}")
        initial = _number(self.initial_scale, problems, "the initial scale")
        interval = _number(self.growth_interval, problems, "the growth interval")
        growth = _number(self.growth_factor, problems, "the growth factor")
        backoff = _number(self.backoff_factor, problems, "the backoff factor")
        floor = _number(self.min_scale, problems, "the minimum scale")
        hysteresis = _number(self.hysteresis, problems, "hysteresis")
        if initial is not None and not (math.isfinite(initial) and initial > 0):
            problems.append(f"the initial scale must be a finite number > 0, got {initial}")
        if interval is not None and not whole_number(interval):
            problems.append(f"the growth interval must be an integer from 1 to "
                            f"{STEP_COUNT_MAX}, got {interval}")
        if growth is not None and not (math.isfinite(growth) and growth > 1):
            problems.append(f"the growth factor must be > 1, got {growth}")
        if backoff is not None and not 0 < backoff < 1:
            problems.append(f"the backoff factor must be in (0, 1), got {backoff}")
        if floor is not None and not (math.isfinite(floor) and floor > 0):
            problems.append(f"the minimum scale must be a finite number > 0, got {floor}")
        if hysteresis is not None and not whole_number(hysteresis):
            problems.append(f"hysteresis must be an integer from 1 to {STEP_COUNT_MAX}, got "
                            f"{hysteresis}")
        if problems:
            raise AmpError("loss scale: " + "; ".join(problems))
        # Numbers as the rule computes with them (an API caller may pass 3.0 or numpy scalars).
        for name in ("initial_scale", "growth_factor", "backoff_factor", "min_scale"):
            object.__setattr__(self, name, float(getattr(self, name)))
        for name in ("growth_interval", "hysteresis"):
            object.__setattr__(self, name, int(getattr(self, name)))

    @classmethod
    def knobs(cls) -> tuple[str, ...]:
        """The fields a user sets by name (`--growth-interval`, `growth_interval=`): all but
        the mode, which `--loss-scale` chooses."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "mode")

    @classmethod
    def from_spec(cls, spec: str | float | None, target: str, **knobs: Any) -> LossScaleRule:
        """The rule for `--loss-scale SPEC` ("dynamic", "none", a number: a fixed scale; None:
        the target's default) with the knobs the user set (None: the default)."""
        unknown = sorted(set(knobs) - set(cls.knobs()))
        if unknown:
            raise AmpError(f"loss scale: no option {unknown[0]!r} (options: "
                           f"{', '.join(cls.knobs())})")
        given = {name: value for name, value in knobs.items() if value is not None}
        if spec is None:
            spec = DEFAULT_MODE.get(target, "dynamic")
        if isinstance(spec, str) and spec.lower() in ("dynamic", "none"):
            return cls(mode=spec.lower(), **given)
        try:
            value = float(spec)
        except (TypeError, ValueError):
            raise AmpError(f"--loss-scale must be dynamic, none or a number, got "
                           f"{spec!r}") from None
        return cls(mode="fixed", **{**given, "initial_scale": value})

    @property
    def scales(self) -> bool:
        """Whether the loss is scaled at all (and bad steps skipped)."""
        return self.mode != "none"

    @property
    def dynamic(self) -> bool:
        """Whether the scale changes from step to step (state variables, an update)."""
        return self.mode == "dynamic"

    @property
    def counts_bad_steps(self) -> bool:
        """Whether the state keeps a bad-step counter (only hysteresis needs one)."""
        return self.dynamic and self.hysteresis > 1

    def initial_state(self) -> ScalerState:
        """The state before the first step."""
        return ScalerState(float(np.float32(self.initial_scale)))

    def step(self, state: ScalerState, finite: bool) -> ScalerState:
        """The state after one step whose gradients were all finite (`finite`) or not. Pure:
        float32 arithmetic, as the graph computes it; a fixed or absent scale never moves."""
        if not self.dynamic:
            return state
        scale = np.float32(state.scale)
        with np.errstate(over="ignore"):
            if finite:
                good_next = state.good_steps + 1
                grow = good_next >= self.growth_interval
                grown = np.float32(scale * np.float32(self.growth_factor))
                if grow and np.isfinite(grown):
                    scale = grown
                return ScalerState(float(scale), 0 if grow else good_next, 0)
            bad_next = state.bad_steps + 1
            back_off = bad_next >= self.hysteresis
            if back_off:
                scale = max(np.float32(scale * np.float32(self.backoff_factor)),
                            np.float32(self.min_scale))
            return ScalerState(float(scale), 0, 0 if back_off else bad_next)

    def run(self, steps: list[bool]) -> list[ScalerState]:
        """The state after each step of a good/bad sequence, from the initial state."""
        states, state = [], self.initial_state()
        for finite in steps:
            state = self.step(state, finite)
            states.append(state)
        return states

    def as_dict(self) -> dict[str, Any]:
        """The rule as the report writes it."""
        return dataclasses.asdict(self)


#: The largest growth interval or hysteresis: the step counters they are compared with are int32.
STEP_COUNT_MAX = 2**31 - 1


def whole_number(value: Any, low: int = 1, high: int = STEP_COUNT_MAX) -> bool:
    """Whether `value` is a whole number in [low, high]; by default a number of steps an int32
    counter can reach (3.0 is; True, 2.5, 1e23 and inf are not: a graph could not even hold the
    constant)."""
    if isinstance(value, bool):
        return False
    try:
        number = float(value)
    except (TypeError, ValueError):
        return False
    return math.isfinite(number) and number == int(number) and low <= number <= high


def _number(value: Any, problems: list[str], what: str) -> float | None:
    """`value` as a number, or None with a problem recorded."""
    if isinstance(value, bool):
        problems.append(f"{what} must be a number, got {value!r}")
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        problems.append(f"{what} must be a number, got {value!r}")
        return None
