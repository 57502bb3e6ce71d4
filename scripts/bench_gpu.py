#!/usr/bin/env python
"""GPU speed of fp16/bf16 conversions on onnxruntime's CUDA execution provider, every converter in
one run: ResNet-50, BERT-base, GPT-2 and a LLaMA-style decoder (with and without a KV cache),
each as exported and, for the transformers, fused by ORT's transformer optimizer (GPT-2 also in
the one export form whose attention ORT fuses, "fused-attn").

    python scripts/bench_gpu.py --parallel-build --jobs 15           # everything (GPU host)
    python scripts/bench_gpu.py --models bert,gpt2 --runs 200
    python scripts/bench_gpu.py --device cpu --size small --runs 3    # a smoke run on any machine

Per model and form (unfused / fused) it builds these variants, each converting the same fp32
export with keep_io_types:

* ``fp32``: the export as is (on CUDA, ORT runs fp32 MatMul/Conv in TF32 by default: the fp32
  baseline a user gets);
* ``onnxconverter-common``: ``float16.convert_float_to_float16``;
* ``ort-float16``: ``onnxruntime.transformers.float16.convert_float_to_float16``;
* ``ort-optimizer``: ORT's transformer optimizer with ``--float16`` (fusion and its own fp16
  conversion in one go; listed with the fused form);
* ``autocast``: NVIDIA AutoCast (``modelopt.onnx.autocast.convert_to_mixed_precision``, fp16);
* ``ours-fp16`` / ``ours-bf16``: ``amp_rewriter.convert`` with the ort-cuda profile, defaults;
* ``ours-fp16-no-*``: ours with one rewrite left out (``ABLATIONS``), to measure what it costs.

ResNet-50 is timed twice: NCHW and with the CUDA provider's ``prefer_nhwc`` (its NHWC kernels).

Timing: IO binding (inputs and outputs on the device), warm-up, then ``--runs`` timed runs per
variant taken in interleaved rounds (every round runs every variant a few times, in a rotating
order), median reported; all variants of a model are open at once, so they see the same GPU
state. Relative error is max|y - ref| / max|ref| over outputs, the reference being the fp32 export
with TF32 off (exact fp32). Casts counts Cast nodes. Conversions run in worker processes (in
parallel, so their seconds are indicative only). For ours and the fastest other fp16 variant of
each model (and the decoders' variants, and fp32), ORT's profiler gives the host's launch time and
the node count per op type and the nodes ORT placed on the CPU, and CUPTI (through torch's
profiler) the GPU's own kernel time per call ("busy") and the kernels that take it.

Writes the Markdown table to stdout and everything to ``$OUT/bench_gpu.json`` (when OUT is set)
and ``--json``, after every model, so a run cut short keeps what it measured.

On the GPU host (no package index), bring onnxruntime-gpu over in two transfers with
scripts/gpu_stage_ort.py, with the other converters' wheels: docs/benchmarks.md ("GPU latency")
has the exact commands. ``--parallel-build`` builds every model at once first (one process per
model), so that the timing phase runs on a quiet machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402

from testkit.bench import output_errors  # noqa: E402

MODELS = ("resnet50", "bert", "gpt2", "llama", "llama-kv")
TRANSFORMERS = ("bert", "gpt2", "llama", "llama-kv")
FP32 = "fp32"
CONVERTERS = ("fp32", "onnxconverter-common", "ort-float16", "ort-optimizer", "autocast",
              "ours-fp16", "ours-bf16", "ours-fp16-no-rescale", "ours-fp16-no-rotary",
              "ours-fp16-no-saturate")
OURS = "ours-fp16"
#: Ours with one rewrite left out, to measure what it costs: without `rescale_rms_statistics`
#: each RMS norm's square and mean stay fp32 (a cast in and out); without `reduce_rotary_angles`
#: the rotary angle is a plain fp16 product (as other converters leave it, off by radians at
#: long positions); without `saturate_masked_sums` no Clip before each masked Softmax (a fully
#: masked row becomes NaN in fp16). The first two only where RMS norms and rotary angles are.
ABLATIONS = {"ours-fp16-no-rescale": "rescale_rms_statistics",
             "ours-fp16-no-rotary": "reduce_rotary_angles",
             "ours-fp16-no-saturate": "saturate_masked_sums"}
DECODERS = ("llama", "llama-kv")
#: GPT-2 exported with its attention written as transformers wrote it before 4.27, then fused by
#: ORT's optimizer: the only form of GPT-2 in which it fuses attention (Attention x12).
CLASSIC_FORM = "fused-attn"
#: The contrib ops ORT's optimizer fuses into (counted per variant).
FUSED_OPS = ("Attention", "MultiHeadAttention", "GroupQueryAttention", "RotaryEmbedding",
             "SkipLayerNormalization", "SkipSimplifiedLayerNormalization",
             "SimplifiedLayerNormalization", "EmbedLayerNormalization", "FastGelu", "BiasGelu",
             "Gelu", "BiasAdd", "Softmax")
#: fp16 variants of the other converters: the ones ours is compared against.
OTHER_FP16 = ("onnxconverter-common", "ort-float16", "ort-optimizer", "autocast")

#: Model sizes: base is what the issue asks for (ResNet-50 at batch 32, the transformers at batch 8
#: and 128 tokens, a LLaMA-style decoder of about 100M parameters); small is a quick smoke run.
SIZES: dict[str, dict[str, dict[str, int]]] = {
    "base": {
        "resnet50": dict(batch=32, image=224),
        "bert": dict(vocab=30522, hidden=768, layers=12, heads=12, ffn=3072, batch=8, sequence=128),
        "gpt2": dict(vocab=50257, hidden=768, layers=12, heads=12, ffn=3072, batch=8, sequence=128),
        "llama": dict(vocab=32000, hidden=768, layers=8, heads=12, kv_heads=4, ffn=2048, batch=8,
                      sequence=128),
    },
    "small": {
        "resnet50": dict(batch=2, image=64),
        "bert": dict(vocab=1000, hidden=64, layers=2, heads=4, ffn=128, batch=2, sequence=32),
        "gpt2": dict(vocab=1000, hidden=64, layers=2, heads=4, ffn=256, batch=2, sequence=32),
        "llama": dict(vocab=1000, hidden=64, layers=2, heads=4, kv_heads=2, ffn=172, batch=2,
                      sequence=32),
    },
}
#: ORT optimizer model types per model (its gpt2 fusions fail on some exports: bert's follow).
FUSION_TYPES = {"bert": ("bert",), "gpt2": ("gpt2", "bert"), "llama": ("gpt2", "bert"),
                "llama-kv": ("gpt2", "bert")}


def dims_of(model: str, size: str) -> dict[str, int]:
    return SIZES[size]["llama" if model == "llama-kv" else model]


# -------------------------------------------------------------------------------------------------
# Exports (cached in the work folder)
# -------------------------------------------------------------------------------------------------


def export(model: str, size: str, work: Path, for_fusion: bool = False) -> Path:
    """The fp32 ONNX export of `model` (random seeded weights), written once per work folder.

    `for_fusion`: the export ORT's transformer optimizer fuses completely, for the fused form.
    For BERT and GPT-2 that is the TorchScript exporter with eager attention at opset 17 (its
    fusions match those graphs: BERT gets Attention, EmbedLayerNormalization, BiasGelu and
    SkipLayerNormalization); the LLaMA-style decoders use the default export either way.
    """
    torchscript = for_fusion and model in ("bert", "gpt2")
    path = work / f"{model}_{size}{'_ts' if torchscript else ''}.onnx"
    if path.exists():
        return path
    import torch
    from torch import nn

    from testkit.models import torch_export

    dims = dims_of(model, size)
    torch.manual_seed(0)
    if model == "resnet50":
        try:
            import torchvision
        except ImportError:
            if size == "base":
                raise
            # The smoke run needs no torchvision: the tests' small bottleneck ResNet stands in.
            return torch_export.export_resnet(path, 17)
        net = torchvision.models.resnet50(weights=None).eval()
        images = torch.randn(2, 3, dims["image"], dims["image"])
        return torch_export.export_module(net, (images,), path, 17, ["images"], ["logits"],
                                          {"images": {0: "batch"}})
    if model == "llama-kv":
        return torch_export.export_llama_with_cache(dims, path)
    attention = "eager" if torchscript else "sdpa"
    with torch_export.quiet_transformers():
        if model == "bert":
            from transformers import BertConfig, BertModel

            net = BertModel(BertConfig(vocab_size=dims["vocab"], hidden_size=dims["hidden"],  # type: ignore[call-arg]  # attn_implementation: a config **kwarg transformers 5's signatures omit
                                       num_hidden_layers=dims["layers"],
                                       num_attention_heads=dims["heads"],
                                       intermediate_size=dims["ffn"],
                                       attn_implementation=attention))
            fields: tuple[str, ...] = ("last_hidden_state", "pooler_output")
        elif model == "gpt2":
            from transformers import GPT2Config, GPT2Model

            net = GPT2Model(GPT2Config(vocab_size=dims["vocab"], n_embd=dims["hidden"],  # type: ignore[call-arg]  # attn_implementation: a config **kwarg transformers 5's signatures omit
                                       n_layer=dims["layers"], n_head=dims["heads"],
                                       n_inner=dims["ffn"], n_positions=1024, use_cache=False,
                                       attn_implementation=attention))
            fields = ("last_hidden_state",)
        else:
            from transformers import LlamaForCausalLM

            net = LlamaForCausalLM(_llama_config(dims))
            fields = ("logits",)
    net.eval()
    use_cache = {"use_cache": False} if model == "llama" else {}

    class TextModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, input_ids, attention_mask):
            out = self.net(input_ids=input_ids, attention_mask=attention_mask, return_dict=True,
                           **use_cache)
            return tuple(out[f] for f in fields)

    ids = torch.randint(0, dims["vocab"], (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    axes = {name: {0: "batch", 1: "sequence"} for name in ("input_ids", "attention_mask")}
    return torch_export.export_module(TextModel().eval(), (ids, mask), path,
                                      17 if torchscript else 18, ("input_ids", "attention_mask"),
                                      fields, axes, torchscript=torchscript)


def export_classic_gpt2(size: str, work: Path) -> Path:
    """GPT-2 with transformers' pre-4.27 attention code (same function and weights' shapes; see
    testkit.models.torch_export.export_gpt2_classic_attention), the form whose attention ORT fuses."""
    path = work / f"gpt2_{size}_classic.onnx"
    if not path.exists():
        import torch

        from testkit.models import torch_export

        torch.manual_seed(0)
        torch_export.export_gpt2_classic_attention(dims_of("gpt2", size), path)
    return path


def _llama_config(dims: dict[str, int]) -> Any:
    """The plain decoder's config (no KV cache; the cache variant is testkit.models.torch_export's)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=dims["vocab"], hidden_size=dims["hidden"],  # type: ignore[call-arg]  # attn_implementation: a config **kwarg transformers 5's signatures omit
                       intermediate_size=dims["ffn"], num_hidden_layers=dims["layers"],
                       num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
                       max_position_embeddings=2048, attn_implementation="sdpa",
                       use_cache=False)


