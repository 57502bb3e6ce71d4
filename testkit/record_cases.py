"""Record every conversion the tests make in-process as a replayable case (scripts/same_output.py
replays them with two versions of the code and compares the outputs byte for byte).

Active only when AMP_REWRITER_RECORD_CASES names a folder; conftest installs it before any test
module imports the entry points. Each format's one conversion function is wrapped, so calls
through `amp_rewriter.convert`, `amp_rewriter.tf.convert_graphdef`, `convert_saved_model` and
`rewrite_training_graph` are all seen. Recording never changes what the conversion returns.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from collections.abc import Callable
from typing import Any

from testkit import same_output_cases

ENV = same_output_cases.RECORD_ENV


def _record(kind: str, model: Any, kwargs: dict[str, Any], **extra: Any) -> None:
    try:
        same_output_cases.record_case(os.environ[ENV], kind, model, kwargs, **extra)
    except Exception as exc:  # a case that cannot be stored is reported, never a test failure
        warnings.warn(f"not recorded ({kind}): {type(exc).__name__}: {exc}", stacklevel=3)


def _public(options) -> dict[str, Any]:
    kwargs = options.as_kwargs()
    kwargs.pop("outputs", None)
    return {k: v for k, v in kwargs.items() if v not in (None, [])}


def _wrap(module: Any, name: str, record: Callable[..., None]) -> None:
    original = getattr(module, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        record(*args, **kwargs)
        return original(*args, **kwargs)
    setattr(module, name, wrapper)


def install() -> None:
    """Wrap the conversion functions of both formats (TensorFlow only where it is installed)."""
    if not os.environ.get(ENV):
        return
    onnx_convert = importlib.import_module("amp_rewriter.formats.onnx.convert")

    def onnx_case(model_or_path, options, base_dir=None):
        if base_dir is None:  # in-memory protos with external data come through convert_file
            _record("onnx", model_or_path, _public(options),
                    input="path" if isinstance(model_or_path, (str, os.PathLike)) else "proto")

    def onnx_file_case(input_path, output_path, options):
        _record("onnx_file", input_path, _public(options))

    _wrap(onnx_convert, "convert_model", onnx_case)
    _wrap(onnx_convert, "convert_model_file", onnx_file_case)
    if importlib.util.find_spec("tensorflow") is None:
        return
    tf_convert = importlib.import_module("amp_rewriter.formats.tf.convert")
    training = importlib.import_module("amp_rewriter.formats.tf.training.rewrite")

    def graphdef_case(graph_def, options, pipeline="tf", pins=None):
        if pipeline == "tf":  # training rewrites are recorded whole, below
            _record("tf_graphdef", graph_def, _public(options), outputs=options.outputs)

    def saved_model_case(input_dir, output_dir, options):
        _record("tf_saved_model", input_dir, _public(options))

    def training_case(source, options, training_options):
        kwargs = {k: v for k, v in _public(options).items() if k not in ("keep_io_types", "check")}
        for key, value in training_options.__dict__.items():
            if value is not None:
                kwargs[key] = getattr(value, "name", value)  # tensors and ops by name
        _record("tf_training", source, kwargs)

    _wrap(tf_convert, "rewrite_graphdef", graphdef_case)
    _wrap(tf_convert, "convert_saved_model_dir", saved_model_case)
    _wrap(training, "rewrite_training_meta_graph", training_case)
