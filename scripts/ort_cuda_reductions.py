#!/usr/bin/env python
"""Are onnxruntime's CUDA reductions right, and how fast, per op, dtype and opset: the facts behind
the ort-cuda profile's choice of which reductions a rewrite may build.

    python scripts/ort_cuda_reductions.py --json bench_out/cuda_reductions.json   # GPU host
    python scripts/ort_cuda_reductions.py --device cpu                            # smoke run

Each case is one single-node model (the reduction over the last axis of a [8, 128, 768] tensor,
keepdims 1, the shape of a decoder's RMS norm), axes as an attribute (opset 13) or as an input
(opset 18), run with IO binding on CUDAExecutionProvider with CPU fallback disabled. The input is
|N(0, 1)| * 0.05 + 1e-3 per element (positive, like the Abs a row maximum is taken of), and the
result is compared with numpy's in float64: the relative error is max|y - ref| / max|ref|. Time
is the median of 200 runs after 20 warm-ups (the whole call, one kernel or a few).

Then the rescaled RMS norm amp_rewriter builds for backends that allow it, node by node against
the CPU provider: where a CUDA kernel of it goes wrong.

Prints a Markdown table; writes it as JSON to --json and $OUT/cuda_reductions.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

OPS = ("ReduceMax", "ReduceMin", "ReduceMean", "ReduceSum", "ReduceL2", "ReduceSumSquare")
SHAPE = (8, 128, 768)
DTYPES = {"fp16": (np.float16, 10), "fp32": (np.float32, 1)}


def reference(op: str, x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return {"ReduceMax": lambda: x64.max(-1, keepdims=True),
            "ReduceMin": lambda: x64.min(-1, keepdims=True),
            "ReduceMean": lambda: x64.mean(-1, keepdims=True),
            "ReduceSum": lambda: x64.sum(-1, keepdims=True),
            "ReduceL2": lambda: np.sqrt((x64 * x64).sum(-1, keepdims=True)),
            "ReduceSumSquare": lambda: (x64 * x64).sum(-1, keepdims=True)}[op]()


def model_bytes(op: str, elem_type: int, opset: int) -> bytes:
    from onnx import helper, numpy_helper

    axes_as_input = opset >= 18 or op == "ReduceSum"  # ReduceSum takes axes as input from 13
    inputs, initializers = ["x"], []
    attributes: dict[str, Any] = {"keepdims": 1}
    if axes_as_input:
        inputs.append("axes")
        initializers.append(numpy_helper.from_array(np.array([-1], np.int64), "axes"))
    else:
        attributes["axes"] = [-1]
    node = helper.make_node(op, inputs, ["y"], **attributes)
    graph = helper.make_graph([node], "reduction",
                              [helper.make_tensor_value_info("x", elem_type, list(SHAPE))],
                              [helper.make_tensor_value_info("y", elem_type, [*SHAPE[:-1], 1])],
                              initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    return model.SerializeToString()


def run_case(op: str, dtype: str, opset: int, device: str) -> dict[str, Any]:
    import onnxruntime as ort

    numpy_type, elem_type = DTYPES[dtype]
    rng = np.random.default_rng(0)
    x = (np.abs(rng.standard_normal(SHAPE)) * 0.05 + 1e-3).astype(numpy_type)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    providers: list[Any] = ["CPUExecutionProvider"]
    if device == "cuda":
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        providers = ["CUDAExecutionProvider"]
    try:
        session = ort.InferenceSession(model_bytes(op, elem_type, opset), options,
                                       providers=providers)
    except Exception as exc:  # noqa: BLE001  (no kernel is a result)
        return {"status": f"no kernel: {str(exc).splitlines()[0][:120]}"}
    binding = session.io_binding()
    value = ort.OrtValue.ortvalue_from_numpy(x, device, 0)
    binding.bind_ortvalue_input("x", value)
    binding.bind_output("y", device, 0)
    binding.synchronize_inputs()

    def call() -> None:
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()

    for _ in range(20):
        call()
    times = []
    for _ in range(200):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    got = binding.copy_outputs_to_cpu()[0].astype(np.float64)
    want = reference(op, x)
    error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    return {"status": "ok", "relative_error": error, "median_ms": statistics.median(times),
            "got_first": float(got.reshape(-1)[0]), "want_first": float(want.reshape(-1)[0])}


def rescaled_norm_divergence(device: str) -> list[dict[str, Any]]:
    """The rescaled RMS norm that `amp_rewriter` builds (an fp32 norm over [8, 128, 768] converted
    to fp16 for a backend that allows the rescale), every node's output exposed, run on `device`
    and on the CPU provider: per node, the largest difference relative to the CPU's largest |y|."""
    import sys

    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import amp_rewriter

    rng = np.random.default_rng(1)
    hidden = SHAPE[-1]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
             helper.make_node("Pow", ["h", "two"], ["square"], name="square"),
             helper.make_node("ReduceMean", ["square", "axes"], ["mean"], keepdims=1, name="mean"),
             helper.make_node("Add", ["mean", "eps"], ["mean_eps"], name="add_eps"),
             helper.make_node("Sqrt", ["mean_eps"], ["root"], name="root"),
             helper.make_node("Reciprocal", ["root"], ["inverse"], name="inverse"),
             helper.make_node("Mul", ["h", "inverse"], ["normed"], name="scale"),
             helper.make_node("MatMul", ["normed", "w"], ["y"], name="proj")]
    graph = helper.make_graph(
        nodes, "rms_norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(SHAPE))],
        [numpy_helper.from_array((rng.standard_normal((hidden, hidden)) / 28).astype(np.float32),
                                 "w"),
         numpy_helper.from_array(np.array(2.0, np.float32), "two"),
         numpy_helper.from_array(np.array([-1], np.int64), "axes"),
         numpy_helper.from_array(np.array(1e-6, np.float32), "eps")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    converted, _ = amp_rewriter.convert(model, target="fp16", backend="ort-cpu",
                                        keep_io_types=True)
    exposed = onnx.ModelProto()
    exposed.CopyFrom(converted)
    typed = {o.name for o in exposed.graph.output}
    inferred = onnx.shape_inference.infer_shapes(exposed)
    for info in inferred.graph.value_info:
        if info.name not in typed:
            exposed.graph.output.append(info)
    feeds = {"x": (rng.standard_normal(SHAPE) * 3).astype(np.float32)}
    outputs = {}
    for provider in ("CPUExecutionProvider", "CUDAExecutionProvider" if device == "cuda"
                     else "CPUExecutionProvider"):
        session = ort.InferenceSession(exposed.SerializeToString(), providers=[provider])
        names = [o.name for o in session.get_outputs()]
        outputs[provider] = dict(zip(names, session.run(None, feeds)))
    cpu, other = outputs["CPUExecutionProvider"], outputs[list(outputs)[-1]]
    # The model as converted (no node output exposed, so ORT may fuse), on the device.
    provider = "CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider"
    whole = ort.InferenceSession(converted.SerializeToString(), providers=[provider])
    final = whole.run(None, feeds)[0].astype(np.float64)
    want_final = cpu[converted.graph.output[0].name].astype(np.float64)
    rows = [{"node": "(whole model, nothing exposed)", "op": "-", "output": "y",
             "relative_difference": float(np.max(np.abs(final - want_final)))
             / float(np.max(np.abs(want_final))),
             "cpu_first": float(want_final.reshape(-1)[0]),
             "device_first": float(final.reshape(-1)[0])}]
    for node in converted.graph.node:
        for name in node.output:
            if name not in cpu:
                continue
            want, got = cpu[name].astype(np.float64), other[name].astype(np.float64)
            scale = float(np.max(np.abs(want))) or 1.0
            rows.append({"node": node.name, "op": node.op_type, "output": name,
                         "relative_difference": float(np.max(np.abs(got - want))) / scale,
                         "cpu_first": float(want.reshape(-1)[0]),
                         "device_first": float(got.reshape(-1)[0])})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.device == "cuda":
        import torch  # noqa: F401, I001  (its CUDA libraries are the ones onnxruntime preloads)
        import onnxruntime as ort

        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
    rows = []
    for op in OPS:
        for dtype in DTYPES:
            for opset in (13, 18):
                rows.append({"op": op, "dtype": dtype, "opset": opset,
                             **run_case(op, dtype, opset, args.device)})
    lines = ["| op | dtype | opset | status | rel. error | median ms | first: got / want |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"| {row['op']} | {row['dtype']} | {row['opset']} | {row['status']} "
                         "| - | - | - |")
            continue
        lines.append(f"| {row['op']} | {row['dtype']} | {row['opset']} | ok "
                     f"| {row['relative_error']:.1e} | {row['median_ms']:.4f} "
                     f"| {row['got_first']:.4g} / {row['want_first']:.4g} |")
    print("\n".join(lines))
    chain = rescaled_norm_divergence(args.device)
    print("\nThe rescaled RMS norm, node by node, against the CPU provider:")
    for row in chain:
        print(f"  {row['op']:12s} {row['node'][:40]:40s} rel. diff {row['relative_difference']:.2e}"
              f"  first: cpu {row['cpu_first']:.4g} / device {row['device_first']:.4g}")
    payload = json.dumps({"shape": SHAPE, "rows": rows, "rescaled_norm": chain}, indent=1)
    for path in ([args.json] if args.json else []) + (
            [Path(os.environ["OUT"]) / "cuda_reductions.json"] if os.environ.get("OUT") else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
