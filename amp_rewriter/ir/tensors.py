"""Constant data in the IR (read lazily) and how it fares in a low-precision dtype."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any, cast

import numpy as np

from .. import progress
from .dtypes import FINITE_MAX, FLOAT32, NUMPY_DTYPES, SMALLEST_SUBNORMAL

#: Bytes of a streaming tensor (one whose values stay in a file, see `LazyTensor.chunks`) read,
#: checked or converted at a time: its memory cost, whatever the tensor's size.
CHUNK_BYTES = 64 << 20
#: Elements handled per numpy call inside a chunk: small enough that the several passes of a
#: range check find the block in the CPU cache.
_BLOCK = 1 << 18
#: Threads that range-check one streamed chunk (more than a few only contend for memory bandwidth).
_MAX_RANGE_THREADS = 4

#: Reads a tensor's values from where they are stored, flat, a slice of at most `CHUNK_BYTES`
#: at a time (read when called, so a test may lower it).
ChunkReader = Callable[[], Iterator[np.ndarray]]


class LazyTensor:
    """Constant data that is only read when a pass needs the values (big weights stay on disk).

    A format may keep a tensor compact: only its leading values, the last of them repeated to
    fill the shape (TensorFlow's compressed TensorProto, where one value can stand for a
    40000x30000 fill). Such a tensor has `stored`; range checks and conversions work on the
    stored values, so a few bytes of input never become gigabytes of memory.

    A tensor may also stream (`reader`): its values are then read a chunk at a time
    (`chunks`), so range checks and conversions of a weight stored in a file of several
    gigabytes never hold more than a chunk of it (`numpy` still reads it whole when asked).
    """

    __slots__ = ("dtype", "shape", "_load", "_array", "handle", "_stored", "_reader",
                 "conversion", "_reloadable", "checked_range")

    def __init__(self, dtype: str, shape: tuple[int, ...], load: Callable[[], np.ndarray] | None,
                 handle: Any = None, stored: Callable[[], np.ndarray] | None = None,
                 reader: ChunkReader | None = None, array: np.ndarray | None = None,
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
        self._stored = stored
        self._reader = reader
        #: (source tensor, clamp) of a tensor `converted` from another (`load` is None then):
        #: its values are the source's, converted when read; a writer may convert a streaming
        #: source's chunks itself, with a faster cast of the same result.
        self.conversion: tuple[LazyTensor, bool] | None = None
        #: (dtype, its range check): kept with the tensor by the conversion that checked it, so
        #: that every pass asking again gets it without a table of its own (hundreds of
        #: thousands of constants in a million-node graph).
        self.checked_range: tuple[str, RangeCheck] | None = None

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
            self._array = self._load() if self._load is not None else self._convert()
        return self._array

    def _convert(self) -> np.ndarray:
        assert self.conversion is not None, "a tensor without data or a source"
        source, clamp = self.conversion
        # The source is read for this conversion only: unless something else had read it, it
        # is let go again, so the fp32 weights are not kept beside the converted ones.
        was_read = source._array is not None
        values = convert_array(np.asarray(source.numpy(), np.float32), self.dtype, clamp)
        if not was_read:
            source.release()
        return values

    def release(self) -> None:
        """Drop the cached values of a tensor that can load them again (one read from its model,
        one a pass computes from such a tensor), so a conversion holds one weight at a time
        rather than all of them."""
        if self._reloadable:
            self._array = None

    @property
    def streams(self) -> bool:
        """Whether the values are read a chunk at a time (a file's tensor not read whole yet,
        or a conversion of one)."""
        if self._array is not None:
            return False
        if self.conversion is not None:
            return self.conversion[0].streams
        return self._reader is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the values in their dtype, known without reading them."""
        return self.size * NUMPY_DTYPES.get(self.dtype, np.dtype(np.uint8)).itemsize

    def chunks(self) -> Iterator[np.ndarray]:
        """The values, flat, a slice of at most `CHUNK_BYTES` at a time: streamed from their
        file when the tensor `streams`, else slices of `numpy()` (a compact tensor expanded).
        A chunk may be a view of a buffer the next one reuses: use it before asking for more."""
        if self.streams:
            if self._reader is not None:
                yield from self._reader()
                return
            assert self.conversion is not None
            source, clamp = self.conversion
            for chunk in source.chunks():
                yield convert_array(np.asarray(chunk, np.float32), self.dtype, clamp)
            return
        flat = self.numpy().reshape(-1)
        step = max(1, CHUNK_BYTES // max(1, flat.itemsize))
        for start in range(0, flat.size, step):
            yield flat[start:start + step]

    def converted(self, dtype: str, clamp: bool) -> LazyTensor:
        """This float32 tensor in `dtype` (see `convert_array`), converted when read: a
        streaming tensor converts chunk by chunk as it is written out, never whole."""
        # No closures: one small object per converted weight (a million-node graph has
        # hundreds of thousands). Reloadable: the values can be computed again from the
        # source, so an emitter's `release` frees them once they are in the output.
        result = LazyTensor(dtype, self.shape, None, reloadable=True)
        result.conversion = (self, clamp)
        return result


@dataclass(frozen=True, slots=True)
class RangeCheck:
    """How a float32 array fares when converted to a low-precision dtype (immutable: equal
    checks of many constants may share one object, see `range_check_of`)."""

    overflowed: int
    flushed_to_zero: int
    nonzero: int = 0

    @property
    def vanishes(self) -> bool:
        """Every non-zero value would become zero."""
        return self.nonzero > 0 and self.flushed_to_zero == self.nonzero


@lru_cache(maxsize=1 << 12)
def range_check_of(overflowed: int, flushed_to_zero: int, nonzero: int) -> RangeCheck:
    """The RangeCheck of these counts, one object for equal counts: hundreds of thousands of
    small weights have a handful of different results, kept with each weight."""
    return RangeCheck(overflowed, flushed_to_zero, nonzero)


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


def check_range_chunks(chunks: Iterable[np.ndarray], dtype: str) -> RangeCheck:
    """`check_range` of the concatenation of `chunks` (flat float32 slices of one tensor), one
    chunk at a time: the counts of the slices add up. Each chunk is split between the CPU's
    cores (numpy releases the GIL in its loops) and finished before the next is read."""
    workers = min(os.cpu_count() or 1, _MAX_RANGE_THREADS)

    def check_slice(flat: np.ndarray) -> RangeCheck:
        return _sum_checks(_check_block(flat[start:start + _BLOCK], dtype)
                           for start in range(0, flat.size, _BLOCK))

    parts: list[RangeCheck] = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for chunk in chunks:
            flat = np.asarray(chunk, np.float32).reshape(-1)
            # Slices on block boundaries, so the blocks are the same whatever the thread count.
            per_slice = -(-flat.size // (workers * _BLOCK)) * _BLOCK or _BLOCK
            slices = [flat[start:start + per_slice] for start in range(0, flat.size, per_slice)]
            parts.extend(pool.map(check_slice, slices))  # done before the next chunk is read
    return _sum_checks(parts)


def _sum_checks(parts: Iterable[RangeCheck]) -> RangeCheck:
    """The counts of several parts of one tensor, added."""
    overflowed = flushed = nonzero = 0
    for part in parts:
        overflowed += part.overflowed
        flushed += part.flushed_to_zero
        nonzero += part.nonzero
    return RangeCheck(overflowed, flushed, nonzero)


def _counted(chunks: Iterable[np.ndarray], drawn: Any) -> Iterator[np.ndarray]:
    """The chunks, each counted on a progress bar as it is handed on."""
    for chunk in chunks:
        yield chunk
        drawn.update(chunk.nbytes)


#: Bit pattern of float32 infinity; magnitudes at or above it are inf or NaN.
_INF_BITS = 0x7F800000


@cache
def _rounding_limits(dtype: str) -> tuple[int, int]:
    """(the smallest float32 magnitude, as bits, that becomes inf in `dtype`; the largest that
    becomes zero), found by converting with numpy, so they agree with `_check_range` exactly.
    Conversion rounds monotonically, so a binary search over the bit patterns finds them."""
    target = NUMPY_DTYPES[dtype]

    def converted(bits: int) -> float:
        value = np.array([bits], np.uint32).view(np.float32)
        with np.errstate(over="ignore"):
            return float(value.astype(target)[0])

    low, high = 0, _INF_BITS  # the first overflowing pattern lies in (low, high]
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if np.isinf(converted(middle)) else (middle, high)
    overflow_from = high
    low, high = 0, _INF_BITS  # the last pattern that becomes zero lies in [low, high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if converted(middle) == 0 else (low, middle)
    return overflow_from, low


def _check_block(block: np.ndarray, dtype: str) -> RangeCheck:
    """`_check_range` of a flat float32 block, counted on the bit patterns (magnitudes of
    float32 values order as their bits do; inf and NaN lie above every finite value): a few
    cheap passes instead of a conversion."""
    overflow_from, zero_up_to = _rounding_limits(dtype)
    magnitude = np.bitwise_and(block.view(np.uint32), np.uint32(0x7FFFFFFF))
    if not magnitude.size:
        return RangeCheck(0, 0, 0)
    nonzero = int(np.count_nonzero(magnitude))
    highest = int(magnitude.max())
    nonfinite = overflowed = flushed = 0
    if highest >= _INF_BITS:
        nonfinite = int(np.count_nonzero(magnitude >= np.uint32(_INF_BITS)))
    if highest >= overflow_from and overflow_from < _INF_BITS:
        overflowed = int(np.count_nonzero((magnitude >= np.uint32(overflow_from))
                                          & (magnitude < np.uint32(_INF_BITS))))
    if nonzero and zero_up_to:
        np.subtract(magnitude, np.uint32(1), out=magnitude)  # zero wraps to the largest value
        if int(magnitude.min()) < zero_up_to:
            flushed = int(np.count_nonzero(magnitude < np.uint32(zero_up_to)))
    return RangeCheck(overflowed, flushed, nonzero - nonfinite)


def tensor_range(tensor: LazyTensor, dtype: str) -> RangeCheck:
    """`check_range` of a float32 constant in `dtype`: a compact tensor on its stored values,
    a streaming one a chunk at a time."""
    if tensor.streams and tensor.dtype == FLOAT32:
        with progress.bar("checking weights", tensor.nbytes, "B") as drawn:
            return check_range_chunks(_counted(tensor.chunks(), drawn), dtype)
    values = np.asarray(tensor.stored(), dtype=np.float32)  # compact: not expanded
    return check_range(values, dtype, tensor.size - values.size)


#: Values checked together by `tensor_ranges` (about 4 MB of float32 at a time).
_BATCH_VALUES = 1 << 20


def tensor_ranges(tensors: Iterable[LazyTensor], dtype: str) -> list[RangeCheck]:
    """`tensor_range` of each of many float32 constants: the plain ones (neither compact nor
    streaming, not empty) are checked a batch of their values at a time, a few numpy calls for
    thousands of small constants (a million-node graph has hundreds of thousands) rather than a
    few per constant; the counts are those `check_range` gives each. Their cached values are
    released as they are batched (`LazyTensor.release`)."""
    tensors = list(tensors)
    results: list[RangeCheck | None] = [None] * len(tensors)
    batch: list[np.ndarray] = []
    positions: list[int] = []
    held = 0
    for position, tensor in enumerate(tensors):
        if tensor.streams or tensor.compact or tensor.dtype != FLOAT32 or not tensor.size:
            results[position] = tensor_range(tensor, dtype)
            continue
        batch.append(np.asarray(tensor.numpy(), dtype=np.float32).reshape(-1))
        tensor.release()  # the batch holds the values until they are checked
        positions.append(position)
        held += tensor.size
        if held >= _BATCH_VALUES:
            _check_batch(batch, positions, dtype, results)
            batch, positions, held = [], [], 0
    if batch:
        _check_batch(batch, positions, dtype, results)
    assert all(result is not None for result in results)
    return cast(list[RangeCheck], results)


def _check_batch(arrays: list[np.ndarray], positions: list[int], dtype: str,
                 results: list[RangeCheck | None]) -> None:
    """`_check_range` of each of `arrays` (none empty), into `results` at `positions`."""
    values = np.concatenate(arrays)
    starts = np.zeros(len(arrays), dtype=np.int64)
    np.cumsum([array.size for array in arrays[:-1]], out=starts[1:])
    overflowing, flushing = _inexact(values, dtype)
    nonzero_finite = np.isfinite(values) & (values != 0)
    counts = np.add.reduceat(np.stack([overflowing, flushing, nonzero_finite]).astype(np.int64),
                             starts, axis=1)
    for position, overflowed, flushed, nonzero in zip(positions, *counts.tolist()):
        results[position] = range_check_of(overflowed, flushed, nonzero)


#: Up to this many values, `_check_range` looks at them one by one in Python: a few numpy calls
#: cost more for so few (a million-node model has a few hundred thousand small constants).
_FEW_VALUES = 16


def _check_range(array: np.ndarray, dtype: str) -> RangeCheck:
    if array.size <= _FEW_VALUES:
        limit, smallest = FINITE_MAX[dtype], SMALLEST_SUBNORMAL[dtype]
        nonzero = 0
        for value in array.ravel().tolist():
            magnitude = abs(value)
            if magnitude == 0 or not math.isfinite(magnitude):
                continue
            if magnitude > limit or magnitude < smallest:
                break  # one that converts inexactly: counted by the general case below
            nonzero += 1
        else:
            return range_check_of(0, 0, nonzero)
    magnitude = np.abs(array)
    finite_magnitude = magnitude[np.isfinite(magnitude)] if not np.isfinite(magnitude).all() \
        else magnitude
    nonzero = finite_magnitude[finite_magnitude > 0]
    if (not nonzero.size or (nonzero.max() <= FINITE_MAX[dtype]
                             and nonzero.min() >= SMALLEST_SUBNORMAL[dtype])):
        return range_check_of(0, 0, int(nonzero.size))  # the common case, without converting
    overflowing, flushing = _inexact(array, dtype)
    return RangeCheck(int(np.count_nonzero(overflowing)), int(np.count_nonzero(flushing)),
                      int(nonzero.size))


def _inexact(values: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Per value, converted to `dtype`: whether a finite one becomes infinite, and whether a
    non-zero one becomes zero."""
    with np.errstate(over="ignore", invalid="ignore"):
        converted = values.astype(NUMPY_DTYPES[dtype])
    return np.isfinite(values) & ~np.isfinite(converted), (values != 0) & (converted == 0)


def convert_array(array: np.ndarray, dtype: str, clamp: bool) -> np.ndarray:
    """`array` in `dtype`; with `clamp`, finite values beyond the dtype's range saturate."""
    if clamp:
        limit = FINITE_MAX[dtype]
        finite = np.isfinite(array)
        array = np.where(finite, np.clip(array, -limit, limit), array)
    with np.errstate(over="ignore", invalid="ignore"):  # NaN converts to NaN, quietly
        return array.astype(NUMPY_DTYPES[dtype])
