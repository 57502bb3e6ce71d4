"""`--optimize MODEL_TYPE`: onnxruntime's transformer optimizer runs before the conversion.

The usual deployment pipeline for transformers on ONNX Runtime is export -> fuse
(`onnxruntime.transformers.optimizer.optimize_model`: Attention, SkipLayerNormalization,
BiasGelu, ...) -> convert. With `--optimize` the fusions are onnxruntime's own, run in-process on
a temporary copy (the input is never touched); the conversion then reads the fused model. Models
with external data (and over 2 GB) stay external: the fused model is written with its tensors
in a `.data` file beside it in the temporary folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx

from ...errors import AmpError
from ...fileio import scratch_dir
from ...options import OnnxOptions
from . import ort_registry
from .emit import has_external_data
from .load import PROTOBUF_LIMIT, load_external_data

#: The fused model's file name inside the temporary folder.
OPTIMIZED_NAME = "optimized.onnx"


def options_after(options: OnnxOptions) -> OnnxOptions:
    """The options for converting the fused model: the optimizer has run."""
    return dataclasses.replace(options, optimize=None, num_heads=None, hidden_size=None)


def _optimizer_module() -> Any:
    try:
        if ort_registry.onnxruntime() is None:  # imported quietly first (see there)
            raise ImportError("onnxruntime")
        with ort_registry.quiet():
            from onnxruntime.transformers import optimizer
    except ImportError:
        raise AmpError("--optimize runs onnxruntime's transformer optimizer, and onnxruntime is "
                       "not installed (pip install 'amp-rewriter[cpu]' or '[gpu]')") from None
    return optimizer



def _too_big_for_one_file(model: onnx.ModelProto) -> bool:
    try:
        return model.ByteSize() > PROTOBUF_LIMIT
    except Exception:  # protobuf refuses to size messages past its limit
        return True


def _op_counts(model: onnx.ModelProto) -> Counter[str]:
    return Counter(node.op_type if node.domain in ("", "ai.onnx")
                   else f"{node.domain}.{node.op_type}" for node in model.graph.node)


@contextlib.contextmanager
def optimized_copy(source: Path | onnx.ModelProto, options: OnnxOptions,
                   base_dir: Path | None = None) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Run onnxruntime's transformer optimizer on `source` (a file, or a ModelProto whose
    external data lives in `base_dir`) and yield the fused model's path in a temporary folder,
    with a summary for the report. The folder is removed on exit."""
    assert options.optimize is not None
    model_type = options.optimize
    optimizer = _optimizer_module()
    if model_type not in optimizer.MODEL_TYPES:
        raise AmpError(f"--optimize: unknown model type {model_type!r} (onnxruntime's transformer "
                       f"optimizer knows {', '.join(sorted(optimizer.MODEL_TYPES))})")
    with scratch_dir("optimize") as tmp:
        work = Path(tmp)
        if isinstance(source, onnx.ModelProto):
            source = _write_input(source, work / "input.onnx", base_dir)
        original = onnx.load(str(source), load_external_data=False)
        external = has_external_data(original)
        try:
            with ort_registry.quiet():
                fused = optimizer.optimize_model(
                    str(source), model_type=model_type, num_heads=options.num_heads or 0,
                    hidden_size=options.hidden_size or 0)
                external = external or _too_big_for_one_file(fused.model)
                target = work / OPTIMIZED_NAME
                fused.save_model_to_file(str(target), use_external_data_format=external)
        except AmpError:
            raise
        except Exception as exc:  # the optimizer raises anything from IndexError to RuntimeError
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise AmpError(f"--optimize {model_type}: onnxruntime's transformer optimizer failed "
                           f"on this model: {type(exc).__name__}: {detail}") from None
        added = _op_counts(fused.model) - _op_counts(original)
        del fused, original
        gc.collect()  # the fused model in memory (and the optimizer's graph objects) go first
        summary = {"model_type": model_type, "num_heads": options.num_heads or "detected",
                   "hidden_size": options.hidden_size or "detected",
                   "onnxruntime": ort_registry.version(),
                   "ops_added": dict(sorted(added.items()))}
        yield target, summary


def _write_input(model: onnx.ModelProto, path: Path, base_dir: Path | None) -> Path:
    """An in-memory model as a file the optimizer can read (external data copied alongside)."""
    if has_external_data(model) or _too_big_for_one_file(model):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        if has_external_data(model):
            if base_dir is None:
                raise AmpError("the model has external data, but no folder to read it from was "
                               "given (pass base_dir)")
            load_external_data(copy, Path(base_dir))
        onnx.save_model(copy, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024)
    else:
        path.write_bytes(model.SerializeToString(deterministic=True))
    return path
