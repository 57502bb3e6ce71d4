"""ONNX conversion: ModelProto or .onnx file in, mixed-precision ModelProto (and file) out."""

from __future__ import annotations

import dataclasses
import difflib
import os
from pathlib import Path
from typing import Any

import onnx

from ...errors import AmpError
from ...ir import Model, ValueNames
from ...op_lists import OpLists
from ...options import Options
from ...passes import PassContext, Pin, run_pipeline
from ...report import Report, build_report
from ..base import cyclic_gc_paused
from .emit import emit_onnx, has_external_data, save_onnx
from .load import PROTOBUF_LIMIT, load_onnx, read_model_file
from .rules import ONNX_RULES

DEFAULT_BACKEND = "ort-cuda"


def convert(model_or_path: onnx.ModelProto | str | os.PathLike, target: str = "fp16",
            backend: str | None = None, *, base_dir: str | os.PathLike | None = None,
            **options: Any) -> tuple[onnx.ModelProto, Report]:
    """Convert an fp32 ONNX model to mixed precision.

    Args:
        model_or_path: a ModelProto (left unmodified) or the path of an .onnx file.
        target: "fp16" or "bf16".
        backend: "ort-cuda" (default) or "ort-cpu": which kernels the op lists assume.
        base_dir: for a ModelProto with external data, the folder its data is relative to
            (a path's own folder is used otherwise).
        **options: the other fields of `amp_rewriter.Options`: keep_io_types, clamp, allow,
            infer, deny, clear (op types moved to that class), keep_nodes (node names or regexes
            pinned to fp32), config (a TOML file with the same overrides), check (run
            onnx.checker with full check on the result, default True).

    Returns:
        The converted ModelProto and the Report of every decision.
    """
    return convert_model(model_or_path, Options(target=target, backend=backend, **options),
                         base_dir)


def convert_model(model_or_path: onnx.ModelProto | str | os.PathLike, options: Options,
                  base_dir: str | os.PathLike | None = None,
                  pins: dict[str, Pin] | None = None) -> tuple[onnx.ModelProto, Report]:
    """`convert` with the options as one object; `pins` maps node names to why a front end
    keeps them fp32 (`convert --auto`'s measurements)."""
    converted, report, _ = convert_model_ir(model_or_path, options, base_dir, pins)
    return converted, report


def convert_model_ir(model_or_path: onnx.ModelProto | str | os.PathLike, options: Options,
                     base_dir: str | os.PathLike | None = None,
                     pins: dict[str, Pin] | None = None
                     ) -> tuple[onnx.ModelProto, Report, ConvertedIR]:
    """`convert_model`, also returning the IR the passes left (for the accuracy tools, which map
    the converted model's tensors back onto the original's)."""
    if options.outputs:
        raise AmpError("--outputs is for TensorFlow GraphDefs: an ONNX model names its outputs")
    options = options.with_backend(DEFAULT_BACKEND)
    with cyclic_gc_paused():
        model, own_dir = _load(model_or_path)
        base = Path(base_dir) if base_dir is not None else own_dir
        lists = OpLists.load("onnx", options.target, options.backend or DEFAULT_BACKEND,
                             options.overrides)
        ir_model = load_onnx(model, base)
        original_nodes = [(node, graph.name) for graph in ir_model.graph.walk_graphs()
                          for node in graph.nodes]
        original_names = ValueNames(ir_model)
        ctx = PassContext(ir_model, lists, options, ONNX_RULES, pins=dict(pins or {}))
        results = run_pipeline(ctx, "onnx")
        converted = emit_onnx(ir_model)
        report = build_report(ctx, original_nodes, results)
        report.warnings = _override_warnings(options, [n.name for n, _ in original_nodes])
    if options.check and not has_external_data(converted) \
            and converted.ByteSize() <= PROTOBUF_LIMIT:
        try:
            check_valid(converted)  # else convert_file checks the saved file
        except AmpError:
            _blame_invalid_input(model_or_path)
            raise
    return converted, report, ConvertedIR(ir_model, original_names)


