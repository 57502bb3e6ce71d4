"""ONNX: load (ModelProto -> IR), emit (IR -> ModelProto), rules (what op names mean), convert,
validate (onnxruntime on the CPU), check (CI lint). `FORMAT` is the package's `Format`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import onnx

from ...accuracy.runner import ModelRunner
from ...errors import AmpError
from ...fileio import Companions
from ...op_lists import Overrides, find_profile
from ...options import OnnxOptions, TrainingOptions
from ...report import CheckResult, Report
from ...validation import Validation, load_inputs
from ..base import Format
from .check import ONNX_CHECK_RULES, check_model
from .convert import (
    convert,
    convert_file,
    convert_model,
    convert_model_file,
    input_files,
)
from .emit import data_files
from .execution import select_execution
from .load import read_model_file
from .rules import ONNX_RULES
from .shapes import activation_traffic
from .validate import random_inputs, validate_conversion


class OnnxFormat(Format[OnnxOptions]):
    """ONNX models (.onnx files, external data beside them) on onnxruntime."""

    name = "onnx"
    options_class = OnnxOptions
    rules = ONNX_RULES
    check_rules = ONNX_CHECK_RULES

    def accepts(self, model: object) -> bool:
        return isinstance(model, onnx.ModelProto)

    def convert(self, model: Any, options: OnnxOptions, source_dir: Path | None = None
                ) -> tuple[onnx.ModelProto, Report]:
        return convert_model(model, options, source_dir)

    def convert_file(self, input_path: Path, output_path: Path, options: OnnxOptions,
                     training: TrainingOptions | None = None) -> tuple[onnx.ModelProto, Report]:
        if training is not None:
            raise AmpError("--training is for TensorFlow training graphs (.meta, .pb, .pbtxt)")
        return convert_model_file(input_path, output_path, options)

    def validate(self, input_path: Path, output_path: Path, report: Report, options: OnnxOptions,
                 inputs: str | None, rtol: float, device: str | None = None) -> Validation:
        feeds = load_inputs(inputs) if inputs else random_inputs(read_model_file(input_path))
        backend = ((report.backend if report is not None else None) or options.backend
                   or self.default_backend(options.target))
        profile = find_profile(self.name, backend, options.overrides)
        execution = select_execution(profile, options.target, device)
        # An emulation too big for memory goes beside the (staged) output, removed with it.
        comparisons, notes = validate_conversion(input_path, output_path, feeds, execution,
                                                 scratch=output_path.parent,
                                                 inputs_given=inputs is not None)
        if inputs and report is not None and report.cost is not None:  # at the sizes really run
            report.cost["activation_bytes"] = activation_traffic(
                read_model_file(output_path), {k: tuple(v.shape) for k, v in feeds.items()})
        return Validation(comparisons, rtol, notes)

    def check(self, path: Path, target: str | None, backend: str | None,
              reference: Path | None, rtol: float | None, inputs: str | None = None,
              device: str | None = None, overrides: Overrides | None = None) -> CheckResult:
        return check_model(path, target, backend, reference, rtol, inputs, device, overrides)

    def explain(self, source: Path, options: OnnxOptions) -> Report:
        return convert_model(source, dataclasses.replace(options, check=False))[1]

    def input_files(self, input_path: Path) -> list[tuple[Path, str]]:
        return input_files(input_path)

    def output_companions(self, output_name: str, options: OnnxOptions) -> Companions | None:
        return data_files(output_name, options.external_data)

    def accuracy_runner(self, path: Path, options: OnnxOptions) -> ModelRunner:
        from .accuracy import OnnxRunner

        return OnnxRunner(path, options)


FORMAT = OnnxFormat()

__all__ = ["FORMAT", "OnnxFormat", "convert", "convert_file", "convert_model",
           "convert_model_file", "check_model"]
