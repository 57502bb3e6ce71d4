"""How our conversion scales to very large graphs: time and peak memory at two sizes, one run.

For each size (default 500k and 1M nodes) the synthetic transformer-like model of
``testkit.synthetic`` is built once (kept in ``--model-dir``); then, ``--repeats`` times, the
sizes are measured in turn (interleaved, so a busy spell on a shared machine hits both), each
measurement in a fresh Python process so its peak memory is its own:

* ``convert``: ``onnx.load`` the model, then ``amp_rewriter.convert(model, target="fp16",
  keep_io_types=True)`` on the in-memory ModelProto. Time is the convert call; peak memory is
  the resident-set high-water mark during the call minus the resident set just before it, i.e.
  above the loaded model.
* ``file``: ``amp_rewriter.convert_file(path, out, target="fp16", keep_io_types=True)``: load,
  convert and save. Peak memory is measured from the resident set after the imports; "above the
  loaded model" subtracts what the loaded ModelProto takes (measured by the ``convert`` runs of
  the same size: resident set after ``onnx.load`` minus before).

Peak memory "with workers" adds the processes a conversion starts (amp_rewriter checks a big
model in a second process): the resident sets of the measuring process and its children summed,
read every 20 ms from outside over the whole measuring process, minus the same start.

Reported per size and mode: the median wall time and CPU time of the repeats, the median peak
above the loaded model (alone and with workers) and per node; and the ratio of the larger size's median time to the
smaller's (linear growth = the size ratio). The machine's load average is recorded with every
measurement: timings on a shared machine are noisy, memory is not.

Example::

    python scripts/bench_scale.py                       # 500k and 1M, 3 repeats, both modes
    python scripts/bench_scale.py --sizes 100k,200k --repeats 1 --json bench_out/scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCRIPTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = SCRIPTS_DIR.parent
sys.path.insert(0, str(REPO_ROOT))

from testkit.bench import (  # noqa: E402  (after the path set-up)
    current_rss_kib,
    parse_sizes,
    peak_rss_kib,
    reset_peak_rss,
    sampled_run,
)

MODES = ("convert", "file")
#: What a run's own peak is measured from: a `file` run reads the model itself, so its peak
#: includes the model (the summary takes it off).
_PEAK_BASIS = {"convert": "above the loaded model",
               "file": "above the imports, the model read included"}
DEFAULT_SIZES = "500k,1000k"
DEFAULT_MODEL_DIR = REPO_ROOT / "bench_out" / "scale_models"


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------------------------------------
# Worker: one measurement in a fresh process
# ---------------------------------------------------------------------------------------------


def run_worker(mode: str, model_path: Path, result_path: Path) -> None:
    """Measure one `mode` run on `model_path`; write the numbers to `result_path` as JSON."""
    import onnx

    import amp_rewriter

    rss_after_imports_kib = current_rss_kib()
    result: dict[str, Any] = {"mode": mode}
    if mode == "convert":
        model = onnx.load(str(model_path))
        result["nodes"] = len(model.graph.node)
        rss_before_kib = current_rss_kib()
        result["loaded_model_mb"] = (rss_before_kib - rss_after_imports_kib) / 1024
        peak_was_reset = reset_peak_rss()
        start, cpu_start = time.perf_counter(), _cpu_seconds()
        converted, _report = amp_rewriter.convert(model, target="fp16", keep_io_types=True)
        result["seconds"] = time.perf_counter() - start
        result["cpu_seconds"] = _cpu_seconds() - cpu_start
        result["peak_above_start_mb"] = (peak_rss_kib(peak_was_reset) - rss_before_kib) / 1024
        result["rss_before_kib"] = rss_before_kib
        result["nodes_out"] = len(converted.graph.node)
    else:
        with tempfile.TemporaryDirectory(dir=result_path.parent) as scratch:
            rss_before_kib = current_rss_kib()
            peak_was_reset = reset_peak_rss()
            start, cpu_start = time.perf_counter(), _cpu_seconds()
            amp_rewriter.convert_file(model_path, Path(scratch) / "converted.onnx", target="fp16",
                                      keep_io_types=True)
            result["seconds"] = time.perf_counter() - start
            result["cpu_seconds"] = _cpu_seconds() - cpu_start
            result["peak_above_start_mb"] = (peak_rss_kib(peak_was_reset) - rss_before_kib) / 1024
            result["rss_before_kib"] = rss_before_kib
            result["output_mb"] = (Path(scratch) / "converted.onnx").stat().st_size / 1e6
    result["peak_measured_with"] = "VmHWM after clear_refs" if peak_was_reset else "ru_maxrss"
    result_path.write_text(json.dumps(result, indent=2))


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def measure(mode: str, model_path: Path, timeout_s: float) -> dict[str, Any]:
    """One measurement in a fresh interpreter; {"error": ...} when it failed or timed out."""
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=model_path.parent) as scratch:
        result_path = Path(scratch) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", mode,
                   "--model", str(model_path), "--result", str(result_path)]
        try:
            completed = sampled_run(command, timeout_s, REPO_ROOT)
        except subprocess.TimeoutExpired:
            return {"mode": mode, "error": f"no result within {timeout_s:g} s"}
        if completed.returncode != 0 or not result_path.exists():
            lines = [line for line in completed.stderr.splitlines() if line.strip()]
            return {"mode": mode,
                    "error": lines[-1] if lines else f"exit status {completed.returncode}"}
        result: dict[str, Any] = json.loads(result_path.read_text())
        # Sampled over the whole measuring process, the workers it starts with it.
        # Never below the process's own exact peak, which a 20 ms sample can miss.
        result["peak_with_workers_above_start_mb"] = max(
            (completed.peak_with_children_kib - result.pop("rss_before_kib")) / 1024,
            result["peak_above_start_mb"])
        result["workers_peak_mb"] = completed.peak_children_kib / 1024
    result["load_average_before"] = load_before
    result["load_average_after"] = os.getloadavg()[0]
    return result


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [run[key] for run in runs if key in run]
    return statistics.median(values) if values else None


def summarize(sizes: list[int], runs: dict[tuple[int, str], list[dict[str, Any]]]
              ) -> dict[str, Any]:
    """Medians per size and mode, peaks above the loaded model, and the time ratios."""
    loaded = {size: _median(runs[(size, "convert")], "loaded_model_mb") for size in sizes}
    rows: list[dict[str, Any]] = []
    for size in sizes:
        for mode in MODES:
            done = runs.get((size, mode), [])
            if not done:
                continue
            peak = _median(done, "peak_above_start_mb")
            with_workers = _median(done, "peak_with_workers_above_start_mb")
            base = loaded[size]
            if mode == "file" and base is not None:
                # measured from the imports: take the loaded model off
                peak = peak - base if peak is not None else None
                with_workers = with_workers - base if with_workers is not None else None
            rows.append({
                "nodes": size, "mode": mode, "runs": len(done),
                "errors": [run["error"] for run in done if "error" in run],
                "median_seconds": _median(done, "seconds"),
                "median_cpu_seconds": _median(done, "cpu_seconds"),
                "all_seconds": [round(run["seconds"], 2) for run in done if "seconds" in run],
                "peak_above_loaded_model_mb": peak,
                "peak_bytes_per_node": peak * 2**20 / size if peak is not None else None,
                "peak_with_workers_above_loaded_model_mb": with_workers,
                "loaded_model_mb": loaded[size],
                "load_averages": [round(run.get("load_average_before", 0.0), 2) for run in done],
            })
    ratios = []
    for mode in MODES:
        by_size = {row["nodes"]: row for row in rows if row["mode"] == mode}
        for smaller, larger in zip(sizes, sizes[1:]):
            small, large = by_size.get(smaller), by_size.get(larger)
            if small and large and small["median_seconds"] and large["median_seconds"]:
                ratios.append({
                    "mode": mode, "from_nodes": smaller, "to_nodes": larger,
                    "size_ratio": larger / smaller,
                    "time_ratio": large["median_seconds"] / small["median_seconds"],
                    "cpu_time_ratio": (large["median_cpu_seconds"] / small["median_cpu_seconds"]
                                       if small["median_cpu_seconds"] else None)})
    return {"rows": rows, "ratios": ratios}


def markdown(summary: dict[str, Any]) -> str:
    """The summary as a markdown table plus one line per ratio."""
    lines = ["| nodes | mode | median s | median CPU s | runs s | peak above loaded model MB "
             "| with workers MB | bytes/node | load avg |", "|---|---|---|---|---|---|---|---|---|"]
    for row in summary["rows"]:
        peak = row["peak_above_loaded_model_mb"]
        per_node = row["peak_bytes_per_node"]
        lines.append(
            f"| {row['nodes']} | {row['mode']} | {_num(row['median_seconds'], 1)} "
            f"| {_num(row['median_cpu_seconds'], 1)} | {row['all_seconds']} "
            f"| {_num(peak, 0)} | {_num(row['peak_with_workers_above_loaded_model_mb'], 0)} "
            f"| {_num(per_node, 0)} | {row['load_averages']} |"
            + (f" errors: {row['errors']}" if row["errors"] else ""))
    for ratio in summary["ratios"]:
        cpu = ratio["cpu_time_ratio"]
        lines.append(f"\n{ratio['mode']}: {ratio['from_nodes']} -> {ratio['to_nodes']} nodes "
                     f"(x{ratio['size_ratio']:.2f}): median time x{ratio['time_ratio']:.2f}, "
                     f"CPU time x{_num(cpu, 2)}")
    return "\n".join(lines)


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES),
                        help="comma-separated node counts, smallest first (a k suffix: thousands)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per size and mode")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated: convert (in memory) and/or file (load+convert+save)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per measurement")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                        help="where the synthetic models are built once and kept")
    parser.add_argument("--json", type=Path, help="write every measurement and the summary here")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        run_worker(args.worker, args.model, args.result)
        return 0

    import onnx

    from testkit.synthetic import build_synthetic_model

    modes = [mode for mode in args.modes.split(",") if mode]
    if "file" in modes and "convert" not in modes:
        parser.error("the file mode needs the convert mode (it measures the loaded model)")
    sizes = sorted(args.sizes)
    args.model_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for size in sizes:
        path = args.model_dir / f"synthetic_{size}.onnx"
        if not path.exists():
            start = time.perf_counter()
            onnx.save(build_synthetic_model(size), str(path))
            print(f"[{size} nodes] built in {time.perf_counter() - start:.0f} s", flush=True)
        paths[size] = path

    runs: dict[tuple[int, str], list[dict[str, Any]]] = {(s, m): [] for s in sizes for m in modes}
    for repeat in range(args.repeats):
        for size in sizes:
            for mode in modes:
                result = measure(mode, paths[size], args.timeout)
                runs[(size, mode)].append(result)
                shown = result.get("error") or (
                    f"{result['seconds']:.1f} s (CPU {result['cpu_seconds']:.1f} s), peak "
                    f"+{result['peak_above_start_mb']:.0f} MB (with workers "
                    f"+{result['peak_with_workers_above_start_mb']:.0f} MB) "
                    f"{_PEAK_BASIS[mode]}, load avg {result['load_average_before']:.1f}")
                print(f"[round {repeat + 1}] {size} nodes {mode}: {shown}", flush=True)

    summary = summarize(sizes, runs)
    print()
    print(markdown(summary))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"sizes": sizes, "repeats": args.repeats,
                                         "runs": {f"{s}/{m}": r for (s, m), r in runs.items()},
                                         "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
