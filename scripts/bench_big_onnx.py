#!/usr/bin/env python
"""Convert a 4 GiB fp32 ONNX model with external data to fp16, beside `cp` of its data file.

    .venv/bin/python scripts/bench_big_onnx.py                 # build (once) and measure
    .venv/bin/python scripts/bench_big_onnx.py --gib 1 --reps 1  # a smaller model, quicker

1. Builds (once, cached under `--out`, default bench_out/big_onnx) an MLP whose weights live in
   `big.onnx.data`: `--big` MatMul weights of 1 GiB each (16384 x 16384, seeded random values
   scaled to keep activations small) and two of 512 MiB, `--gib` GiB in all, written a
   slice at a time.
2. In one run, interleaved `--reps` times: `cp` of the data file, and `amp-rewriter convert`
   (this checkout); then once each, onnxconverter-common's `convert_float_to_float16` and
   onnxruntime's transformers float16 tool (`onnxruntime.transformers.float16`), both under a
   memory cap (`--cap-gib`, RLIMIT_AS) so they fail rather than take the shared machine's
   memory: a side that fails is recorded with its error.
3. Every side runs in its own subprocess; its peak RSS comes from `os.wait4`. The baseline is a
   Python that imports what the conversion imports (numpy, onnx, onnxruntime, amp_rewriter).
4. Validates our output against the input in onnxruntime on a seeded random batch: the fp32
   model as it is, ours with every node that reads or writes fp16 data run in fp32 between casts
   (the CPU provider has no fp16 MatMul; outputs rounded to fp16 where they are produced), graph
   optimizations off so no weight is stored widened (`amp-rewriter check` would emulate the same,
   but holds the weights in memory several times over); relative error under 2e-2. Checks that
   the input's files are unchanged (size and mtime).

Prints a table (seconds, ratio to the fastest cp, peak RSS, above the baseline) and writes it as
JSON to `<out>/results.json`. Note the load average it prints: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
SIDE = 16384  # a 16384 x 16384 float32 matrix is 1 GiB


def build(folder: Path, gib: int, big: int) -> Path:
    """The model and its data file, written a row block at a time (never a weight in memory)."""
    import numpy as np
    from onnx import TensorProto, helper

    model_path = folder / "big.onnx"
    if model_path.exists() and (folder / "big.onnx.data").exists():
        return model_path
    folder.mkdir(parents=True, exist_ok=True)
    half = SIDE // 2
    # (name, rows, cols): `big` square 1 GiB weights, then 512 MiB ones to reach `gib`.
    shapes = [(f"w{i}", SIDE, SIDE) for i in range(big)]
    rest = gib * GIB - big * GIB
    count = 0
    while rest > 0:
        shapes.append((f"h{count}", SIDE, half) if count % 2 == 0 else (f"h{count}", half, SIDE))
        rest -= GIB // 2
        count += 1
    if count % 2:  # end on SIDE columns so the chain closes
        shapes.append((f"h{count}", half, SIDE))
    rng = np.random.default_rng(0)
    initializers, nodes = [], []
    offset = 0
    data = folder / "big.onnx.data.partial"
    with open(data, "wb") as handle:
        for name, rows, cols in shapes:
            for start in range(0, rows, 1024):
                block = rng.standard_normal((min(1024, rows - start), cols), dtype=np.float32)
                block *= np.float32(1.0 / np.sqrt(rows))
                handle.write(block.tobytes())
            tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[rows, cols],
                                 data_location=TensorProto.EXTERNAL)
            for key, value in (("location", "big.onnx.data"), ("offset", str(offset)),
                               ("length", str(rows * cols * 4))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            offset += rows * cols * 4
            initializers.append(tensor)
    previous = "x"
    for index, (name, _rows, cols) in enumerate(shapes):
        bias = f"b{index}"
        initializers.append(helper.make_tensor(bias, TensorProto.FLOAT, [cols],
                                               (rng.standard_normal(cols) * 0.01).tolist()))
        nodes.append(helper.make_node("MatMul", [previous, name], [f"m{index}"], name=f"mm{index}"))
        nodes.append(helper.make_node("Add", [f"m{index}", bias], [f"a{index}"], name=f"add{index}"))
        last = index == len(shapes) - 1
        nodes.append(helper.make_node("Tanh" if not last else "Identity", [f"a{index}"],
                                      ["y" if last else f"t{index}"], name=f"act{index}"))
        previous = f"t{index}"
    graph = helper.make_graph(
        nodes, "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SIDE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", SIDE])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    os.replace(data, folder / "big.onnx.data")
    (folder / "big.onnx").write_bytes(model.SerializeToString())
    return model_path


def measure(command: list[str], env: dict[str, str] | None = None, cap: int | None = None,
            cwd: Path | None = None) -> dict:
    """Run `command`; its wall time, peak RSS (os.wait4) and exit status. Dirty pages are
    flushed first (not timed), so no side pays for the writes of the one before it."""
    os.sync()

    def limit() -> None:
        if cap is not None:
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, cwd=cwd, preexec_fn=limit,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert process.stdout is not None
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "status": process.returncode,
            "tail": output.decode(errors="replace").strip().splitlines()[-3:]}


def python_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}


# Each tool's own way for models over 2 GB: onnxconverter-common's model-path entry point (shape
# inference on the file), ORT's converter with its shape inference off (it serializes the model).
ONNXCONVERTER = """
import sys, onnx
from onnxconverter_common import float16
converted = float16.convert_float_to_float16_model_path(sys.argv[1], keep_io_types=True)
onnx.save_model(converted, sys.argv[2], save_as_external_data=True,
                all_tensors_to_one_file=True, location="out.onnx.data")
