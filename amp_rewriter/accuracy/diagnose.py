"""`amp-rewriter diagnose`: which node overflows, flushes or adds the error, by node name.

From one measurement with the converted model's tensors: per node, its fp32 range, the share of
its output that would overflow or flush in the target, the converted model's error at its output,
the error it adds on its own (local attribution: its fp32 inputs in, its low-precision output
compared) and whether its inputs' rounding alone explains it; the first node where NaN/Inf
appears. Sorted by contribution: NaN/Inf on its own first, then local error; fp32 nodes (which
add none) after, by how far out of range their values would be in the target.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..options import AutoOptions
from .measure import Measurement, NodeMeasurement, format_number
from .rules import SHORT, node_hazard


def _contribution(node: NodeMeasurement, measurement: Measurement) -> tuple:
    ranges = measurement.ranges_of(node.info.outputs)
    overflow = max((s.overflow_fraction for s in ranges), default=0.0)
    flush = max((s.flush_fraction for s in ranges), default=0.0)
    if node.info.low and node.info.measured:
        return (0, not node.breaks_locally, -node.local_error, node.info.order)
    return (1, -overflow, -flush, node.info.order)


def rows(measurement: Measurement, options: AutoOptions) -> list[dict[str, Any]]:
    """One entry per node with float outputs, sorted by contribution."""
    entries = []
    # Nodes that compute (constants and inputs have nothing to report).
    nodes = [n for n in measurement.nodes.values()
             if n.info.outputs and (n.info.inputs or n.info.low)]
    for node in sorted(nodes, key=lambda n: _contribution(n, measurement)):
        ranges = measurement.ranges_of(node.info.outputs)
        entry: dict[str, Any] = {
            "node": node.info.name, "op": node.info.op, "order": node.info.order,
            "precision": node.info.precision,
            "absmax": max((s.absmax for s in ranges), default=0.0),
            "min": min((s.minimum for s in ranges if s.elements), default=None),
            "max": max((s.maximum for s in ranges if s.elements), default=None),
            "overflow_fraction": max((s.overflow_fraction for s in ranges), default=0.0),
            "flush_fraction": max((s.flush_fraction for s in ranges), default=0.0),
            "batches_overflowing": max((s.batches_overflowing for s in ranges), default=0),
            "converted_error": _number(node.converted_error) if node.converted else None,
            "converted_nonfinite": any(s.broken for s in node.converted),
            "local_error": (_number(node.local_error)
                            if node.info.low and node.info.measured else None),
            "local_nonfinite": node.breaks_locally,
            "input_rounding_error": (_number(node.input_rounding_error)
                                     if node.rounded else None),
            "hazard": node_hazard(node, measurement, options) if node.info.low else "",
            # An attention mask's sum, saturated before its Softmax: its -inf is by design.
            "saturated": node.info.saturated,
        }
        if node.info.graph != "main":
            entry["graph"] = node.info.graph
        entries.append(entry)
    return entries


def _number(value: float) -> float | str:
    return value if math.isfinite(value) else "inf"


def diagnose_dict(measurement: Measurement, options: AutoOptions, target: str, backend: str,
                  output_errors: dict[str, float]) -> dict[str, Any]:
    """The JSON report."""
    return {
        "target": target, "backend": backend,
        "calibration": measurement.calibration, "random_inputs": measurement.random_inputs,
        "batches": measurement.batches, "execution": measurement.execution,
        "first_nonfinite": measurement.first_nonfinite,
        "first_local_nonfinite": measurement.first_local_nonfinite,
        "outputs": {k: _number(v) for k, v in output_errors.items()},
        "notes": measurement.notes,
        "nodes": rows(measurement, options),
    }


def diagnose_text(report: dict[str, Any], limit: int = 25) -> str:
    """The report for people: a header and the top `limit` nodes."""
    short = SHORT.get(report["target"], report["target"])
    lines = [f"diagnose: {short} (backend {report['backend']}) on {report['calibration']}",
             f"  runs on: {report['execution']}"]
    if report["random_inputs"]:
        lines.append("  warning: random inputs: only hazards this data triggers can show; give "
                     "real data with --inputs")
    for name, value in report["outputs"].items():
        lines.append(f"  output {name}: relative error {_text(value)}")
    first = report["first_nonfinite"]
    lines.append(f"  first NaN/Inf: {first}" if first else
                 "  first NaN/Inf: none (the converted model stays finite)")
    for note in report["notes"]:
        lines.append(f"  note: {note}")
    header = (f"{'node':<40} {'op':<18} {'prec':<5} {'absmax':>9} {'overflow':>8} "
              f"{'flush':>6} {'error':>9} {'local':>9} {'rounding':>9}")
    lines += ["", header, "-" * len(header)]
    for row in report["nodes"][:limit]:
        name = row["node"] if len(row["node"]) <= 40 else "..." + row["node"][-37:]
        lines.append(
            f"{name:<40} {row['op'][:18]:<18} {row['precision'][:5]:<5} "
            f"{format_number(row['absmax']):>9} {_percent(row['overflow_fraction']):>8} "
            f"{_percent(row['flush_fraction']):>6} {_text(row['converted_error']):>9} "
            f"{_text(row['local_error']):>9} {_text(row['input_rounding_error']):>9}")
        if row["hazard"]:
            lines.append(f"{'':<40}   hazard: {row['hazard']}")
    remaining = len(report["nodes"]) - limit
    if remaining > 0:
        lines.append(f"... {remaining} more node(s) (--json has them all)")
    lines.append("")
    lines.append("error: the converted model's relative error at the node's output; local: the "
                 "error the node adds on its own (fp32 inputs in); rounding: the node in fp32 "
                 "fed its low-precision inputs rounded")
    return "\n".join(lines)


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return format_number(float(value))


def _percent(fraction: float) -> str:
    if not fraction:
        return "0"
    return f"{100 * fraction:.2g}%"


def to_json(report: dict[str, Any]) -> str:
    """The report as JSON text."""
    return json.dumps(report, indent=2) + "\n"
