"""Constant data in the IR (read lazily) and how it fares in a low-precision dtype."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import FINITE_MAX, NUMPY_DTYPES, SMALLEST_SUBNORMAL


class LazyTensor:
    """Constant data that is only read when a pass needs the values (big weights stay on disk)."""

    __slots__ = ("dtype", "shape", "_load", "_array", "handle", "_reloadable")

    def __init__(self, dtype: str, shape: tuple[int, ...], load: Callable[[], np.ndarray],
                 handle: Any = None, array: np.ndarray | None = None,
                 reloadable: bool = False):
        self.dtype = dtype
        self.shape = shape
        self._load = load
        #: The values, when already known (a pass's result); else read on first use.
        self._array: np.ndarray | None = array
        #: The loader's original tensor proto; None for tensors a pass created.
        self.handle = handle
        #: Whether `load` can produce the values again (so the cache may be dropped).
        self._reloadable = reloadable or handle is not None

    @property
    def size(self) -> int:
        """Number of elements, known without reading the data."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    def numpy(self) -> np.ndarray:
        """The values, read (and cached) on first use."""
        if self._array is None:
            self._array = self._load()
        return self._array

    def release(self) -> None:
        """Drop the cached values of a tensor that can load them again (one read from its model,
        one a pass computes from such a tensor), so a conversion holds one weight at a time
        rather than all of them."""
        if self._reloadable:
            self._array = None


@dataclass
class RangeCheck:
    """How a float32 array fares when converted to a low-precision dtype."""

    overflowed: int
    flushed_to_zero: int
    nonzero: int = 0

    @property
    def vanishes(self) -> bool:
        """Every non-zero value would become zero."""
        return self.nonzero > 0 and self.flushed_to_zero == self.nonzero


def check_range(array: np.ndarray, dtype: str) -> RangeCheck:
    """Count finite values that become inf and non-zero values that become zero in `dtype`."""
    magnitude = np.abs(array)
    finite_magnitude = magnitude[np.isfinite(magnitude)] if not np.isfinite(magnitude).all() \
        else magnitude
    nonzero = finite_magnitude[finite_magnitude > 0]
    if (not nonzero.size or (nonzero.max() <= FINITE_MAX[dtype]
                             and nonzero.min() >= SMALLEST_SUBNORMAL[dtype])):
        return RangeCheck(0, 0, int(nonzero.size))  # the common case, without converting
    with np.errstate(over="ignore"):
        converted = array.astype(NUMPY_DTYPES[dtype])
    finite = np.isfinite(array)
    overflowed = int(np.count_nonzero(finite & ~np.isfinite(converted)))
    flushed = int(np.count_nonzero((array != 0) & (converted == 0)))
    return RangeCheck(overflowed, flushed, int(nonzero.size))


def convert_array(array: np.ndarray, dtype: str, clamp: bool) -> np.ndarray:
    """`array` in `dtype`; with `clamp`, finite values beyond the dtype's range saturate."""
    if clamp:
        limit = FINITE_MAX[dtype]
        finite = np.isfinite(array)
        array = np.where(finite, np.clip(array, -limit, limit), array)
    with np.errstate(over="ignore"):
        return array.astype(NUMPY_DTYPES[dtype])
