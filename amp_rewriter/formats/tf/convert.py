"""TensorFlow conversion: frozen GraphDefs, MetaGraphDefs and SavedModels through the same IR,
op lists and passes as ONNX.

    graph_def, report = convert_graphdef(graph_def, outputs=["y"], target="bf16", backend="tf-cpu")
    report = convert_saved_model("model_dir", "model_bf16_dir", target="bf16", backend="tf-cpu")
    report = convert_tf_file("model.pb", "model_bf16.pb", outputs=["y"], target="bf16")

A SavedModel's functions are rewritten one by one (as Grappler optimizes each function as its own
item) with their signatures unchanged, so every caller (signatures, StatefulPartitionedCall and
PartitionedCall nodes, other functions) still matches; variables, assets and the object graph are
copied unchanged, so variables stay fp32 and reads of weights get a cast.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import function_pb2, graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2
from tensorflow.python.framework import op_def_registry

from ...errors import AmpError, first_line
from ...host import record_bf16_host_check
from ...ir import ALLOW, TARGET_DTYPES, Model, ValueNames, decisions, short_name
from ...op_lists import OpLists
from ...options import DEFAULT_TARGET, TfOptions
from ...passes import PassContext, Pin, StoredRange, run_pipeline
from ...precision_map import PrecisionMap
from ...report import NodeEntries, Report, build_report
from ...training.passes import TrainingContext
from ..base import cyclic_gc_paused
from ._tensorflow import imported_graph
from .emit import emit_function, emit_graphdef
from .files import (
    is_saved_model_dir,
    read_graphdef,
    read_meta_graph,
    read_saved_model,
    write_graphdef,
    write_saved_model,
)
from .lists import default_backend, load_tf_lists
from .load import default_fetches, load_function, load_graphdef
from .rounding import lower_rounding_casts
from .rules import TF_RULES
from .weights import (
    VariableRanges,
    apply_low_precision_weights,
    check_variable_ranges,
    plan_low_precision_weights,
    write_checkpoint,
)

#: Functions that save or restore checkpoints are copied as they are.
_CHECKPOINT_OPS = frozenset({"SaveV2", "RestoreV2", "MergeV2Checkpoints", "Save", "Restore",
                             "RestoreSlice", "SaveSlices"})


def _run(ir_model: Model, lists: OpLists, options: TfOptions, graph_name: str,
         pipeline: str = "tf", pins: Mapping[str, Pin] | None = None,
         stored: Mapping[str, StoredRange] | None = None,
         training: TrainingContext | None = None) -> Report:
    original = list(ir_model.graph.nodes)
    ctx = PassContext(ir_model, lists, options, TF_RULES, pins=dict(pins or {}),
                      stored_ranges=dict(stored or {}), training=training)
    results = run_pipeline(ctx, pipeline)
    # the nodes a training front end's passes added are reported with the model's own
    added = training.added if training is not None else []
    return build_report(ctx, original + added, results, lambda node: graph_name)


def _resolved(options: TfOptions) -> tuple[TfOptions, OpLists]:
    """The options with the target's default backend filled in, and their op lists."""
    options = options.with_backend(default_backend(options.target))
    assert options.backend is not None
    return options, load_tf_lists(options.target, options.backend, options.overrides)


def _warnings(options: TfOptions, report: Report, unknown_ops: set[str]) -> list[str]:
    """Overrides that cannot have done anything (likely typos), and ops TF does not know."""
    warnings = []
    overrides = options.overrides
    for op in overrides.moves:
        if op_def_registry.get(op) is None:
            warnings.append(f"{overrides.source[op]} {op}: no such TensorFlow op")
    names = [entry["name"] for entry in report.nodes]
    for pattern in options.keep_node_patterns:
        if not any(pattern.fullmatch(name) for name in names):
            warnings.append(f"--keep-node {pattern.pattern!r} matches no node")
    if unknown_ops:
        warnings.append(f"ops with no OpDef (custom ops) left as they are, fp32 barriers: "
                        f"{', '.join(sorted(unknown_ops))}")
    return warnings