"""

ORT_FLOAT16 = """
import sys, onnx
from onnxruntime.transformers.float16 import convert_float_to_float16
model = onnx.load(sys.argv[1])  # loads the external data
converted = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True)
onnx.save_model(converted, sys.argv[2], save_as_external_data=True,
                all_tensors_to_one_file=True, location="out.onnx.data")
"""

VALIDATE = """
import sys, numpy as np, onnx, onnxruntime as ort
from onnx import TensorProto, helper
reference, converted = sys.argv[1], sys.argv[2]
options = ort.SessionOptions()
# No constant folding: a Cast of a 1 GiB fp16 weight runs per call instead of being stored fp32.
options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
x = np.random.default_rng(0).standard_normal((2, 16384)).astype(np.float32)
session = ort.InferenceSession(reference, options, providers=["CPUExecutionProvider"])
expected = session.run(None, {"x": x})[0]
del session
# onnxruntime's CPU provider has no fp16 MatMul: every node with fp16 data runs in fp32 between
# casts (inputs widened, outputs rounded to fp16 where they are produced), as an fp16 kernel
# with fp32 accumulation would compute it.
model = onnx.load(converted, load_external_data=False)
graph = model.graph
fp16 = {t.name for t in graph.initializer if t.data_type == TensorProto.FLOAT16}
inferred = onnx.shape_inference.infer_shapes(model)
fp16 |= {v.name for v in list(inferred.graph.value_info) + list(graph.input)
         if v.type.tensor_type.elem_type == TensorProto.FLOAT16}
nodes = []
for index, node in enumerate(graph.node):
    if node.op_type == "Cast" or not (set(node.input) | set(node.output)) & fp16:
        nodes.append(node)
        continue
    after = []
    for i, name in enumerate(node.input):
        if name in fp16:
            wide = f"{name}__emulated_in{index}"
            nodes.append(helper.make_node("Cast", [name], [wide], to=TensorProto.FLOAT))
            node.input[i] = wide
    for i, name in enumerate(node.output):
        if name in fp16:
            node.output[i] = f"{name}__emulated_fp32"
            after.append(helper.make_node("Cast", [f"{name}__emulated_fp32"], [name], to=TensorProto.FLOAT16))
    nodes.append(node)
    nodes.extend(after)
