"""Per-tensor statistics, updated batch by batch so no activation outlives its batch.

`RangeStats` is what the fp32 reference run says about one tensor (its range, how much of it
would overflow or flush to zero in the target dtype, on how many batches); `ErrorStats` is how
far a low-precision computation of that tensor is from the reference (max-abs and relative
error, cosine similarity, new NaN/Inf). Both hold a few numbers per tensor, whatever the
number of batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ir.dtypes import FINITE_MAX, NUMPY_DTYPES

#: Smallest positive normal value: below it a value keeps fewer mantissa bits.
SMALLEST_NORMAL = {"float16": 2.0**-14, "bfloat16": 2.0**-126}


def _floating(array: Any) -> np.ndarray:
    """The array in a dtype numpy computes in (bf16 widened to fp32, integers to fp64)."""
    array = np.asarray(array)
    if array.dtype.name == "bfloat16":
        return array.astype(np.float32)
    if not np.issubdtype(array.dtype, np.floating):
        return array.astype(np.float64)
    return array


def _absmax(array: np.ndarray) -> float:
    """max |x| without a temporary array (NaN when there is one)."""
    return float(max(array.max(), -array.min()))


@dataclass
class RangeStats:
    """The fp32 range of one tensor over the calibration batches, and how it fares in `dtype`."""

    dtype: str
    #: The `--data-max` threshold the batches are counted against (the dtype's finite max when
    #: None).
    limit: float | None = None
    elements: int = 0
    absmax: float = 0.0
    minimum: float = math.inf
    maximum: float = -math.inf
    nonfinite: int = 0
    nonzero: int = 0
    #: Finite values that become inf in `dtype`, non-zero values that become zero, non-zero
    #: values below the smallest normal (fewer significant bits).
    overflow: int = 0
    flushed: int = 0
    subnormal: int = 0
    batches: int = 0
    batches_overflowing: int = 0
    batches_flushing: int = 0
    batches_over_limit: int = 0
    shape: tuple[int, ...] = ()

    def update(self, array: Any) -> None:
        """Add one batch's values (a few passes over the array, no float64 copies)."""
        values = _floating(array)
        self.batches += 1
        self.shape = tuple(values.shape)
        if values.size == 0:
            return
        self.elements += values.size
        top = _absmax(values)
        if not math.isfinite(top):
            finite = np.isfinite(values)
            self.nonfinite += int(values.size - np.count_nonzero(finite))
            values = values[finite]
            if values.size == 0:
                return
            top = _absmax(values)
        self.absmax = max(self.absmax, top)
        self.minimum = min(self.minimum, float(values.min()))
        self.maximum = max(self.maximum, float(values.max()))
        nonzero = int(np.count_nonzero(values))
        self.nonzero += nonzero
        overflow = 0
        if top > FINITE_MAX[self.dtype]:
            with np.errstate(over="ignore"):
                overflow = int(np.count_nonzero(~np.isfinite(
                    values.astype(NUMPY_DTYPES[self.dtype]))))
        normal = SMALLEST_NORMAL[self.dtype]
        small = int(np.count_nonzero((values > -normal) & (values < normal))) - (
            values.size - nonzero)
        flushed = 0
        if small:
            tiny = values[(values != 0) & (values > -normal) & (values < normal)]
            flushed = int(np.count_nonzero(tiny.astype(NUMPY_DTYPES[self.dtype]) == 0))
        self.overflow += overflow
        self.flushed += flushed
        self.subnormal += small
        self.batches_overflowing += overflow > 0
        self.batches_flushing += flushed > 0
        self.batches_over_limit += top > self.threshold

    @property
    def threshold(self) -> float:
        """The magnitude above which a value counts as out of range."""
        return FINITE_MAX[self.dtype] if self.limit is None else self.limit

    @property
    def overflow_fraction(self) -> float:
        return self.overflow / self.elements if self.elements else 0.0

    @property
    def flush_fraction(self) -> float:
        """Of the non-zero values, the share that becomes zero in the target dtype."""
        return self.flushed / self.nonzero if self.nonzero else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"absmax": self.absmax,
                "min": self.minimum if self.elements else None,
                "max": self.maximum if self.elements else None,
                "elements": self.elements, "nonfinite": self.nonfinite,
                "overflow_fraction": self.overflow_fraction,
                "flush_fraction": self.flush_fraction,
                "subnormal_fraction": self.subnormal / self.nonzero if self.nonzero else 0.0,
                "batches_overflowing": self.batches_overflowing,
                "batches_flushing": self.batches_flushing,
                "batches_over_limit": self.batches_over_limit, "batches": self.batches}