def convert_graphdef(graph_def: graph_pb2.GraphDef, outputs: Iterable[str] | None = None,
                     target: str = DEFAULT_TARGET, backend: str | None = None, **options: Any
                     ) -> tuple[graph_pb2.GraphDef, Report]:
    """Convert an fp32 GraphDef (left unmodified) to mixed precision.

    `outputs` are the fetch tensors ("y" or "y:1"); by default the nodes nothing reads. With
    `keep_io_types` their nodes are preserved, as Grappler preserves fetch nodes, so the outputs
    keep their names and dtypes. `**options` are the other fields of `amp_rewriter.TfOptions`;
    `check` imports the result into a tf.Graph.
    """
    from . import FORMAT

    return rewrite_graphdef(graph_def, FORMAT.options(
        target=target, backend=backend, outputs=list(outputs) if outputs else None, **options))


def rewrite_graphdef(graph_def: graph_pb2.GraphDef, options: TfOptions,
                      pipeline: str = "tf", pins: Mapping[str, Pin] | None = None
                      ) -> tuple[graph_pb2.GraphDef, Report]:
    """`convert_graphdef` with the options as one object; `pins` maps node names to why a front
    end keeps them fp32 (the training rewrite's plan, with its own `pipeline`; `--auto`'s
    measurements)."""
    converted, report, _ = rewrite_graphdef_ir(graph_def, options, pipeline, pins)
    return converted, report


def rewrite_graphdef_ir(graph_def: graph_pb2.GraphDef, options: TfOptions,
                         pipeline: str = "tf", pins: Mapping[str, Pin] | None = None,
                         plan_training: Callable[[Model], TrainingContext] | None = None
                         ) -> tuple[graph_pb2.GraphDef, Report, tuple[Model, ValueNames]]:
    """`rewrite_graphdef`, also returning the IR the passes left and the values' names before
    them (for the accuracy tools). `plan_training` is a training front end: it reads the loaded
    IR and returns the training context the `pipeline`'s training passes work on."""
    if options.keep_fp32_weights:
        raise AmpError("--keep-fp32-weights is for SavedModels (their variables): a GraphDef's "
                       "constants convert with the nodes that read them, range-checked")
    options, lists = _resolved(options)
    copy = graph_pb2.GraphDef()
    copy.CopyFrom(graph_def)
    fetches = list(options.outputs) if options.outputs else default_fetches(copy)
    if not fetches:
        raise AmpError("no output found: name the fetch nodes with --outputs")
    with cyclic_gc_paused():
        ir_model = load_graphdef(copy, fetches, keep_fetch_nodes=options.keep_io_types)
        names = ValueNames(ir_model)
        training = plan_training(ir_model) if plan_training is not None else None
        report = _run(ir_model, lists, options, "main", pipeline, pins, training=training)
        lower_rounding_casts(ir_model)  # the IR's stochastic Casts, as TensorFlow ops
        converted = emit_graphdef(ir_model)
    report.summary["outputs"] = fetches
    report.warnings = _warnings(options, report, ir_model.handle.unknown_ops)
    record_bf16_host_check(report, lists.profile)
    if options.check:
        check_graphdef(converted)
    return converted, report, (ir_model, names)


def rewrite_function_ir(fdef: function_pb2.FunctionDef,
                        library: function_pb2.FunctionDefLibrary, options: TfOptions,
                        pipeline: str = "tf",
                        plan_training: Callable[[Model], TrainingContext] | None = None
                        ) -> tuple[Model, Report]:
    """One function body through a pipeline: its IR after the passes (for `emit_function`)
    and the report. `plan_training` is a training front end, as for `rewrite_graphdef_ir`;
    the function's arguments and return values keep their dtypes."""
    options, lists = _resolved(dataclasses.replace(options, keep_io_types=True))
    with cyclic_gc_paused():
        ir_model = load_function(fdef, library)
        training = plan_training(ir_model) if plan_training is not None else None
        report = _run(ir_model, lists, options, fdef.signature.name, pipeline,
                      training=training)
        lower_rounding_casts(ir_model)  # the IR's stochastic Casts, as TensorFlow ops
    report.warnings = _warnings(options, report, ir_model.handle.unknown_ops)
    record_bf16_host_check(report, lists.profile)
    return ir_model, report


