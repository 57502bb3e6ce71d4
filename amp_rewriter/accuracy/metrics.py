"""The accuracy metric `convert --auto` holds under `--max-error`.

A metric is a function ``f(reference_outputs, outputs) -> float``: both arguments map each model
output's name to its array for one calibration batch (the fp32 model's, the converted model's);
lower is better. It is called once per batch and the worst (largest) value counts: the
conversion passes when it is ``<= --max-error``. A NaN result fails.

Built in:

- ``max-rel`` (default): over the outputs, max |out - ref| / max |ref| (what ``--validate``
  prints as "relative"); new NaN/Inf gives inf.
- ``cosine``: over the outputs, 1 - cosine similarity of the flattened arrays (``--max-error
  1e-3`` asks for cosine >= 0.999).

``--metric module:function`` (or ``path/to/file.py:function``) loads a callable of the same
contract, for a task metric. An ``np.allclose`` pass/fail maps onto it in one of two ways:

    def allclose(reference_outputs, outputs):          # --max-error 0.5: 0 passes, 1 fails
        return 0.0 if all(np.allclose(outputs[k], reference_outputs[k], rtol=1e-2, atol=1e-8)
                          for k in reference_outputs) else 1.0

    def allclose_ratio(reference_outputs, outputs):    # --max-error 1: the same test, graded
        return max(float(np.max(np.abs(outputs[k] - r) / (1e-8 + 1e-2 * np.abs(r))))
                   for k, r in reference_outputs.items())

The graded form tells the search how far off a candidate is; both accept exactly the models
that ``np.allclose(out, ref, rtol, atol)`` accepts.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import AmpError

Outputs = Mapping[str, np.ndarray]
MetricFunction = Callable[[Outputs, Outputs], float]


def _float64(array: Any) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype.name == "bfloat16":
        array = array.astype(np.float32)
    return array.astype(np.float64, copy=False)


def max_relative_error(reference_outputs: Outputs, outputs: Outputs) -> float:
    """Over the outputs: max |out - ref| / max |ref| (inf for new NaN/Inf or another shape)."""
    worst = 0.0
    for name, reference in reference_outputs.items():
        ref, new = _float64(reference), _float64(outputs[name])
        if ref.shape != new.shape:
            return math.inf
        if not np.issubdtype(np.asarray(reference).dtype, np.floating) \
                and np.asarray(reference).dtype.name != "bfloat16":
            if not np.array_equal(ref, new):
                return math.inf
            continue
        finite = np.isfinite(ref)
        if np.any(finite & ~np.isfinite(new)):
            return math.inf
        if not finite.any():
            continue
        diff = float(np.max(np.abs(ref[finite] - new[finite])))
        scale = float(np.max(np.abs(ref[finite])))
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def cosine_distance(reference_outputs: Outputs, outputs: Outputs) -> float:
    """Over the outputs: 1 - cosine similarity of the flattened arrays (inf for NaN/Inf)."""
    worst = 0.0
    for name, reference in reference_outputs.items():
        ref, new = _float64(reference).ravel(), _float64(outputs[name]).ravel()
        if ref.shape != new.shape or not np.isfinite(new).all():
            return math.inf
        norms = float(np.linalg.norm(ref) * np.linalg.norm(new))
        if norms == 0:
            distance = 0.0 if float(np.linalg.norm(ref - new)) == 0 else 1.0
        else:
            distance = 1.0 - float(np.dot(ref, new)) / norms
        worst = max(worst, distance)
    return worst


BUILT_IN: dict[str, MetricFunction] = {"max-rel": max_relative_error, "cosine": cosine_distance}


@dataclass(frozen=True)
class Metric:
    """A named metric and the largest value that passes."""

    name: str
    function: MetricFunction
    max_error: float

    def evaluate(self, reference_outputs: Outputs, outputs: Outputs) -> float:
        """The metric on one batch; a user function that raises is a one-line error."""
        try:
            value = self.function(reference_outputs, outputs)
        except AmpError:
            raise
        except Exception as exc:  # the user's code: say where, without a traceback
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise AmpError(f"--metric {self.name} raised {type(exc).__name__}: {detail}") \
                from None
        try:
            return float(value)
        except (TypeError, ValueError):
            raise AmpError(f"--metric {self.name} returned {type(value).__name__}, expected a "
                           f"number (lower is better)") from None

    def passes(self, value: float) -> bool:
        """Whether a metric value holds (NaN never does)."""
        return not math.isnan(value) and value <= self.max_error


def load_metric(spec: str, max_error: float) -> Metric:
    """`max-rel`, `cosine`, or `module:function` / `path/file.py:function` (see the module)."""
    if not max_error >= 0:  # also refuses NaN
        raise AmpError(f"--max-error must be a number >= 0, got {max_error}")
    if spec in BUILT_IN:
        return Metric(spec, BUILT_IN[spec], max_error)
    module_name, sep, function_name = spec.rpartition(":")
    if not sep or not module_name or not function_name:
        raise AmpError(f"--metric {spec!r}: expected max-rel, cosine or module:function")
    module = _import(module_name, spec)
    function = getattr(module, function_name, None)
    if not callable(function):
        raise AmpError(f"--metric {spec!r}: {module_name} has no function {function_name!r}")
    return Metric(spec, function, max_error)


def _import(module_name: str, spec: str) -> Any:
    """A module by dotted name (current folder first) or by file path."""
    try:
        if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
            path = Path(module_name)
            if not path.is_file():
                raise AmpError(f"--metric {spec!r}: no such file {module_name}")
            loader_spec = importlib.util.spec_from_file_location(path.stem, path)
            if loader_spec is None or loader_spec.loader is None:
                raise AmpError(f"--metric {spec!r}: cannot load {module_name}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
            return module
        if "" not in sys.path and "." not in sys.path:
            sys.path.insert(0, "")  # a module next to the user, as `python -m` would find it
        return importlib.import_module(module_name)
    except AmpError:
        raise
    except Exception as exc:  # the user's module failed to import
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise AmpError(f"--metric {spec!r}: cannot import {module_name} ({type(exc).__name__}: "
                       f"{detail})") from None
