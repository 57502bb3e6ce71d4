"""The Python entry points, for every format; the CLI is a thin shell over the same objects.

    model, report = amp_rewriter.convert("model.onnx", target="fp16", backend="ort-cuda")
    graph_def, report = amp_rewriter.convert("frozen.pb", target="bf16", outputs=["y"])
    _, report = amp_rewriter.convert_file("model.onnx", "model_fp16.onnx", clamp=True)

Keyword arguments are the fields of the format's options (`amp_rewriter.OnnxOptions`,
`amp_rewriter.TfOptions`: the shared `Options` fields and the format's own); another format's
option is refused in one line. Only the format asked for is imported: converting ONNX never
imports TensorFlow and the other way round.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import formats
from .options import DEFAULT_TARGET, AutoOptions, files_read, split_kwargs
from .report import Report


def convert(model_or_path: Any, target: str = DEFAULT_TARGET, backend: str | None = None,
            **options: Any) -> tuple[Any, Report]:
    """Convert an fp32 model to mixed precision in memory; the input is never modified.

    Args:
        model_or_path: an onnx.ModelProto or .onnx path (returns a ModelProto), or a TensorFlow
            GraphDef or .pb/.pbtxt path (returns a GraphDef; name the fetches with `outputs`).
        target: "fp16" or "bf16".
        backend: a backend profile (see `amp-rewriter convert --help`; default: the format's
            for the target).
        **options: the other fields of the format's options (keep_io_types, clamp, allow,
            infer, deny, clear, keep_nodes, config, check; ONNX's optimize, external_data, ...;
            TensorFlow's outputs, keep_fp32_weights); base_dir: the folder an in-memory
            model's own files (ONNX's external data) are relative to.

    Returns:
        The converted model and the Report of every decision.
    """
    base_dir = options.pop("base_dir", None)
    fmt = formats.for_model_or_path(model_or_path)
    return fmt.convert(model_or_path, fmt.options(target=target, backend=backend, **options),
                       Path(base_dir) if base_dir is not None else None)


def convert_file(input_path: str | os.PathLike, output_path: str | os.PathLike,
                 **options: Any) -> tuple[Any, Report]:
    """Convert a model file (or SavedModel directory) and write the result: all of it (external
    data, a whole directory) or, on failure, nothing; an existing output is replaced only on
    success, and an output that is, or would overwrite, an input file is refused.

    Returns the converted ModelProto for ONNX (None for TensorFlow: read `output_path`) and
    the Report. Keyword arguments are the fields of the format's options.
    """
    input_path = Path(input_path)
    fmt = formats.for_path(input_path)
    return fmt.convert_to(input_path, output_path, fmt.options(**options))


def convert_auto(input_path: str | os.PathLike, output_path: str | os.PathLike,
                 inputs: Sequence[str | os.PathLike] | None = None, *, max_error: float,
                 metric: str = "max-rel", **options: Any) -> Report:
    """`convert --auto`: convert as much as possible while `metric <= max_error` holds on the
    calibration data, and write the result (all of it or nothing, as `convert_file` does).

    `inputs` are .npz files, folders of them or Polygraphy JSON input files (None: seeded random
    batches, with a warning in `report.warnings`). `metric` is "max-rel", "cosine" or
    "module:function" (see `amp_rewriter.accuracy.metrics`). Other keyword arguments are the
    fields of `AutoOptions` (data_max, flush_max, local_max, max_reduction, max_trials,
    random_batches) and of the format's options. `report.auto` describes the search; every
    node it pinned has kind "measurement" and the measurement as its reason.
    """
    from .accuracy import run_auto

    auto, rest = split_kwargs(AutoOptions, {**options, "max_error": max_error, "metric": metric})
    input_path = Path(input_path)
    fmt = formats.for_path(input_path)
    conversion = fmt.options(**rest)
    with fmt.transaction(input_path,
                         files_read(conversion.config, inputs, auto.metric)) as outputs:
        staged = fmt.stage_output(outputs, output_path, input_path, conversion)
        runner = fmt.accuracy_runner(input_path, conversion)
        report, _ = run_auto(runner, staged, [str(p) for p in inputs] if inputs else None, auto,
                             conversion.target)
        outputs.commit()
    return report


def diagnose(model_path: str | os.PathLike, inputs: Sequence[str | os.PathLike] | None = None,
             **options: Any) -> dict[str, Any]:
    """`amp-rewriter diagnose` as a dict (the JSON report): per node its fp32 range, overflow and
    flush fractions in the target, the converted model's error there and the error it adds on
    its own, sorted by contribution; `first_nonfinite` names the first node with NaN/Inf.
    Keyword arguments: fields of the format's options and the data-range fields of `AutoOptions`."""
    from .accuracy import run_diagnose

    auto, rest = split_kwargs(AutoOptions, options)
    model_path = Path(model_path)
    fmt = formats.for_path(model_path)
    conversion = fmt.options(**rest)
    runner = fmt.accuracy_runner(model_path, conversion)
    backend = getattr(runner, "options", conversion).backend or ""
    report, warnings = run_diagnose(runner, [str(p) for p in inputs] if inputs else None, auto,
                                    conversion.target, backend)
    report["warnings"] = warnings
    return report