def meta_graph_fetches(meta: meta_graph_pb2.MetaGraphDef) -> list[str]:
    """What a MetaGraph's users fetch: signature outputs and the nodes its collections name
    (train_op, saver ops, ...), so all of them are preserved."""
    names = {nd.name for nd in meta.graph_def.node}
    fetches: list[str] = []
    for signature in meta.signature_def.values():
        for info in signature.outputs.values():
            if info.name.partition(":")[0] in names and info.name not in fetches:
                fetches.append(info.name)
    for collection in meta.collection_def.values():
        for entry in collection.node_list.value:
            node = entry.lstrip("^").partition(":")[0]
            if node in names and node not in fetches:
                fetches.append(node)
    return fetches


def convert_meta_graph_file(input_path: Path, output_path: Path, options: TfOptions) -> Report:
    """Convert the graph of a .meta file; signatures, collections and saver stay as they are."""
    meta = read_meta_graph(input_path)
    if not options.outputs:
        options = dataclasses.replace(options, outputs=meta_graph_fetches(meta) or None)
    converted, report = rewrite_graphdef(meta.graph_def, options)
    out = meta_graph_pb2.MetaGraphDef()
    out.CopyFrom(meta)
    out.graph_def.CopyFrom(converted)
    write_graphdef(out, output_path)
    return report


def check_graphdef(graph_def: graph_pb2.GraphDef) -> None:
    """Import into a fresh tf.Graph (checks every op, input dtype and attr); AmpError if not."""
    imported_graph(graph_def, "the converted graph")


def convertible_function(fdef: function_pb2.FunctionDef) -> bool:
    """Whether convert rewrites this function of a SavedModel: those that save or restore
    checkpoints are copied as they are (they keep the variables' stored dtype)."""
    return not any(nd.op in _CHECKPOINT_OPS for nd in fdef.node_def)


def convert_saved_model(input_dir: str | os.PathLike, output_dir: str | os.PathLike,
                        target: str = DEFAULT_TARGET, backend: str | None = None, **options: Any
                        ) -> Report:
    """Convert every function of a SavedModel; variables and assets are copied unchanged.

    Function signatures never change, so `keep_io_types` is always in force inside functions and
    every signature serves the same input and output dtypes. `check` loads the result with
    tf.saved_model.load. The output directory appears whole or not at all (an existing
    SavedModel there is replaced only on success). `**options` are the other fields of
    `amp_rewriter.TfOptions`.
    """
    from . import FORMAT

    input_dir = Path(input_dir)
    if not is_saved_model_dir(input_dir):
        raise AmpError(f"{input_dir}: not a SavedModel directory (no saved_model.pb)")
    return FORMAT.convert_to(input_dir, output_dir,
                             FORMAT.options(target=target, backend=backend, **options))[1]


def refuse_outputs_for_saved_models(options: TfOptions) -> None:
    """`--outputs` names a GraphDef's fetches; a SavedModel's signatures name its outputs."""
    if options.outputs:
        raise AmpError("--outputs is for GraphDefs: a SavedModel's signatures name its outputs")