def make_inputs(model: str, size: str, graph_inputs: list[str]) -> dict[str, np.ndarray]:
    """Benchmark inputs: BERT right-padded (row i drops 12*i tokens, as a batch of different
    lengths is), GPT-2 and LLaMA full rows; llama-kv decodes one token after sequence-1 cached."""
    dims = dims_of(model, size)
    rng = np.random.default_rng(1234)
    if model == "resnet50":
        return {graph_inputs[0]: rng.standard_normal((dims["batch"], 3, dims["image"], dims["image"]),
                                              dtype=np.float32)}
    batch, sequence = dims["batch"], dims["sequence"]
    mask = np.ones((batch, sequence), np.int64)
    if model == "bert":
        for row in range(batch):
            mask[row, sequence - (12 * row * sequence) // 128:] = 0
    new = 1 if model == "llama-kv" else sequence
    feeds: dict[str, np.ndarray] = {
             "input_ids": rng.integers(0, dims["vocab"], (batch, new), dtype=np.int64),
             "attention_mask": mask}
    head_dim = dims["hidden"] // dims["heads"]
    for name in graph_inputs:
        if name.startswith("past_key_values"):
            feeds[name] = rng.standard_normal((batch, dims["kv_heads"], sequence - 1, head_dim),
                                              dtype=np.float32)
    return {name: feeds[name] for name in graph_inputs}


# -------------------------------------------------------------------------------------------------
# Conversions, each in a worker process
# -------------------------------------------------------------------------------------------------


def convert_in_worker(converter: str, source: str, target: str, model: str, size: str,
                      use_gpu: bool) -> dict[str, Any]:
    """Run one converter (inside the worker process); returns its seconds or its error."""
    import logging

    import onnx

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    try:
        start = time.perf_counter()
        if converter == "autocast":
            from modelopt.onnx.autocast import convert_to_mixed_precision

            converted = convert_to_mixed_precision(onnx_path=source, low_precision_type="fp16",
                                                   keep_io_types=True)
        elif converter == "ort-optimizer":
            optimized = optimize(source, model, size, use_gpu)
            optimized.convert_float_to_float16(keep_io_types=True)
            converted = optimized.model
        else:
            loaded = onnx.load(source)
            start = time.perf_counter()
            if converter.startswith("ours-"):
                import amp_rewriter
                from amp_rewriter.passes.pipeline import PIPELINES

                if converter in ABLATIONS:  # this worker process only
                    PIPELINES["onnx"] = [p for p in PIPELINES["onnx"]
                                         if p != ABLATIONS[converter]]
                converted, _ = amp_rewriter.convert(loaded, target=converter.split("-")[1],
                                                    backend="ort-cuda", keep_io_types=True)
            elif converter == "ort-float16":
                from onnxruntime.transformers.float16 import convert_float_to_float16

                converted = convert_float_to_float16(loaded, keep_io_types=True)
            else:
                from onnxconverter_common import float16

                converted = float16.convert_float_to_float16(loaded, keep_io_types=True)
        seconds = time.perf_counter() - start
        onnx.save(converted, target)
        return {"seconds": seconds}
    except Exception as exc:  # noqa: BLE001  (a converter's failure is a result)
        return {"error": first_line(exc)}


def optimize(source: str, model: str, size: str, use_gpu: bool) -> Any:
    """ORT's transformer optimizer on `source`: the first model type whose fusions succeed."""
    from onnxruntime.transformers.optimizer import optimize_model

    dims = dims_of(model, size)
    failures = []
    for model_type in FUSION_TYPES[model]:
        try:
            return optimize_model(source, model_type=model_type, num_heads=dims["heads"],
                                  hidden_size=dims["hidden"], use_gpu=use_gpu)
        except Exception as exc:  # noqa: BLE001  (try the next model type)
            failures.append(f"{model_type}: {first_line(exc)}")
    raise RuntimeError("ORT's optimizer failed: " + "; ".join(failures))


def run_worker(converter: str, source: Path, target: Path, model: str, size: str, use_gpu: bool,
               timeout: float, reuse_ours: bool = False) -> dict[str, Any]:
    """One conversion in a fresh process (killed at `timeout`); an earlier outcome (the model or
    its error, kept in a `.outcome.json` beside it) is reused, except that ours is converted
    afresh unless `reuse_ours` (the build phase of this same run made it)."""
    outcome_path = target.with_suffix(".outcome.json")
    if outcome_path.exists() and (reuse_ours or not converter.startswith("ours-")):
        outcome = json.loads(outcome_path.read_text())
        if "error" in outcome or target.exists():
            return outcome
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", converter, str(source),
               str(target), model, "--size", size] + (["--use-gpu"] if use_gpu else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if lines:
            outcome = json.loads(lines[-1])
        else:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            outcome = {"error": f"worker failed: {tail[:200]}"}
    except subprocess.TimeoutExpired:
        outcome = {"error": f"timed out after {timeout:g} s"}
    outcome_path.write_text(json.dumps(outcome))
    return outcome


# -------------------------------------------------------------------------------------------------
# Sessions, timing, profiles
# -------------------------------------------------------------------------------------------------


def first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def count_ops(path: Path) -> dict[str, int]:
    import onnx

    counts: dict[str, int] = defaultdict(int)

    def visit(graph: Any) -> None:
        for node in graph.node:
            counts[node.op_type] += 1
            for attribute in node.attribute:
                if attribute.HasField("g"):
                    visit(attribute.g)
                for subgraph in attribute.graphs:
                    visit(subgraph)

    visit(onnx.load(str(path), load_external_data=False).graph)
    return dict(counts)


def open_session(path: Path, device: str, tf32: bool = True, nhwc: bool = False,
                 profile_prefix: str | None = None) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    if device == "cuda":
        cuda = {"device_id": "0", "use_tf32": "1" if tf32 else "0"}
        if nhwc:
            cuda["prefer_nhwc"] = "1"
        providers: list[Any] = [("CUDAExecutionProvider", cuda), "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    session = ort.InferenceSession(str(path), options, providers=providers)
    if device == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise RuntimeError(f"CUDAExecutionProvider not used (got {session.get_providers()})")
    return session


class BoundSession:
    """A session with its inputs and outputs bound on the device."""

    def __init__(self, session: Any, feeds: dict[str, np.ndarray], device: str) -> None:
        import onnxruntime as ort

        types: dict[str, type[np.generic]] = {"tensor(float16)": np.float16, "tensor(float)": np.float32,
                 "tensor(double)": np.float64, "tensor(int64)": np.int64,
                 "tensor(int32)": np.int32, "tensor(bool)": np.bool_}
        self.session = session
        self.binding = session.io_binding()
        self.values = []
        for info in session.get_inputs():
            array = np.ascontiguousarray(feeds[info.name].astype(types.get(info.type, np.float32)))
            value = ort.OrtValue.ortvalue_from_numpy(array, device, 0)
            self.values.append(value)  # keep the device copies alive
            self.binding.bind_ortvalue_input(info.name, value)
        self.output_names = [info.name for info in session.get_outputs()]
        for name in self.output_names:
            self.binding.bind_output(name, device, 0)
        self.binding.synchronize_inputs()

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)
        self.binding.synchronize_outputs()

    def timed(self, runs: int) -> list[float]:
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            self.run()
            times.append((time.perf_counter() - start) * 1000.0)
        return times

    def outputs(self) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.binding.copy_outputs_to_cpu()))


