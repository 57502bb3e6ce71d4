"""Peak memory of `convert --auto` on a big model: statistics are streamed, so memory should grow
with the model and one batch, not with the number of calibration batches.

Builds an fp32 ONNX model of about --size-mb MB (a chain of MatMul + Relu layers with
weights x weights matrices, stored as external data, as models this big are), writes --batches
calibration batches, and runs `python -m amp_rewriter convert --auto` (and plain `convert`, for
comparison) in a child process each, reading the child's peak resident set (ru_maxrss). It prints
the peak against the bound the issue sets: 2 x the model's size + one batch's activations (the
sum of every float tensor of one batch, computed from the model's shapes).

    python scripts/auto_memory.py                          # ~1 GB model, 8 batches
    python scripts/auto_memory.py --size-mb 256 --batches 2,8 --json bench_out/memory.json
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

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
WIDTH = 4096
ROWS = 4


def build(folder: Path, size_mb: int) -> tuple[Path, int, int]:
    """The model file, its size in bytes (graph + data) and one batch's activation bytes."""
    import onnx
    from onnx import helper, numpy_helper

    layers = max(1, round(size_mb * 2**20 / (WIDTH * WIDTH * 4)))
    rng = np.random.default_rng(0)
    nodes, initializers = [], []
    current = "x"
    for layer in range(layers):
        weight = rng.standard_normal((WIDTH, WIDTH), dtype=np.float32)
        weight *= np.float32(1 / np.sqrt(WIDTH))
        initializers.append(numpy_helper.from_array(weight, f"w{layer}"))
        nodes.append(helper.make_node("MatMul", [current, f"w{layer}"], [f"mm{layer}"],
                                      name=f"mm{layer}"))
        nodes.append(helper.make_node("Relu", [f"mm{layer}"], [f"relu{layer}"],
                                      name=f"relu{layer}"))
        current = f"relu{layer}"
    graph = helper.make_graph(
        nodes, "big", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                     ["batch", WIDTH])],
        [helper.make_tensor_value_info(current, onnx.TensorProto.FLOAT, ["batch", WIDTH])],
        initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "big.onnx"
    (folder / "big.onnx.data").unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="big.onnx.data", size_threshold=1024)
    size = path.stat().st_size + (folder / "big.onnx.data").stat().st_size
    activations = 2 * layers * ROWS * WIDTH * 4 + ROWS * WIDTH * 4
    return path, size, activations


def child_peak_mb(command: list[str]) -> tuple[float, float, int]:
    """Run `command`; its peak RSS in MB (ru_maxrss of this one child), seconds, exit code."""
    script = ("import resource, subprocess, sys\n"
              "code = subprocess.run(sys.argv[1:]).returncode\n"
              "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
              "sys.exit(code)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", script, *command], capture_output=True,
                            text=True, env=env, check=False)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        print(result.stderr[-2000:], file=sys.stderr)
    peak_kib = int(result.stdout.strip().splitlines()[-1])
    return peak_kib / 1024, seconds, result.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--batches", default="8", help="comma-separated batch counts to try")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="auto_memory_"))
    work.mkdir(parents=True, exist_ok=True)
    model, size, activations = build(work, args.size_mb)
    bound_mb = (2 * size + activations) / 2**20
    print(f"model {size / 2**20:.0f} MB, one batch's activations {activations / 2**20:.1f} MB, "
          f"bound {bound_mb:.0f} MB", flush=True)
    runs: list[dict[str, object]] = []
    results = {"model_mb": size / 2**20, "activations_mb": activations / 2**20,
               "bound_mb": bound_mb, "runs": runs}
    python = [sys.executable, "-m", "amp_rewriter", "convert", str(model)]
    peak, seconds, code = child_peak_mb(python + [str(work / "plain.onnx"), "--quiet"])
    runs.append({"run": "plain convert", "peak_mb": peak, "seconds": seconds,
                            "exit": code})
    print(f"plain convert: peak {peak:.0f} MB, {seconds:.1f} s", flush=True)
    rng = np.random.default_rng(1)
    for count in (int(c) for c in args.batches.split(",")):
        folder = work / f"calibration_{count}"
        folder.mkdir(exist_ok=True)
        for index in range(count):
            np.savez(folder / f"batch{index}.npz",
                     x=rng.standard_normal((ROWS, WIDTH)).astype(np.float32))
        peak, seconds, code = child_peak_mb(python + [
            str(work / f"auto_{count}.onnx"), "--auto", "--max-error", "5e-2", "--inputs",
            str(folder), "--quiet"])
        runs.append({"run": f"--auto, {count} batches", "peak_mb": peak,
                                "seconds": seconds, "exit": code,
                                "under_bound": peak <= bound_mb})
        print(f"--auto with {count} batches: peak {peak:.0f} MB "
              f"({'under' if peak <= bound_mb else 'OVER'} the {bound_mb:.0f} MB bound), "
              f"{seconds:.1f} s, exit {code}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