def convert_saved_model_proto(input_dir: Path, options: TfOptions,
                              pins: Mapping[str, Pin] | None = None
                              ) -> tuple[saved_model_pb2.SavedModel, Report,
                                         Callable[[Path], None] | None]:
    """The converted saved_model.pb of a SavedModel directory (nothing written), its report,
    and what writes the variables checkpoint with low-precision weights into a copy of the
    directory (None: the checkpoint is copied as it is). `pins` maps node names to why a front
    end keeps them fp32 (`--auto`'s measurements); they apply in every function."""
    refuse_outputs_for_saved_models(options)
    asked_keep_io_types = options.keep_io_types
    options, lists = _resolved(dataclasses.replace(options, keep_io_types=True))
    saved = read_saved_model(input_dir)
    # Before the functions change: what reads a variable the target cannot hold stays fp32.
    ranges = _variable_ranges(saved, input_dir, options)
    stored_reads = ranges.reads if ranges is not None else {}
    reports: list[Report] = []
    served: list[bool] = []
    unknown_ops: set[str] = set()
    with cyclic_gc_paused():
        for meta_graph in saved.meta_graphs:
            library = meta_graph.graph_def.library
            original = type(library)()
            original.CopyFrom(library)  # every function loads against the unmodified library
            signature_functions = served_functions(meta_graph)
            for index, fdef in enumerate(original.function):
                if not convertible_function(fdef):
                    continue
                ir_model = load_function(fdef, original)
                reports.append(_run(ir_model, lists, options, fdef.signature.name, pins=pins,
                                    stored=stored_reads.get(fdef.signature.name)))
                served.append(fdef.signature.name in signature_functions
                              or not meta_graph.signature_def)
                library.function[index].CopyFrom(emit_function(ir_model))
                unknown_ops |= ir_model.handle.unknown_ops
            main = _convert_main_graph(meta_graph, lists, options, pins)
            reports.extend(main)
            served.extend(True for _ in main)
    report = merge_reports(reports, options, served)
    report.warnings = _warnings(options, report, unknown_ops)
    record_bf16_host_check(report, lists.profile)
    write_variables = None
    if not options.keep_fp32_weights:
        write_variables = _lower_weights(saved, options, report, ranges)
    if not asked_keep_io_types:
        report.summary["note"] = ("--no-keep-io-types has no effect on SavedModels: signatures "
                                  "keep their dtypes")
    return saved, report, write_variables


def convert_saved_model_dir(input_dir: Path, output_dir: Path, options: TfOptions,
                            pins: Mapping[str, Pin] | None = None) -> Report:
    """Convert a SavedModel directory and write it at `output_dir`, a fresh path (the private
    path of an `OutputTransaction`), then load it back when `options.check`."""
    saved, report, write_variables = convert_saved_model_proto(input_dir, options, pins)
    write_saved_model(saved, input_dir, output_dir, write_variables)
    if options.check:
        check_saved_model(output_dir)
    return report


def _checkpointed_meta_graph(saved: saved_model_pb2.SavedModel, input_dir: Path
                             ) -> meta_graph_pb2.MetaGraphDef | None:
    """The one MetaGraph of a TF2 SavedModel with a variables checkpoint (None otherwise: a TF1
    SavedModel's variables live in its main graph only)."""
    if len(saved.meta_graphs) != 1 or not (input_dir / "variables" / "variables.index").is_file():
        return None
    meta_graph = saved.meta_graphs[0]
    return meta_graph if meta_graph.object_graph_def.nodes else None


def _checkpoint_functions(meta_graph: meta_graph_pb2.MetaGraphDef) -> frozenset[str]:
    return frozenset(f.signature.name for f in meta_graph.graph_def.library.function
                     if not convertible_function(f))


def _variable_ranges(saved: saved_model_pb2.SavedModel, input_dir: Path, options: TfOptions
                     ) -> VariableRanges | None:
    """The captured variables' range checks in the target dtype (`check_variable_ranges`);
    None without a TF2 checkpoint."""
    meta_graph = _checkpointed_meta_graph(saved, input_dir)
    if meta_graph is None:
        return None
    return check_variable_ranges(meta_graph, input_dir / "variables" / "variables",
                                 TARGET_DTYPES[options.target],
                                 _checkpoint_functions(meta_graph))


