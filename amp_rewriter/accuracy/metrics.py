"""The accuracy metric `convert --auto` holds under `--max-error`.

A metric is a function ``f(reference_outputs, outputs) -> float``: both arguments map each model
output's name to its array for one calibration batch (the fp32 model's, the converted model's);
lower is better. It is called once per batch and the worst (largest) value counts: the
conversion passes when it is ``<= --max-error``. A user function runs guarded (`Metric.evaluate`):
it gets read-only arrays; an exception, a `sys.exit`, something that is no number, and NaN, inf
or a value past 1e300 on outputs that are all finite are a one-line error naming the metric
(exit 2); on outputs that hold NaN or inf (a candidate that overflowed), NaN or inf means the
candidate fails.

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

import contextlib
import importlib
import importlib.util
import math
import numbers
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import AmpError, first_line
from ..options import metric_source_file

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
        """The metric on one batch. A user function runs guarded: it gets read-only arrays
        (the reference outputs serve every trial), and an exception, a `sys.exit`, or a value
        that is no real number is a one-line error naming the metric; so is NaN, inf or a value
        beyond 1e300, unless the outputs it judged hold NaN or inf themselves (a conversion that
        overflowed: then it fails, as inf)."""
        if self.name in BUILT_IN:
            return float(self.function(reference_outputs, outputs))
        with _guarded(lambda detail: f"--metric {self.name} failed ({detail})"):
            value = self.function(_read_only(reference_outputs), _read_only(outputs))
        return _checked_value(value, self.name, _any_nonfinite(outputs))

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
    """A module by dotted name (current folder first) or by file path; its import runs guarded
    (an exception or a `sys.exit` at import time is a one-line error)."""
    with _guarded(lambda detail: f"--metric {spec!r}: cannot import {module_name} ({detail})"):
        path = metric_source_file(spec)
        if path is not None:
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


#: The largest metric value taken as a measurement; past it a value means the metric is broken
#: (the built-in ones stay below 2 unless an output overflows, which they report as inf).
ABSURD_METRIC_VALUE = 1e300


@contextlib.contextmanager
def _guarded(message: Callable[[str], str]) -> Iterator[None]:
    """Run the user's code: what it raises, `SystemExit` included (a `sys.exit` in a metric must
    not end the tool with the metric's status), becomes an AmpError whose text is `message` of
    what happened. Ctrl-C stays an interruption."""
    try:
        yield
    except AmpError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001  (the user's code: anything)
        if isinstance(exc, SystemExit):
            detail = f"it called sys.exit({exc.code!r})"
        else:
            text = first_line(exc) if str(exc).strip() else ""
            detail = type(exc).__name__ + (f": {text}" if text else "")
        raise AmpError(message(detail)) from None


def _read_only(outputs: Outputs) -> dict[str, np.ndarray]:
    """Views of the arrays that the user's function cannot write through."""
    views = {}
    for name, array in outputs.items():
        view = np.asarray(array).view()
        view.flags.writeable = False
        views[name] = view
    return views


def _checked_value(value: object, name: str, outputs_nonfinite: bool) -> float:
    """A metric's result as a float (see `Metric.evaluate`): a real number (or a one-element
    array of one), finite and not absurdly large; NaN, +inf or a huge value count as "fails"
    (inf) only where the outputs were not finite themselves, -inf never (it would pass
    anything)."""
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(-1)[0]
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise AmpError(f"--metric {name} returned {type(value).__name__}, expected a number "
                       f"(lower is better)")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        number = math.inf if isinstance(value, numbers.Integral) and int(value) > 0 \
            else -math.inf
    if math.isfinite(number) and abs(number) <= ABSURD_METRIC_VALUE:
        return number
    if outputs_nonfinite and not number < 0:
        return math.inf
    where = "" if outputs_nonfinite else " on finite outputs"
    raise AmpError(f"--metric {name} returned {_shown(value)}{where}: a metric must give a "
                   f"finite number (lower is better; for a conversion that fails, a large one)")


def _any_nonfinite(outputs: Outputs) -> bool:
    """Whether some float output holds NaN or inf."""
    for array in outputs.values():
        data = np.asarray(array)
        if data.dtype.name == "bfloat16":
            data = data.astype(np.float32)
        if np.issubdtype(data.dtype, np.floating) and not np.isfinite(data).all():
            return True
    return False


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"
