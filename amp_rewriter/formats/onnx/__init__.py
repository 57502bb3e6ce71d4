"""ONNX: load (ModelProto -> IR), emit (IR -> ModelProto), rules (what op names mean), convert,
validate (onnxruntime on the CPU), check (CI lint). `FORMAT` is the package's `Format`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

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
    input_files,
)
from .load import read_model_file
from .rules import ONNX_RULES
from .validate import compare_models, random_inputs, runnable_on_cpu


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
        # A bf16 model runs emulated; an emulation too big for memory goes beside the output.
        with runnable_on_cpu(output_path, scratch=output_path.parent) as (candidate, notes):
            comparisons = compare_models(str(input_path), candidate, feeds,
                                         inputs_given=inputs is not None)
        return Validation(comparisons, rtol, notes)

    def check(self, path: Path, target: str | None, backend: str | None,
              reference: Path | None, rtol: float | None, inputs: str | None = None
              ) -> CheckResult:
        return check_model(path, target, backend or DEFAULT_BACKEND, reference, rtol, inputs)

    def explain(self, source: Path, options: Options) -> Report:
        return convert_model(source, dataclasses.replace(options, check=False))[1]

    def input_files(self, input_path: Path) -> list[tuple[Path, str]]:
        return input_files(input_path)


FORMAT = OnnxFormat()

__all__ = ["FORMAT", "OnnxFormat", "convert", "convert_file", "convert_model",
           "convert_model_file", "check_model"]