del graph.node[:]
graph.node.extend(nodes)
del graph.value_info[:]
folder = converted.rsplit("/", 1)[0]
onnx.save_model(model, folder + "/emulated.onnx")
session = ort.InferenceSession(folder + "/emulated.onnx", options, providers=["CPUExecutionProvider"])
got = session.run(None, {"x": x})[0]
error = float(np.max(np.abs(got - expected)) / np.max(np.abs(expected)))
print(f"relative error {error:.3g} (max|y| {np.max(np.abs(expected)):.3g})")
sys.exit(0 if error < 2e-2 else 1)
"""

BASELINE = "import numpy, onnx, onnxruntime, amp_rewriter.cli, amp_rewriter.formats.onnx.convert"


def fresh(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench_out" / "big_onnx")
    parser.add_argument("--gib", type=int, default=4, help="the model's weights in GiB")
    parser.add_argument("--big", type=int, default=2, help="how many 1 GiB weights")
    parser.add_argument("--reps", type=int, default=2, help="interleaved cp / convert rounds")
    parser.add_argument("--cap-gib", type=float, default=12.0,
                        help="address-space cap of the competitors' processes")
    parser.add_argument("--skip-others", action="store_true", help="only cp and ours")
    args = parser.parse_args()
    python = sys.executable
    model = build(args.out / "model", args.gib, args.big)
    data = model.parent / "big.onnx.data"
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in model.parent.iterdir()}
    results: dict = {"model_bytes": data.stat().st_size, "load_average": os.getloadavg(),
                     "cp": [], "ours": []}
    results["baseline"] = measure([python, "-c", BASELINE], python_env())
    baseline = results["baseline"]["peak_rss_mib"]
    ours_out = args.out / "ours"
    for _ in range(args.reps):
        copy = fresh(args.out / "cp")
        results["cp"].append(measure(["cp", str(data), str(copy / "big.onnx.data")]))
        shutil.rmtree(copy)
        fresh(ours_out)
        results["ours"].append(measure([python, "-m", "amp_rewriter", "convert", str(model),
                                        str(ours_out / "big_fp16.onnx")], python_env()))
    if not args.skip_others:
        cap = int(args.cap_gib * GIB)
        for name, script in (("onnxconverter_common", ONNXCONVERTER), ("ort_float16", ORT_FLOAT16)):
            out = fresh(args.out / name)
            results[name] = measure([python, "-c", script, str(model), str(out / "out.onnx")],
                                    python_env(), cap=cap)
            results[name]["cap_gib"] = args.cap_gib
            shutil.rmtree(out)
    results["check"] = measure([python, "-c", VALIDATE, str(model),
                                str(ours_out / "big_fp16.onnx")], python_env())
    after = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in model.parent.iterdir()}
    results["input_unchanged"] = before == after
    results["load_average_after"] = os.getloadavg()
    cp_best = min(r["seconds"] for r in results["cp"])
    print(f"model: {results['model_bytes'] / GIB:.2f} GiB of weights; load average "
          f"{results['load_average'][0]:.1f} before, {results['load_average_after'][0]:.1f} after")
    print(f"{'side':24} {'s':>8} {'x cp':>6} {'peak RSS MiB':>13} {'above base':>11}  status")
    rows = [("python baseline", results["baseline"])]
    rows += [(f"cp #{i + 1}", r) for i, r in enumerate(results["cp"])]
    rows += [(f"amp-rewriter #{i + 1}", r) for i, r in enumerate(results["ours"])]
    rows += [(name, results[name]) for name in ("onnxconverter_common", "ort_float16", "check")
             if name in results]
    for label, r in rows:
        print(f"{label:24} {r['seconds']:8.1f} {r['seconds'] / cp_best:6.2f} "
              f"{r['peak_rss_mib']:13.0f} {r['peak_rss_mib'] - baseline:11.0f}  {r['status']}"
              f"{'' if r['status'] == 0 else ' ' + ' | '.join(r['tail'])[-160:]}")
    print(f"input files unchanged: {results['input_unchanged']}")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    ok = all(r["status"] == 0 for r in results["ours"]) and results["check"]["status"] == 0
    return 0 if ok and results["input_unchanged"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
