"""The Python entry points; the CLI is a thin shell over these."""

from __future__ import annotations

import contextlib
import difflib
import gc
import os
from pathlib import Path
from typing import Iterable, Iterator

import onnx

from .emitters.onnx import emit_onnx, has_external_data, save_onnx
from .errors import AmpError
from .loaders.onnx import PROTOBUF_LIMIT, load_onnx, read_model_file
from .op_lists import OpLists, Overrides
from .passes.base import ConversionOptions, PassContext
from .pipeline import run_pipeline
from .report import Report, build_report


def build_overrides(allow: Iterable[str] = (), infer: Iterable[str] = (),
                    deny: Iterable[str] = (), clear: Iterable[str] = (),
                    keep_nodes: Iterable[str] = (), config: str | os.PathLike | None = None
                    ) -> Overrides:
    """Collect op-class moves and pinned nodes; the config file first, explicit options win.

    A single string is taken as one name. Naming one op in two classes is an error.
    """
    overrides = Overrides.from_config(config) if config is not None else Overrides()
    explicit: dict[str, str] = {}
    for op_class, ops in (("allow", allow), ("infer", infer), ("deny", deny), ("clear", clear)):
        for op in _names(ops):
            if explicit.get(op, op_class) != op_class:
                raise AmpError(f"--{explicit[op]} and --{op_class} both name {op!r}")
            explicit[op] = op_class
            overrides.move(op, op_class, f"--{op_class}")
    overrides.keep_nodes.extend(_names(keep_nodes))
    return overrides


def _names(values: Iterable[str] | str) -> list[str]:
    return [values] if isinstance(values, str) else list(values)


def _load(model_or_path: onnx.ModelProto | str | os.PathLike
          ) -> tuple[onnx.ModelProto, Path | None]:
    if isinstance(model_or_path, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model_or_path)  # the caller's model is never modified
        return copy, None
    path = Path(model_or_path)
    return read_model_file(path), path.resolve().parent


def convert(model_or_path: onnx.ModelProto | str | os.PathLike, target: str = "fp16",
            backend: str = "ort-cuda", *, keep_io_types: bool = True, clamp: bool = False,
            allow: Iterable[str] = (), infer: Iterable[str] = (), deny: Iterable[str] = (),
            clear: Iterable[str] = (), keep_nodes: Iterable[str] = (),
            config: str | os.PathLike | None = None, check: bool = True,
            base_dir: str | os.PathLike | None = None) -> tuple[onnx.ModelProto, Report]:
    """Convert an fp32 ONNX model to mixed precision.

    Args:
        model_or_path: a ModelProto (left unmodified) or the path of an .onnx file.
        target: "fp16" or "bf16".
        backend: "ort-cuda" or "ort-cpu": which kernels the op lists assume.
        keep_io_types: keep graph inputs and outputs in their original dtype.
        clamp: saturate constants beyond the target's range instead of keeping them fp32.
        allow/infer/deny/clear: op types to move into that class.
        keep_nodes: node names or regexes pinned to fp32.
        config: a TOML file with the same overrides.
        check: run onnx.checker (full check) on the result.
        base_dir: for a ModelProto with external data, the folder its data is relative to
            (a path's own folder is used otherwise).

    Returns:
        The converted ModelProto and the Report of every decision.
    """
    with _cyclic_gc_paused():
        return _convert(model_or_path, target, backend, keep_io_types, clamp, allow, infer, deny,
                        clear, keep_nodes, config, check, base_dir)


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """The IR makes hundreds of thousands of small objects that live until the end; Python's
    cyclic collector would rescan them again and again (half the run time at 50k nodes)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _convert(model_or_path, target, backend, keep_io_types, clamp, allow, infer, deny, clear,
             keep_nodes, config, check, base_dir) -> tuple[onnx.ModelProto, Report]:
    model, own_dir = _load(model_or_path)
    base_dir = Path(base_dir) if base_dir is not None else own_dir
    overrides = build_overrides(allow, infer, deny, clear, keep_nodes, config)
    lists = OpLists.load("onnx", target, backend, overrides)
    options = ConversionOptions(target=target, backend=backend, keep_io_types=keep_io_types,
                                clamp=clamp, keep_nodes=overrides.keep_node_patterns())
    ir_model = load_onnx(model, base_dir)
    original_nodes = [(node, graph.name) for graph in ir_model.graph.walk_graphs()
                      for node in graph.nodes]
    ctx = PassContext(ir_model, lists, options)
    results = run_pipeline(ctx)
    converted = emit_onnx(ir_model)
    report = build_report(ctx, original_nodes, results)
    report.warnings = _override_warnings(overrides, options, [n.name for n, _ in original_nodes])
    if check and not has_external_data(converted) and converted.ByteSize() <= PROTOBUF_LIMIT:
        try:
            check_valid(converted)  # else convert_file checks the saved file
        except AmpError:
            _blame_invalid_input(model_or_path)
            raise
    return converted, report


def _override_warnings(overrides: Overrides, options: ConversionOptions,
                       node_names: list[str]) -> list[str]:
    """Overrides that cannot have done anything: likely typos."""
    warnings = []
    for op in overrides.moves:
        if "." not in op and not onnx.defs.has(op):
            known = sorted({schema.name for schema in onnx.defs.get_all_schemas()})
            close = difflib.get_close_matches(op, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            warnings.append(f"{overrides.source[op]} {op}: no such ONNX op{hint}")
    for pattern in options.keep_nodes:
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
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AmpError(f"the input model already fails the ONNX checker: {first}") from None


def check_valid(model: onnx.ModelProto | str) -> None:
    """onnx.checker with full check (type and shape inference); failures raise AmpError.

    A path is checked from disk, which is the only way for external data or models over 2 GB.
    """
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:  # the checker raises several exception types
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AmpError(f"the converted model fails the ONNX checker: {first_line}") from None


def convert_file(input_path: str | os.PathLike, output_path: str | os.PathLike,
                 **options) -> tuple[onnx.ModelProto, Report]:
    """Convert a model file and write the result atomically; the input is never touched."""
    input_path, output_path = Path(input_path), Path(output_path)
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
    model, report = convert(source, base_dir=input_path.resolve().parent, **options)
    del source  # convert worked on its own copy
    external = external or model.ByteSize() > PROTOBUF_LIMIT
    save_onnx(model, output_path, source_dir=input_path.resolve().parent, external=external)
    if options.get("check", True) and external:
        try:
            check_valid(str(output_path))
        except AmpError:
            output_path.unlink(missing_ok=True)
            Path(str(output_path) + ".data").unlink(missing_ok=True)
            raise
    return model, report
