"""ONNX conversion: ModelProto or .onnx file in, mixed-precision ModelProto (and file) out."""

from __future__ import annotations

import difflib
import gc
import marshal
import os
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import onnx

from ... import progress
from ...errors import AmpError, first_line
from ...fileio import owned_prefix
from ...host import record_bf16_host_check
from ...ir import LazyTensor, Model, Node, ValueNames
from ...op_lists import OpLists, default_backend
from ...options import DEFAULT_TARGET, OnnxOptions
from ...passes import PassContext, Pin, run_pipeline
from ...passes.analysis.pins import keep_node_match
from ...passes.pipeline import passes_of
from ...report import Report, build_report, constant_entries
from ..base import cyclic_gc_paused
from . import ort_registry
from .background_check import BackgroundCheck
from .emit import (
    EXTERNAL_DATA_THRESHOLD,
    Emission,
    deferred_bytes,
    has_external_data,
    save_onnx,
)
from .load import (
    PROTOBUF_LIMIT,
    all_tensors,
    load_external_data,
    load_onnx,
    op_in_opset,
    read_model_file,
    walk_graph_protos,
)
from .optimize import optimized_copy, options_after
from .rules import ONNX_RULES
from .shapes import (
    checked_activation_traffic,
    encoded_activation_traffic,
    validation_input_shapes,
)

#: onnxruntime's contrib domain.
ORT_DOMAIN = "com.microsoft"


def convert(model_or_path: onnx.ModelProto | str | os.PathLike, target: str = DEFAULT_TARGET,
            backend: str | None = None, *, base_dir: str | os.PathLike | None = None,
            **options: Any) -> tuple[onnx.ModelProto, Report]:
    """Convert an fp32 ONNX model to mixed precision.

    Args:
        model_or_path: a ModelProto (left unmodified) or the path of an .onnx file.
        target: "fp16" or "bf16".
        backend: a backend profile of op_lists/onnx.toml (ort-cuda, the default, or ort-cpu)
            or of the `config` file: which kernels the op lists assume.
        base_dir: for a ModelProto with external data, the folder its data is relative to
            (a path's own folder is used otherwise).
        **options: the other fields of `amp_rewriter.OnnxOptions`: keep_io_types, clamp, allow,
            infer, deny, clear (op types moved to that class), keep_nodes (node names or regexes
            pinned to fp32), config (a TOML file with the same overrides), optimize (a model
            type: onnxruntime's transformer optimizer fuses the model first), num_heads and
            hidden_size (for optimize), check (run onnx.checker with full check on the result,
            default True).

    Returns:
        The converted ModelProto and the Report of every decision.
    """
    from . import FORMAT

    return convert_model(model_or_path, FORMAT.options(target=target, backend=backend, **options),
                         base_dir)


def convert_model(model_or_path: onnx.ModelProto | str | os.PathLike, options: OnnxOptions,
                  base_dir: str | os.PathLike | None = None,
                  pins: dict[str, Pin] | None = None, *,
                  deferred: dict[str, LazyTensor] | None = None
                  ) -> tuple[onnx.ModelProto, Report]:
    """`convert` with the options as one object; `pins` maps node names to why a front end
    keeps them fp32 (`convert --auto`'s measurements).

    `deferred`: a dict to fill with the weights that stream from the input's external data
    (see `emit_onnx`); their protos stay without data until `save_onnx` writes them. Without
    it the returned model holds every converted weight.
    """
    if options.optimize:
        source = (Path(model_or_path) if not isinstance(model_or_path, onnx.ModelProto)
                  else model_or_path)
        with optimized_copy(source, options, Path(base_dir) if base_dir is not None else None
                            ) as (fused_path, summary):
            model, report = convert_model(fused_path, options_after(options), pins=pins)
            if has_external_data(model):  # the caller gets a model that outlives the folder
                load_external_data(model, fused_path.parent)
        report.optimizer = summary
        return model, report
    # A ModelProto is not copied: the conversion only reads it (emission writes what changed
    # into new messages), so a caller's in-memory model does not cost its size twice.
    borrowed = isinstance(model_or_path, onnx.ModelProto)
    model, own_dir = _load(model_or_path, copy=False)
    held = [model]
    del model  # _convert_owned holds the only reference (see there)
    result = _convert_owned(
        held.pop, options, Path(base_dir) if base_dir is not None else own_dir, model_or_path,
        pins=pins, deferred=deferred, borrowed=borrowed)
    return result.model, result.report


