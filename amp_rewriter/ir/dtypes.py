"""Dtype names the IR uses, and what each low-precision target can represent."""

from __future__ import annotations

import ml_dtypes
import numpy as np

FLOAT32 = "float32"
FLOAT16 = "float16"
BFLOAT16 = "bfloat16"
FLOAT64 = "float64"
#: Dtypes the passes may repaint (only fp32 is ever lowered; the others are recognised as floats).
FLOAT_DTYPES = frozenset({FLOAT32, FLOAT16, BFLOAT16, FLOAT64})
LOW_PRECISION_DTYPES = frozenset({FLOAT16, BFLOAT16})

#: The user's name of a target ("fp16") -> the dtype it paints.
TARGET_DTYPES = {"fp16": FLOAT16, "bf16": BFLOAT16}
#: Short names for reports and new value names.
SHORT_NAMES = {FLOAT16: "fp16", BFLOAT16: "bf16", FLOAT32: "fp32", FLOAT64: "fp64"}

NUMPY_DTYPES = {FLOAT16: np.dtype(np.float16), BFLOAT16: np.dtype(ml_dtypes.bfloat16),
                FLOAT32: np.dtype(np.float32)}
#: Largest finite value of each low-precision dtype.
FINITE_MAX = {FLOAT16: 65504.0, BFLOAT16: float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)}
#: Smallest positive normal value of each low-precision dtype (below it precision thins out).
SMALLEST_NORMAL = {FLOAT16: 2.0**-14, BFLOAT16: 2.0**-126}
#: Smallest positive (subnormal) value of each low-precision dtype.
SMALLEST_SUBNORMAL = {FLOAT16: 2.0**-24, BFLOAT16: 2.0**-133}


def short_name(dtype: str | None) -> str | None:
    """"fp16" for "float16"; other dtype names are returned as they are."""
    return SHORT_NAMES.get(dtype, dtype) if dtype is not None else None
