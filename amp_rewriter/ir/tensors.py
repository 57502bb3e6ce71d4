"""Constant data in the IR (read lazily) and how it fares in a low-precision dtype."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import FINITE_MAX, NUMPY_DTYPES, SMALLEST_SUBNORMAL


class LazyTensor:
    """Constant data that is only read when a pass needs the values (big weights stay on disk).

    A format may keep a tensor compact: only its leading values, the last of them repeated to
    fill the shape (TensorFlow's compressed TensorProto, where one value can stand for a
    40000x30000 fill). Such a tensor has `stored`; range checks and conversions work on the
    stored values, so a few bytes of input never become gigabytes of memory.
    """

    __slots__ = ("dtype", "shape", "_load", "_array", "handle", "_stored")

    def __init__(self, dtype: str, shape: tuple[int, ...], load: Callable[[], np.ndarray],
                 handle: Any = None, stored: Callable[[], np.ndarray] | None = None):
        self.dtype = dtype
        self.shape = shape
        self._load = load
        self._array: np.ndarray | None = None
        #: The loader's original tensor proto; None for tensors a pass created.
        self.handle = handle
        self._stored = stored

    @classmethod
    def repeating_last(cls, dtype: str, shape: tuple[int, ...], values: np.ndarray,
                       handle: Any = None) -> LazyTensor:
        """A compact tensor: `values` (flat, at least one), the last repeated to fill `shape`."""
        size = math.prod(shape)

        def expand() -> np.ndarray:
            flat = np.concatenate([values, np.full(size - values.size, values[-1], values.dtype)])
            return flat.reshape(shape)
        return cls(dtype, shape, expand, handle=handle, stored=lambda: values)

    @property
    def size(self) -> int:
        """Number of elements, known without reading the data."""
        # math.prod: np.prod costs microseconds per call, and this runs per constant per pass.
        return math.prod(self.shape)

    @property
    def compact(self) -> bool:
        """Whether only leading values are stored, the last repeating (see the class)."""
        return self._stored is not None

    def stored(self) -> np.ndarray:
        """The stored values, flat; the last repeats `size - len` more times. For a tensor that
        is not compact, all its values."""
        if self._stored is None:
            return self.numpy().reshape(-1)
        return self._stored()

    def numpy(self) -> np.ndarray:
        """The values, read (and cached) on first use; a compact tensor is expanded."""
        if self._array is None:
            self._array = self._load()
        return self._array


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


def check_range(array: np.ndarray, dtype: str, repeat_last: int = 0) -> RangeCheck:
    """Count finite values that become inf and non-zero values that become zero in `dtype`.

    `repeat_last`: how many more times the last value occurs (a compact tensor's stored values).
    """
    result = _check_range(array, dtype)
    if repeat_last and array.size:
        last = _check_range(array.reshape(-1)[-1:], dtype)
        result = RangeCheck(result.overflowed + repeat_last * last.overflowed,
                            result.flushed_to_zero + repeat_last * last.flushed_to_zero,
                            result.nonzero + repeat_last * last.nonzero)
    return result


def _check_range(array: np.ndarray, dtype: str) -> RangeCheck:
    magnitude = np.abs(array)
    finite_magnitude = magnitude[np.isfinite(magnitude)] if not np.isfinite(magnitude).all() \
        else magnitude
    nonzero = finite_magnitude[finite_magnitude > 0]
    if (not nonzero.size or (nonzero.max() <= FINITE_MAX[dtype]
                             and nonzero.min() >= SMALLEST_SUBNORMAL[dtype])):
        return RangeCheck(0, 0, int(nonzero.size))  # the common case, without converting
    with np.errstate(over="ignore", invalid="ignore"):
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
    with np.errstate(over="ignore", invalid="ignore"):  # NaN converts to NaN, quietly
        return array.astype(NUMPY_DTYPES[dtype])
