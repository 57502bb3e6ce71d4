"""ONNX: load (ModelProto -> IR), emit (IR -> ModelProto), rules (what op names mean), convert,
validate (onnxruntime on the CPU), check (CI lint). `FORMAT` is the package's `Format`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ...accuracy.runner import ModelRunner
from ...errors import AmpError
from ...options import Options, TrainingOptions
from ...report import CheckResult, Report
from ...validation import Validation, load_inputs
from ..base import Format
from .check import check_model
from .convert import (
    DEFAULT_BACKEND,
    convert,
    convert_file,
    convert_model,
    convert_model_file,
    discard_output,
)
from .load import read_model_file
from .rules import ONNX_RULES
from .validate import compare_models, emulate_bfloat16, has_bfloat16, random_inputs


class OnnxFormat(Format):
    """ONNX models (.onnx files, external data beside them) on onnxruntime."""

    name = "onnx"
    rules = ONNX_RULES

    def default_backend(self, target: str) -> str:
        return DEFAULT_BACKEND

    def convert_file(self, input_path: Path, output_path: Path, options: Options,
                     training: TrainingOptions | None = None) -> Report:
        if training is not None:
            raise AmpError("--training is for TensorFlow training graphs (.meta, .pb, .pbtxt)")
        return convert_model_file(input_path, output_path, options)[1]

    def validate(self, input_path: Path, output_path: Path, report: Report, options: Options,
                 inputs: str | None, rtol: float) -> Validation:
        feeds = load_inputs(inputs) if inputs else random_inputs(read_model_file(input_path))
        candidate: object = str(output_path)
        notes = []
        if options.target == "bf16":
            converted = read_model_file(output_path)
            if has_bfloat16(converted):
                candidate = emulate_bfloat16(converted)
                notes.append("onnxruntime's CPU provider lacks bf16 kernels; running the bf16 "
                             "model emulated (fp32 compute, every bf16 tensor rounded to bf16)")
        comparisons = compare_models(str(input_path), candidate, feeds)  # type: ignore[arg-type]
        return Validation(comparisons, rtol, notes)

    def check(self, path: Path, target: str | None, backend: str | None,
              reference: Path | None, rtol: float | None) -> CheckResult:
        return check_model(path, target, backend or DEFAULT_BACKEND, reference, rtol)

    def explain(self, source: Path, options: Options) -> Report:
        return convert_model(source, dataclasses.replace(options, check=False))[1]

    def discard_output(self, output_path: Path) -> None:
        discard_output(output_path)

    def accuracy_runner(self, path: Path, options: Options) -> ModelRunner:
        from .accuracy import OnnxRunner

        return OnnxRunner(path, options)


FORMAT = OnnxFormat()

__all__ = ["FORMAT", "OnnxFormat", "convert", "convert_file", "convert_model",
           "convert_model_file", "check_model"]
