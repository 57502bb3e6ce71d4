#!/usr/bin/env python
"""Transformers in fp16: amp-rewriter vs ORT's float16 tool vs onnxconverter-common vs NVIDIA
AutoCast, on BERT-base, GPT-2 and a LLaMA-style decoder with KV-cache inputs, each unfused (the
torch 2.13 export) and ORT-fused (onnxruntime.transformers.optimizer), in one run.

    .venv/bin/python scripts/bench_transformers.py --json bench_out/transformers.json
    .venv/bin/python scripts/bench_transformers.py --size small --models bert   # quick look

Per model, variant and converter it reports:

- casts: Cast nodes in the converted model (the export's own included);
- fp32 compute ops: MatMul/Gemm/Conv/attention ops whose data input is fp32 (names in the JSON);
- low-precision byte share: activation bytes moved in fp16 / all float activation bytes moved,
  as amp-rewriter's report counts them (amp_rewriter/cost.py): each float node output is written
  once and read once per consumer (a graph output once by the caller); shapes inferred at the
  benchmark's input sizes (ORT's symbolic shape inference);
- relative error: max|converted - fp32| / max|fp32| per output (the table shows the worst output),
  on inputs with padding (fully masked rows included). The converted model runs with fp16
  rounding at every fp16 tensor ("emulated": fp32 compute and a Cast down and back at each fp16
  tensor, as CUDA kernels round), because ORT's CPU provider runs fp16 ops without a CPU kernel in
  fp32 and hides fp16 overflow; the error of a plain CPU run is in the JSON too;
- NaN/Inf: non-finite output values where fp32 is finite (emulated run);
- valid: onnx.checker full check, and whether ORT's CPU provider loads the model;
- conversion time: the convert call alone, each converter in its own process.

The acceptance columns compare ours with ORT's tool: casts <= theirs + 2 per float graph
input/output kept fp32; no compute op fp32 that theirs converts; byte share >= theirs; relative
error <= 1.5x theirs; no NaN/Inf where fp32 has none.

AutoCast (nvidia-modelopt) is optional: install it without its CUDA dependencies,
``pip install --no-deps nvidia-modelopt==0.47.0 onnx-graphsurgeon nvidia-ml-py onnxslim lief
polygraphy``
(a pyproject extra cannot say --no-deps, so it is not one). Without it its rows say why.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402

from testkit.bench import output_errors  # noqa: E402

CONVERTERS = ("ours", "ort", "occ", "autocast")
LABELS = {"ours": "amp-rewriter", "ort": "ORT float16 tool", "occ": "onnxconverter-common",
          "autocast": "NVIDIA AutoCast"}
MODELS = ("bert", "gpt2", "llama")
VARIANTS = ("unfused", "fused")
COMPUTE_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "Attention",
               "MultiHeadAttention", "GroupQueryAttention", "PackedAttention",
               "PackedMultiHeadAttention", "DecoderMaskedMultiHeadAttention", "FusedMatMul",
               "GemmFastGelu", "FusedConv"}

#: Model sizes: base is what the docs report; small is for a quick check.
SIZES: dict[str, dict[str, dict[str, int]]] = {
    "base": {
        "bert": dict(vocab=30522, hidden=768, layers=12, heads=12, ffn=3072),
        "gpt2": dict(vocab=50257, hidden=768, layers=12, heads=12, ffn=3072),
        "llama": dict(vocab=32000, hidden=1024, layers=8, heads=16, kv_heads=8, ffn=2816),
    },
    "small": {
        "bert": dict(vocab=1000, hidden=64, layers=2, heads=4, ffn=128),
        "gpt2": dict(vocab=1000, hidden=64, layers=2, heads=4, ffn=256),
        "llama": dict(vocab=1000, hidden=64, layers=2, heads=4, kv_heads=2, ffn=172),
    },
}
#: Benchmark inputs: batch 4 of 128 tokens (LLaMA: 96 cached + 32 new).
BATCH, SEQUENCE, PAST = 4, 128, 96
#: ORT optimizer model types to try per model, in order (LLaMA-style decoders have none of their
#: own; its gpt2 fusions fail on the dynamo export's bias-less Gemm, so bert's generic ones follow).
FUSION_TYPES = {"bert": ("bert",), "gpt2": ("gpt2", "bert"), "llama": ("gpt2", "bert")}


# -------------------------------------------------------------------------------------------------
# Export (cached in the work folder)
# -------------------------------------------------------------------------------------------------


def export(model: str, size: str, work: Path) -> Path:
    """The fp32 export of `model` at `size` (random seeded weights), written once."""
    path = work / f"{model}_{size}.onnx"
    if path.exists():
        return path
    import torch
    from torch import nn

    from testkit.models import torch_export

    dims = SIZES[size][model]
    torch.manual_seed(0)
    net: nn.Module
    with torch_export.quiet_transformers():
        if model == "bert":
            from transformers import BertConfig, BertModel

            net = BertModel(BertConfig(vocab_size=dims["vocab"], hidden_size=dims["hidden"],  # type: ignore[call-arg]  # attn_implementation: a config **kwarg transformers 5's signatures omit
                                       num_hidden_layers=dims["layers"],
                                       num_attention_heads=dims["heads"],
                                       intermediate_size=dims["ffn"], attn_implementation="sdpa"))
            fields: tuple[str, ...] = ("last_hidden_state", "pooler_output")
        elif model == "gpt2":
            from transformers import GPT2Config, GPT2Model

            net = GPT2Model(GPT2Config(vocab_size=dims["vocab"], n_embd=dims["hidden"],  # type: ignore[call-arg]  # attn_implementation: a config **kwarg transformers 5's signatures omit
                                       n_layer=dims["layers"], n_head=dims["heads"],
                                       n_inner=dims["ffn"], n_positions=1024, use_cache=False,
                                       bos_token_id=dims["vocab"] - 1,
                                       eos_token_id=dims["vocab"] - 1,
                                       attn_implementation="sdpa"))
            fields = ("last_hidden_state",)
        else:
            return torch_export.export_llama_with_cache(dims, path)
    net.eval()

    class TextModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, input_ids, attention_mask):
            out = self.net(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)
            return tuple(out[f] for f in fields)

    ids = torch.randint(0, dims["vocab"], (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[1, 8:] = 0
    axes = {name: {0: "batch", 1: "sequence"} for name in ("input_ids", "attention_mask")}
    torch_export.export_module(TextModel().eval(), (ids, mask), path, 18,
                               ("input_ids", "attention_mask"), fields, axes)
    return path


def fuse(model: str, size: str, source: Path, work: Path) -> tuple[Path, str]:
    """ORT's transformer optimizer on the export (its fusions), written once; returns the path
    and the model type whose fusions were used."""
    path = work / f"{model}_{size}_fused.onnx"
    used = work / f"{model}_{size}_fused.type"
    if path.exists() and used.exists():
        return path, used.read_text()
    import logging

    from onnxruntime.transformers.optimizer import optimize_model

    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    dims = SIZES[size][model]
    failures = []
    for model_type in FUSION_TYPES[model]:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                optimized = optimize_model(str(source), model_type=model_type,
                                           num_heads=dims["heads"], hidden_size=dims["hidden"])
        except Exception as exc:  # noqa: BLE001  (try the next model type)
            failures.append(f"{model_type}: {type(exc).__name__}: {exc}")
            continue
        optimized.save_model_to_file(str(path))
        used.write_text(model_type)
        return path, model_type
    raise RuntimeError("ORT's optimizer failed: " + "; ".join(failures))


def fused_ops(path: Path) -> dict[str, int]:
    """The com.microsoft ops in a fused model, by type."""
    import onnx

    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.domain == "com.microsoft":
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items()))


# -------------------------------------------------------------------------------------------------
# Conversion, each converter in its own process
# -------------------------------------------------------------------------------------------------


def convert_in_worker(converter: str, source: str, target: str) -> dict[str, Any]:
    """Run one converter (inside the worker process); returns its time or its error."""
    import onnx

    warnings.simplefilter("ignore")
    try:
        if converter == "autocast":
            from modelopt.onnx.autocast import convert_to_mixed_precision

            start = time.perf_counter()  # AutoCast takes a path: its load is timed too
            model = convert_to_mixed_precision(onnx_path=source, low_precision_type="fp16",
                                               keep_io_types=True)
            seconds = time.perf_counter() - start
        else:
            loaded = onnx.load(source)
            start = time.perf_counter()
            if converter == "ours":
                import amp_rewriter

                model, _ = amp_rewriter.convert(loaded, target="fp16", backend="ort-cuda",
                                                keep_io_types=True)
            elif converter == "ort":
                from onnxruntime.transformers.float16 import convert_float_to_float16

                model = convert_float_to_float16(loaded, keep_io_types=True)
            else:
                from onnxconverter_common import float16

                model = float16.convert_float_to_float16(loaded, keep_io_types=True)
            seconds = time.perf_counter() - start
        onnx.save(model, target)
        return {"seconds": seconds}
    except Exception as exc:  # noqa: BLE001  (a converter's failure is a result)
        text = str(exc).strip().splitlines()
        return {"error": f"{type(exc).__name__}: {text[0][:200] if text else ''}"}


def convert(converter: str, source: Path, target: Path, timeout: float) -> dict[str, Any]:
    """One conversion in a fresh process (independent timing, killed at `timeout`)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", converter,
               str(source), str(target)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                   os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                              check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"worker failed: {tail[:200]}"}
    return json.loads(lines[-1])


