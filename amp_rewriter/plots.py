"""Pictures, written only when asked (`--plot FILE.png|svg`), with matplotlib (the `plot`
extra): where a conversion put each precision (`convert --plot`) and where the error grows
(`diagnose --plot`).

Both read data the run already has (the conversion's `PrecisionMap`, diagnose's report) and
draw with matplotlib's object API (no pyplot: no global figure state, no GUI backend). The
files are byte-identical for the same data: no date or software version in their metadata, a
fixed SVG id salt, text kept as text in SVGs (searchable, and no font outlines to vary).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import AmpError
from .ir import short_name
from .precision_map import (
    CAST,
    FP32,
    FP32_COMPUTE,
    KIND_NAMES,
    LOW,
    LOW_COMPUTE,
    MIXED,
    NO_FLOAT,
    PrecisionMap,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: File suffix -> matplotlib's format name.
PLOT_FORMATS = {".png": "png", ".svg": "svg"}
#: What to install for --plot.
EXTRA = "pip install 'amp-rewriter[plot]'"

#: Cell colours: compute ops in strong colours, other nodes pale, casts black.
KIND_COLOURS = {
    NO_FLOAT: "#e3e3e3",
    FP32: "#f3b7ae",
    FP32_COMPUTE: "#b2182b",
    LOW: "#a6cbe8",
    LOW_COMPUTE: "#14539a",
    MIXED: "#b39ddb",
    CAST: "#111111",
}
#: Settings that make the files depend on their data only (Any: matplotlib types its keys as
#: literals).
_RC: Any = {"svg.hashsalt": "amp-rewriter", "svg.fonttype": "none", "font.family": "DejaVu Sans",
       "font.size": 9}
_METADATA = {"png": {"Software": None}, "svg": {"Date": None, "Creator": None}}
#: Pixels per inch of PNG files.
DPI = 130


def plot_paths(arguments: Sequence[str] | None) -> list[Path]:
    """The `--plot` destinations, checked before the run does any work: a .png or .svg name
    each, and matplotlib importable."""
    paths = [Path(argument) for argument in arguments or []]
    for path in paths:
        if path.suffix.lower() not in PLOT_FORMATS:
            raise AmpError(f"--plot {path}: expected a file name ending in .png or .svg")
    if paths:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise AmpError(f"--plot needs matplotlib, which is not installed: {EXTRA}") from None
    return paths


def save(figure: Figure, path: Path, format_of: Path | None = None) -> None:
    """Write `figure` to `path` (a staged path; `format_of` is the destination whose suffix
    says the format, when the staged name differs)."""
    import matplotlib

    fmt = PLOT_FORMATS[(format_of or path).suffix.lower()]
    with matplotlib.rc_context(_RC):
        figure.savefig(path, format=fmt, dpi=DPI, metadata=_METADATA[fmt])


def _figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _short(name: str, limit: int = 48) -> str:
    return name if len(name) <= limit else "..." + name[-(limit - 3):]


# -- convert --plot: the precision map ----------------------------------------------------------

#: The longest repeating unit (a transformer layer, a ResNet block) `_period` looks for, and
#: the share of cells that must repeat at that distance (a BERT export's 12 layers give 0.88:
#: its embeddings and pooler, a tenth of the graph, do not repeat; other distances give 0.26).
MAX_PERIOD = 400
PERIOD_MATCH = 0.75
#: Cells `_period` compares (the start of the graph tells the unit as well as all of it).
PERIOD_SAMPLE = 200_000


def _period(ops: Sequence[str]) -> int | None:
    """The length of the unit the graph repeats (its layers), when there is one: the smallest
    distance at which at least `PERIOD_MATCH` of the ops equal the op that distance later."""
    import numpy as np

    sample = ops[:PERIOD_SAMPLE]
    codes: dict[str, int] = {}
    series = np.array([codes.setdefault(op, len(codes)) for op in sample], dtype=np.int32)
    for distance in range(4, min(MAX_PERIOD, len(series) // 3) + 1):
        if np.mean(series[:-distance] == series[distance:]) >= PERIOD_MATCH:
            return distance
    return None


def _grid_columns(cells: PrecisionMap) -> tuple[int, int | None]:
    """(columns, repeating unit or None): about three times as wide as high, at least 20 cells
    a row; for a graph that repeats a unit, a whole number of units a row, so that the layers
    line up under each other and a layer that differs shows."""
    count = max(len(cells), 1)
    ideal = max(20, math.ceil(math.sqrt(count * 3)))
    unit = _period(cells.ops)
    if unit is None:
        return max(1, min(count, ideal)), None
    return unit * max(1, round(ideal / unit)), unit


def precision_map_figure(cells: PrecisionMap, title: str, subtitle: str, low_name: str
                         ) -> Figure:
    """Each node a cell, left to right and top to bottom in graph order, coloured by the
    precision it runs in (compute ops in strong colours, casts black); `title` is the cost
    line. Rows are labelled with the index and name of their first node."""
    import matplotlib

    with matplotlib.rc_context(_RC):
        return _draw_precision_map(cells, title, subtitle, low_name)


def _draw_precision_map(cells: PrecisionMap, title: str, subtitle: str, low_name: str
                        ) -> Figure:
    import numpy as np
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    count = len(cells)
    columns, unit = _grid_columns(cells)
    if unit is not None:
        subtitle += f"; the graph repeats every {unit} nodes: {columns // unit} a row"
    rows = max(1, math.ceil(count / columns))
    cell_inches = min(0.3, 13.0 / columns)
    width = max(8.0, columns * cell_inches + 3.5)
    height = rows * cell_inches + 2.6
    figure = _figure(width, height)
    axes = figure.add_subplot()
    palette = np.array([to_rgb(KIND_COLOURS[kind]) for kind in range(len(KIND_NAMES))]
                       + [to_rgb("white")])
    codes = np.full(rows * columns, len(KIND_NAMES), dtype=np.uint8)  # white past the end
    codes[:count] = np.frombuffer(bytes(cells.kinds), dtype=np.uint8)
    axes.imshow(palette[codes.reshape(rows, columns)], interpolation="nearest", aspect="auto",
                extent=(0, columns, rows, 0))
    if columns <= 80:  # cells large enough to separate
        axes.vlines(np.arange(1, columns), 0, rows, colors="white", linewidth=0.6)
        axes.hlines(np.arange(1, rows), 0, columns, colors="white", linewidth=0.6)
    for start, _ in cells.graphs[1:]:  # where a nested graph or function begins
        row, column = divmod(start, columns)
        axes.plot([column, column], [row, row + 1], color="#ff9800", linewidth=2.2)
    step = max(1, math.ceil(rows / 14))
    labelled = list(range(0, rows, step))
    axes.set_yticks([row + 0.5 for row in labelled])
    axes.set_yticklabels([f"{row * columns}  {_short(cells.names[row * columns], 40)}"
                          for row in labelled], fontsize=7)
    axes.set_xticks([])
    axes.set_xlim(0, columns)
    axes.set_ylim(rows, 0)
    for side in axes.spines.values():
        side.set_visible(False)
    counts = [sum(1 for kind in cells.kinds if kind == code) for code in range(len(KIND_NAMES))]
    handles = [Patch(facecolor=KIND_COLOURS[code], edgecolor="#777777", linewidth=0.4,
                     label=f"{KIND_NAMES[code].format(low=low_name)} ({counts[code]})")
               for code in range(len(KIND_NAMES)) if counts[code]]
    if len(cells.graphs) > 1:
        handles.append(Patch(facecolor="#ff9800", label=f"start of a nested graph or function "
                                                         f"({len(cells.graphs) - 1})"))
    axes.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02),
                ncol=min(4, len(handles)), frameon=False, fontsize=8)
    wrap = max(60, int(width * 13))
    figure.suptitle(textwrap.fill(title, wrap), fontsize=10, x=0.01, ha="left")
    axes.set_title(subtitle, fontsize=8, loc="left", color="#444444")
    return figure


# -- diagnose --plot: where the error grows -----------------------------------------------------

def _finite(value: Any) -> float | None:
    """A report number as a float (None when absent; inf for "inf")."""
    if value is None:
        return None
    return math.inf if value == "inf" else float(value)


def diagnose_figure(report: dict[str, Any], model_name: str) -> Figure:
    """Nodes in graph order on the x axis: above, the error each low-precision node adds on its
    own and the converted model's accumulated error at each node's output (log scale, NaN/Inf at
    the top); below, the share of each node's fp32 values that overflows or flushes to zero in
    the target. The culprit (the top of diagnose's ranking) and the first NaN/Inf are named."""
    import matplotlib

    with matplotlib.rc_context(_RC):
        return _draw_diagnose(report, model_name)


#: Above this many nodes, the accumulated error is also drawn as its maximum over windows of
#: nodes (a line through every node zig-zags between the layers' small and large errors).
ENVELOPE_FROM = 400
#: Up to this many nodes, each is named on the x axis.
NAMED_TICKS = 40


def _draw_diagnose(report: dict[str, Any], model_name: str) -> Figure:
    import numpy as np

    rows = sorted(report["nodes"], key=lambda row: row["order"])
    x = np.arange(len(rows))
    local = [_finite(row["local_error"]) for row in rows]
    accumulated = [_finite(row["converted_error"]) for row in rows]
    positive = [v for v in local + accumulated if v is not None and 0 < v < math.inf]
    floor = 10 ** math.floor(math.log10(min(positive))) / 10 if positive else 1e-8
    ceiling = 10 ** math.ceil(math.log10(max(positive))) * 10 if positive else 1.0

    def clipped(values: list[float | None]) -> np.ndarray:
        """The values with zero drawn at the floor; NaN where there is none or it is not
        finite, which breaks a line there rather than bridging it."""
        return np.array([max(v, floor) if v is not None and v < math.inf else math.nan
                         for v in values])

    width = min(18.0, max(10.0, len(rows) / 60))
    figure = _figure(width, 6.8)
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    many = len(rows) > ENVELOPE_FROM
    acc_y = clipped(accumulated)
    loc_y = clipped(local)
    top.plot(x, acc_y, color="#1f77b4", linewidth=0.6 if many else 0.9,
             alpha=0.35 if many else 1.0, marker="" if many else ".", markersize=3,
             label="accumulated error at the node's output (converted model)")
    if many:
        # Over each repeating unit (a layer) where the graph has one: the error per layer.
        unit = _period([row["op"] for row in rows])
        window = unit if unit is not None and unit >= 8 else max(2, len(rows) // 100)
        starts = np.arange(0, len(rows), window)
        top.step(x[starts], np.fmax.reduceat(acc_y, starts), where="post",
                 color="#0b3c68", linewidth=1.6,
                 label=f"accumulated error, highest over each {window} nodes"
                       + (" (the graph's repeating unit)" if window == unit else ""))
    top.scatter(x, loc_y, s=5 if many else 14, color="#ff7f0e", zorder=3,
                label="local error the node adds (fp32 inputs in)")
    broken = [i for i, row in enumerate(rows) if math.inf in (local[i], accumulated[i])]
    meant = [i for i in broken if rows[i].get("saturated")]
    broken = [i for i in broken if not rows[i].get("saturated")]
    if broken:
        top.scatter(broken, np.full(len(broken), ceiling), marker="^", s=28, color="#d62728",
                    zorder=4, label="NaN/Inf where fp32 has none")
    if meant:
        top.scatter(meant, np.full(len(meant), ceiling), marker="v", s=14, color="#9e9e9e",
                    zorder=4, label="-inf of an attention mask, saturated before its Softmax")
    top.set_yscale("log")
    top.set_ylim(floor / 1.5, ceiling * 1.5)
    top.set_ylabel("relative error (0 at the bottom)")
    top.grid(True, which="major", axis="y", color="#dddddd", linewidth=0.5)
    top.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=2, fontsize=8, frameon=False)

    saturated = np.array([bool(row.get("saturated")) for row in rows])
    low = np.array([row["precision"] != "fp32" for row in rows]) & ~saturated
    fp32 = ~low & ~saturated
    for fraction, offset, label in (("overflow_fraction", 0.0, "overflows"),
                                    ("flush_fraction", 0.3, "flushes to zero")):
        shares = np.array([row[fraction] for row in rows], dtype=float)
        for chosen, colour, where in ((low, "#d62728" if offset == 0 else "#7b1fa2",
                                       "in a low-precision node"),
                                      (fp32, "#b0b0b0" if offset == 0 else "#d1c4e9",
                                       "in an fp32 node, if converted"),
                                      (saturated, "#9e9e9e", "in a saturated mask sum")):
            shown = chosen & (shares > 0)
            if shown.any():
                bottom.vlines(x[shown] + offset, 1e-6, shares[shown], color=colour,
                              linewidth=1.2, label=f"{label} {where}")
    bottom.set_yscale("log")
    bottom.set_ylim(1e-6, 1.5)
    bottom.set_ylabel("share of values")
    bottom.set_xlabel(f"node, in graph order ({len(rows)} nodes with float outputs)")
    bottom.set_xlim(-1, max(len(rows), 2))
    if len(rows) <= NAMED_TICKS:  # few enough nodes to name each one
        bottom.set_xticks(x)
        bottom.set_xticklabels([_short(row["node"], 24) for row in rows], rotation=60,
                               ha="right", fontsize=7)
    if bottom.get_legend_handles_labels()[0]:
        bottom.legend(loc="lower left", bbox_to_anchor=(0, 1.0), fontsize=8, frameon=False,
                      ncol=4)
    else:
        bottom.text(0.5, 0.5, "no value overflows or flushes to zero in the target",
                    transform=bottom.transAxes, ha="center", va="center", color="#666666")

    index = {row["node"]: i for i, row in enumerate(rows)}
    culprit = _culprit(report)
    if culprit is not None and culprit["node"] in index:
        i = index[culprit["node"]]
        value = _finite(culprit["local_error"])
        infinite = culprit["local_nonfinite"] or value is None or value == math.inf
        y = ceiling if infinite else max(value or floor, floor)
        how = culprit["hazard"] or ("NaN/Inf on its own" if infinite
                                    else f"adds {value:.2g} on its own")
        top.annotate(f"culprit: {_short(culprit['node'])} ({culprit['op']}): {_short(how, 90)}",
                     xy=(i, y), xytext=(0.5, 0.92), textcoords="axes fraction", ha="center",
                     fontsize=9, fontweight="bold",
                     arrowprops={"arrowstyle": "->", "color": "#333333", "linewidth": 0.8})
    first = report.get("first_nonfinite")
    if first and first in index and not rows[index[first]].get("saturated"):
        top.axvline(index[first], color="#d62728", linestyle="--", linewidth=0.8)
        top.text(index[first], floor, f" first NaN/Inf: {_short(first, 36)}", rotation=90,
                 va="bottom", ha="right", fontsize=7, color="#d62728")
    outputs = ", ".join(f"{name} {_finite(value):.3g}" for name, value in
                        list(report["outputs"].items())[:4])
    figure.suptitle(textwrap.fill(
        f"{model_name}: {short_name(report['target'])} (backend {report['backend']}) on "
        f"{report['calibration']}; output relative error: {outputs or 'none'}",
        max(60, int(width * 13))), fontsize=10, x=0.01, ha="left")
    return figure


def _culprit(report: dict[str, Any]) -> dict[str, Any] | None:
    """The node to name: diagnose's first-ranked node with a hazard, else its first-ranked
    node that adds error of its own (an attention mask's saturated sum is -inf by design)."""
    ranked = [row for row in report["nodes"] if not row.get("saturated")]
    for row in ranked:
        if row["hazard"]:
            return row
    for row in ranked[:1]:
        value = _finite(row["local_error"])
        if row["local_nonfinite"] or (value is not None and value > 0):
            return row
    return None
