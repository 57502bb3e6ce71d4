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


#: (op, input slot) where a value flushed to zero changes the result completely.
DIVISOR_SLOTS = {("Div", 1), ("Reciprocal", 0), ("Pow", 1), ("Mod", 1)}


def _constant_inputs(ctx: PassContext):
    """(group, slot, source) for every paintable group slot fed by a float32 constant."""
    for node in ctx.model.graph.walk_nodes():
        for group in node.type_groups:
            if not group.paintable:
                continue
            for slot in group.input_slots:
                value = node.inputs[slot]
                if value is not None and value.const is not None and value.dtype == FLOAT32:
                    yield group, slot, value
            if node.op_type == "ConstantOfShape" and "value" in node.attrs:
                yield group, -1, node.attrs["value"]


def guard_constant_ranges(ctx: PassContext) -> PassResult:
    """Force fp32 on groups whose constant inputs the target dtype would not represent.

    A constant beyond the finite range (an attention mask filled with -3.4e38) keeps its exact
    value unless `--clamp`: the op consuming it runs in fp32, and as a deny seed that decision
    spreads to the infer/clear ops downstream of it (the mask Add and the Softmax). A constant
    whose non-zero values would all flush to zero, or any divisor that would partly flush (x / 0),
    is kept in fp32 the same way, clamp or not.
    """
    target = ctx.target_dtype
    forced = 0
    for group, slot, source in _constant_inputs(ctx):
        if group.forced_deny:
            continue
        tensor = source.const if isinstance(source, Value) else source
        result = cached_range_check(ctx, tensor, target)
        name = source.name if isinstance(source, Value) else f"{group.node.name}.value"
        divisor = (group.node.op_type, slot) in DIVISOR_SLOTS
        if result.overflowed and not ctx.options.clamp:
            why = (f"constant {name!r} has {result.overflowed} value(s) beyond "
                   f"{ctx.options.target}'s finite range ({FINITE_MAX[target]:g}); kept exact in "
                   f"fp32 (use --clamp to saturate instead)")
        elif result.vanishes or (divisor and result.flushed_to_zero):
            why = (f"constant {name!r}: {result.flushed_to_zero} of its {result.nonzero} non-zero "
                   f"value(s) would flush to zero in {ctx.options.target}"
                   f"{' (a divisor)' if divisor else ''}; kept exact in fp32")
        else:
            continue
        if not any(r.name == name for r in ctx.constants):
            ctx.constants.append(ConstantRecord(
                name, "kept_fp32", tensor.size, overflowed=result.overflowed,
                flushed_to_zero=result.flushed_to_zero,
                detail=f"feeds {group.node.name} ({group.node.op_type}), which stays fp32"))
        group.forced_deny = why
        forced += 1
    return PassResult("guard_constant_ranges", forced)