def profile(path: Path, feeds: dict[str, np.ndarray], device: str, nhwc: bool, runs: int,
            folder: Path) -> dict[str, Any]:
    """Kernel time per op type (ms per run) from ORT's profiler, and the nodes it ran on the CPU."""
    warmup = 3  # the first runs carry one-off set-up (cuBLAS handles, arena growth): not counted
    session = open_session(path, device, nhwc=nhwc, profile_prefix=str(folder / path.stem))
    bound = BoundSession(session, feeds, device)
    for _ in range(warmup + runs):
        bound.run()
    profile_path = Path(session.end_profiling())
    events = json.loads(profile_path.read_text())
    starts = sorted(e["ts"] for e in events if e.get("name") == "model_run")
    cutoff = starts[warmup] if len(starts) > warmup else 0
    runs = max(1, len(starts) - warmup)
    by_op: dict[str, float] = defaultdict(float)
    calls_by_op: dict[str, float] = defaultdict(float)
    cpu_nodes: set[str] = set()
    for event in events:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time") \
                or event.get("ts", 0) < cutoff:
            continue
        args = event.get("args", {})
        by_op[args.get("op_name", "?")] += event.get("dur", 0) / 1000.0 / runs
        calls_by_op[args.get("op_name", "?")] += 1 / runs
        if args.get("provider") == "CPUExecutionProvider":
            cpu_nodes.add(f"{args.get('op_name')}:{event['name'][:-len('_kernel_time')]}")
    top = dict(sorted(by_op.items(), key=lambda item: -item[1])[:15])
    # On CUDA these are the host's times to launch each node (ORT's profiler does not wait for
    # the GPU); the GPU's own kernel times come from CUPTI below.
    result: dict[str, Any] = {
        "host_ms_by_op": {op: round(ms, 4) for op, ms in top.items()},
        "host_ms_total": round(sum(by_op.values()), 4),
        "nodes_per_run": round(sum(calls_by_op.values())),
        "nodes_by_op": {op: round(n) for op, n in sorted(calls_by_op.items(), key=lambda i: -i[1])},
        "cpu_nodes": sorted(cpu_nodes)[:40], "cpu_node_count": len(cpu_nodes)}
    if device == "cuda":
        try:
            result["gpu"] = gpu_kernel_profile(bound, runs, folder / f"{path.stem}_kineto.json")
        except Exception as exc:  # noqa: BLE001  (the GPU trace is extra information)
            result["gpu"] = {"error": first_line(exc)}
    return result


