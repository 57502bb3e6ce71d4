"""Range checks for constants: which values overflow or flush to zero in the target dtype."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..ir import BFLOAT16, FLOAT16, FLOAT32, LazyTensor, Value
from .base import ConstantRecord, PassContext, PassResult

NUMPY_DTYPES = {FLOAT16: np.dtype(np.float16), BFLOAT16: np.dtype(ml_dtypes.bfloat16),
                FLOAT32: np.dtype(np.float32)}
#: Largest finite value of each low-precision dtype.
FINITE_MAX = {FLOAT16: 65504.0, BFLOAT16: float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)}
#: Smallest positive (subnormal) value of each low-precision dtype.
SMALLEST_SUBNORMAL = {FLOAT16: 2.0**-24, BFLOAT16: 2.0**-133}


def cached_range_check(ctx: PassContext, tensor: LazyTensor, dtype: str) -> RangeCheck:
    """`check_range` of a constant, computed once per conversion."""
    key = (id(tensor), dtype)
    result = ctx.range_checks.get(key)
    if result is None:
        result = check_range(np.asarray(tensor.numpy(), dtype=np.float32), dtype)
        ctx.range_checks[key] = result
    return result


@dataclass
class RangeCheck:
    """How a float32 array fares when converted to a low-precision dtype."""

    overflowed: int
    flushed_to_zero: int


def check_range(array: np.ndarray, dtype: str) -> RangeCheck:
    """Count finite values that become inf and non-zero values that become zero in `dtype`."""
    magnitude = np.abs(array)
    finite_magnitude = magnitude[np.isfinite(magnitude)] if not np.isfinite(magnitude).all() \
        else magnitude
    nonzero = finite_magnitude[finite_magnitude > 0]
    if (not nonzero.size or (nonzero.max() <= FINITE_MAX[dtype]
                             and nonzero.min() >= SMALLEST_SUBNORMAL[dtype])):
        return RangeCheck(0, 0)  # the common case, without converting
    with np.errstate(over="ignore"):
        converted = array.astype(NUMPY_DTYPES[dtype])
    finite = np.isfinite(array)
    overflowed = int(np.count_nonzero(finite & ~np.isfinite(converted)))
    flushed = int(np.count_nonzero((array != 0) & (converted == 0)))
    return RangeCheck(overflowed, flushed)


def convert_array(array: np.ndarray, dtype: str, clamp: bool) -> np.ndarray:
    """`array` in `dtype`; with `clamp`, finite values beyond the dtype's range saturate."""
    if clamp:
        limit = FINITE_MAX[dtype]
        finite = np.isfinite(array)
        array = np.where(finite, np.clip(array, -limit, limit), array)
    with np.errstate(over="ignore"):
        return array.astype(NUMPY_DTYPES[dtype])


def _constant_inputs(ctx: PassContext):
    """(group, value) for every paintable group slot fed by a float32 constant."""
    for node in ctx.model.graph.walk_nodes():
        for group in node.type_groups:
            if not group.paintable:
                continue
            for slot in group.input_slots:
                value = node.inputs[slot]
                if value is not None and value.const is not None and value.dtype == FLOAT32:
                    yield group, value
            if node.op_type == "ConstantOfShape" and "value" in node.attrs:
                yield group, node.attrs["value"]


def guard_constant_ranges(ctx: PassContext) -> PassResult:
    """Force fp32 on groups whose constant inputs would overflow the target dtype.

    Without `--clamp`, such a constant keeps its exact value: the op consuming it runs in fp32,
    and as a deny seed that decision spreads to the infer/clear ops downstream of it (e.g. an
    attention mask filled with -3.4e38 keeps the mask Add and the Softmax in fp32). With `--clamp`
    the constant is saturated to the dtype's finite range at conversion instead.
    """
    if ctx.options.clamp:
        return PassResult("guard_constant_ranges", 0, ["--clamp: out-of-range constants saturate"])
    target = ctx.target_dtype
    forced = 0
    for group, source in _constant_inputs(ctx):
        tensor = source.const if isinstance(source, Value) else source
        result = cached_range_check(ctx, tensor, target)
        if result.overflowed and not group.forced_deny:
            name = source.name if isinstance(source, Value) else f"{group.node.name}.value"
            if not any(r.name == name for r in ctx.constants):
                ctx.constants.append(ConstantRecord(
                    name, "kept_fp32", tensor.size, overflowed=result.overflowed,
                    detail=f"feeds {group.node.name} ({group.node.op_type}), which stays fp32"))
            group.forced_deny = (f"constant {name!r} has {result.overflowed} value(s) beyond "
                                 f"{ctx.options.target}'s finite range ({FINITE_MAX[target]:g}); "
                                 f"kept exact in fp32 (use --clamp to saturate instead)")
            forced += 1
    return PassResult("guard_constant_ranges", forced)
