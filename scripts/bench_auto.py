"""Accuracy-driven conversion on the trained all-MiniLM-L6-v2: `amp-rewriter convert --auto`
against onnxconverter-common's `auto_mixed_precision.auto_convert_mixed_precision`, in one run.

Scenarios (the elementwise test onnxconverter-common uses, np.allclose, rtol 0.01):

- ``a``: atol 1e-8 (its default when only rtol is given);
- ``b``: atol 2e-3;
- ``plain``: no hazard to find (``--metric max-rel --max-error 5e-2``): ours only, against plain
  ``convert`` (same bytes expected; time against plain convert plus one reference and one
  verification run).

Calibration data, the same for both tools: 32 token sequences of length 128 (``--sequences``,
``--length``, ``--per-batch`` change that) from the model's
vocabulary (ids 1000..30521, [CLS] first, [SEP] at the end of each sequence, padding after a
random length between 32 and 128, attention mask to match). onnxconverter-common takes one feed
dict (all 32); ours takes the same 32 as 8 .npz batches of 4.

Each tool runs in its own process, timed by wall clock from start to written model. Ours runs
`python -m amp_rewriter convert --auto ... --metric scripts/allclose_metric.py:rtol1e2_atol...
--max-error 1`. onnxconverter-common (>= 1.15) cannot run its auto mode on this export as
released: its float16 converter leaves the export's `Cast(to=FLOAT)` nodes unretargeted while
typing their outputs fp16 (onnxconverter-common #320), so attempt 1 fails to load, and blocking a
node next to one that stays converted often gives a model ORT refuses ("bound to different
types", #304), which its bisection does not catch. The benchmark patches both, in the worker
only: the Cast targets are retargeted as 1.14 did (the open fix, PR #326), and an attempt whose
model ORT cannot load counts as a failed attempt (the segment is split) instead of ending the
run. keep_io_types stays at its default (False; with True, blocking the last LayerNorm leaves
an fp32 graph output read by an fp16 Mul). Its run is capped by --occ-timeout (killed, counted as
not finished).

Both results are then checked the same way: np.allclose on all 32 sequences, with fp16 run
emulated (fp32 compute, every fp16 tensor rounded where it is produced: what a GPU kernel with
fp32 accumulation gives; onnxruntime's CPU provider drops most fp16 casts) and, for reference,
plain onnxruntime CPU. "fp16 nodes" counts, in each output model, the nodes other than Cast with
an fp16 output.

    python scripts/bench_auto.py --json bench_out/auto.json                 # exports MiniLM
    python scripts/bench_auto.py --model minilm.onnx --scenarios b,plain --occ-timeout 600
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SCRIPTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = SCRIPTS_DIR.parent
sys.path.insert(0, str(REPO_ROOT))

ATOL = {"a": 1e-8, "b": 2e-3}
METRIC = {"a": "rtol1e2_atol1e8", "b": "rtol1e2_atol2e3"}
SEQUENCES, LENGTH, PER_BATCH = 32, 128, 4


def calibration(folder: Path, seed: int = 0, sequences: int = SEQUENCES, length: int = LENGTH,
                per_batch: int = PER_BATCH) -> dict[str, np.ndarray]:
    """`sequences` padded token sequences of `length`; written as .npz batches of `per_batch`,
    returned as one feed."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, 30522, size=(sequences, length)).astype(np.int64)
    mask = np.ones((sequences, length), np.int64)
    ids[:, 0] = 101
    for row, used in enumerate(rng.integers(max(2, length // 4), length + 1, size=sequences)):
        ids[row, used - 1] = 102
        ids[row, used:] = 0
        mask[row, used:] = 0
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("batch*.npz"):
        stale.unlink()
    for index in range(-(-sequences // per_batch)):
        rows = slice(index * per_batch, (index + 1) * per_batch)
        np.savez(folder / f"batch{index}.npz", input_ids=ids[rows], attention_mask=mask[rows])
    return {"input_ids": ids, "attention_mask": mask}


# -- onnxconverter-common, in its own process ------------------------------------------------

OCC_WORKER = r'''
import json, sys, time, warnings
import numpy as np, onnx
warnings.simplefilter("ignore")
from onnxconverter_common import auto_mixed_precision, float16

model_path, feed_path, out_path, result_path, atol = sys.argv[1:6]
state = {"attempts": 0, "load_failures": 0, "start": time.perf_counter()}

def save_state():
    state["seconds"] = time.perf_counter() - state["start"]
    with open(result_path, "w") as handle:
        json.dump(state, handle)

release_convert = float16.convert_float_to_float16
def convert_with_cast_fix(*args, **kwargs):
    # onnxconverter-common #320: Cast(to=FLOAT) nodes whose outputs it typed fp16 keep to=FLOAT;
    # retarget them as 1.14 did (the open fix, PR #326).
    model = release_convert(*args, **kwargs)
    typed = {v.name: v.type.tensor_type.elem_type
             for v in list(model.graph.value_info) + list(model.graph.output)}
    for node in model.graph.node:
        if node.op_type == "Cast":
            for attr in node.attribute:
                if attr.name == "to" and attr.i == onnx.TensorProto.FLOAT \
                        and typed.get(node.output[0]) == onnx.TensorProto.FLOAT16:
                    attr.i = onnx.TensorProto.FLOAT16
    return model
float16.convert_float_to_float16 = convert_with_cast_fix

release_run = auto_mixed_precision.get_tensor_values_using_ort
def run_counting_failures(model, feed, output_names=None, sess_options=None):
    if output_names is not None:  # its up-front dtype pass, not an attempt
        return release_run(model, feed, output_names, sess_options)
    state["attempts"] += 1
    save_state()
    try:
        return release_run(model, feed, output_names, sess_options)
    except Exception:  # a model ORT refuses: a failed attempt, not the end of the search
        state["load_failures"] += 1
        return [np.full((1,), np.nan, np.float32) for _ in model.graph.output]
auto_mixed_precision.get_tensor_values_using_ort = run_counting_failures

model = onnx.load(model_path)
with np.load(feed_path) as data:
    feed = {k: data[k] for k in data.files}
try:
    converted = auto_mixed_precision.auto_convert_mixed_precision(
        model, feed, rtol=0.01, atol=float(atol), keep_io_types=False)
    onnx.save(converted, out_path)
    state["finished"] = True
except Exception as exc:
    state["finished"] = False
    state["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
save_state()
'''


def run_occ(model: Path, feed: Path, out: Path, atol: float, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        worker = Path(tmp) / "occ_worker.py"
        worker.write_text(OCC_WORKER)
        result_path = Path(tmp) / "result.json"
        start = time.perf_counter()
        try:
            subprocess.run([sys.executable, str(worker), str(model), str(feed), str(out),
                            str(result_path), repr(atol)], capture_output=True, text=True,
                           timeout=timeout, check=False)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        seconds = time.perf_counter() - start
        state = json.loads(result_path.read_text()) if result_path.exists() else {}
    state.update({"wall_seconds": seconds, "timed_out": timed_out})
    if timed_out:
        state["finished"] = False
        state["error"] = f"stopped at the {timeout:.0f} s cap"
    return state


# -- ours, in its own process -------------------------------------------------------------------

def run_ours(model: Path, folder: Path, out: Path, args: list[str]) -> dict[str, Any]:
    report = out.with_suffix(".json")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "amp_rewriter", "convert", str(model), str(out),
                             "--inputs", str(folder), "--report", str(report), "--quiet", *args],
                            capture_output=True, text=True, env=env, check=False)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        return {"finished": False, "error": result.stderr.strip().splitlines()[-1],
                "wall_seconds": seconds}
    data = json.loads(report.read_text())
    auto = data.get("auto", {})
    return {"finished": True, "wall_seconds": seconds, "auto": auto,
            "pinned": len(auto.get("pinned", [])),
            "low_precision_nodes": data["summary"]["low_precision_nodes"]}


def run_plain(model: Path, out: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "amp_rewriter", "convert", str(model), str(out),
                    "--quiet"], check=True, env=env)
    return time.perf_counter() - start


# -- checking both results the same way -------------------------------------------------------

def fp16_nodes(path: Path) -> int:
    import onnx

    from amp_rewriter.formats.onnx.load import load_onnx

    ir = load_onnx(onnx.load(str(path)), path.parent)
    return sum(1 for node in ir.graph.walk_nodes() if node.op_type != "Cast"
               and any(v is not None and v.dtype == "float16" for v in node.outputs))


def has_fp16(path: Path) -> bool:
    """Whether any tensor of the model (constants included) is fp16."""
    import onnx

    from amp_rewriter.formats.onnx.load import load_onnx

    ir = load_onnx(onnx.load(str(path)), path.parent)
    return any(value.dtype == "float16" for graph in ir.graph.walk_graphs()
               for value in graph.values.values())


def check(reference: Path, candidate: Path, feed: dict[str, np.ndarray], atol: float
          ) -> dict[str, Any]:
    import onnx
    import onnxruntime as ort

    from amp_rewriter.formats.onnx.emulation import WHOLE_MODEL, emulate_low_precision
    from amp_rewriter.formats.onnx.execution import round_feeds

    options = ort.SessionOptions()
    options.log_severity_level = 3
    ref = ort.InferenceSession(str(reference), options, providers=["CPUExecutionProvider"])
    expected = ref.run(None, feed)
    model = onnx.load(str(candidate))
    # An all-fp32 result runs as it is: emulation rebuilds the graph (without its value_info),
    # which changes onnxruntime's fusions and so the fp32 summation order, and with atol 1e-8
    # that alone fails np.allclose on near-zero outputs.
    emulated = (emulate_low_precision(model, policy=WHOLE_MODEL).model if has_fp16(candidate)
                else model)
    results = {}
    for label, session_model, feeds in (
            ("emulated", emulated, round_feeds(model, feed)),
            ("ort_cpu", model, feed)):
        session = ort.InferenceSession(session_model.SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        names = [o.name for o in ref.get_outputs()]
        got = session.run(names, {i.name: feeds[i.name] for i in session.get_inputs()})
        ratio = max(float(np.max(np.abs(g.astype(np.float64) - e) / (atol + 1e-2 * np.abs(e))))
                    for g, e in zip(got, expected))
        results[label] = {"allclose": bool(ratio <= 1.0), "ratio": ratio}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="MiniLM .onnx (default: export it)")
    parser.add_argument("--workdir", type=Path, help="keep the files here")
    parser.add_argument("--scenarios", default="a,b,plain")
    parser.add_argument("--occ-timeout", type=float, default=900.0,
                        help="cap on each onnxconverter-common run, seconds (default 900)")
    parser.add_argument("--skip-occ", action="store_true")
    parser.add_argument("--sequences", type=int, default=SEQUENCES,
                        help=f"calibration sequences (default {SEQUENCES})")
    parser.add_argument("--length", type=int, default=LENGTH,
                        help=f"tokens per sequence (default {LENGTH})")
    parser.add_argument("--per-batch", type=int, default=PER_BATCH,
                        help=f"sequences per .npz batch for ours (default {PER_BATCH})")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_auto_"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from testkit.models.torch_export import export_minilm

        model = work / "minilm.onnx"
        if not model.exists():
            export_minilm(model, 17)
    folder = work / "calibration"
    feed = calibration(folder, sequences=args.sequences, length=args.length,
                       per_batch=args.per_batch)
    feed_path = work / "feed.npz"
    np.savez(feed_path, allow_pickle=False, **feed)
    report: dict[str, Any] = {"model": str(model), "sequences": args.sequences,
                              "length": args.length,
                              "batches_ours": -(-args.sequences // args.per_batch),
                              "scenarios": {}}
    for scenario in args.scenarios.split(","):
        print(f"== scenario {scenario}", flush=True)
        entry: dict[str, Any] = {}
        if scenario == "plain":
            plain_out = work / "plain.onnx"
            entry["plain_convert_seconds"] = run_plain(model, plain_out)
            out = work / "auto_plain.onnx"
            entry["ours"] = run_ours(model, folder, out,
                                     ["--auto", "--metric", "max-rel", "--max-error", "5e-2"])
            entry["same_bytes_as_plain"] = out.read_bytes() == plain_out.read_bytes()
            auto = entry["ours"].get("auto", {})
            entry["runs"] = {"reference": auto.get("reference_runs"),
                             "verification": auto.get("verification_runs")}
            if auto:
                trials = sum(t["seconds"] for t in auto["trials"])
                entry["ours"]["reference_seconds"] = auto["seconds"]["reference"]
                entry["ours"]["verification_seconds"] = trials
                entry["budget_seconds"] = (3 * entry["plain_convert_seconds"]
                                           + auto["seconds"]["reference"] + trials)
            report["scenarios"][scenario] = entry
            print(json.dumps(entry, indent=1), flush=True)
            continue
        atol = ATOL[scenario]
        out = work / f"ours_{scenario}.onnx"
        metric = f"{SCRIPTS_DIR / 'allclose_metric.py'}:{METRIC[scenario]}"
        entry["ours"] = run_ours(model, folder, out,
                                 ["--auto", "--metric", metric, "--max-error", "1"])
        if entry["ours"]["finished"]:
            entry["ours"]["fp16_nodes"] = fp16_nodes(out)
            entry["ours"]["check"] = check(model, out, feed, atol)
        print(json.dumps(entry["ours"].get("check"), indent=1), flush=True)
        if not args.skip_occ:
            occ_out = work / f"occ_{scenario}.onnx"
            entry["occ"] = run_occ(model, feed_path, occ_out, atol, args.occ_timeout)
            if entry["occ"].get("finished"):
                entry["occ"]["fp16_nodes"] = fp16_nodes(occ_out)
                entry["occ"]["check"] = check(model, occ_out, feed, atol)
            if entry["occ"].get("finished") or entry["occ"].get("timed_out"):
                entry["occ_over_ours"] = entry["occ"]["wall_seconds"] / \
                    entry["ours"]["wall_seconds"]
        report["scenarios"][scenario] = entry
        print(json.dumps({k: v for k, v in entry.items()}, indent=1, default=str), flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2, default=str))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