def gpu_kernel_profile(bound: BoundSession, runs: int, trace: Path) -> dict[str, Any]:
    """The GPU's kernel time per run, from CUPTI through torch's profiler (it records every
    kernel of the process, onnxruntime's included): busy time, launches, and the kernels and
    kernel families (the name up to its template arguments) that take the most time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as recorder:
        for _ in range(runs):
            bound.run()
    recorder.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text()).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    by_family: dict[str, float] = defaultdict(float)
    for event in kernels:
        name = str(event.get("name", "?"))
        milliseconds = float(event.get("dur", 0)) / 1000.0 / runs
        by_name[name][0] += milliseconds
        by_name[name][1] += 1 / runs
        by_family[_kernel_family(name)] += milliseconds
    busy = sum(total for total, _ in by_name.values())
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:25]
    return {"busy_ms_per_run": round(busy, 4),
            "launches_per_run": round(sum(n for _, n in by_name.values()), 1),
            "top_kernels": [[name[:140], round(ms, 4), round(n, 1)] for name, (ms, n) in top],
            "families": {family: round(ms, 4) for family, ms in
                         sorted(by_family.items(), key=lambda item: -item[1])[:25]}}


def _kernel_family(name: str) -> str:
    """A kernel's name without template arguments or parameters: `void ns::Kernel<...>(...)`
    -> `ns::Kernel`, so that one op's kernels for several shapes add up."""
    head = name.split("(")[0].split("<")[0].strip()
    return head.removeprefix("void ").strip()[:100] or name[:100]


