"""Stochastic rounding's bit procedure (`ir.rounding.stochastic_round`), without TensorFlow: it
keeps what the target holds, picks one of the two neighbours otherwise, is unbiased, handles
subnormals, overflows only where round-to-nearest does, and keeps NaN."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from amp_rewriter.ir import BFLOAT16, FLOAT16
from amp_rewriter.ir.dtypes import NUMPY_DTYPES
from amp_rewriter.ir.rounding import stochastic_round

TARGETS = [FLOAT16, BFLOAT16]


def _bits(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(-2**63, 2**63 - 1, size=shape, dtype=np.int64,
                                                endpoint=True)


def _neighbours(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The target values just below and above each x (x itself twice when it is one)."""
    low = NUMPY_DTYPES[dtype]
    nearest = x.astype(low)
    toward = np.where(nearest.astype(np.float32) > x, -np.inf, np.inf).astype(low)
    other = np.nextafter(nearest, toward) if dtype == FLOAT16 else \
        _bf16_nextafter(nearest, toward)
    exact = nearest.astype(np.float32) == x
    a, b = np.where(exact, nearest, other), nearest
    return np.minimum(a, b), np.maximum(a, b)


def _bf16_nextafter(x: np.ndarray, toward: np.ndarray) -> np.ndarray:
    bits = x.view(np.uint16).astype(np.int32)
    up = (toward.astype(np.float32) > x.astype(np.float32))
    away = up == (x.astype(np.float32) >= 0)
    step = np.where(away, 1, -1)
    zero = x.astype(np.float32) == 0
    bits = np.where(zero, np.where(up, 1, 0x8001), bits + step)
    return bits.astype(np.uint16).view(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", TARGETS)
def test_every_value_the_target_holds_is_kept_whatever_the_bits(dtype):
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(NUMPY_DTYPES[dtype])
    every = every[np.isfinite(every.astype(np.float32))]
    x = every.astype(np.float32)
    for seed in range(3):
        out = stochastic_round(x, _bits(x.shape, seed), dtype)
        assert np.array_equal(out.view(np.uint16), every.view(np.uint16))  # -0.0 included


@pytest.mark.parametrize("dtype", TARGETS)
def test_each_result_is_a_neighbour_and_the_mean_is_x(dtype):
    rng = np.random.default_rng(1)
    tiny = 2.0**-24 if dtype == FLOAT16 else 2.0**-133
    x = np.concatenate([rng.uniform(-4, 4, 40), rng.uniform(-1, 1, 20) * 2.0**-14,  # subnormal
                        rng.uniform(-1, 1, 20) * tiny * 3, [1e-4, 3e-6, 2.5e-8]]).astype(np.float32)
    draws = 4000
    xs = np.repeat(x[None, :], draws, axis=0)
    out = stochastic_round(xs, _bits(xs.shape, 2), dtype).astype(np.float64)
    low, high = _neighbours(x, dtype)
    assert np.all((out == low.astype(np.float64)) | (out == high.astype(np.float64)))
    gap = (high.astype(np.float64) - low.astype(np.float64))
    # the chance of rounding up is (x - low) / gap: the mean lands within 5 sigma of x
    sigma = np.maximum(gap, 1e-300) * 0.5 / np.sqrt(draws)
    assert np.all(np.abs(out.mean(axis=0) - x.astype(np.float64)) <= 5 * sigma)


def test_the_classic_sum_drifts_to_one_where_nearest_stalls():
    total = np.zeros(1000, np.float16)
    nearest = np.float16(0)
    for step in range(10_000):
        total = stochastic_round(total.astype(np.float32) + np.float32(1e-4),
                                 _bits(total.shape, step), FLOAT16)
        nearest = np.float16(np.float32(nearest) + np.float32(1e-4))
    assert abs(float(total.astype(np.float64).mean()) - 1.0) < 0.01
    assert 0.2 < float(nearest) < 0.3


@pytest.mark.parametrize("dtype", TARGETS)
def test_overflow_and_nan_follow_round_to_nearest(dtype):
    big = float(ml_dtypes.finfo(NUMPY_DTYPES[dtype]).max)
    with np.errstate(over="ignore"):  # bfloat16's 2 * max is inf in float32 too
        x = np.array([big, np.nextafter(np.float32(big), np.float32(np.inf)), big * 1.001,
                      big * 2, -big * 2, np.inf, -np.inf, np.nan]).astype(np.float32)
    xs = np.repeat(x[None, :], 200, axis=0)
    with np.errstate(over="ignore"):
        nearest = x.astype(NUMPY_DTYPES[dtype]).astype(np.float32)
    out = stochastic_round(xs, _bits(xs.shape, 3), dtype).astype(np.float32)
    finite_where_nearest_is = np.isfinite(nearest)
    assert np.all(np.isfinite(out[:, finite_where_nearest_is]))
    assert np.array_equal(out[:, ~np.isnan(nearest)],
                          np.broadcast_to(nearest[~np.isnan(nearest)], (200, 7)))
    assert np.all(np.isnan(out[:, -1]))
    # below the largest finite value stochastic rounding never reaches inf
    near_top = np.full(1000, np.float32(big) * np.float32(0.9999), np.float32)
    assert np.all(np.isfinite(stochastic_round(near_top, _bits(near_top.shape), dtype)
                              .astype(np.float32)))