class ConvertedIR:
    """The IR after the passes, and each value's name before them."""

    def __init__(self, model: Model, names: ValueNames):
        self.model = model
        self.original_name = names.original_name


def _load(model_or_path: onnx.ModelProto | str | os.PathLike
          ) -> tuple[onnx.ModelProto, Path | None]:
    if isinstance(model_or_path, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model_or_path)  # the caller's model is never modified
        return copy, None
    path = Path(model_or_path)
    return read_model_file(path), path.resolve().parent


def _override_warnings(options: Options, node_names: list[str]) -> list[str]:
    """Overrides that cannot have done anything: likely typos."""
    warnings = []
    overrides = options.overrides
    for op in overrides.moves:
        if "." not in op and not onnx.defs.has(op):
            known = sorted({schema.name for schema in onnx.defs.get_all_schemas()})
            close = difflib.get_close_matches(op, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            warnings.append(f"{overrides.source[op]} {op}: no such ONNX op{hint}")
    for pattern in options.keep_node_patterns:
        if not any(pattern.fullmatch(name) for name in node_names):
            warnings.append(f"--keep-node {pattern.pattern!r} matches no node")
    return warnings


def _blame_invalid_input(model_or_path: onnx.ModelProto | str | os.PathLike) -> None:
    """When the input itself fails the checker, say so rather than blame the conversion."""
    original = (model_or_path if isinstance(model_or_path, onnx.ModelProto)
                else str(model_or_path))
    try:
        onnx.checker.check_model(original, full_check=True)
    except Exception as exc:  # the checker raises several exception types
        raise AmpError(f"the input model already fails the ONNX checker: "
                       f"{_first_line(exc)}") from None


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def check_valid(model: onnx.ModelProto | str) -> None:
    """onnx.checker with full check (type and shape inference); failures raise AmpError.

    A path is checked from disk, which is the only way for external data or models over 2 GB.
    """
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:  # the checker raises several exception types
        raise AmpError(f"the converted model fails the ONNX checker: {_first_line(exc)}") from None


def convert_file(input_path: str | os.PathLike, output_path: str | os.PathLike,
                 **options: Any) -> tuple[onnx.ModelProto, Report]:
    """Convert a model file and write the result atomically; the input is never touched."""
    return convert_model_file(Path(input_path), Path(output_path), Options(**options))


def convert_model_file(input_path: Path, output_path: Path, options: Options,
                       pins: dict[str, Pin] | None = None) -> tuple[onnx.ModelProto, Report]:
    """`convert_file` with the options as one object (and a front end's `pins`)."""
    if output_path.exists() and input_path.exists() and os.path.samefile(input_path, output_path):
        raise AmpError("the output path is the input file: refusing to overwrite the input")
    if output_path.resolve() == input_path.resolve():
        raise AmpError("the output path is the input file: refusing to overwrite the input")
    if output_path.is_dir():
        raise AmpError(f"{output_path}: is a directory, expected an output file name")
    if not output_path.resolve().parent.is_dir():
        raise AmpError(f"{output_path}: output folder does not exist")
    source = read_model_file(input_path)
    external = has_external_data(source)
    # A model with external data is checked once written (from the file, without its data):
    # checking it in memory would serialize every converted weight twice more.
    model, report = convert_model(
        source, dataclasses.replace(options, check=options.check and not external),
        base_dir=input_path.resolve().parent, pins=pins)
    del source  # convert worked on its own copy
    external = external or model.ByteSize() > PROTOBUF_LIMIT
    save_onnx(model, output_path, source_dir=input_path.resolve().parent, external=external)
    if options.check and external:
        try:
            check_valid(str(output_path))
        except AmpError:
            discard_output(output_path)
            _blame_invalid_input(input_path)
            raise
    return model, report


def discard_output(output_path: Path) -> None:
    """Remove a written model and its external data file."""
    output_path.unlink(missing_ok=True)
    Path(str(output_path) + ".data").unlink(missing_ok=True)