# -------------------------------------------------------------------------------------------------
# One model
# -------------------------------------------------------------------------------------------------


@dataclass
class Row:
    model: str
    form: str  # unfused | fused
    converter: str
    layout: str = "NCHW"
    status: str = "ok"
    error: str | None = None
    convert_seconds: float | None = None
    casts: int | None = None
    nodes: int | None = None
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    speedup_vs_fp32: float | None = None
    ours_vs_fastest_other: float | None = None
    relative_error: float | None = None
    nonfinite: int | None = None
    path: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.model}/{self.form}/{self.converter}/{self.layout}"


def build_variants(model: str, args: argparse.Namespace, work: Path) -> tuple[list[Row], Path]:
    """Export, fuse and convert: one row per variant with its model file (or its failure)."""
    source = export(model, args.size, work)
    use_gpu = args.device == "cuda"
    forms = {"unfused": source}
    rows: list[Row] = []
    if model in TRANSFORMERS and "fused" in args.forms:
        fused = work / f"{model}_{args.size}_fused.onnx"
        if not fused.exists():
            try:
                fusion_source = export(model, args.size, work, for_fusion=True)
                optimized = optimize(str(fusion_source), model, args.size, use_gpu)
                optimized.save_model_to_file(str(fused))
            except Exception as exc:  # noqa: BLE001
                rows.append(Row(model, "fused", FP32, status="fusion failed", error=first_line(exc)))
        if fused.exists():
            forms["fused"] = fused
    if model == "gpt2" and CLASSIC_FORM in args.forms:
        classic = work / f"{model}_{args.size}_{CLASSIC_FORM}.onnx"
        if not classic.exists():
            try:
                optimized = optimize(str(export_classic_gpt2(args.size, work)), model, args.size,
                                     use_gpu)
                optimized.save_model_to_file(str(classic))
            except Exception as exc:  # noqa: BLE001
                rows.append(Row(model, CLASSIC_FORM, FP32, status="fusion failed",
                                error=first_line(exc)))
        if classic.exists():
            forms[CLASSIC_FORM] = classic
    if "unfused" not in args.forms:
        del forms["unfused"]
    jobs = []
    for form, path in forms.items():
        for converter in args.converters:
            if converter == "ort-optimizer" and (form == "unfused" or model not in TRANSFORMERS):
                continue
            if converter in ABLATIONS and model not in (
                    TRANSFORMERS if converter == "ours-fp16-no-saturate" else DECODERS):
                continue
            row = Row(model, form, converter)
            rows.append(row)
            if converter == FP32:
                row.path = str(path)
                continue
            from_path = path
            if converter == "ort-optimizer":  # from the export it fuses, not from our fused form
                from_path = export_classic_gpt2(args.size, work) if form == CLASSIC_FORM \
                    else export(model, args.size, work, for_fusion=True)
            target = work / f"{model}_{args.size}_{form}_{converter}.onnx"
            jobs.append((row, from_path, target))
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_worker, row.converter, from_path, target, model, args.size,
                               use_gpu, args.convert_timeout, args.reuse_ours): (row, target)
                   for row, from_path, target in jobs}
        for future in concurrent.futures.as_completed(futures):
            row, target = futures[future]
            outcome = future.result()
            if "error" in outcome:
                row.status, row.error = "conversion failed", outcome["error"]
            else:
                row.convert_seconds = outcome.get("seconds")
                row.path = str(target)
    for row in rows:
        if row.path is not None:
            ops = count_ops(Path(row.path))
            row.casts, row.nodes = ops.get("Cast", 0), sum(ops.values())
            row.extra["fused_ops"] = {op: n for op, n in sorted(ops.items()) if op in FUSED_OPS}
    if model == "resnet50" and args.device == "cuda":
        rows += [Row(row.model, row.form, row.converter, layout="NHWC", path=row.path,
                     casts=row.casts, nodes=row.nodes, convert_seconds=row.convert_seconds,
                     status=row.status, error=row.error) for row in list(rows)]
    return rows, source


