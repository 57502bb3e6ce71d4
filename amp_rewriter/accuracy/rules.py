"""Data-range rules: which low-precision nodes the calibration data shows to be hazards.

In the spirit of NVIDIA AutoCast's `data_max` / `init_max` / reduction-depth rules, but aimed at
what breaks rather than at what is large: a node is a hazard when, on the calibration data,

- a value it produces or reads in low precision exceeds `--data-max` (default: the target's
  largest finite value, so only values that really overflow; AutoCast's 512 would keep every
  node that carries a large activation fp32),
- it computes NaN/Inf on its own from finite fp32 inputs (the probe's local run),
- a divisor it reads loses values to zero in the target (x / 0), or its output loses more than
  `--flush-max` of its non-zero values to zero,
- with `--max-reduction N`, it reduces over more than N elements.

Constants beyond the target's range are the conversion's own rule (guard_constant_ranges). Each
hazard's reason is the measurement itself, so `explain` and the report show it.
"""

from __future__ import annotations

import math

from ..ir.dtypes import FINITE_MAX
from ..options import AutoOptions
from .measure import Measurement, NodeMeasurement, format_number

#: Unit roundoff of each target: half the gap between 1 and the next value.
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
SHORT = {"float16": "fp16", "bfloat16": "bf16"}


def data_max(options: AutoOptions, target_dtype: str) -> float:
    """The magnitude above which a value is out of range."""
    return FINITE_MAX[target_dtype] if options.data_max is None else options.data_max


def local_max(options: AutoOptions, target_dtype: str) -> float:
    """The local error that counts as large."""
    return 32 * UNIT_ROUNDOFF[target_dtype] if options.local_max is None else options.local_max


def hazards(measurement: Measurement, options: AutoOptions) -> dict[str, str]:
    """Low-precision node name -> the measurement that makes it a hazard, in execution order."""
    found: dict[str, str] = {}
    for node in measurement.nodes.values():
        if not node.info.low:
            continue
        reason = node_hazard(node, measurement, options)
        if reason:
            found[node.info.name] = reason
    return found


def node_hazard(node: NodeMeasurement, measurement: Measurement, options: AutoOptions) -> str:
    """Why one low-precision node is a hazard ("" when it is not)."""
    target = measurement.target
    short = SHORT[target]
    limit = data_max(options, target)
    batches = measurement.batches
    info = node.info
    for name in info.outputs if not info.saturated else ():
        stats = measurement.tensors.get(name)
        if stats is not None and stats.absmax > limit:
            return (f"output {name!r} absmax {format_number(stats.absmax)} > {limit:g} on "
                    f"{stats.batches_over_limit}/{batches} calibration batches")
    for name in info.low_inputs if not info.saturated else ():
        stats = measurement.tensors.get(name)
        if stats is not None and stats.absmax > limit:
            return (f"reads {name!r} in {short}: absmax {format_number(stats.absmax)} > "
                    f"{limit:g} on {stats.batches_over_limit}/{batches} calibration batches")
    if node.breaks_locally and not info.saturated:
        return (f"computes NaN/Inf in {short} on its own (from finite fp32 inputs) on "
                f"{node.batches_breaking}/{batches} calibration batches")
    for name in info.divisor_inputs:
        stats = measurement.tensors.get(name)
        if stats is not None and stats.flushed and name in info.low_inputs:
            return (f"divides by {name!r}: {stats.flushed} of its non-zero values flush to zero "
                    f"in {short} ({stats.batches_flushing}/{batches} calibration batches)")
    for name in info.outputs:
        stats = measurement.tensors.get(name)
        if stats is not None and stats.nonzero and stats.flush_fraction > options.flush_max:
            return (f"output {name!r}: {100 * stats.flush_fraction:.0f}% of its non-zero values "
                    f"flush to zero in {short} (> {100 * options.flush_max:.0f}%)")
    if options.max_reduction is not None and info.reduction is not None:
        length = reduction_length(info.reduction, measurement)
        if length is not None and length > options.max_reduction:
            return (f"reduces over {length} elements in {short} (> --max-reduction "
                    f"{options.max_reduction})")
    return ""


def reduction_length(reduction: tuple[str, str, str], measurement: Measurement) -> int | None:
    """How many elements each output value sums: ("ratio", input, output) for Reduce* ops (input
    size / output size), ("last", input, "") for MatMul (the input's last dimension)."""
    kind, source, result = reduction
    source_stats = measurement.tensors.get(source)
    if source_stats is None or not source_stats.shape:
        return None
    if kind == "last":
        return int(source_stats.shape[-1])
    result_stats = measurement.tensors.get(result)
    if result_stats is None:
        return None
    size_in = math.prod(source_stats.shape)
    size_out = max(math.prod(result_stats.shape), 1)
    return size_in // size_out