def _lower_weights(saved: saved_model_pb2.SavedModel, options: TfOptions, report: Report,
                   ranges: VariableRanges | None
                   ) -> Callable[[Path], None] | None:
    """Plan and apply low-precision storage of the weights only read in low precision (TF2
    SavedModels with one MetaGraph and a checkpoint); returns what writes the new checkpoint."""
    if ranges is None:
        return None  # no TF2 checkpoint (see _variable_ranges)
    meta_graph = saved.meta_graphs[0]
    plan = plan_low_precision_weights(meta_graph, ranges, TARGET_DTYPES[options.target])
    if plan.out_of_range:
        target = options.target
        report.warnings.append(
            f"{len(plan.out_of_range)} variable(s) hold values {target} cannot represent "
            f"(beyond its range, or all flushing to zero): {', '.join(plan.out_of_range[:5])}"
            f"{' ...' if len(plan.out_of_range) > 5 else ''}; they stay fp32 in the checkpoint")
    if not plan.variables:
        return None
    apply_low_precision_weights(meta_graph, plan, ranges.skip)
    for index, entry in enumerate(report.nodes):
        if (entry.get("graph", "main"), entry["name"]) in plan.read_nodes:
            report.nodes.update(
                index, precision=short_name(plan.dtype), kind=decisions.TYPE_GROUP,
                reason=f"reads a variable stored in {short_name(plan.dtype)}: every read of it "
                       f"is cast to {short_name(plan.dtype)}, so the weight is stored that way "
                       f"and the cast dropped")

    def write_variables(staged: Path) -> None:
        write_checkpoint(ranges.checkpoint, staged / "variables" / "variables", plan)
        report.weights = plan.summary()
        report.summary["weights_stored_low"] = len(plan.variables)
        report.summary["casts_inserted"] -= plan.casts_removed
    return write_variables


def _convert_main_graph(meta_graph, lists: OpLists, options: TfOptions,
                        pins: Mapping[str, Pin] | None = None) -> list[Report]:
    """A MetaGraph's own graph (where TF1 SavedModels keep their compute), with the signatures'
    output tensors as preserved fetches. TF2 graphs hold only variables and calls: skipped."""
    graph_def = meta_graph.graph_def
    if not any(lists.class_of(nd.op)[0] == ALLOW for nd in graph_def.node):
        return []
    names = {nd.name: nd for nd in graph_def.node}
    fetches = []
    for signature in meta_graph.signature_def.values():
        for info in signature.outputs.values():
            node, _, port = info.name.partition(":")
            if node in names and info.name not in fetches:
                fetches.append(info.name if port else node)
    ir_model = load_graphdef(graph_def, fetches, keep_fetch_nodes=True, label="main graph")
    report = _run(ir_model, lists, options, "main graph", pins=pins)
    converted = emit_graphdef(ir_model)
    graph_def.ClearField("node")
    graph_def.node.extend(converted.node)
    return [report]


def check_saved_model(path: Path) -> None:
    """Load the SavedModel with tf.saved_model.load; AmpError if it does not load."""
    try:
        tf.saved_model.load(str(path))
    except Exception as exc:
        raise AmpError(f"the converted SavedModel does not load: {first_line(exc)}") from None


#: Summary counts that describe the model (what runs in which precision): for a SavedModel they
#: count the functions its signatures run. The other counts (casts, constants) describe edits,
#: made in every function.
_MODEL_COUNTS = ("nodes", "low_precision_nodes", "compute_ops", "low_precision_compute_ops",
                 "compute_ops_by_type")