@dataclass
class ErrorStats:
    """How far a computed tensor is from the reference, over the calibration batches."""

    max_abs: float = 0.0
    ref_absmax: float = 0.0
    sum_sq_error: float = 0.0
    sum_sq_ref: float = 0.0
    sum_sq_new: float = 0.0
    dot: float = 0.0
    elements: int = 0
    #: Elements that are finite in the reference and NaN/Inf here, and the batches with any.
    new_nonfinite: int = 0
    batches_nonfinite: int = 0
    batches: int = 0
    shape_mismatch: bool = False

    def update(self, reference: Any, computed: Any) -> None:
        """Add one batch: the reference values and the computed ones."""
        self.batches += 1
        ref = _floating(reference)
        new = _floating(computed)
        if ref.shape != new.shape:
            self.shape_mismatch = True
            return
        if ref.size == 0:
            return
        work = np.result_type(ref.dtype, new.dtype, np.float32)
        diff = np.subtract(new, ref, dtype=work)
        worst = _absmax(diff)
        if not math.isfinite(worst):  # NaN/Inf somewhere: drop what the reference lacks too
            finite = np.isfinite(ref)
            broken = finite & ~np.isfinite(new)
            broken_count = int(np.count_nonzero(broken))
            if broken_count:
                self.new_nonfinite += broken_count
                self.batches_nonfinite += 1
            keep = finite & ~broken
            ref, new = ref[keep], new[keep]
            if ref.size == 0:
                return
            diff = np.subtract(new, ref, dtype=work)
            worst = _absmax(diff)
        flat_diff, flat_ref, flat_new = diff.ravel(), ref.astype(work, copy=False).ravel(), \
            new.astype(work, copy=False).ravel()
        self.elements += ref.size
        self.max_abs = max(self.max_abs, worst)
        self.ref_absmax = max(self.ref_absmax, _absmax(ref))
        self.sum_sq_error += _dot64(flat_diff, flat_diff)
        self.sum_sq_ref += _dot64(flat_ref, flat_ref)
        self.sum_sq_new += _dot64(flat_new, flat_new)
        self.dot += _dot64(flat_ref, flat_new)

    @property
    def broken(self) -> bool:
        """NaN/Inf where the reference is finite, or a different shape."""
        return self.new_nonfinite > 0 or self.shape_mismatch

    @property
    def relative(self) -> float:
        """max |computed - reference| / max |reference| (inf when broken)."""
        if self.broken:
            return math.inf
        if self.ref_absmax > 0:
            return self.max_abs / self.ref_absmax
        return self.max_abs

    @property
    def rms_relative(self) -> float:
        """Root-mean-square error over the reference's root-mean-square."""
        if self.broken:
            return math.inf
        if self.sum_sq_ref > 0:
            return math.sqrt(self.sum_sq_error / self.sum_sq_ref)
        return math.sqrt(self.sum_sq_error / self.elements) if self.elements else 0.0

    @property
    def cosine(self) -> float:
        if self.broken:
            return -1.0
        denominator = math.sqrt(self.sum_sq_ref * self.sum_sq_new)
        return self.dot / denominator if denominator > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"relative": _json_number(self.relative), "max_abs": self.max_abs,
                "rms_relative": _json_number(self.rms_relative),
                "cosine": self.cosine, "new_nonfinite": self.new_nonfinite,
                "batches_nonfinite": self.batches_nonfinite, "batches": self.batches,
                "shape_mismatch": self.shape_mismatch}


def _json_number(value: float) -> float | str:
    """JSON has no inf: write it as the string "inf"."""
    return value if math.isfinite(value) else "inf"


#: Elements per float64 block of `_dot64` (its memory: two such blocks).
_DOT_BLOCK = 1 << 20


def _dot64(left: np.ndarray, right: np.ndarray) -> float:
    """The dot product of two flat arrays in float64, a block at a time: float32 sums of squares
    overflow once values pass about 1e19 (an attention mask's -3.4e38 squared)."""
    total = 0.0
    for start in range(0, left.size, _DOT_BLOCK):
        stop = start + _DOT_BLOCK
        total += float(np.dot(left[start:stop].astype(np.float64),
                              right[start:stop].astype(np.float64)))
    return total