def convert_model_ir(model_or_path: onnx.ModelProto | str | os.PathLike, options: OnnxOptions,
                     base_dir: str | os.PathLike | None = None,
                     pins: dict[str, Pin] | None = None
                     ) -> tuple[onnx.ModelProto, Report, ConvertedIR]:
    """`convert_model`, also returning the IR the passes left (for the accuracy tools, which map
    the converted model's tensors back onto the original's)."""
    if options.optimize:
        raise AmpError("--optimize does not combine with --auto or diagnose yet: fuse the model "
                       "first (onnxruntime.transformers.optimizer), then run them on it")
    model, own_dir = _load(model_or_path, copy=True)  # the kept IR's handles are the model's
    result = _convert_owned(
        [model].pop, options, Path(base_dir) if base_dir is not None else own_dir, model_or_path,
        pins=pins, keep_ir=True)
    assert result.kept is not None
    return result.model, result.report, result.kept


class ConvertedIR:
    """The IR after the passes, and each value's name before them."""

    def __init__(self, model: Model, names: ValueNames):
        self.model = model
        self.original_name = names.original_name


class _Converted(NamedTuple):
    """What `_convert_owned` returns."""

    model: onnx.ModelProto
    report: Report
    kept: ConvertedIR | None
    #: Some tensor of the input keeps its data in external files.
    input_external: bool
    #: Some tensor of `model` still refers to external data (the input's, or deferred).
    external: bool


