"""Benchmark converter run time and peak memory on synthetic graphs of growing size.

For each size, the synthetic transformer-like model (``testkit.synthetic``) is built once and
saved; then each converter runs in its own fresh Python process on that file:

* ``ours``:   ``amp_rewriter.convert(model, target="fp16", keep_io_types=True)``
* ``theirs``: ``onnxconverter_common.float16.convert_float_to_float16(model, keep_io_types=True)``

A fresh process per conversion keeps the measurements independent (no warm caches, no memory left
over from the previous conversion) and lets a runaway conversion be killed at ``--timeout``.
Inside the worker the model is loaded first, so the reported conversion time covers the convert
call alone on an in-memory ``onnx.ModelProto``. For ours, load and save are timed too.

Peak memory is the resident-set high-water mark during the convert call, minus the resident set
just before it (so the loaded model and the imported libraries are not counted). On Linux the
high-water mark is reset right before the call; elsewhere ``ru_maxrss`` is used, which can only
over-report when loading peaked higher than converting. "Peak with workers" adds the processes
the conversion starts (amp_rewriter checks a big model in a second process): the resident sets
of the measuring process and its children summed, read every 20 ms from outside over the whole
measuring process (load, convert, save), minus the same resident set before the convert call.

Example::

    python scripts/bench_convert.py --sizes 1000,10000,50000,100000 --json bench_out/convert.json
    python scripts/bench_convert.py --sizes 1000,10000 --only theirs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCRIPTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = SCRIPTS_DIR.parent
# The worker imports amp_rewriter (and this testkit) from the checkout, without an installed package.
sys.path.insert(0, str(REPO_ROOT))

from testkit.bench import (  # noqa: E402  (after the path set-up)
    current_rss_kib,
    parse_sizes,
    peak_rss_kib,
    reset_peak_rss,
    sampled_run,
)

CONVERTERS = ("ours", "theirs")
CONVERTER_LABELS = {"ours": "amp_rewriter", "theirs": "onnxconverter-common"}
DEFAULT_SIZES = (1000, 10000, 50000, 100000)


# ---------------------------------------------------------------------------------------------
# Worker: one conversion in a fresh process
# ---------------------------------------------------------------------------------------------


def _count_op(model: Any, op_type: str) -> int:
    return sum(1 for node in model.graph.node if node.op_type == op_type)


def run_worker(
    converter: str, model_path: Path, result_path: Path, theirs_op_block_list: list[str] | None = None
) -> None:
    """Load `model_path`, convert it with `converter`, and write the measurements as JSON.

    `theirs_op_block_list` replaces onnxconverter-common's default op block list when given.
    """
    import onnx

    if converter == "ours":
        import amp_rewriter

        def convert(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Any]:
            return amp_rewriter.convert(model, target="fp16", keep_io_types=True)

    else:
        from onnxconverter_common import float16

        block_list_argument = {} if theirs_op_block_list is None else {"op_block_list": theirs_op_block_list}

        def convert(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Any]:
            return float16.convert_float_to_float16(model, keep_io_types=True, **block_list_argument), None

    rss_after_imports_kib = current_rss_kib()

    start = time.perf_counter()
    model = onnx.load(str(model_path))
    load_seconds = time.perf_counter() - start
    nodes_in = len(model.graph.node)

    gc.collect()
    rss_before_convert_kib = current_rss_kib()
    peak_was_reset = reset_peak_rss()
    start = time.perf_counter()
    converted, report = convert(model)
    convert_seconds = time.perf_counter() - start
    peak_kib = peak_rss_kib(peak_was_reset)

    result: dict[str, Any] = {
        "converter": converter,
        "nodes_in": nodes_in,
        "nodes_out": len(converted.graph.node),
        "cast_nodes_out": _count_op(converted, "Cast"),
        "load_seconds": load_seconds,
        "convert_seconds": convert_seconds,
        "rss_after_imports_mb": rss_after_imports_kib / 1024,
        "rss_before_convert_mb": rss_before_convert_kib / 1024,
        "peak_rss_mb": peak_kib / 1024,
        "convert_peak_delta_mb": (peak_kib - rss_before_convert_kib) / 1024,
        "peak_measured_with": "VmHWM after clear_refs" if peak_was_reset else "ru_maxrss",
    }
    if converter == "ours":
        with tempfile.TemporaryDirectory() as scratch:
            start = time.perf_counter()
            onnx.save(converted, str(Path(scratch) / "converted.onnx"))
            result["save_seconds"] = time.perf_counter() - start
        result["load_convert_save_seconds"] = load_seconds + convert_seconds + result["save_seconds"]
        if report is not None and hasattr(report, "to_dict"):
            result["report_summary"] = report.to_dict().get("summary")
    result_path.write_text(json.dumps(result, indent=2))


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


@dataclass
class Measurement:
    """Outcome of one conversion: `status` is "ok", ">timeout" or "error"; `details` holds the numbers."""

    converter: str
    num_nodes: int
    status: str
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def convert_seconds(self) -> float | None:
        return self.details.get("convert_seconds") if self.status == "ok" else None


def measure_in_subprocess(
    converter: str,
    model_path: Path,
    num_nodes: int,
    timeout_s: float,
    theirs_op_block_list: list[str] | None = None,
) -> Measurement:
    """Run one conversion in a fresh interpreter and collect its measurements."""
    with tempfile.TemporaryDirectory() as scratch:
        result_path = Path(scratch) / "result.json"
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            converter,
            "--model",
            str(model_path),
            "--result",
            str(result_path),
        ]
        if theirs_op_block_list is not None:
            command += ["--theirs-op-block-list", ",".join(theirs_op_block_list)]
        try:
            completed = sampled_run(command, timeout_s, REPO_ROOT)
        except subprocess.TimeoutExpired:
            return Measurement(converter, num_nodes, ">timeout", error=f"no result within {timeout_s:g} s")
        if completed.returncode != 0 or not result_path.exists():
            stderr_lines = [line for line in completed.stderr.strip().splitlines() if line.strip()]
            last_line = stderr_lines[-1] if stderr_lines else f"exit status {completed.returncode}"
            return Measurement(converter, num_nodes, "error", error=last_line)
        details = json.loads(result_path.read_text())
        # Sampled over the whole measuring process (load, convert and save), its workers with it.
        # Never below the process's own exact peak, which a 20 ms sample can miss.
        details["peak_with_workers_delta_mb"] = max(
            completed.peak_with_children_kib / 1024 - details["rss_before_convert_mb"],
            details["convert_peak_delta_mb"])
        details["workers_peak_mb"] = completed.peak_children_kib / 1024
        return Measurement(converter, num_nodes, "ok", details=details)


def _format_seconds(measurement: Measurement | None, key: str = "convert_seconds") -> str:
    if measurement is None:
        return "-"
    if measurement.status == ">timeout":
        return ">timeout"
    if measurement.status == "error":
        return "error"
    value = measurement.details.get(key)
    return "-" if value is None else f"{value:.3f}"


def _format_megabytes(measurement: Measurement | None, key: str = "convert_peak_delta_mb") -> str:
    if measurement is None or measurement.status != "ok":
        return "-"
    return f"{measurement.details[key]:.0f}"


def _format_casts(measurement: Measurement | None) -> str:
    if measurement is None or measurement.status != "ok":
        return "-"
    return str(measurement.details["cast_nodes_out"])


def speed_ratio(theirs: Measurement | None, ours: Measurement | None, timeout_s: float) -> str:
    """onnxconverter-common time / our time, as text (a lower bound when theirs timed out)."""
    if ours is None or ours.convert_seconds is None or ours.convert_seconds <= 0:
        return "-"
    if theirs is not None and theirs.status == ">timeout":
        return f">{timeout_s / ours.convert_seconds:.1f}x"
    if theirs is None or theirs.convert_seconds is None:
        return "-"
    return f"{theirs.convert_seconds / ours.convert_seconds:.1f}x"


def scaling_ratios(ours_by_size: dict[int, Measurement]) -> list[dict[str, Any]]:
    """Our time at each size over our time at the next smaller size (linear growth = size ratio)."""
    seconds = {size: m.convert_seconds for size, m in ours_by_size.items() if m.convert_seconds}
    sizes = sorted(seconds)
    ratios = []
    for smaller, larger in zip(sizes, sizes[1:]):
        ratios.append(
            {
                "from_nodes": smaller,
                "to_nodes": larger,
                "size_ratio": larger / smaller,
                "time_ratio": seconds[larger] / seconds[smaller],
            }
        )
    return ratios


def time_ratio(ours_by_size: dict[int, Measurement], smaller: int, larger: int) -> float | None:
    """Our time at `larger` nodes over our time at `smaller` nodes, if both finished."""
    small, large = ours_by_size.get(smaller), ours_by_size.get(larger)
    if small is None or large is None or not small.convert_seconds or large.convert_seconds is None:
        return None
    return large.convert_seconds / small.convert_seconds


def markdown_table(
    sizes: list[int], results: dict[tuple[str, int], Measurement], timeout_s: float
) -> str:
    """Render one row per model size."""
    header = (
        "| nodes | ours convert s | ours load+convert+save s | ours peak MB "
        "| ours peak with workers MB | ours Casts "
        "| onnxconverter-common convert s | theirs peak MB | theirs Casts | theirs/ours time |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for size in sizes:
        ours = results.get(("ours", size))
        theirs = results.get(("theirs", size))
        lines.append(
            f"| {size} | {_format_seconds(ours)} | {_format_seconds(ours, 'load_convert_save_seconds')} "
            f"| {_format_megabytes(ours)} | {_format_megabytes(ours, 'peak_with_workers_delta_mb')} "
            f"| {_format_casts(ours)} | {_format_seconds(theirs)} "
            f"| {_format_megabytes(theirs)} | {_format_casts(theirs)} | {speed_ratio(theirs, ours, timeout_s)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=parse_sizes, default=list(DEFAULT_SIZES), help="comma-separated node counts")
    parser.add_argument("--only", choices=CONVERTERS, help="run only one converter")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per conversion")
    parser.add_argument("--json", type=Path, help="write all measurements to this JSON file")
    parser.add_argument("--model-dir", type=Path, help="keep the synthetic models here (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--theirs-op-block-list",
        type=lambda text: [op for op in text.split(",") if op],
        help="op types onnxconverter-common keeps in fp32 instead of its default list, e.g. "
        "Exp,ReduceMean,Softmax,LayerNormalization to match what ours keeps (this is the path where "
        "it inserts Casts node by node and slows down sharply with graph size)",
    )
    # Internal: the per-conversion subprocess.
    parser.add_argument("--worker", choices=CONVERTERS, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        run_worker(args.worker, args.model, args.result, args.theirs_op_block_list)
        return 0

    # Imported here so the worker processes start without them.
    import onnx

    from testkit.synthetic import build_synthetic_model

    converters = [args.only] if args.only else list(CONVERTERS)
    results: dict[tuple[str, int], Measurement] = {}
    with tempfile.TemporaryDirectory() as default_model_dir:
        model_dir = args.model_dir or Path(default_model_dir)
        model_dir.mkdir(parents=True, exist_ok=True)
        for size in args.sizes:
            model_path = model_dir / f"synthetic_{size}.onnx"
            start = time.perf_counter()
            onnx.save(build_synthetic_model(size, seed=args.seed), str(model_path))
            print(
                f"[{size} nodes] built and saved in {time.perf_counter() - start:.1f} s "
                f"({model_path.stat().st_size / 1e6:.1f} MB)",
                flush=True,
            )
            for converter in converters:
                measurement = measure_in_subprocess(
                    converter, model_path, size, args.timeout, args.theirs_op_block_list
                )
                results[(converter, size)] = measurement
                summary = _format_seconds(measurement)
                if measurement.error:
                    summary += f" ({measurement.error})"
                print(f"[{size} nodes] {CONVERTER_LABELS[converter]}: {summary}", flush=True)

    ours_by_size = {size: m for (converter, size), m in results.items() if converter == "ours"}
    scaling = scaling_ratios(ours_by_size)
    table = markdown_table(args.sizes, results, args.timeout)
    print()
    print(table)
    if scaling:
        print()
    for step in scaling:
        print(
            f"ours {step['to_nodes']}/{step['from_nodes']} nodes: time x{step['time_ratio']:.2f} "
            f"for size x{step['size_ratio']:.2f}"
        )

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "timeout_seconds": args.timeout,
            "theirs_op_block_list": args.theirs_op_block_list,
            "sizes": args.sizes,
            "measurements": [asdict(m) for m in results.values()],
            "ours_scaling": scaling,
            "ours_100k_over_50k_time": time_ratio(ours_by_size, 50000, 100000),
            "markdown": table,
        }
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
