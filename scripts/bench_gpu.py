"""Compare fp16 conversions of real architectures on onnxruntime's CUDA execution provider.

For each model (ResNet-50, BERT-base, GPT-2; random weights, exported on this machine with
``torch.onnx.export`` at opset 17) the script builds four variants:

* ``fp32``: the exported model as is (on CUDA, ORT runs fp32 MatMul/Conv in TF32 by default,
  which is the fp32 baseline a user gets);
* ``onnxconverter-common``: ``onnxconverter_common.float16.convert_float_to_float16(m, keep_io_types=True)``;
* ``ort-transformers``: ``onnxruntime.transformers.float16.convert_float_to_float16(m, keep_io_types=True)``;
* ``amp_rewriter``: ``amp_rewriter.convert(m, target="fp16", backend="ort-cuda")``.

Each variant gets its own session. Inputs and outputs stay on the device (IO binding), so the
timing covers the model run and not host/device copies: 20 warm-up runs, then the median of
``--runs`` timed runs. Accuracy is the worst, over outputs, of max|y - y_fp32| / max|y_fp32|.
A variant whose session cannot be created is recorded as "fails to load" with the error's first line.

Results are printed as a Markdown table and written as JSON to ``$OUT/bench_gpu.json`` when the
``OUT`` environment variable is set, and to ``--json`` when given (partial results are written
after every variant, so a run cut short still leaves what it measured).

Examples::

    python scripts/bench_gpu.py                                   # all models on CUDA
    python scripts/bench_gpu.py --models bert --runs 200
    python scripts/bench_gpu.py --device cpu --runs 3 --models bert --json /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
# Import amp_rewriter from the checkout; the benchmark host has no installed copy.
sys.path.insert(0, str(REPO_ROOT))

# torch must be imported before onnxruntime on the GPU host: its bundled CUDA libraries are the
# ones onnxruntime's preload_dlls() finds.
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

OPSET = 17
SEED = 0
FP32 = "fp32"
ONNXCONVERTER_COMMON = "onnxconverter-common"
ORT_TRANSFORMERS = "ort-transformers"
AMP_REWRITER = "amp_rewriter"
VARIANTS = (FP32, ONNXCONVERTER_COMMON, ORT_TRANSFORMERS, AMP_REWRITER)
OTHER_CONVERTERS = (ONNXCONVERTER_COMMON, ORT_TRANSFORMERS)

ORT_TYPE_TO_NUMPY = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


@dataclass
class BenchmarkModel:
    """A torch module to export plus the inputs (by ONNX input name) it is exported and run with."""

    name: str
    module: torch.nn.Module
    inputs: dict[str, np.ndarray]
    output_names: list[str]


class _BertOutputs(torch.nn.Module):
    """Return BERT's tensors as a plain tuple so the exporter sees fixed, named outputs."""

    def __init__(self, bert: torch.nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = self.bert(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)
        return outputs.last_hidden_state, outputs.pooler_output


class _Gpt2Outputs(torch.nn.Module):
    """Return only GPT-2's last hidden state (no key/value cache outputs)."""

    def __init__(self, gpt2: torch.nn.Module) -> None:
        super().__init__()
        self.gpt2 = gpt2

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        outputs = self.gpt2(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=True)
        return outputs.last_hidden_state


def build_resnet50(attn_implementation: str) -> BenchmarkModel:
    """ResNet-50 with random weights, batch 32, 3x224x224 images."""
    del attn_implementation  # no attention in a ResNet
    import torchvision  # optional: raises ImportError where it is not installed

    torch.manual_seed(SEED)
    module = torchvision.models.resnet50(weights=None).eval()
    images = np.random.default_rng(SEED).standard_normal((32, 3, 224, 224), dtype=np.float32)
    return BenchmarkModel("resnet50", module, {"images": images}, ["logits"])


def _token_ids(vocab_size: int, batch: int, sequence: int) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, vocab_size, size=(batch, sequence), dtype=np.int64)