def _convert_owned(take_model: Callable[[], onnx.ModelProto], options: OnnxOptions,
                   base: Path | None,
                   original: onnx.ModelProto | str | os.PathLike, *,
                   pins: dict[str, Pin] | None = None,
                   deferred: dict[str, LazyTensor] | None = None, keep_ir: bool = False,
                   borrowed: bool = False
                   ) -> _Converted:
    """Convert the model `take_model` hands over. Unless `borrowed` (the caller's own model,
    which is only read), it is ours to rewrite in place (one read from a file, or a copy) and
    referenced nowhere else, so that its memory can go once the IR is released and the emitted
    model assembled. `original` is what the caller gave, blamed when the result fails the
    checker because the input already does. `keep_ir`: also return the IR after the passes
    (else it is released as soon as the model is emitted); it needs a model of our own."""
    assert not (keep_ir and borrowed), "the kept IR's node handles must be ours"
    model = take_model()
    options = options.with_backend(default_backend("onnx", options.target))
    with cyclic_gc_paused(), progress.bar("converting", len(passes_of("onnx")) + 2,
                                          "step") as drawn:
        steps = progress.Steps(drawn)
        steps.start("loading")
        opset = default_opset(model)
        _refuse_old_opset(opset)
        lists = OpLists.load("onnx", options.target, options.backend or "",
                             options.overrides, opset)
        ir_model = load_onnx(model, base, borrowed=borrowed)
        input_external = ir_model.external_data
        original_nodes = list(ir_model.graph.walk_nodes())
        original_names = ValueNames(ir_model) if keep_ir else None
        ctx = PassContext(ir_model, lists, options, ONNX_RULES, pins=dict(pins or {}),
                          op_available=partial(op_in_opset, opset=opset))
        results = run_pipeline(ctx, "onnx", on_pass=steps.start)
        steps.start("emitting")
        # All but the main graph's nodes now (and the IR's name tables go); what reads the nodes
        # runs before they are written, since emission lets each go once it is written (unless
        # the IR is kept), so that the model's encoding takes their memory.
        emission = Emission(ir_model, deferred, split=not keep_ir, release=not keep_ir)
        # A node keeps its graph when a pass removes it.
        report = build_report(ctx, original_nodes, results, _graph_name, with_constants=False)
        constants = ctx.constants  # made entries once the nodes are gone, in their memory
        override_warnings = _override_warnings(options, original_nodes)
        schema_warnings = _schema_warnings(ir_model)
        del original_nodes, ctx
        op_kinds = None
        if report.cost is not None:  # what the cost summary needs of the IR
            op_kinds = {(node.domain, node.op_type) for node in ir_model.graph.walk_nodes()}
        emitted = emission.finish()
        del emission
        report.constants = constant_entries(constants)
        del constants
        encodable = emitted.size_bound() <= PROTOBUF_LIMIT
        big = len(report.nodes) >= BIG_GRAPH_NODES
        kept = None
        if original_names is not None:
            kept = ConvertedIR(ir_model, original_names)
        else:  # free the IR now (gigabytes at a million nodes), before the model is assembled
            # and shape inference and the checker make their own copies of it
            _freeing_the_ir(ir_model, report, big)
        del ir_model, model
        # The model stays in its encoding while the cost summary and the checker read it:
        # parsed, it would take 500 MB more at a million nodes.
        encoded = emitted.encode()  # None: not one encoding (the IR kept, or over 2 GB)
        converted = emitted.assemble() if encoded is None else None
        del emitted
        if encoded is not None and input_external:  # its tensors are looked at next
            converted = encoded.parse()
        # Without external data in the input there is none in the output: no walk over the
        # model's attributes to find out (a second a million nodes).
        external = input_external and converted is not None and has_external_data(converted)
        # else convert_file checks the saved file
        check_here = options.check and encodable and not external
        background = None
        if check_here and encoded is not None and big:
            background = BackgroundCheck.start(encoded.encoding)
        try:
            types_checked = False
            if report.cost is not None:
                assert op_kinds is not None
                found = None
                if encoded is not None and converted is None:
                    found = encoded_activation_traffic(encoded, op_kinds, type_check=check_here)
                if found is None:
                    if converted is None:
                        assert encoded is not None
                        converted = encoded.parse()
                    found = checked_activation_traffic(
                        converted, validation_input_shapes(converted), op_kinds=op_kinds,
                        type_check=check_here)
                report.cost["activation_bytes"], types_checked = found
            # The type check ran with the cost summary's inference: then the structural check
            # is all that is left, and the worker's verdict is that.
            verdict = background.verdict() if background is not None and types_checked else None
        finally:
            if background is not None:
                background.cancel()
        report.warnings = override_warnings
        report.warnings += bf16_advice(report, lists, opset)
        report.warnings += schema_warnings
        record_bf16_host_check(report, lists.profile)
        if converted is None:
            assert encoded is not None
            converted = encoded.parse()
        # The model's encoding serves the check.
        encoding = encoded.encoding if encoded is not None else None
        del encoded
        steps.finish()
        if check_here:
            try:
                if verdict is None:
                    check_valid(converted, full=not types_checked, encoding=encoding)
                elif verdict:
                    raise AmpError(checker_failure(verdict))
            except AmpError:
                _blame_invalid_input(original)
                raise
    return _Converted(converted, report, kept, input_external, external)


def _graph_name(node: Node) -> str:
    assert node.graph is not None, "nodes keep their graph until the IR is released"
    return node.graph.name


#: Nodes from which a conversion frees its IR with a full collection (`_freeing_the_ir`) and
#: checks its result in a second process (`BackgroundCheck`) while it runs the cost summary.
BIG_GRAPH_NODES = 100_000


def _freeing_the_ir(ir_model: Model, report: Report, big: bool) -> None:
    """Release the IR so that the system gets its memory back (`big`: it held many nodes).

    What outlives the IR (the report's constants, structures and cost) holds
    names read while the IR was built; scattered through the IR's memory, such objects keep
    Python's allocator from handing nearly any of it back (at 100k nodes RSS stays 230 MB
    higher). So they are packed into one buffer first and rebuilt after the IR is gone, and the
    cycles of the nodes the passes removed are collected (what is left to scan then is small).
    """
    try:
        packed: bytes | None = marshal.dumps((report.constants, report.structures, report.cost,
                                              report.passes))
    except ValueError:  # an object marshal cannot write: keep the objects as they are
        packed = None
    if packed is not None:
        report.constants, report.structures, report.passes, report.cost = [], [], [], None
    ir_model.release()
    if big:
        # A full collection also empties the interpreter's free lists (tuples, lists, dicts
        # and floats kept for reuse): their blocks, freed from all over the IR, would keep
        # most of its memory from the system (at 200k nodes, 220 MB of 450). It scans the
        # caller's objects too (0.2 s beside torch and TensorFlow): only for a big IR.
        gc.collect()
    else:
        # The cyclic collector is paused during a conversion, so everything the conversion
        # made is still in the youngest generation: collecting that one finds the removed
        # nodes without scanning the caller's objects.
        gc.collect(0)
    if packed is not None:
        report.constants, report.structures, report.cost, report.passes = marshal.loads(packed)


