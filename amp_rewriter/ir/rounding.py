"""How the IR's Cast rounds, and stochastic rounding's bit procedure as numpy (the reference the
formats' lowerings are tested against, bit for bit).

A Cast rounds to nearest, ties to even, unless its `rounding` attribute says `stochastic`. A
stochastic Cast (float32 to float16 or bfloat16) has a second input, its key: an int64 pair from
which the format draws the random bits with a stateless generator, so equal keys give equal bits
(the same draw on every replica of a distributed step). The format lowers it to ordinary ops
(formats/tf/rounding.py); nothing else needs to know how.

Stochastic rounding keeps x when the target holds it, and otherwise rounds |x| up to the next
representable value with probability (|x| - below) / (above - below), down otherwise: the
expected result is x, so a sum of updates smaller than half a unit in the last place drifts
where round-to-nearest would stall. The procedure works on the bits, in integers only (no
floating-point step that a flush-to-zero mode could change):

    a = |x|'s float32 bits; e = a >> 23 (the exponent field), e1 = max(e, 1)
    sig = the significand as an integer (the 23 stored bits, with the leading 1 for e >= 1)
    k = (23 - M) + max(0, E - e1)       bits of sig below the target's unit in the last place
                                        (M: the target's mantissa bits; E: the float32
                                        exponent field of its smallest normal number)
    q = (sig + (r mod 2^k)) >> k        r: the random bits, so sig rounds up with probability
                                        (sig mod 2^k) / 2^k
    bits = (max(e1 - E, 0) << M) + q    the target's bits (a carry out of q moves to the next
                                        exponent, and subnormals fall out of the same formula)

with the sign put back on top. Where |x| is beyond the target's largest finite value (inf and
NaN included) the result is round-to-nearest's, so stochastic rounding never overflows where
round-to-nearest does not, and NaN stays NaN. k is at most 62 (the random bits are int64);
below 2^-63 (float16) the value rounds to zero, where its chance of rounding up would be below
2^-39.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import BFLOAT16, FLOAT16, NUMPY_DTYPES

NEAREST = "nearest"
STOCHASTIC = "stochastic"
ROUNDING_MODES = (NEAREST, STOCHASTIC)
#: The Cast attribute that holds the mode (absent: round to nearest).
ROUNDING_ATTR = "rounding"
#: The most random bits one element uses (the random bits are int64, kept non-negative).
MAX_DROPPED_BITS = 62


@dataclass(frozen=True)
class RoundingFormat:
    """What the bit procedure needs of a 16-bit target."""

    #: Stored mantissa bits.
    mantissa_bits: int
    #: The float32 exponent field of the target's smallest normal number.
    smallest_normal_field: int
    #: The float32 bits of the target's largest finite value.
    largest_finite_bits: int


ROUNDING_FORMATS = {
    FLOAT16: RoundingFormat(10, 127 - 14, 0x477FE000),     # 2^-14, 65504
    BFLOAT16: RoundingFormat(7, 1, 0x7F7F0000),             # 2^-126, (2 - 2^-7) * 2^127
}


def rounding_of(attrs: Any) -> str:
    """The rounding mode a Cast's attributes ask for (`Node.attrs`)."""
    return str(attrs.get(ROUNDING_ATTR, NEAREST))


def stochastic_round(x: np.ndarray, random_bits: np.ndarray, dtype: str) -> np.ndarray:
    """`x` (float32) rounded stochastically to `dtype` (float16 or bfloat16) with the given
    random bits (int64, one per element; only their low bits are used), by the procedure of
    the module docstring."""
    fmt = ROUNDING_FORMATS[dtype]
    x = np.asarray(x, np.float32)
    bits = x.view(np.int32).astype(np.int64)
    magnitude = bits & 0x7FFFFFFF
    exponent = magnitude >> 23
    exponent1 = np.maximum(exponent, 1)
    significand = (magnitude & 0x7FFFFF) | np.where(exponent >= 1, 1 << 23, 0)
    dropped = (23 - fmt.mantissa_bits) + np.maximum(fmt.smallest_normal_field - exponent1, 0)
    capped = np.minimum(dropped, MAX_DROPPED_BITS)
    noise = np.asarray(random_bits, np.int64) & ((np.int64(1) << capped) - 1)
    kept = (significand + noise) >> capped
    kept = np.where(dropped > MAX_DROPPED_BITS, 0, kept)
    out = (np.maximum(exponent1 - fmt.smallest_normal_field, 0) << fmt.mantissa_bits) + kept
    out = out + np.where(bits < 0, 1 << 15, 0)
    rounded = out.astype(np.uint16).view(NUMPY_DTYPES[dtype])
    with np.errstate(over="ignore", invalid="ignore"):
        nearest = x.astype(NUMPY_DTYPES[dtype])
    return np.where(magnitude > fmt.largest_finite_bits, nearest, rounded)