def build_bert(attn_implementation: str) -> BenchmarkModel:
    """BERT-base with random weights, batch 8, sequence 128, with padded rows in the mask."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(SEED)
    config = BertConfig(attn_implementation=attn_implementation)
    module = _BertOutputs(BertModel(config).eval())
    batch, sequence = 8, 128
    attention_mask = np.ones((batch, sequence), dtype=np.int64)
    # Row i keeps 128 - 12*i tokens: padding exercises the additive mask, which is where fp16
    # overflow (a large negative fill value) turns into NaN or -inf in careless conversions.
    for row in range(batch):
        attention_mask[row, sequence - 12 * row :] = 0
    inputs = {"input_ids": _token_ids(config.vocab_size, batch, sequence), "attention_mask": attention_mask}
    return BenchmarkModel("bert", module, inputs, ["last_hidden_state", "pooler_output"])


def build_gpt2(attn_implementation: str) -> BenchmarkModel:
    """GPT-2 (124M) with random weights, batch 8, sequence 128, no cache, no padding.

    The all-ones attention mask is passed explicitly: without one, transformers looks for packed
    sequences with ``torch.diff``, which the TorchScript exporter cannot export.
    """
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(SEED)
    config = GPT2Config(attn_implementation=attn_implementation, use_cache=False)
    module = _Gpt2Outputs(GPT2Model(config).eval())
    batch, sequence = 8, 128
    inputs = {
        "input_ids": _token_ids(config.vocab_size, batch, sequence),
        "attention_mask": np.ones((batch, sequence), dtype=np.int64),
    }
    return BenchmarkModel("gpt2", module, inputs, ["last_hidden_state"])


MODEL_BUILDERS: dict[str, Callable[[str], BenchmarkModel]] = {
    "resnet50": build_resnet50,
    "bert": build_bert,
    "gpt2": build_gpt2,
}


def export_to_onnx(model: BenchmarkModel, path: Path) -> dict[str, Any]:
    """Export `model` to `path`; return which exporter worked, the opset it wrote, and why others failed.

    Tried in order: the TorchScript exporter (dynamo=False) at opset 17, which writes opset 17
    natively; the dynamo exporter at opset 17, kept only if the result passes the ONNX checker (its
    down-conversion from opset 18 can leave opset-18 attributes behind, e.g. Split's num_outputs);
    and last the dynamo exporter at its own opset 18, so a model is still benchmarked when 17 fails.
    """
    example_args = tuple(torch.from_numpy(array) for array in model.inputs.values())
    attempts = [("torchscript", False, OPSET), ("dynamo", True, OPSET), ("dynamo", True, OPSET + 1)]
    failures = []
    for exporter, dynamo, opset in attempts:
        try:
            with torch.no_grad():
                torch.onnx.export(
                    model.module,
                    example_args,
                    str(path),
                    dynamo=dynamo,
                    opset_version=opset,
                    input_names=list(model.inputs),
                    output_names=model.output_names,
                )
            # The path form checks models with external data (the dynamo exporter may write some).
            onnx.checker.check_model(str(path))
        except Exception as error:  # noqa: BLE001 - any exporter failure means: try the next one
            failures.append(f"{exporter}@{opset}: {first_line(error)}")
            continue
        exported = onnx.load(str(path), load_external_data=False)
        written_opset = next((entry.version for entry in exported.opset_import if entry.domain in ("", "ai.onnx")), None)
        return {"exporter": exporter, "opset": written_opset, "earlier_failures": failures}
    raise RuntimeError("all exporters failed: " + " | ".join(failures))


# ---------------------------------------------------------------------------------------------
# Converters
# ---------------------------------------------------------------------------------------------


def convert_with_onnxconverter_common(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxconverter_common import float16

    return float16.convert_float_to_float16(model, keep_io_types=True)


def convert_with_ort_transformers(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.transformers import float16

    return float16.convert_float_to_float16(model, keep_io_types=True)


def make_amp_rewriter_converter(backend: str) -> Callable[[onnx.ModelProto], onnx.ModelProto]:
    """Return a converter calling ``amp_rewriter.convert`` for `backend` (the report is dropped here)."""

    def convert_with_amp_rewriter(model: onnx.ModelProto) -> onnx.ModelProto:
        import amp_rewriter

        converted, _report = amp_rewriter.convert(model, target="fp16", backend=backend)
        return converted

    return convert_with_amp_rewriter


def count_nodes(graph: onnx.GraphProto, op_type: str | None = None) -> int:
    """Count nodes (of `op_type`, if given) in `graph` and every subgraph inside it."""
    total = 0
    for node in graph.node:
        if op_type is None or node.op_type == op_type:
            total += 1
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                total += count_nodes(attribute.g, op_type)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                total += sum(count_nodes(subgraph, op_type) for subgraph in attribute.graphs)
    return total


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


def first_line(error: BaseException) -> str:
    """The first non-empty line of an exception's message, prefixed with its type, at most 300 chars."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def create_session(model_bytes: bytes, device: str) -> ort.InferenceSession:
    """Create a session on `device`; raise if CUDA was asked for and the CUDA provider is not used."""
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: fp16 models trigger many harmless warnings
    if device == "cuda":
        providers: list[Any] = [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    session = ort.InferenceSession(model_bytes, options, providers=providers)
    if device == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise RuntimeError(f"CUDAExecutionProvider not used (got {session.get_providers()})")
    return session


def time_session(
    session: ort.InferenceSession, inputs: dict[str, np.ndarray], device: str, warmup: int, runs: int
) -> tuple[list[float], list[np.ndarray]]:
    """Run with inputs and outputs bound on `device`; return per-run milliseconds and the outputs.

    ``run_with_iobinding`` synchronizes the device stream before returning (onnxruntime's default),
    so wall-clock time around it is the device time of one inference.
    """
    binding = session.io_binding()
    for model_input in session.get_inputs():
        # Cast to the session's declared input type, in case a converter changed the graph inputs.
        dtype = ORT_TYPE_TO_NUMPY.get(model_input.type, np.float32)
        array = np.ascontiguousarray(inputs[model_input.name].astype(dtype))
        binding.bind_ortvalue_input(model_input.name, ort.OrtValue.ortvalue_from_numpy(array, device, 0))
    for model_output in session.get_outputs():
        binding.bind_output(model_output.name, device, 0)
    binding.synchronize_inputs()

    for _ in range(warmup):
        session.run_with_iobinding(binding)
    milliseconds = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        milliseconds.append((time.perf_counter() - start) * 1000.0)
    return milliseconds, binding.copy_outputs_to_cpu()


def max_relative_error(outputs: list[np.ndarray], reference: list[np.ndarray]) -> float:
    """Worst over outputs of max|y - ref| / max|ref| (NaN if any output holds NaN)."""
    worst = 0.0
    for output, expected in zip(outputs, reference):
        expected = expected.astype(np.float32)
        difference = np.abs(output.astype(np.float32) - expected).max()
        scale = max(float(np.abs(expected).max()), np.finfo(np.float32).tiny)
        worst = max(worst, float(difference) / scale) if np.isfinite(difference) else float("nan")
        if np.isnan(worst):
            return worst
    return worst


@dataclass
class VariantResult:
    """Everything measured for one (model, variant) pair; `status` is "ok" or what went wrong."""

    model: str
    variant: str
    status: str = "ok"
    error: str | None = None
    convert_seconds: float | None = None
    nodes: int | None = None
    cast_nodes: int | None = None
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    speedup_vs_fp32: float | None = None
    ours_vs_best_other: float | None = None
    max_relative_error: float | None = None
    nan_or_inf: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def benchmark_variant(
    benchmark: BenchmarkModel,
    variant: str,
    fp32_model: onnx.ModelProto,
    converter: Callable[[onnx.ModelProto], onnx.ModelProto] | None,
    reference_outputs: list[np.ndarray] | None,
    args: argparse.Namespace,
) -> tuple[VariantResult, list[np.ndarray] | None]:
    """Convert (unless fp32), load, time and check one variant; never raises for a variant failure."""
    result = VariantResult(benchmark.name, variant)
    model = fp32_model
    if converter is not None:
        # Converters may edit their input in place, so each one gets its own copy.
        model_copy = onnx.ModelProto()
        model_copy.CopyFrom(fp32_model)
        start = time.perf_counter()
        try:
            model = converter(model_copy)
        except Exception as error:  # noqa: BLE001 - a converter failure is a result, not a crash
            result.status, result.error = "conversion failed", first_line(error)
            return result, None
        result.convert_seconds = time.perf_counter() - start
    result.nodes = count_nodes(model.graph)
    result.cast_nodes = count_nodes(model.graph, "Cast")

    try:
        session = create_session(model.SerializeToString(), args.device)
    except Exception as error:  # noqa: BLE001
        result.status, result.error = "fails to load", first_line(error)
        return result, None
    try:
        milliseconds, outputs = time_session(session, benchmark.inputs, args.device, args.warmup, args.runs)
    except Exception as error:  # noqa: BLE001
        result.status, result.error = "run failed", first_line(error)
        return result, None
    finally:
        del session
        gc.collect()

    result.median_ms = statistics.median(milliseconds)
    result.p10_ms, result.p90_ms = (float(q) for q in np.percentile(milliseconds, [10, 90]))
    result.nan_or_inf = not all(np.isfinite(output.astype(np.float32)).all() for output in outputs)
    if reference_outputs is not None:
        result.max_relative_error = max_relative_error(outputs, reference_outputs)
    return result, outputs


def fill_ratios(results: list[VariantResult]) -> None:
    """Speedup of every variant over fp32, and ours against the faster of the other two converters."""
    by_variant = {result.variant: result for result in results if result.median_ms}
    fp32 = by_variant.get(FP32)
    for result in by_variant.values():
        if fp32 is not None:
            result.speedup_vs_fp32 = fp32.median_ms / result.median_ms
    ours = by_variant.get(AMP_REWRITER)
    others = [by_variant[name].median_ms for name in OTHER_CONVERTERS if name in by_variant]
    if ours is not None and others:
        # > 1 means ours runs faster than the best of the two reference converters.
        ours.ours_vs_best_other = min(others) / ours.median_ms


def _format(value: float | None, pattern: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, pattern) + suffix


#: Longest error text shown in a table cell; the JSON keeps the whole first line.
TABLE_ERROR_CHARS = 120


def markdown_table(results: list[VariantResult]) -> str:
    """Render all results, one row per (model, variant)."""
    header = (
        "| model | variant | status | median ms | speedup vs fp32 | ours vs best other "
        "| max rel err | NaN/Inf | Casts | convert s |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for result in results:
        status = result.status
        if result.error is not None:
            status += ": " + result.error[:TABLE_ERROR_CHARS] + ("..." if len(result.error) > TABLE_ERROR_CHARS else "")
        status = status.replace("|", "/")
        error = "nan" if result.max_relative_error is not None and np.isnan(result.max_relative_error) else (
            _format(result.max_relative_error, ".2e")
        )
        nan_or_inf = "-" if result.nan_or_inf is None else ("yes" if result.nan_or_inf else "no")
        lines.append(
            f"| {result.model} | {result.variant} | {status} | {_format(result.median_ms, '.2f')} "
            f"| {_format(result.speedup_vs_fp32, '.2f', 'x')} | {_format(result.ours_vs_best_other, '.2f', 'x')} "
            f"| {error} | {nan_or_inf} | {_format(result.cast_nodes, 'd')} | {_format(result.convert_seconds, '.1f')} |"
        )
    return "\n".join(lines)


def environment_summary(device: str) -> dict[str, Any]:
    """Versions and hardware, so a JSON file says where its numbers came from."""
    summary: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": ort.__version__,
        "available_providers": ort.get_available_providers(),
        "device": device,
    }
    if device == "cuda" and torch.cuda.is_available():
        summary["gpu"] = torch.cuda.get_device_name(0)
    for package in ("transformers", "torchvision", "onnxconverter_common"):
        try:
            summary[package] = __import__(package).__version__
        except ImportError:
            summary[package] = None
    return summary


def write_json(payload: dict[str, Any], explicit_path: Path | None) -> list[Path]:
    """Write `payload` to $OUT/bench_gpu.json (when OUT is set) and to `explicit_path` (when given)."""
    paths = []
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / "bench_gpu.json")
    if explicit_path is not None:
        paths.append(explicit_path)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2, default=str))
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet50,bert,gpt2", help="comma-separated: " + ",".join(MODEL_BUILDERS))
    parser.add_argument("--runs", type=int, default=100, help="timed runs per variant (median reported)")
    parser.add_argument(
        "--warmup", type=int, help="untimed runs before timing (default: 20 on cuda, 1 on cpu, where runs are slow)"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", type=Path, help="also write results here (besides $OUT/bench_gpu.json)")
    parser.add_argument("--workdir", type=Path, help="where exported models go (default: a temp dir)")
    parser.add_argument("--ours-backend", default="ort-cuda", help="backend passed to amp_rewriter.convert")
    parser.add_argument(
        "--attn-implementation",
        default="eager",
        help="transformers attention implementation used for export (eager exports most reliably)",
    )
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ",".join(VARIANTS))
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = 20 if args.device == "cuda" else 1
    args.models = [name.strip() for name in args.models.split(",") if name.strip()]
    args.variants = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = [name for name in args.models if name not in MODEL_BUILDERS] + [
        name for name in args.variants if name not in VARIANTS
    ]
    if unknown:
        parser.error(f"unknown model or variant: {', '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()  # finds the CUDA/cuDNN libraries that came with torch
    environment = environment_summary(args.device)
    print(json.dumps(environment), flush=True)

    converters: dict[str, Callable[[onnx.ModelProto], onnx.ModelProto] | None] = {
        FP32: None,
        ONNXCONVERTER_COMMON: convert_with_onnxconverter_common,
        ORT_TRANSFORMERS: convert_with_ort_transformers,
        AMP_REWRITER: make_amp_rewriter_converter(args.ours_backend),
    }
    all_results: list[VariantResult] = []
    model_info: dict[str, Any] = {}
    payload: dict[str, Any] = {"environment": environment, "settings": vars(args), "models": model_info}

    def save_progress() -> None:
        payload["results"] = [asdict(result) for result in all_results]
        payload["markdown"] = markdown_table(all_results)
        write_json(payload, args.json)

    with tempfile.TemporaryDirectory() as default_workdir:
        workdir = args.workdir or Path(default_workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        for model_name in args.models:
            try:
                benchmark = MODEL_BUILDERS[model_name](args.attn_implementation)
            except ImportError as error:
                print(f"[{model_name}] skipped: {first_line(error)}", flush=True)
                model_info[model_name] = {"skipped": first_line(error)}
                save_progress()
                continue
            path = workdir / f"{model_name}.onnx"
            start = time.perf_counter()
            try:
                export = export_to_onnx(benchmark, path)
            except Exception as error:  # noqa: BLE001
                print(f"[{model_name}] export failed: {first_line(error)}", flush=True)
                model_info[model_name] = {"export_failed": first_line(error)}
                save_progress()
                continue
            export["export_seconds"] = time.perf_counter() - start
            fp32_model = onnx.load(str(path))
            export["nodes"] = count_nodes(fp32_model.graph)
            model_info[model_name] = export
            print(f"[{model_name}] exported: {export}", flush=True)
            del benchmark.module  # free torch's copy of the weights before the sessions start
            gc.collect()

            model_results = []
            reference_outputs = None
            for variant in [v for v in VARIANTS if v in args.variants]:
                result, outputs = benchmark_variant(
                    benchmark, variant, fp32_model, converters[variant], reference_outputs, args
                )
                if variant == FP32 and outputs is not None:
                    reference_outputs = outputs
                    result.max_relative_error = 0.0
                model_results.append(result)
                all_results.append(result)
                fill_ratios(model_results)
                summary = f"{result.median_ms:.2f} ms" if result.median_ms else f"{result.status}: {result.error}"
                print(f"[{model_name}] {variant}: {summary}", flush=True)
                save_progress()

    print()
    print(markdown_table(all_results))
    for path in write_json(payload, args.json):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