#: The first default-domain opset converted: before it, Cast names its target type (a string
#: `to`), which onnx's type inference cannot follow, so no converted model would pass the
#: checker's full check (and onnxruntime runs opset 7 and newer only).
FIRST_OPSET = 6


def _refuse_old_opset(opset: int) -> None:
    if 0 < opset < FIRST_OPSET:
        raise AmpError(f"the model imports opset {opset} of the ONNX domain; amp-rewriter "
                       f"converts opset {FIRST_OPSET} and newer (onnxruntime runs 7 and newer): "
                       f"upgrade it first with onnx.version_converter.convert_version(model, 17)")


def default_opset(model: onnx.ModelProto) -> int:
    """The model's opset of the default (ai.onnx) domain; 0 when it imports none."""
    return next((imp.version for imp in model.opset_import if imp.domain in ("", "ai.onnx")), 0)


#: The newest opset whose schemas `bf16_advice` may suggest moving to.
_NEWEST_OPSET = onnx.defs.onnx_opset_version()


def _first_opset_allowing_bf16(op: str, after: int) -> int | None:
    """The first opset above `after` at which `op`'s schema takes bfloat16 for its inputs."""
    for opset in range(after + 1, _NEWEST_OPSET + 1):
        try:
            schema = onnx.defs.get_schema(op, opset, "")
        except Exception:  # no such op at that opset
            continue
        if schema.since_version <= after:
            continue  # the same schema as the model's: still no bf16
        if any("tensor(bfloat16)" in c.allowed_type_strs for c in schema.type_constraints):
            return schema.since_version
    return None


def bf16_advice(report: Report, lists: OpLists, opset: int) -> list[str]:
    """Warnings for a bf16 conversion that left the compute ops (MatMul, Conv, ...) in fp32: one
    line each saying why and what would help."""
    if report.target != "bf16":
        return []
    summary = report.summary
    warnings = []
    advice = lists.profile.tables.get(report.target, {}).get("no_compute_advice")
    if advice and summary["low_precision_compute_ops"] == 0:
        converted = summary["low_precision_nodes"]
        what = "nothing" if converted == 0 else f"only {converted} data-movement node(s)"
        ops = ", ".join(summary["compute_ops_by_type"]) or "none in this model"
        warnings.append(f"bf16 for {lists.backend} converted {what} and none of the compute ops "
                        f"({ops}): {advice}")
    blocked: dict[str, int] = {}
    for entry in report.nodes:
        if entry["op"] in ONNX_RULES.compute_ops and entry["kind"] == "schema" \
                and entry["precision"] == "fp32":
            blocked[entry["op"]] = blocked.get(entry["op"], 0) + 1
    for op, count in sorted(blocked.items()):
        since = _first_opset_allowing_bf16(op, opset)
        if since is None or not lists.has_kernel(op):
            continue
        warnings.append(
            f"{count} of {summary['compute_ops_by_type'][op][1]} {op} node(s) stay fp32: the "
            f"{op} schema takes bf16 only from opset {since} (this model: opset {opset}); "
            f"convert the model to opset {since} (onnx.version_converter) to run them in bf16 "
            f"on {lists.backend}")
    return warnings


def _load(model_or_path: onnx.ModelProto | str | os.PathLike, *, copy: bool
          ) -> tuple[onnx.ModelProto, Path | None]:
    """The model to convert and the folder of its file; a ModelProto given is returned as it
    is, or with `copy` as a copy to rewrite (the caller's model is never modified)."""
    if isinstance(model_or_path, onnx.ModelProto):
        if not copy:
            return model_or_path, None
        duplicate = onnx.ModelProto()
        duplicate.CopyFrom(model_or_path)
        return duplicate, None
    path = Path(model_or_path)
    return read_model_file(path), path.resolve().parent