def bench_model(model: str, args: argparse.Namespace, work: Path) -> tuple[list[Row], dict]:
    start = time.perf_counter()
    rows, source = build_variants(model, args, work)
    import onnx

    graph_inputs = [i.name for i in onnx.load(str(source), load_external_data=False).graph.input]
    feeds = make_inputs(model, args.size, graph_inputs)
    info: dict[str, Any] = {"build_seconds": round(time.perf_counter() - start, 1),
                            "inputs": {k: list(v.shape) for k, v in feeds.items()}}
    print(f"[{model}] built {len(rows)} variants in {info['build_seconds']} s", flush=True)

    # The reference of each form is its own fp32 model run with TF32 off (exact fp32): the
    # error shown is the conversion's, not the fusion's or the exporter's.
    references: dict[str, dict[str, np.ndarray]] = {}
    for row in rows:
        if row.converter == FP32 and row.path is not None and row.form not in references:
            reference_session = open_session(Path(row.path), args.device, tf32=False)
            reference = BoundSession(reference_session, feeds, args.device)
            reference.run()
            references[row.form] = reference.outputs()
            del reference, reference_session

    bound: dict[str, BoundSession] = {}
    for row in rows:
        if row.path is None:
            continue
        try:
            session = open_session(Path(row.path), args.device, nhwc=row.layout == "NHWC")
            bound[row.key] = BoundSession(session, feeds, args.device)
            for _ in range(args.warmup):
                bound[row.key].run()
            # testkit.bench.output_errors: max|y - ref| / max|ref| per output, and the
            # non-finite values where the reference is finite.
            compared = output_errors(references[row.form], bound[row.key].outputs())
            row.relative_error = compared["worst_relative_error"]
            row.nonfinite = compared["nonfinite"]
        except Exception as exc:  # noqa: BLE001  (a model that does not load or run is a result)
            row.status, row.error = "fails to load or run", first_line(exc)
            bound.pop(row.key, None)
    times: dict[str, list[list[float]]] = defaultdict(list)
    keys = list(bound)
    rounds = max(1, args.rounds)
    per_round = max(1, -(-args.runs // rounds))
    for round_index in range(rounds):
        shift = round_index % max(1, len(keys))
        for key in keys[shift:] + keys[:shift]:
            times[key].append(bound[key].timed(per_round))
    by_key = {row.key: row for row in rows}
    for key, per_round_samples in times.items():
        row = by_key[key]
        samples = [t for one_round in per_round_samples for t in one_round]
        row.median_ms = statistics.median(samples)
        row.p10_ms, row.p90_ms = (float(q) for q in np.percentile(samples, [10, 90]))
        row.extra["timed_runs"] = len(samples)
        # The median of each half of the rounds: how far two runs of the table would differ.
        half = max(1, len(per_round_samples) // 2)
        row.extra["half_medians_ms"] = [
            round(statistics.median([t for r in part for t in r]), 4)
            for part in (per_round_samples[:half], per_round_samples[half:]) if part]
    bound.clear()
    gc.collect()
    fill_ratios(rows)
    if args.profile_runs:
        profiles = {}
        with tempfile.TemporaryDirectory() as folder:
            for row in profile_targets(rows):
                assert row.path is not None  # profile_targets keeps rows with a path
                try:
                    profiles[row.key] = profile(Path(row.path), feeds, args.device,
                                                row.layout == "NHWC", args.profile_runs,
                                                Path(folder))
                except Exception as exc:  # noqa: BLE001
                    profiles[row.key] = {"error": first_line(exc)}
        info["profiles"] = profiles
    info["seconds"] = round(time.perf_counter() - start, 1)
    return rows, info


def fill_ratios(rows: list[Row]) -> None:
    """Speed-up over fp32 (same form and layout), and ours against the fastest other fp16
    variant of the same model and layout, either form (> 1: ours is faster)."""
    timed = [row for row in rows if row.median_ms]
    for row in timed:
        base = next((r for r in timed if r.converter == FP32 and r.form == row.form
                     and r.layout == row.layout), None)
        if base is not None:
            row.speedup_vs_fp32 = base.median_ms / row.median_ms  # type: ignore[operator]
    for row in timed:
        others = [r for r in timed if r.converter in OTHER_FP16 and r.layout == row.layout]
        if row.converter == OURS and others:
            fastest = min(others, key=lambda r: r.median_ms)  # type: ignore[arg-type,return-value]
            row.ours_vs_fastest_other = fastest.median_ms / row.median_ms  # type: ignore
            row.extra["fastest_other"] = fastest.key


def profile_targets(rows: list[Row]) -> list[Row]:
    """Ours (fp16, every form and layout) and the fastest other fp16 variant of the model; for the
    decoders also every ours-fp16 variant and ORT's float16 tool in each form (what the rewrites
    cost), and fp32 in each form and layout."""
    timed = [row for row in rows if row.median_ms and row.path]
    picks = [row for row in timed if row.converter == OURS]
    others = [row for row in timed if row.converter in OTHER_FP16]
    if others:
        picks.append(min(others, key=lambda row: row.median_ms or 0.0))  # all timed: never 0.0
    picks += [row for row in timed if row.model in DECODERS and row not in picks
              and (row.converter.startswith(OURS) or row.converter == "ort-float16")]
    # fp32 in each form and layout: the GPU time a speed-up over fp32 is bounded by.
    picks += [row for row in timed if row.converter == FP32 and row not in picks]
    return picks


# -------------------------------------------------------------------------------------------------
# Report
# -------------------------------------------------------------------------------------------------


def _fmt(value: Any, pattern: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, pattern) + suffix


def markdown_table(rows: list[Row]) -> str:
    lines = ["| model | form | converter | layout | median ms | halves ms | vs fp32 "
             "| ours vs fastest other | rel. error | NaN/Inf | casts | convert s | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        status = row.status if row.error is None else f"{row.status}: {row.error[:90]}"
        halves = " / ".join(f"{m:.3f}" for m in row.extra.get("half_medians_ms", [])) or "-"
        lines.append(
            f"| {row.model} | {row.form} | {row.converter} | {row.layout} "
            f"| {_fmt(row.median_ms, '.3f')} | {halves} "
            f"| {_fmt(row.speedup_vs_fp32, '.2f', 'x')} "
            f"| {_fmt(row.ours_vs_fastest_other, '.2f', 'x')} | {_fmt(row.relative_error, '.2e')} "
            f"| {_fmt(row.nonfinite, 'd')} | {_fmt(row.casts, 'd')} "
            f"| {_fmt(row.convert_seconds, '.1f')} | {status.replace('|', '/')} |")
    return "\n".join(lines)


def environment(device: str) -> dict[str, Any]:
    import onnx
    import onnxruntime as ort

    summary: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                               "onnx": onnx.__version__, "onnxruntime": ort.__version__,
                               "providers": ort.get_available_providers(), "device": device}
    for package in ("torch", "transformers", "torchvision", "onnxconverter_common", "modelopt"):
        try:
            summary[package] = __import__(package).__version__
        except Exception as exc:  # noqa: BLE001
            summary[package] = f"unavailable ({first_line(exc)})"
    try:
        import torch

        if torch.cuda.is_available():
            summary["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    try:
        summary["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                                           capture_output=True, text=True,
                                           check=False).stdout.strip() or None
    except OSError:
        summary["commit"] = None
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--converters", default=",".join(CONVERTERS))
    parser.add_argument("--forms", default=f"unfused,fused,{CLASSIC_FORM}",
                        help=f"{CLASSIC_FORM}: GPT-2 only (its attention fused by ORT)")
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--runs", type=int, default=100, help="timed runs per variant (median)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds the runs split into")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--profile-runs", type=int, default=10,
                        help="profiled runs for ours and the fastest other (0: no profile)")
    parser.add_argument("--jobs", type=int, default=6, help="conversions run at once")
    parser.add_argument("--convert-timeout", type=float, default=600)
    parser.add_argument("--work", type=Path, default=REPO_ROOT / "bench_out" / "gpu",
                        help="exports and converted models (reused when present)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--parallel-build", action="store_true",
                        help="first export, fuse and convert every model at once, one process per "
                             "model (a many-core GPU host builds in the time of the slowest "
                             "model), then time them one model at a time on a quiet machine")
    parser.add_argument("--build-only", action="store_true",
                        help="export, fuse and convert, and stop (what --parallel-build runs)")
    parser.add_argument("--reuse-ours", action="store_true",
                        help="reuse our converted models found in --work (made by this code)")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.converters = [c for c in args.converters.split(",") if c]
    args.forms = [f for f in args.forms.split(",") if f]
    unknown = [m for m in args.models if m not in MODELS] + \
        [c for c in args.converters if c not in CONVERTERS]
    if unknown:
        parser.error("unknown model or converter: " + ", ".join(unknown))
    if FP32 not in args.converters:
        args.converters.insert(0, FP32)
    return args


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker = argparse.ArgumentParser()
        for name in ("converter", "source", "target", "model"):
            worker.add_argument(name)
        worker.add_argument("--size", default="base")
        worker.add_argument("--use-gpu", action="store_true")
        w = worker.parse_args(sys.argv[2:])
        print(json.dumps(convert_in_worker(w.converter, w.source, w.target, w.model, w.size,
                                           w.use_gpu)))
        return 0
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.build_only:
        for model in args.models:
            start = time.perf_counter()
            build_variants(model, args, args.work)
            print(f"[{model}] built in {time.perf_counter() - start:.1f} s", flush=True)
        return 0
    import torch  # noqa: F401, I001  (before onnxruntime: its CUDA libraries are those ORT preloads)
    import onnxruntime as ort

    if args.device == "cuda":
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        check_cuda_provider()
    build_seconds = build_in_parallel(args) if args.parallel_build else None
    payload: dict[str, Any] = {"environment": environment(args.device),
                               "settings": {k: str(v) for k, v in vars(args).items()},
                               "models": {}, "rows": []}
    payload["environment"]["parallel_build_seconds"] = build_seconds
    print(json.dumps(payload["environment"]), flush=True)
    all_rows: list[Row] = []
    for model in args.models:
        try:
            rows, info = bench_model(model, args, args.work)
        except Exception as exc:  # noqa: BLE001  (one model's failure does not stop the run)
            import traceback

            traceback.print_exc()
            payload["models"][model] = {"error": first_line(exc)}
            continue
        all_rows += rows
        payload["models"][model] = info
        payload["rows"] = [asdict(row) for row in all_rows]
        payload["markdown"] = markdown_table(all_rows)
        write_json(payload, args.json)
        print(markdown_table(rows), flush=True)
        print(json.dumps({model: info.get("profiles")}, indent=1), flush=True)
    print()
    print(markdown_table(all_rows))
    write_json(payload, args.json)
    return 0


def check_cuda_provider() -> None:
    """Fail fast when onnxruntime's CUDA provider does not compute: a small fp16 and fp32 model
    (MatMul, Softmax, LayerNormalization, Cast) run on CUDA against the CPU provider."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((64, 64)).astype(np.float32)
    nodes = [helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
             helper.make_node("MatMul", ["x16", "w16"], ["y16"]),
             helper.make_node("Softmax", ["y16"], ["s16"], axis=-1),
             helper.make_node("Cast", ["s16"], ["s"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["s", "w"], ["z"]),
             helper.make_node("LayerNormalization", ["z", "gamma"], ["out"], axis=-1)]
    graph = helper.make_graph(
        nodes, "cuda_check",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [8, 64])],
        [onnx.numpy_helper.from_array(weight.astype(np.float16), "w16"),
         onnx.numpy_helper.from_array(weight, "w"),
         onnx.numpy_helper.from_array(np.ones(64, np.float32), "gamma")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              ir_version=8).SerializeToString()
    feeds = {"x": rng.standard_normal((8, 64)).astype(np.float32)}
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    cuda = ort.InferenceSession(model, options, providers=["CUDAExecutionProvider"])
    got = cuda.run(None, feeds)[0]
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    error = float(np.max(np.abs(got - want)))
    if not np.isfinite(error) or error > 1e-2:
        raise SystemExit(f"onnxruntime's CUDA provider computes wrongly (max error {error})")
    print(f"CUDA provider check: max error {error:.1e} against the CPU provider", flush=True)


def build_in_parallel(args: argparse.Namespace) -> float:
    """Build every model's variants at once, one `--build-only` process per model sharing the
    conversion jobs; afterwards the timing phase reuses them (ours included)."""
    start = time.perf_counter()
    jobs = max(1, args.jobs // len(args.models))
    passed = ["--size", args.size, "--device", args.device, "--converters",
              ",".join(args.converters), "--forms", ",".join(args.forms), "--work",
              str(args.work), "--jobs", str(jobs), "--convert-timeout", str(args.convert_timeout)]
    builders = {model: subprocess.Popen([sys.executable, str(Path(__file__).resolve()),
                                         "--build-only", "--models", model, *passed],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
                for model in args.models}
    for model, builder in builders.items():
        output, _ = builder.communicate()
        lines = output.strip().splitlines()
        print(f"[{model}] build exit {builder.returncode}: {lines[-1] if lines else ''}"[:300],
              flush=True)
    args.reuse_ours = True
    return round(time.perf_counter() - start, 1)


def write_json(payload: dict[str, Any], explicit: Path | None) -> None:
    paths = [Path(os.environ["OUT"]) / "bench_gpu.json"] if os.environ.get("OUT") else []
    if explicit is not None:
        paths.append(explicit)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=1, default=str))


if __name__ == "__main__":
    raise SystemExit(main())
