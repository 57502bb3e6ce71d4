"""np.allclose as `convert --auto` metrics (for scripts/bench_auto.py and as an example).

`amp-rewriter convert --auto --metric scripts/allclose_metric.py:rtol1e2_atol2e3 --max-error 1`
accepts exactly the models whose outputs pass ``np.allclose(out, ref, rtol=1e-2, atol=2e-3)`` on
every calibration batch: the metric is the largest ``|out - ref| / (atol + rtol |ref|)`` over the
elements (NaN/Inf give NaN, which fails), so ``<= 1`` is the allclose test and the value says
how far off a candidate is.
"""

from __future__ import annotations

import numpy as np


def allclose_ratio(reference_outputs, outputs, rtol: float, atol: float) -> float:
    """max over outputs and elements of |out - ref| / (atol + rtol |ref|)."""
    worst = 0.0
    for name, reference in reference_outputs.items():
        ref = np.asarray(reference, dtype=np.float64)
        out = np.asarray(outputs[name], dtype=np.float64)
        ratio = np.abs(out - ref) / (atol + rtol * np.abs(ref))
        value = float(np.max(ratio)) if ratio.size else 0.0
        if not np.isfinite(value):
            return float("nan")
        worst = max(worst, value)
    return worst


def rtol1e2_atol1e8(reference_outputs, outputs) -> float:
    """np.allclose(rtol=0.01) with numpy's... and onnxconverter-common's default atol 1e-8."""
    return allclose_ratio(reference_outputs, outputs, 1e-2, 1e-8)


def rtol1e2_atol2e3(reference_outputs, outputs) -> float:
    """np.allclose(rtol=0.01, atol=2e-3)."""
    return allclose_ratio(reference_outputs, outputs, 1e-2, 2e-3)