def _override_warnings(options: OnnxOptions, nodes: list[Node]) -> list[str]:
    """Overrides that cannot have done anything: likely typos."""
    warnings = []
    overrides = options.overrides
    for op in overrides.moves:
        if "." not in op and not onnx.defs.has(op) and not ort_registry.has_op(op):
            known = sorted({schema.name for schema in onnx.defs.get_all_schemas()})
            close = difflib.get_close_matches(op, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            warnings.append(f"{overrides.source[op]} {op}: no such ONNX op{hint}")
    for pattern in options.keep_node_patterns:
        if not any(keep_node_match(pattern, node) is not None for node in nodes):
            warnings.append(f"--keep-node {pattern.pattern!r} matches no node name or module")
    return warnings


def _schema_warnings(ir_model: Any) -> list[str]:
    """Contrib ops left without a schema because onnxruntime, which defines them, is missing."""
    if ort_registry.available():
        return []
    ops = sorted({node.qualified_op for node in ir_model.graph.walk_nodes()
                  if not node.has_schema and node.domain in ort_registry.ORT_DOMAINS})
    if not ops:
        return []
    return [f"onnxruntime is not installed, so its ops ({', '.join(ops)}) have no schema and "
            f"stay fp32 (pip install 'amp-rewriter[cpu]' or '[gpu]')"]


def _blame_invalid_input(model_or_path: onnx.ModelProto | str | os.PathLike) -> None:
    """When the input itself fails the checker, say so rather than blame the conversion."""
    original = (model_or_path if isinstance(model_or_path, onnx.ModelProto)
                else str(model_or_path))
    try:
        onnx_full_check(original)
    except Exception as exc:  # the checker raises several exception types
        raise AmpError(f"the input model already fails the ONNX checker: "
                       f"{first_line(exc)}") from None


def check_valid(model: onnx.ModelProto | str, full: bool = True,
                encoding: bytes | bytearray | None = None) -> None:
    """onnx.checker with full check (type and shape inference; `full=False`: the structural
    check alone, for a model whose inference passed in strict mode); failures raise AmpError.
    `encoding`: the model's encoding, if at hand (the structural check reads it rather than
    serializing the model again).

    A path is checked from disk, which is the only way for external data or models over 2 GB.
    """
    try:
        if full:
            onnx_full_check(model)
        else:
            onnx.checker.check_model(bytes(encoding) if encoding is not None else model)
    except Exception as exc:  # the checker raises several exception types
        raise AmpError(checker_failure(first_line(exc))) from None


def checker_failure(message: str) -> str:
    """The error for a converted model that onnx.checker refuses with `message`."""
    return f"the converted model fails the ONNX checker: {message}"


def onnx_full_check(model: onnx.ModelProto | str) -> None:
    """`onnx.checker.check_model(full_check=True)`, with the default-domain ops that only
    onnxruntime defines (SimplifiedLayerNormalization, which its transformer optimizer emits)
    checked as the custom ops they are to onnx: it has no schema for them and would refuse every
    model that holds one. Raises what the checker raises."""
    proto = read_model_file(model) if isinstance(model, str) else model
    ort_only = {node.op_type for g in walk_graph_protos(proto.graph) for node in g.node
                if node.domain in ("", "ai.onnx") and not onnx.defs.has(node.op_type)
                and ort_registry.has_op(node.op_type)}
    if not ort_only:
        onnx.checker.check_model(model, full_check=True)
        return
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    for g in walk_graph_protos(copy.graph):
        for node in g.node:
            if node.domain in ("", "ai.onnx") and node.op_type in ort_only:
                node.domain = ORT_DOMAIN
    if not any(imp.domain == ORT_DOMAIN for imp in copy.opset_import):
        copy.opset_import.append(onnx.helper.make_opsetid(ORT_DOMAIN, 1))
    if not isinstance(model, str):
        onnx.checker.check_model(copy, full_check=True)
        return
    # Beside the original, so its external data resolves; removed right after.
    with tempfile.NamedTemporaryFile(dir=Path(model).resolve().parent, prefix=owned_prefix(),
                                     suffix=".onnx", delete=False) as handle:
        handle.write(copy.SerializeToString())
    try:
        onnx.checker.check_model(handle.name, full_check=True)
    finally:
        os.unlink(handle.name)


def convert_file(input_path: str | os.PathLike, output_path: str | os.PathLike,
                 **options: Any) -> tuple[onnx.ModelProto, Report]:
    """Convert a model file and write the result (and its external data) atomically: all of it
    or, on failure, nothing; the input is never touched (`Format.convert_to`)."""
    from . import FORMAT

    return FORMAT.convert_to(Path(input_path), output_path, FORMAT.options(**options))


def input_files(model_path: Path) -> list[tuple[Path, str]]:
    """The files a conversion of `model_path` reads: the model and its external data files."""
    files = [(model_path, "the input model")]
    model = read_model_file(model_path)
    base = model_path.resolve().parent
    locations = {entry.value for tensor in all_tensors(model.graph)
                 if tensor.data_location == onnx.TensorProto.EXTERNAL
                 for entry in tensor.external_data if entry.key == "location"}
    files += [(base / location, f"the input model's external data {location!r}")
              for location in sorted(locations)]
    return files


def convert_model_file(input_path: Path, output_path: Path, options: OnnxOptions,
                       pins: dict[str, Pin] | None = None) -> tuple[onnx.ModelProto, Report]:
    """Convert `input_path` and write the model (and its .data) at `output_path`, which is a
    fresh path: the CLI and `convert_file` give the private path of an `OutputTransaction`.
    `pins`: a front end's nodes kept fp32 (`convert --auto`)."""
    if options.optimize:
        read_model_file(input_path)  # a file that is no model is refused before the optimizer
        with optimized_copy(input_path, options) as (fused_path, summary):
            model, report = _convert_and_save(fused_path, output_path,
                                              options_after(options), pins)
        report.optimizer = summary
    else:
        model, report = _convert_and_save(input_path, output_path, options, pins)
    return model, report


def _convert_and_save(input_path: Path, output_path: Path, options: OnnxOptions,
                      pins: dict[str, Pin] | None = None) -> tuple[onnx.ModelProto, Report]:
    source = read_model_file(input_path)
    # The model read here is converted in place (no copy of a model that may have a million
    # nodes); weights in the input's external data are read, range checked and converted a
    # chunk at a time, and written the same way: never the whole weight set in memory.
    deferred: dict[str, LazyTensor] = {}
    owned = [source]
    del source  # _convert_owned holds the only reference
    result = _convert_owned(owned.pop, options, input_path.resolve().parent,
                            input_path, pins=pins, deferred=deferred)
    model, report = result.model, result.report
    size = model.ByteSize()  # a walk of the whole model: once
    checked = not result.external and size <= PROTOBUF_LIMIT
    layout = options.external_data
    if layout is None:
        external = result.input_external or size + deferred_bytes(deferred) > PROTOBUF_LIMIT
        layout = "single" if external else "inline"
    to_write = size + deferred_bytes(deferred)
    if result.external:
        to_write += _external_bytes(model)
    with cyclic_gc_paused(), progress.bar("writing", unit="B", total=to_write) as bar:
        save_onnx(model, output_path, source_dir=input_path.resolve().parent, layout=layout,
                  threshold=(EXTERNAL_DATA_THRESHOLD if options.external_data_threshold is None
                             else options.external_data_threshold),
                  deferred=deferred, progress=bar.update, has_external=result.external)
    if options.check and not (checked and layout == "inline"):
        check_valid(str(output_path))  # the file: its external data is never loaded whole
    return model, report


def _external_bytes(model: onnx.ModelProto) -> int:
    """About how many bytes `save_onnx` copies from the input's external data (for the
    progress bar)."""
    external = 0
    for tensor in all_tensors(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            length = next((e.value for e in tensor.external_data if e.key == "length"), "")
            external += int(length) if length.isdigit() else 0
    return external
