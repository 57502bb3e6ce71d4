"""How a training step updates its variables, declared once (each knob with its command-line
flag, like the loss-scale rule): where the weights live, how their updates are rounded, how the
loss scale is taken back out of the gradients, and over how many micro-steps gradients are
accumulated.

- `weights`: None keeps fp32 master weights (the default); "fp16" or "bf16" stores the trainable
  variables themselves in 16 bits. The optimizer still computes in fp32, on an fp32 view of each
  weight, and the new value is rounded back by `rounding`: "stochastic" (the default for 16-bit
  weights: unbiased, so updates below half a unit in the last place still add up) or "nearest".
  Stochastic rounding draws its bits from a stateless generator keyed by (`rounding_seed` and the
  variable, the step), so a run is reproducible and every replica draws the same bits.
- `slots`: optimizer state (momentum, Adam's m and v) stays fp32 unless this is "fp16"/"bf16".
- `unscale`: "gradients" multiplies every gradient by 1/scale; "optimizer" folds the scale into
  each update's learning rate (SGD, momentum) or epsilon (Adam: times the scale; RMSProp: times
  its square) instead, one scalar product per update rather than one product per gradient
  (exact where the scale is a power of two; a fixed scale only; the optimizer's state then
  holds scaled gradients); "auto" folds where that is exact and changes no stored value: the
  factor is a power of two and the updates keep no state (plain SGD).
- `accumulate`: gradients of N micro-steps are summed into fp32 accumulators and applied, as
  their mean, once per window; the loss scale stays fixed within a window.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import AmpError
from ..flags import flag_field
from ..ir.dtypes import TARGET_DTYPES
from ..ir.rounding import NEAREST, ROUNDING_MODES, STOCHASTIC
from .rule import STEP_COUNT_MAX, whole_number

UNSCALE_MODES = ("auto", "gradients", "optimizer")
#: The largest rounding seed (it is hashed with each variable's name into an int64 key).
SEED_MAX = 2**31 - 1


@dataclass(frozen=True)
class UpdateOptions:
    """Where the weights live and how an update reaches them (see the module docstring)."""

    weights: str | None = flag_field(
        None, "--weights", "fp16 or bf16: store the trainable variables in 16 bits (the "
        "optimizer computes in fp32 and rounds each update back; checkpoints hold 16 bits); "
        "default (or fp32): fp32 master weights", metavar="fp16|bf16|fp32")
    rounding: str | None = flag_field(
        None, "--rounding", "how a 16-bit weight or slot takes its update: stochastic (the "
        "default) or nearest", metavar="stochastic|nearest")
    slots: str | None = flag_field(
        None, "--slots", "fp16 or bf16: store optimizer slots (momentum, Adam's m and v) in 16 "
        "bits too (default fp32)", metavar="fp16|bf16")
    rounding_seed: int = flag_field(0, "--rounding-seed", "seed of stochastic rounding's "
                                    "random bits (default 0)", metavar="N", type=int)
    unscale: str = flag_field(
        "auto", "--unscale", "where 1/loss-scale is applied: gradients (one multiply each), "
        "optimizer (folded into learning rates or epsilons; a fixed scale; slots then hold "
        "scaled gradients) or auto (default: folded where exact and no slot changes: SGD with "
        "a power-of-two scale)", metavar="auto|gradients|optimizer")
    accumulate: int = flag_field(1, "--accumulate", "apply the mean of N micro-steps' gradients "
                                 "once every N steps (default 1)", metavar="N", type=int)

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name in ("weights", "slots"):
            if getattr(self, name) == "fp32":  # said explicitly: fp32 master weights / slots
                object.__setattr__(self, name, None)
        for name in ("weights", "slots"):
            value = getattr(self, name)
            if value is not None and value not in TARGET_DTYPES:
                problems.append(f"--{name} must be fp16, bf16 or fp32, got {value!r}")
        if self.rounding is not None:
            if self.rounding not in ROUNDING_MODES:
                problems.append(f"--rounding must be stochastic or nearest, got "
                                f"{self.rounding!r}")
            elif self.weights is None and self.slots is None:
                problems.append("--rounding applies to 16-bit weights or slots: give --weights "
                                "or --slots")
        if self.unscale not in UNSCALE_MODES:
            problems.append(f"--unscale must be auto, gradients or optimizer, got "
                            f"{self.unscale!r}")
        if not whole_number(self.rounding_seed, 0, SEED_MAX):
            problems.append(f"--rounding-seed must be an integer from 0 to {SEED_MAX}, got "
                            f"{self.rounding_seed!r}")
        if not whole_number(self.accumulate):
            problems.append(f"--accumulate must be an integer from 1 to {STEP_COUNT_MAX}, got "
                            f"{self.accumulate!r}")
        if problems:
            raise AmpError("; ".join(problems))
        object.__setattr__(self, "rounding_seed", int(self.rounding_seed))
        object.__setattr__(self, "accumulate", int(self.accumulate))

    @classmethod
    def knobs(cls) -> tuple[str, ...]:
        """The fields a user sets by name (`--weights`, `weights=`)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @property
    def weight_dtype(self) -> str | None:
        """The IR dtype the weights are stored in (None: fp32 master weights)."""
        return TARGET_DTYPES[self.weights] if self.weights else None

    @property
    def slot_dtype(self) -> str | None:
        """The IR dtype optimizer slots are stored in (None: fp32)."""
        return TARGET_DTYPES[self.slots] if self.slots else None

    @property
    def rounding_mode(self) -> str:
        """How a 16-bit variable takes its update."""
        return self.rounding or STOCHASTIC

    @property
    def stochastic(self) -> bool:
        """Whether some variable is rounded stochastically (the step needs a counter for it)."""
        return (self.weights is not None or self.slots is not None) \
            and self.rounding_mode != NEAREST

    def as_dict(self) -> dict[str, Any]:
        """The options as the report writes them."""
        return {**dataclasses.asdict(self), "rounding": self.rounding_mode
                if self.weights or self.slots else None}

