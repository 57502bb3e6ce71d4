#!/usr/bin/env python
"""Which of onnxruntime's fused (contrib) ops have fp16/bf16 CUDA kernels, and which keep their
statistics and softmax sums in fp32: the facts the ort-cuda profile's contrib-op lists rest on.

    python scripts/ort_cuda_contrib_kernels.py --json bench_out/contrib_kernels.json   # GPU host
    python scripts/ort_cuda_contrib_kernels.py --device cpu                            # smoke run

Kernels: one single-node model per op and dtype, opened on CUDAExecutionProvider with CPU fallback
disabled (``session.disable_cpu_ep_fallback``) and run once: "yes" only if a CUDA kernel takes the
dtype and runs.

Accumulation, in fp16 (each check's input makes an fp16 accumulator fail visibly where an fp32
one is exact):

* normalisations: rows of 4096 values alternating +-300 (RMS 300). The mean of x*x is 90000,
  beyond fp16's 65504: statistics summed in fp16 overflow (Inf/NaN or 0 output), fp32 ones give
  +-1 (times gamma = 1).
* attention: 4096 keys with equal scores and values 1. The output is exactly 1 when the softmax
  sum and the weighted sum of values are fp32; an fp16 sum stalls at 2048 (2048 + 1 == 2048).

Prints a Markdown table per part; writes both as JSON to --json and $OUT/contrib_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

MS = "com.microsoft"
HIDDEN, HEADS, BATCH, SEQ = 64, 2, 2, 8
LONG = 4096
#: op -> (domain, inputs as (name, shape or None for "absent", kind), attributes, output count).
#: kind "T" is the float type under test; "i32"/"i64" integer inputs.
SPECS: dict[str, tuple[str, list[tuple[str, Any, str]], dict[str, Any], int]] = {
    "Attention": (MS, [("input", [BATCH, SEQ, HIDDEN], "T"), ("weights", [HIDDEN, 3 * HIDDEN], "T"),
                       ("bias", [3 * HIDDEN], "T")], {"num_heads": HEADS}, 1),
    "MultiHeadAttention": (MS, [("query", [BATCH, SEQ, HIDDEN], "T"), ("key", [BATCH, SEQ, HIDDEN], "T"),
                                ("value", [BATCH, SEQ, HIDDEN], "T")], {"num_heads": HEADS}, 1),
    "GroupQueryAttention": (MS, [("query", [BATCH, SEQ, HIDDEN], "T"),
                                 ("key", [BATCH, SEQ, HIDDEN // 2], "T"),
                                 ("value", [BATCH, SEQ, HIDDEN // 2], "T"),
                                 ("past_key", None, "T"), ("past_value", None, "T"),
                                 ("seqlens_k", [BATCH], "seqlens"),
                                 ("total_sequence_length", [], "total")],
                            {"num_heads": HEADS, "kv_num_heads": HEADS // 2}, 3),
    "SkipLayerNormalization": (MS, [("input", [BATCH, SEQ, HIDDEN], "T"), ("skip", [BATCH, SEQ, HIDDEN], "T"),
                                    ("gamma", [HIDDEN], "T"), ("beta", [HIDDEN], "T")], {}, 1),
    "SkipSimplifiedLayerNormalization": (MS, [("input", [BATCH, SEQ, HIDDEN], "T"),
                                              ("skip", [BATCH, SEQ, HIDDEN], "T"), ("gamma", [HIDDEN], "T")],
                                         {}, 1),
    "SimplifiedLayerNormalization": ("", [("X", [BATCH, SEQ, HIDDEN], "T"), ("scale", [HIDDEN], "T")],
                                     {"axis": -1}, 1),
    "LayerNormalization": ("", [("X", [BATCH, SEQ, HIDDEN], "T"), ("scale", [HIDDEN], "T"),
                                ("B", [HIDDEN], "T")], {"axis": -1}, 1),
    "EmbedLayerNormalization": (MS, [("input_ids", [BATCH, SEQ], "ids"), ("segment_ids", [BATCH, SEQ], "zeros"),
                                     ("word_embedding", [100, HIDDEN], "T"),
                                     ("position_embedding", [SEQ, HIDDEN], "T"),
                                     ("segment_embedding", [2, HIDDEN], "T"), ("gamma", [HIDDEN], "T"),
                                     ("beta", [HIDDEN], "T")], {}, 2),
    "BiasGelu": (MS, [("A", [BATCH, SEQ, HIDDEN], "T"), ("B", [HIDDEN], "T")], {}, 1),
    "FastGelu": (MS, [("X", [BATCH, SEQ, HIDDEN], "T"), ("bias", [HIDDEN], "T")], {}, 1),
    "Gelu": (MS, [("X", [BATCH, SEQ, HIDDEN], "T")], {}, 1),
    "QuickGelu": (MS, [("X", [BATCH, SEQ, HIDDEN], "T")], {}, 1),
    "BiasAdd": (MS, [("X", [BATCH, SEQ, 320], "T"), ("bias", [320], "T"), ("skip", [BATCH, SEQ, 320], "T")],
                {}, 1),
    "BiasSplitGelu": (MS, [("X", [BATCH, SEQ, 2560], "T"), ("bias", [2560], "T")], {}, 1),
    "RotaryEmbedding": (MS, [("input", [BATCH, SEQ, HIDDEN], "T"), ("position_ids", [BATCH, SEQ], "pos"),
                             ("cos_cache", [SEQ, HIDDEN // HEADS // 2], "T"),
                             ("sin_cache", [SEQ, HIDDEN // HEADS // 2], "T")], {"num_heads": HEADS}, 1),
    "FusedMatMul": (MS, [("A", [BATCH, SEQ, HIDDEN], "T"), ("B", [HIDDEN, HIDDEN], "T")], {}, 1),
    "GemmFastGelu": (MS, [("X", [SEQ, HIDDEN], "T"), ("W", [HIDDEN, HIDDEN], "T"), ("bias", [HIDDEN], "T")],
                     {}, 1),
}


def build(op: str, elem: int, spec: tuple, shapes: dict[str, list[int]] | None = None,
          values: dict[str, np.ndarray] | None = None) -> tuple[bytes, dict[str, np.ndarray]]:
    """A one-node model of `op` with float inputs of onnx type `elem`; returns it and its feeds."""
    import onnx
    from onnx import helper

    domain, inputs, attributes, outputs = spec
    shapes, values = shapes or {}, values or {}
    rng = np.random.default_rng(0)
    np_type = helper.tensor_dtype_to_np_dtype(elem)
    graph_inputs, feeds, names = [], {}, []
    for name, shape, kind in inputs:
        if shape is None:
            names.append("")
            continue
        shape = shapes.get(name, shape)
        names.append(name)
        if kind == "T":
            array = values.get(name, rng.standard_normal(shape).astype(np.float32) * 0.5)
            if elem == onnx.TensorProto.BFLOAT16:
                graph_inputs.append(helper.make_tensor_value_info(name, elem, shape))
                feeds[name] = array.astype(np.float32)  # cast in the graph below
                continue
            feeds[name] = array.astype(np_type)
            graph_inputs.append(helper.make_tensor_value_info(name, elem, shape))
            continue
        if kind == "seqlens":
            array = np.full(shape, shapes.get("total", [SEQ])[0] - 1, np.int32)
        elif kind == "total":
            array = np.array(shapes.get("total", [SEQ])[0], np.int32)
        elif kind == "pos":
            array = np.tile(np.arange(shape[1], dtype=np.int64), (shape[0], 1))
        elif kind == "ids":
            array = rng.integers(0, 100, shape).astype(np.int32)
        else:
            array = np.zeros(shape, np.int32)
        feeds[name] = array
        graph_inputs.append(helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(array.dtype), list(array.shape)))
    nodes = []
    if elem == onnx.TensorProto.BFLOAT16:
        # numpy has no bfloat16 for ORT to take: fp32 inputs are cast to bf16 inside the graph
        # (a Cast to bf16 has a CUDA kernel, so it does not hide a missing one).
        renamed = []
        for info in graph_inputs:
            if info.type.tensor_type.elem_type == elem:
                info.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
                nodes.append(helper.make_node("Cast", [info.name], [info.name + "_bf16"], to=elem))
                renamed.append(info.name)
        names = [n + "_bf16" if n in renamed else n for n in names]
    output_names = [f"out{i}" for i in range(outputs)]
    nodes.append(helper.make_node(op, names, output_names, domain=domain, **attributes))
    final = []
    for index, out in enumerate(output_names):
        if op == "EmbedLayerNormalization" and index == 1:  # its mask_index output is int32
            final.append(helper.make_tensor_value_info(out, onnx.TensorProto.INT32, None))
        elif elem == onnx.TensorProto.BFLOAT16:
            nodes.append(helper.make_node("Cast", [out], [out + "_f32"], to=onnx.TensorProto.FLOAT))
            final.append(helper.make_tensor_value_info(out + "_f32", onnx.TensorProto.FLOAT, None))
        else:
            final.append(helper.make_tensor_value_info(out, elem, None))
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(MS, 1)]
    model = helper.make_model(helper.make_graph(nodes, op, graph_inputs, final), opset_imports=opsets)
    model.ir_version = 8
    return model.SerializeToString(), feeds


def session(model: bytes, device: str) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    if device == "cuda":
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        return ort.InferenceSession(model, options, providers=["CUDAExecutionProvider"])
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def short(error: BaseException) -> str:
    text = " ".join(str(error).split())
    if "Type Error: Type 'tensor(" in text:
        return "schema forbids"
    for marker in ("Could not find an implementation", "Kernel not found", "CPU fallback",
                   "not supported"):
        if marker in text:
            return "no kernel"
    return text[:160]


def kernels(device: str) -> dict[str, dict[str, str]]:
    import onnx

    table: dict[str, dict[str, str]] = {}
    for op, spec in SPECS.items():
        row = {}
        for label, elem in (("fp32", onnx.TensorProto.FLOAT), ("fp16", onnx.TensorProto.FLOAT16),
                            ("bf16", onnx.TensorProto.BFLOAT16)):
            try:
                model, feeds = build(op, elem, spec)
                session(model, device).run(None, feeds)
                row[label] = "yes"
            except Exception as exc:  # noqa: BLE001  (a missing kernel is the measurement)
                row[label] = short(exc)
        table[op] = row
        print(op, row, flush=True)
    return table


def accumulation(device: str) -> dict[str, dict[str, Any]]:
    import onnx

    fp16 = onnx.TensorProto.FLOAT16
    results: dict[str, dict[str, Any]] = {}
    row = np.where(np.arange(LONG) % 2 == 0, 300.0, -300.0).astype(np.float32)[None, None, :]
    norm_shapes = {n: [1, 1, LONG] for n in ("input", "skip", "X")}
    norm_shapes.update({n: [LONG] for n in ("gamma", "beta", "scale", "B")})
    norm_values = {"input": row, "X": row, "skip": np.zeros_like(row), "gamma": np.ones(LONG, np.float32),
                   "scale": np.ones(LONG, np.float32), "beta": np.zeros(LONG, np.float32),
                   "B": np.zeros(LONG, np.float32)}
    for op in ("LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
               "SkipSimplifiedLayerNormalization"):
        results[op] = _check(op, fp16, norm_shapes, norm_values, np.sign(row), device,
                             "statistics of a row with RMS 300 (mean of x*x = 90000 > 65504)")
    ones = np.ones((1, LONG, HIDDEN), np.float32)
    zeros = np.zeros((1, LONG, HIDDEN), np.float32)
    attention_expected = np.ones((1, LONG, HIDDEN), np.float32)
    bias = np.concatenate([np.zeros(2 * HIDDEN), np.ones(HIDDEN)]).astype(np.float32)
    results["Attention"] = _check(
        "Attention", fp16, {"input": [1, LONG, HIDDEN], "weights": [HIDDEN, 3 * HIDDEN], "bias": [3 * HIDDEN]},
        {"input": zeros, "weights": np.zeros((HIDDEN, 3 * HIDDEN), np.float32), "bias": bias},
        attention_expected, device, "softmax over 4096 equal scores, values 1")
    results["MultiHeadAttention"] = _check(
        "MultiHeadAttention", fp16, {n: [1, LONG, HIDDEN] for n in ("query", "key", "value")},
        {"query": zeros, "key": zeros, "value": ones}, attention_expected, device,
        "softmax over 4096 equal scores, values 1")
    kv = np.ones((1, LONG, HIDDEN // 2), np.float32)
    results["GroupQueryAttention"] = _check(
        "GroupQueryAttention", fp16,
        {"query": [1, LONG, HIDDEN], "key": [1, LONG, HIDDEN // 2], "value": [1, LONG, HIDDEN // 2],
         "seqlens_k": [1], "total": [LONG]},
        {"query": zeros, "key": np.zeros_like(kv), "value": kv}, None, device,
        "causal softmax over up to 4096 equal scores, values 1 (every row's output is 1)")
    return results


def _check(op: str, elem: int, shapes: dict, values: dict, expected: np.ndarray | None, device: str,
           what: str) -> dict[str, Any]:
    try:
        model, feeds = build(op, elem, SPECS[op], shapes, values)
        got = np.asarray(session(model, device).run(None, feeds)[0], np.float32)
    except Exception as exc:  # noqa: BLE001
        return {"input": what, "error": short(exc)}
    target = np.ones_like(got) if expected is None else expected
    error = float(np.nanmax(np.abs(got - target))) if np.isfinite(got).any() else float("inf")
    finite = bool(np.isfinite(got).all())
    verdict = "fp32" if finite and error <= 2e-3 else "fp16 (or worse)"
    return {"input": what, "max_abs_error": error, "all_finite": finite,
            "sample": [float(v) for v in got.reshape(-1)[:4]], "accumulates_in": verdict}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch  # noqa: F401  (its CUDA libraries are the ones onnxruntime preloads)
    import onnxruntime as ort

    if args.device == "cuda" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    payload = {"onnxruntime": ort.__version__, "device": args.device,
               "kernels": kernels(args.device), "accumulation": accumulation(args.device)}
    print("| op | fp32 | fp16 | bf16 |\n|---|---|---|---|")
    for op, row in payload["kernels"].items():
        print(f"| {op} | {row['fp32']} | {row['fp16']} | {row['bf16']} |")
    print("\n| op (fp16) | input | max abs error | finite | accumulates in |\n|---|---|---|---|---|")
    for op, row in payload["accumulation"].items():
        print(f"| {op} | {row['input']} | {row.get('max_abs_error', row.get('error'))} "
              f"| {row.get('all_finite', '-')} | {row.get('accumulates_in', '-')} |")
    paths = [Path(os.environ["OUT"]) / "contrib_kernels.json"] if os.environ.get("OUT") else []
    paths += [args.json] if args.json else []
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
