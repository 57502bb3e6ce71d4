"""TensorFlow: load (GraphDef / FunctionDef -> IR), emit, rules (what op names mean), lists
(tf.toml, Grappler's variables, TF's kernel registry), files, convert (GraphDefs, MetaGraphs,
SavedModels), validate (TF on the CPU), check (CI lint), training (TF1 training graphs).
`FORMAT` is the package's `Format`.

Importing this package imports TensorFlow, with its C++ start-up notes kept off stderr.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...accuracy.runner import ModelRunner
from ...errors import AmpError
from ...op_lists import Overrides
from ...options import TfOptions, TrainingOptions
from ...report import CheckResult, Report
from ...training import LossScaleRule
from ...validation import Validation, load_inputs
from ..base import Format
from . import _tensorflow  # noqa: F401  (sorts first of this package: TensorFlow, quietly)
from .check import TF_CHECK_RULES, check_tf_graph
from .convert import (
    convert_file,
    convert_graphdef,
    convert_saved_model,
    convert_saved_model_proto,
    convert_tf_file,
    meta_graph_fetches,
    output_kind,
    rewrite_graphdef,
)
from .files import is_saved_model_dir, read_graphdef, read_meta_graph, read_saved_model
from .rules import TF_RULES
from .training.hook import MixedPrecisionFunction, MixedPrecisionStep, mixed_precision
from .training.rewrite import TrainingRewrite, convert_training_file, rewrite_training_graph
from .validate import compare_graphdefs, compare_saved_models

if TYPE_CHECKING:  # imported for real only after `_tensorflow` has quieted TensorFlow
    from tensorflow.core.framework import graph_pb2


class TfFormat(Format[TfOptions]):
    """TensorFlow GraphDefs (.pb, .pbtxt), MetaGraphDefs (.meta) and SavedModel directories."""

    name = "tf"
    options_class = TfOptions
    rules = TF_RULES
    check_rules = TF_CHECK_RULES

    def accepts(self, model: object) -> bool:
        from tensorflow.core.framework import graph_pb2

        return isinstance(model, graph_pb2.GraphDef)

    def convert(self, model: Any, options: TfOptions, source_dir: Path | None = None
                ) -> tuple[graph_pb2.GraphDef, Report]:
        graph_def = model if self.accepts(model) else read_graphdef(Path(model))
        return rewrite_graphdef(graph_def, options)

    def convert_file(self, input_path: Path, output_path: Path, options: TfOptions,
                     training: TrainingOptions | None = None) -> tuple[None, Report]:
        if training is not None:
            return None, convert_training_file(input_path, output_path, options, training)
        return None, convert_file(input_path, output_path, options)

    def input_entry(self, path: Path, what: str = "input") -> tuple[Path, str]:
        return path, f"the {what} {'SavedModel' if is_saved_model_dir(path) else 'model'}"

    def validate(self, input_path: Path, output_path: Path, report: Report, options: TfOptions,
                 inputs: str | None, rtol: float, device: str | None = None) -> Validation:
        _cpu_only(device)
        feeds = load_inputs(inputs) if inputs else None
        if is_saved_model_dir(input_path):
            comparisons = compare_saved_models(input_path, output_path, feeds)
        elif input_path.suffix == ".meta":
            comparisons = compare_graphdefs(read_meta_graph(input_path).graph_def,
                                            read_meta_graph(output_path).graph_def,
                                            report.summary["outputs"], feeds)
        else:
            comparisons = compare_graphdefs(read_graphdef(input_path), read_graphdef(output_path),
                                            report.summary["outputs"], feeds)
        return Validation(comparisons, rtol)

    def check(self, path: Path, target: str | None, backend: str | None,
              reference: Path | None, rtol: float | None, inputs: str | None = None,
              device: str | None = None, overrides: Overrides | None = None) -> CheckResult:
        _cpu_only(device)
        return check_tf_graph(path, target, backend, reference, rtol, inputs, overrides)

    def explain(self, source: Path, options: TfOptions) -> Report:
        options = dataclasses.replace(options, check=False)
        if is_saved_model_dir(source):
            return convert_saved_model_proto(source, options)[1]
        if source.suffix == ".meta":
            meta = read_meta_graph(source)
            if not options.outputs:
                options = dataclasses.replace(options, outputs=meta_graph_fetches(meta) or None)
            return rewrite_graphdef(meta.graph_def, options)[1]
        return rewrite_graphdef(read_graphdef(source), options)[1]

    def accuracy_runner(self, path: Path, options: TfOptions) -> ModelRunner:
        from .accuracy import TfRunner

        return TfRunner(path, options)

    def output_kind(self, input_path: Path) -> str:
        return output_kind(input_path)

    def replaceable_output_dir(self, path: Path) -> bool:
        return is_saved_model_dir(path)


def _cpu_only(device: str | None) -> None:
    """TensorFlow graphs run on TensorFlow's CPU kernels whatever the profile's device."""
    if device not in (None, "cpu"):
        raise AmpError(f"--device {device}: TensorFlow graphs are validated on the CPU only")


FORMAT = TfFormat()

__all__ = ["FORMAT", "TfFormat", "convert_graphdef", "convert_saved_model", "convert_tf_file",
           "rewrite_training_graph", "TrainingRewrite", "mixed_precision", "MixedPrecisionStep",
           "MixedPrecisionFunction", "LossScaleRule", "check_tf_graph",
           "compare_graphdefs", "compare_saved_models", "read_graphdef", "read_meta_graph",
           "read_saved_model"]