# -------------------------------------------------------------------------------------------------
# Inputs and measurements
# -------------------------------------------------------------------------------------------------


def make_inputs(model: str, size: str, fp32_path: Path) -> dict[str, np.ndarray]:
    """Token ids with padding that leaves fully masked attention rows: BERT right-padded with
    one empty sequence; GPT-2 and LLaMA left-padded (as in batched generation), so the padded
    query rows see no key at all."""
    import onnx

    dims = SIZES[size][model]
    rng = np.random.default_rng(1234)
    feeds: dict[str, np.ndarray] = {}
    lengths = [SEQUENCE, SEQUENCE * 3 // 4, 17, 0] if model == "bert" else [SEQUENCE, 100, 40, 1]
    total = SEQUENCE
    new = SEQUENCE - PAST if model == "llama" else SEQUENCE
    mask = np.zeros((BATCH, total), np.int64)
    for row, length in enumerate(lengths):
        if model == "bert":
            mask[row, :length] = 1
        else:
            mask[row, total - length:] = 1
    feeds["input_ids"] = rng.integers(0, dims["vocab"], (BATCH, new), dtype=np.int64)
    feeds["attention_mask"] = mask
    graph_inputs = [i.name for i in onnx.load(str(fp32_path), load_external_data=False).graph.input]
    if model == "llama":
        head_dim = dims["hidden"] // dims["heads"]
        for name in graph_inputs:
            if name.startswith("past_key_values"):
                feeds[name] = rng.standard_normal((BATCH, dims["kv_heads"], PAST, head_dim),
                                                  dtype=np.float32)
    return {name: feeds[name] for name in graph_inputs}


def run_model(model_or_path: Any, feeds: dict[str, np.ndarray], optimize: bool = True
              ) -> dict[str, np.ndarray]:
    """Outputs by name from ORT's CPU provider (inputs cast to the model's input dtypes);
    `optimize=False` turns ORT's graph optimizations off."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = model_or_path if isinstance(model_or_path, str) else \
        model_or_path.SerializeToString()
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    types = {"tensor(float16)": np.float16, "tensor(float)": np.float32}
    prepared = {i.name: feeds[i.name].astype(types.get(i.type, feeds[i.name].dtype))
                for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, prepared)))


def analyse(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    """Static measures of a converted model: validity, casts, fp32 compute ops, byte share."""
    import onnx

    model = onnx.load(str(path))
    result: dict[str, Any] = {}
    try:
        onnx.checker.check_model(str(path), full_check=True)
        result["checker"] = "ok"
    except Exception as exc:  # noqa: BLE001
        result["checker"] = str(exc).strip().splitlines()[0][:160]
    result["casts"] = sum(1 for n in _all_nodes(model.graph) if n.op_type == "Cast"
                          and n.domain in ("", "ai.onnx"))
    types, shapes = _inferred(model, feeds)
    fp32_ops = []
    reads: dict[str, int] = {}
    for node in _all_nodes(model.graph):
        for name in node.input:
            reads[name] = reads.get(name, 0) + 1
    for out in model.graph.output:
        reads[out.name] = reads.get(out.name, 0) + 1
    low_bytes = all_bytes = 0
    unknown = 0
    for node in _all_nodes(model.graph):
        if node.op_type in COMPUTE_OPS and node.input and \
                types.get(node.input[0]) == onnx.TensorProto.FLOAT:
            fp32_ops.append(node.name or node.op_type)
        for out in node.output:
            elem = types.get(out)
            if elem not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16) \
                    or node.op_type == "Constant":
                continue
            shape = shapes.get(out)
            if shape is None:
                unknown += 1
                continue
            accesses = 1 + reads.get(out, 0)  # written once, read by every consumer
            size = int(np.prod(shape, dtype=np.int64)) * accesses * \
                (2 if elem == onnx.TensorProto.FLOAT16 else 4)
            all_bytes += size
            low_bytes += size if elem == onnx.TensorProto.FLOAT16 else 0
    result["fp32_compute_ops"] = fp32_ops
    result["low_precision_byte_share"] = low_bytes / all_bytes if all_bytes else 0.0
    result["tensors_without_shape"] = unknown
    return result


def _all_nodes(graph):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _all_nodes(attr.g)


def _inferred(model, feeds: dict[str, np.ndarray]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """elem type and shape of every tensor at the feeds' sizes (ORT symbolic shape inference,
    which knows the contrib ops; onnx's shape inference where it fails)."""
    import onnx

    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for info in fixed.graph.input:
        if info.name in feeds:
            dims = info.type.tensor_type.shape.dim
            for dim, size in zip(dims, feeds[info.name].shape):
                dim.Clear()
                dim.dim_value = int(size)
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inferred = SymbolicShapeInference.infer_shapes(fixed, auto_merge=True)
    except Exception:  # noqa: BLE001  (it knows no ReduceMax with axes as an input, ...)
        return _observed(fixed, feeds)
    types: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    for info in list(inferred.graph.input) + list(inferred.graph.output) + \
            list(inferred.graph.value_info):
        tensor = info.type.tensor_type
        types[info.name] = tensor.elem_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if tensor.HasField("shape") and all(d is not None for d in dims):
            shapes[info.name] = dims
    for tensor in inferred.graph.initializer:
        types[tensor.name] = tensor.data_type
    return types, shapes


def _observed(model, feeds: dict[str, np.ndarray]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """elem type and shape of every node output as one ORT CPU run at the feeds' sizes produces
    them (each made a graph output, graph optimizations off so none is fused away); for models
    ORT's symbolic shape inference cannot follow."""
    import onnx

    typed = onnx.shape_inference.infer_shapes(model)
    types = {info.name: info.type.tensor_type.elem_type
             for info in list(typed.graph.input) + list(typed.graph.output) +
             list(typed.graph.value_info)}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    present = {o.name for o in probe.graph.output}
    for node in probe.graph.node:
        for name in node.output:
            if name and name not in present and types.get(name):
                probe.graph.output.append(onnx.helper.make_value_info(
                    name, onnx.helper.make_tensor_type_proto(types[name], None)))
                present.add(name)
    shapes = {name: list(array.shape)
              for name, array in run_model(probe, feeds, optimize=False).items()}
    for tensor in probe.graph.initializer:
        types[tensor.name] = tensor.data_type
    return types, shapes


def measure(path: Path, feeds: dict[str, np.ndarray], reference: dict[str, np.ndarray]
            ) -> dict[str, Any]:
    """Static measures plus the emulated and the plain CPU run against fp32."""
    import onnx

    from amp_rewriter.formats.onnx.emulation import EVERY_NODE, emulate_low_precision

    result = analyse(path, feeds)
    try:
        run_model(str(path), feeds)
        result["loads_in_ort"] = "ok"
    except Exception as exc:  # noqa: BLE001
        result["loads_in_ort"] = str(exc).strip().splitlines()[0][:160]
    try:
        emulated = emulate_low_precision(onnx.load(str(path)), policy=EVERY_NODE).model
        result["emulated"] = output_errors(reference, run_model(emulated, feeds))
    except Exception as exc:  # noqa: BLE001
        result["emulated"] = {"error": str(exc).strip().splitlines()[0][:160]}
    if result["loads_in_ort"] == "ok":
        result["cpu"] = output_errors(reference, run_model(str(path), feeds))
    return result


# -------------------------------------------------------------------------------------------------
# The run and its table
# -------------------------------------------------------------------------------------------------


def float_io_count(path: Path) -> int:
    """Float graph inputs and outputs (kept fp32 by every converter here)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return sum(1 for info in list(graph.input) + list(graph.output)
               if info.type.tensor_type.elem_type == onnx.TensorProto.FLOAT)


def acceptance(ours: dict[str, Any], theirs: dict[str, Any], io_count: int) -> dict[str, Any]:
    """Acceptance items 1 and 2 for one model: ours against ORT's tool."""
    if "error" in ours or "error" in theirs:
        return {"comparable": False}
    checks: dict[str, Any] = {"comparable": True}
    checks["casts"] = ours["casts"] <= theirs["casts"] + 2 * io_count
    extra = sorted(set(ours["fp32_compute_ops"]) - set(theirs["fp32_compute_ops"]))
    checks["fp32_compute_ops_theirs_convert"] = extra
    checks["byte_share"] = ours["low_precision_byte_share"] >= \
        theirs["low_precision_byte_share"] - 1e-9
    our_run, their_run = ours.get("emulated", {}), theirs.get("emulated", {})
    if "worst_relative_error" in our_run and "worst_relative_error" in their_run:
        checks["error"] = all(
            our_run["relative_error"][name] <= 1.5 * max(err, 1e-6)
            for name, err in their_run["relative_error"].items())
        checks["no_new_nonfinite"] = our_run["nonfinite"] == 0
    checks["valid"] = ours["checker"] == "ok" and ours["loads_in_ort"] == "ok"
    return checks


def format_table(results: list[dict[str, Any]]) -> str:
    lines = ["| model | variant | converter | casts | fp32 compute ops | fp16 byte share | "
             "rel. error (emulated) | NaN/Inf | rel. error (ORT CPU) | valid | time (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results:
        m = row["measures"]
        if "error" in m:
            lines.append(f"| {row['model']} | {row['variant']} | {LABELS[row['converter']]} | "
                         f"{m['error']} | | | | | | | |")
            continue
        emulated = m.get("emulated", {})
        cpu = m.get("cpu", {})
        err = (f"{emulated['worst_relative_error']:.2e}" if "worst_relative_error" in emulated
               else "n/a")
        nan = emulated.get("nonfinite", "n/a")
        cpu_err = f"{cpu['worst_relative_error']:.2e}" if "worst_relative_error" in cpu else "n/a"
        valid = "yes" if m["checker"] == "ok" and m["loads_in_ort"] == "ok" else \
            ("checker: " + m["checker"] if m["checker"] != "ok" else "ORT: " + m["loads_in_ort"])
        lines.append(f"| {row['model']} | {row['variant']} | {LABELS[row['converter']]} | "
                     f"{m['casts']} | {len(m['fp32_compute_ops'])} | "
                     f"{m['low_precision_byte_share']:.1%} | {err} | {nan} | {cpu_err} | "
                     f"{valid[:60]} | {m['seconds']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=tuple(SIZES), default="base")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--converters", default=",".join(CONVERTERS))
    parser.add_argument("--work", type=Path, default=REPO_ROOT / "bench_out" / "transformers")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per conversion (s)")
    parser.add_argument("--json", type=Path, help="write every measure here")
    parser.add_argument("--worker", nargs=3, metavar=("CONVERTER", "SOURCE", "TARGET"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(convert_in_worker(*args.worker)))
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    fusions: list[dict[str, Any]] = []
    for model in args.models.split(","):
        started = time.perf_counter()
        fp32 = export(model, args.size, args.work)
        print(f"[{model}] export ready ({time.perf_counter() - started:.0f} s)", flush=True)
        for variant in args.variants.split(","):
            source = fp32
            if variant == "fused":
                try:
                    source, model_type = fuse(model, args.size, fp32, args.work)
                except RuntimeError as exc:
                    print(f"[{model} fused] {exc}", flush=True)
                    fusions.append({"model": model, "error": str(exc)[:300]})
                    continue
                fusions.append({"model": model, "model_type": model_type,
                                "fused_ops": fused_ops(source)})
                print(f"[{model} fused] {model_type} fusions: {fusions[-1]['fused_ops']}",
                      flush=True)
            feeds = make_inputs(model, args.size, source)
            reference = run_model(str(source), feeds)
            io_count = float_io_count(source)
            by_converter: dict[str, dict[str, Any]] = {}
            for converter in args.converters.split(","):
                target = args.work / f"{model}_{args.size}_{variant}_{converter}.onnx"
                timing = convert(converter, source, target, args.timeout)
                measures = dict(timing) if "error" in timing else \
                    {**measure(target, feeds, reference), **timing}
                by_converter[converter] = measures
                results.append({"model": model, "variant": variant, "converter": converter,
                                "measures": measures})
                outcome = measures.get("error") or f"converted in {measures['seconds']:.2f} s"
                print(f"[{model} {variant}] {converter}: {outcome}", flush=True)
            if "ours" in by_converter and "ort" in by_converter:
                checks.append({"model": model, "variant": variant, "float_io": io_count,
                               **acceptance(by_converter["ours"], by_converter["ort"],
                                            io_count)})
    print()
    print(format_table(results))
    print()
    for check in checks:
        print(f"acceptance {check['model']} {check['variant']}: "
              f"{json.dumps({k: v for k, v in check.items() if k not in ('model', 'variant')})}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"size": args.size, "batch": BATCH,
                                         "sequence": SEQUENCE, "past": PAST,
                                         "fusions": fusions, "results": results,
                                         "acceptance": checks}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
