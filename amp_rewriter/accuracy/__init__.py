"""Accuracy tools from one reference run: `convert --auto` (the smallest set of fp32 pins under
which the converted model meets a metric on calibration data) and `diagnose` (which node
overflows, flushes or adds the error, by node name).

Format-neutral: nothing here imports onnx or tensorflow. A format provides a `ModelRunner`
(`runner.py`); this package loads calibration data (`calibration.py`), streams per-tensor
statistics (`stats.py`, `measure.py`), applies the data-range rules (`rules.py`), searches
(`search.py`) and writes the diagnose report (`diagnose.py`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..ir import TARGET_DTYPES
from ..options import AutoOptions
from ..report import Report
from .calibration import CalibrationSet, InputSpec
from .diagnose import diagnose_dict
from .measure import measure
from .metrics import load_metric
from .runner import ModelRunner, ProbePlan
from .search import AutoResult, auto_convert

RANDOM_WARNING = ("no --inputs: {count} seeded random batch(es) of the model's input shapes "
                  "stand in for calibration data; coverage decides the result (a hazard only "
                  "real data triggers stays hidden)")


def calibration_for(runner: ModelRunner, inputs: Sequence[str] | None,
                    options: AutoOptions) -> tuple[CalibrationSet, list[str]]:
    """The calibration set of `--inputs`, or seeded random batches with a warning."""
    specs = runner.input_specs()
    if inputs:
        return CalibrationSet.from_paths(list(inputs), specs), []
    batches = [runner.random_batch(seed) for seed in range(options.random_batches)]
    return (CalibrationSet.from_batches(batches, specs, random=True, label="random batch"),
            [RANDOM_WARNING.format(count=options.random_batches)])


def run_auto(runner: ModelRunner, output_path: Path, inputs: Sequence[str] | None,
             options: AutoOptions, target: str,
             progress: Callable[[str], None] | None = None) -> tuple[Report, AutoResult]:
    """Search, then write the result exactly as `convert` writes a conversion with those pins;
    the report carries the search (`report.auto`) and every pin's measured reason."""
    if options.max_error is None:
        from ..errors import AmpError

        raise AmpError("--auto needs --max-error R (the largest metric value accepted)")
    metric = load_metric(options.metric, options.max_error)
    try:
        calibration, warnings = calibration_for(runner, inputs, options)
        result = auto_convert(runner, calibration, metric, options, TARGET_DTYPES[target],
                              progress)
        gc.collect()  # the search's last conversion and sessions, before the final one
        report = runner.write(output_path, result.pins)
    finally:
        runner.close()
    report.auto = result.to_dict()
    report.warnings = warnings + report.warnings
    return report, result


def run_diagnose(runner: ModelRunner, inputs: Sequence[str] | None, options: AutoOptions,
                 target: str, backend: str) -> tuple[dict[str, Any], list[str]]:
    """Measure the plain conversion with the converted model's tensors; the JSON report and
    warnings."""
    try:
        calibration, warnings = calibration_for(runner, inputs, options)
        measurement = measure(runner, lambda: runner.convert({}), calibration,
                              TARGET_DTYPES[target], ProbePlan(candidate_tensors=True),
                              data_max=options.data_max)
    finally:
        runner.close()
    report = diagnose_dict(measurement, options, TARGET_DTYPES[target], backend,
                           measurement.output_errors)
    return report, warnings


__all__ = ["AutoResult", "CalibrationSet", "InputSpec", "ModelRunner", "calibration_for",
           "run_auto", "run_diagnose"]