def merge_reports(reports: list[Report], options: TfOptions,
                  served: list[bool] | None = None) -> Report:
    """One report for many function bodies: nodes concatenated, counts added. `served[i]` says
    whether report i's graph is one the signatures run; the model counts (nodes, compute ops)
    add only those, so gradient and other helper functions do not dilute them."""
    summary: dict = {}
    nodes: list[dict] = []
    constants: list[dict] = []
    passes: dict[str, dict] = {}
    for index, report in enumerate(reports):
        counted = served is None or served[index]
        for key, value in report.summary.items():
            if key in _MODEL_COUNTS and not counted:
                continue
            if isinstance(value, dict):
                merged_counts = summary.setdefault(key, {})
                for op, (low, total) in value.items():
                    previous = merged_counts.get(op, [0, 0])
                    merged_counts[op] = [previous[0] + low, previous[1] + total]
            else:
                summary[key] = summary.get(key, 0) + value
        nodes.extend(report.nodes)
        constants.extend(report.constants)
        for entry in report.passes:
            merged = passes.setdefault(entry["name"], {"name": entry["name"], "changed": 0,
                                                       "notes": []})
            merged["changed"] += entry["changed"]
    for key in _MODEL_COUNTS:
        summary.setdefault(key, {} if key == "compute_ops_by_type" else 0)
    summary["compute_ops_by_type"] = dict(sorted(summary["compute_ops_by_type"].items()))
    summary["graphs_converted"] = len(reports)  # function bodies and main graphs
    if served is not None:
        summary["graphs_not_served"] = served.count(False)
    cells = None
    if options.precision_map:
        cells = PrecisionMap()
        for report in reports:
            if report.precision_map is not None:
                cells.extend(report.precision_map)
    return Report(options.target, options.backend or "", summary, NodeEntries(nodes), constants,
                  list(passes.values()), precision_map=cells)


def served_functions(meta_graph: meta_graph_pb2.MetaGraphDef) -> set[str]:
    """The functions a MetaGraph's signatures run: those its signature outputs' nodes call,
    directly or through other functions (call ops, func attributes such as While's body).
    Gradient functions, and functions only a checkpoint or a Python attribute reaches, are not
    among them."""
    library = {f.signature.name: f for f in meta_graph.graph_def.library.function}
    nodes = {nd.name: nd for nd in meta_graph.graph_def.node}
    pending = [info.name.lstrip("^").split(":")[0] for signature in
               meta_graph.signature_def.values() for info in signature.outputs.values()]
    seen_nodes: set[str] = set()
    calls: list[str] = []
    while pending:
        name = pending.pop()
        if name in seen_nodes or name not in nodes:
            continue
        seen_nodes.add(name)
        nd = nodes[name]
        calls.extend(_called(nd, library))
        pending.extend(ref.lstrip("^").split(":")[0] for ref in nd.input)
    served: set[str] = set()
    while calls:
        name = calls.pop()
        if name in served or name not in library:
            continue
        served.add(name)
        for nd in library[name].node_def:
            calls.extend(_called(nd, library))
    return served


def _called(nd, library: dict) -> list[str]:
    """The functions a node calls: its op when that is a library function, and its func attrs."""
    called = [nd.op] if nd.op in library else []
    for value in nd.attr.values():
        if value.HasField("func"):
            called.append(value.func.name)
        called.extend(f.name for f in value.list.func)
    return called


def convert_tf_file(input_path: str | os.PathLike, output_path: str | os.PathLike,
                    outputs: Iterable[str] | None = None, target: str = DEFAULT_TARGET,
                    backend: str | None = None, **options: Any) -> Report:
    """Convert a GraphDef file (.pb/.pbtxt/.meta) or a SavedModel directory; the input is
    untouched and the output appears whole or not at all. `**options` are the other fields of
    `amp_rewriter.TfOptions`."""
    from . import FORMAT

    return FORMAT.convert_to(Path(input_path), output_path, FORMAT.options(
        target=target, backend=backend, outputs=list(outputs) if outputs else None,
        **options))[1]


def output_kind(input_path: Path) -> str:
    """A SavedModel converts to a directory, a graph file to a file."""
    return "dir" if is_saved_model_dir(input_path) else "file"


def convert_file(input_path: Path, output_path: Path, options: TfOptions) -> Report:
    """`convert_tf_file` writing at `output_path`, a fresh path (the private path of an
    `OutputTransaction`)."""
    if is_saved_model_dir(input_path):
        return convert_saved_model_dir(input_path, output_path, options)
    if input_path.suffix == ".meta":
        return convert_meta_graph_file(input_path, output_path, options)
    converted, report = rewrite_graphdef(read_graphdef(input_path), options)
    write_graphdef(converted, output_path)
    return report
