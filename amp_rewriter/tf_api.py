"""TensorFlow front end: frozen GraphDefs and SavedModels through the same IR, op lists and passes.

    graph_def, report = convert_graphdef(graph_def, outputs=["y"], target="bf16", backend="tf-cpu")
    report = convert_saved_model("model_dir", "model_bf16_dir", target="bf16", backend="tf-cpu")
    report = convert_tf_file("model.pb", "model_bf16.pb", outputs=["y"], target="bf16")

Backends: `tf-cpu` (oneDNN; Grappler's bfloat16 lists; kernels asked from TF's kernel registry)
and `tf-gpu` (CUDA; Grappler's fp16 lists; kernels from a table in op_lists/tf.toml). Grappler's
TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_* list variables are honoured as overrides.

A SavedModel's functions are rewritten one by one (as Grappler optimizes each function as its own
item) with their signatures unchanged, so every caller (signatures, StatefulPartitionedCall and
PartitionedCall nodes, other functions) still matches; variables, assets and the object graph are
copied unchanged, so variables stay fp32 and reads of weights get a cast.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .api import build_overrides
from .errors import AmpError
from .fileio import write_atomically
from .ir import Model
from .op_lists import OpLists, Overrides
from .passes.base import TARGET_DTYPES, ConversionOptions, PassContext
from .pipeline import TF_PIPELINE, run_pipeline
from .report import Report, build_report
from .validate import OutputComparison, compare_outputs

import tensorflow as tf  # noqa: E402
from google.protobuf import message, text_format  # noqa: E402
from tensorflow.core.framework import graph_pb2  # noqa: E402
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2  # noqa: E402
from tensorflow.python.framework import kernels  # noqa: E402

from .emitters.tf import emit_function, emit_graphdef  # noqa: E402
from .loaders.tf import (default_fetches, dtype_enum, load_function, load_graphdef,  # noqa: E402
                         read_graphdef)

BACKENDS = ("tf-cpu", "tf-gpu")
ENV_PREFIX = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_"
#: Grappler's list names in its environment variables (and their pre-2.4 names).
ENV_LISTS = {"ALLOWLIST": "allow", "INFERLIST": "infer", "DENYLIST": "deny", "CLEARLIST": "clear",
             "WHITELIST": "allow", "GRAYLIST": "infer", "BLACKLIST": "deny"}
#: Functions that save or restore checkpoints are copied as they are.
_CHECKPOINT_OPS = frozenset({"SaveV2", "RestoreV2", "MergeV2Checkpoints", "Save", "Restore",
                             "RestoreSlice", "SaveSlices"})


def default_backend(target: str) -> str:
    """Grappler's pairing: fp16 for CUDA GPUs, bf16 for CPUs with oneDNN."""
    return "tf-cpu" if target == "bf16" else "tf-gpu"


# -- op lists ------------------------------------------------------------------------------

def kernel_checker(device: str, dtype: str) -> Callable[[str, str | None], bool]:
    """(op, type group) -> whether TF registers a `device` kernel with that group in `dtype`.

    Like Grappler's NodeHasF16KernelForTypeAttr: a kernel qualifies when its constraint on the
    group's attr allows `dtype` (or it has no constraint on it). With no group, any kernel of the
    op that allows `dtype` somewhere (or has no type constraint) qualifies.
    """
    enum = dtype_enum(dtype)
    cache: dict[tuple[str, str | None], bool] = {}

    def check(op: str, group: str | None) -> bool:
        attr = group.partition("[")[0] if group else None
        key = (op, attr)
        if key not in cache:
            ok = False
            for kernel in kernels.get_registered_kernels_for_op(op).kernel:
                if kernel.device_type not in (device, "DEFAULT"):
                    continue
                allowed = {c.name: set(c.allowed_values.list.type) for c in kernel.constraint}
                if attr is None:
                    ok = not allowed or any(enum in types for types in allowed.values())
                else:
                    ok = attr not in allowed or enum in allowed[attr]
                if ok:
                    break
            cache[key] = ok
        return cache[key]

    return check


def apply_grappler_env(lists: OpLists, environ: dict[str, str] | None = None) -> list[str]:
    """Apply Grappler's list variables (per list: _ADD, then _REMOVE); returns what changed."""
    environ = os.environ if environ is None else environ
    notes = []
    for key, op_class in ENV_LISTS.items():
        for suffix in ("ADD", "REMOVE"):
            var = f"{ENV_PREFIX}{key}_{suffix}"
            for op in (o.strip() for o in environ.get(var, "").split(",")):
                if not op:
                    continue
                if suffix == "ADD":
                    lists.classes[op] = op_class
                    lists.reasons[op] = f"{op_class}: added by {var}"
                elif lists.classes.get(op) == op_class:
                    lists.classes[op] = "fp32"
                    lists.reasons[op] = (f"removed from the {op_class} list by {var}: unlisted "
                                         f"ops stay fp32")
                else:
                    continue
                notes.append(f"{var}: {op}")
    if environ.get(f"{ENV_PREFIX}LEVEL", "").upper() == "TREAT_INFER_AS_DENY":
        for op, op_class in list(lists.classes.items()):
            if op_class == "infer":
                lists.classes[op] = "deny"
                lists.reasons[op] = f"deny: infer ops are deny with {ENV_PREFIX}LEVEL=TREAT_INFER_AS_DENY"
        notes.append(f"{ENV_PREFIX}LEVEL=TREAT_INFER_AS_DENY")
    return notes


def load_tf_lists(target: str, backend: str, overrides: Overrides | None = None) -> OpLists:
    """The op lists for TF: generic + backend profile, Grappler's env variables, then the user's."""
    lists = OpLists.load("tf", target, backend)
    apply_grappler_env(lists)
    if overrides is not None:
        lists.apply_overrides(overrides)
    if backend == "tf-cpu":
        lists.kernel_check = kernel_checker("CPU", TARGET_DTYPES[target])
    return lists


# -- one graph -------------------------------------------------------------------------------

def _run(ir_model: Model, lists: OpLists, options: ConversionOptions, graph_name: str
         ) -> Report:
    original = [(node, graph_name) for node in ir_model.graph.nodes]
    ctx = PassContext(ir_model, lists, options)
    results = run_pipeline(ctx, TF_PIPELINE)
    return build_report(ctx, original, results)


def _setup(target: str, backend: str | None, keep_io_types: bool, clamp: bool, allow, infer,
           deny, clear, keep_nodes, config) -> tuple[OpLists, ConversionOptions, Overrides]:
    backend = backend or default_backend(target)
    overrides = build_overrides(allow, infer, deny, clear, keep_nodes, config)
    lists = load_tf_lists(target, backend, overrides)
    options = ConversionOptions(target=target, backend=backend, keep_io_types=keep_io_types,
                                clamp=clamp, keep_nodes=overrides.keep_node_patterns())
    return lists, options, overrides


def _warnings(overrides: Overrides, options: ConversionOptions, report: Report,
              unknown_ops: set[str]) -> list[str]:
    """Overrides that cannot have done anything (likely typos), and ops TF does not know."""
    from tensorflow.python.framework import op_def_registry

    warnings = []
    for op in overrides.moves:
        if op_def_registry.get(op) is None:
            warnings.append(f"{overrides.source[op]} {op}: no such TensorFlow op")
    names = [entry["name"] for entry in report.nodes]
    for pattern in options.keep_nodes:
        if not any(pattern.fullmatch(name) for name in names):
            warnings.append(f"--keep-node {pattern.pattern!r} matches no node")
    if unknown_ops:
        warnings.append(f"ops with no OpDef (custom ops) left as they are, fp32 barriers: "
                        f"{', '.join(sorted(unknown_ops))}")
    return warnings


def convert_graphdef(graph_def: graph_pb2.GraphDef, outputs: Iterable[str] | None = None,
                     target: str = "bf16", backend: str | None = None, *,
                     keep_io_types: bool = True, clamp: bool = False, allow: Iterable[str] = (),
                     infer: Iterable[str] = (), deny: Iterable[str] = (),
                     clear: Iterable[str] = (), keep_nodes: Iterable[str] = (),
                     config: str | os.PathLike | None = None, check: bool = True,
                     pins: dict[str, str] | None = None
                     ) -> tuple[graph_pb2.GraphDef, Report]:
    """Convert an fp32 GraphDef (left unmodified) to mixed precision.

    `outputs` are the fetch tensors ("y" or "y:1"); by default the nodes nothing reads. With
    `keep_io_types` their nodes are preserved, as Grappler preserves fetch nodes, so the outputs
    keep their names and dtypes. `check` imports the result into a tf.Graph. `pins` maps node
    names to the reason they stay fp32 (the training rewrite pins its optimizer path).
    """
    lists, options, overrides = _setup(target, backend, keep_io_types, clamp, allow, infer, deny,
                                       clear, keep_nodes, config)
    copy = graph_pb2.GraphDef()
    copy.CopyFrom(graph_def)
    fetches = list(outputs) if outputs else default_fetches(copy)
    if not fetches:
        raise AmpError("no output found: name the fetch nodes with --outputs")
    ir_model = load_graphdef(copy, fetches, keep_fetch_nodes=keep_io_types, pins=pins)
    report = _run(ir_model, lists, options, "main")
    converted = emit_graphdef(ir_model)
    report.summary["outputs"] = fetches
    report.warnings = _warnings(overrides, options, report, ir_model.handle.unknown_ops)
    if check:
        check_graphdef(converted)
    return converted, report


# -- MetaGraphDefs (.meta) ------------------------------------------------------------------------

def read_meta_graph(path: str | os.PathLike) -> meta_graph_pb2.MetaGraphDef:
    """Parse a binary MetaGraphDef (.meta); bad files raise AmpError."""
    path = Path(path)
    if not path.is_file():
        raise AmpError(f"{path}: no such file")
    meta = meta_graph_pb2.MetaGraphDef()
    try:
        meta.ParseFromString(path.read_bytes())
    except (message.DecodeError, RuntimeError):
        raise AmpError(f"{path}: not a MetaGraphDef (the protobuf does not parse; truncated or "
                       f"another format?)") from None
    if not meta.graph_def.node:
        raise AmpError(f"{path}: not a MetaGraphDef (no graph)")
    return meta


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


def convert_meta_graph_file(input_path: str | os.PathLike, output_path: str | os.PathLike,
                            outputs: Iterable[str] | None = None, **options) -> Report:
    """Convert the graph of a .meta file; signatures, collections and saver stay as they are."""
    meta = read_meta_graph(input_path)
    fetches = list(outputs) if outputs else meta_graph_fetches(meta)
    converted, report = convert_graphdef(meta.graph_def, fetches or None, **options)
    out = meta_graph_pb2.MetaGraphDef()
    out.CopyFrom(meta)
    out.graph_def.CopyFrom(converted)
    write_graphdef(out, output_path)
    return report


def check_graphdef(graph_def: graph_pb2.GraphDef) -> None:
    """Import into a fresh tf.Graph (checks every op, input dtype and attr); AmpError if not."""
    try:
        with tf.Graph().as_default():
            tf.compat.v1.import_graph_def(graph_def, name="")
    except Exception as exc:  # TF raises ValueError / InvalidArgumentError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AmpError(f"the converted graph does not import into TensorFlow: {first}") from None


# -- SavedModels -----------------------------------------------------------------------------

def read_saved_model(path: str | os.PathLike) -> saved_model_pb2.SavedModel:
    path = Path(path)
    binary, text = path / "saved_model.pb", path / "saved_model.pbtxt"
    saved = saved_model_pb2.SavedModel()
    try:
        if binary.is_file():
            saved.ParseFromString(binary.read_bytes())
        elif text.is_file():
            text_format.Parse(text.read_text(), saved)
        else:
            raise AmpError(f"{path}: not a SavedModel directory (no saved_model.pb)")
    except (message.DecodeError, text_format.ParseError, UnicodeDecodeError, RuntimeError):
        raise AmpError(f"{path}: saved_model.pb does not parse (truncated or another "
                       f"format?)") from None
    if not saved.meta_graphs:
        raise AmpError(f"{path}: the SavedModel has no MetaGraph")
    has_variables = any(meta.saver_def.filename_tensor_name
                        or any(node.HasField("variable") for node in meta.object_graph_def.nodes)
                        for meta in saved.meta_graphs)
    if has_variables and not (path / "variables" / "variables.index").is_file():
        raise AmpError(f"{path}: the SavedModel has variables but variables/variables.index is "
                       f"missing")
    return saved


def _convertible(fdef) -> bool:
    return not any(nd.op in _CHECKPOINT_OPS for nd in fdef.node_def)


def convert_saved_model(input_dir: str | os.PathLike, output_dir: str | os.PathLike,
                        target: str = "bf16", backend: str | None = None, *,
                        keep_io_types: bool = True, clamp: bool = False,
                        allow: Iterable[str] = (), infer: Iterable[str] = (),
                        deny: Iterable[str] = (), clear: Iterable[str] = (),
                        keep_nodes: Iterable[str] = (), config: str | os.PathLike | None = None,
                        check: bool = True) -> Report:
    """Convert every function of a SavedModel; variables and assets are copied unchanged.

    Function signatures never change, so `keep_io_types` is always in force inside functions and
    every signature serves the same input and output dtypes. `check` loads the result with
    tf.saved_model.load.
    """
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    lists, options, overrides = _setup(target, backend, True, clamp, allow, infer, deny, clear,
                                       keep_nodes, config)
    saved = read_saved_model(input_dir)
    reports: list[Report] = []
    unknown_ops: set[str] = set()
    for meta_graph in saved.meta_graphs:
        library = meta_graph.graph_def.library
        original = type(library)()
        original.CopyFrom(library)  # every function loads against the unmodified library
        for index, fdef in enumerate(original.function):
            if not _convertible(fdef):
                continue
            ir_model = load_function(fdef, original)
            reports.append(_run(ir_model, lists, options, fdef.signature.name))
            library.function[index].CopyFrom(emit_function(ir_model))
            unknown_ops |= ir_model.handle.unknown_ops
        reports.extend(_convert_main_graph(meta_graph, lists, options))
    report = merge_reports(reports, options)
    report.warnings = _warnings(overrides, options, report, unknown_ops)
    existed = output_dir.exists()
    write_saved_model(saved, input_dir, output_dir)
    if check:
        try:
            check_saved_model(output_dir)
        except AmpError:
            if not existed:  # leave nothing half-made behind
                shutil.rmtree(output_dir, ignore_errors=True)
            raise
    if not keep_io_types:
        report.summary["note"] = ("--no-keep-io-types has no effect on SavedModels: signatures "
                                  "keep their dtypes")
    return report


def _convert_main_graph(meta_graph, lists: OpLists, options: ConversionOptions) -> list[Report]:
    """A MetaGraph's own graph (where TF1 SavedModels keep their compute), with the signatures'
    output tensors as preserved fetches. TF2 graphs hold only variables and calls: skipped."""
    graph_def = meta_graph.graph_def
    if not any(lists.class_of(nd.op)[0] == "allow" for nd in graph_def.node):
        return []
    names = {nd.name: nd for nd in graph_def.node}
    fetches = []
    for signature in meta_graph.signature_def.values():
        for info in signature.outputs.values():
            node, _, port = info.name.partition(":")
            if node in names and info.name not in fetches:
                fetches.append(info.name if port else node)
    ir_model = load_graphdef(graph_def, fetches, keep_fetch_nodes=True, label="main graph")
    report = _run(ir_model, lists, options, "main graph")
    converted = emit_graphdef(ir_model)
    graph_def.ClearField("node")
    graph_def.node.extend(converted.node)
    return [report]


def write_saved_model(saved: saved_model_pb2.SavedModel, input_dir: Path, output_dir: Path
                      ) -> None:
    """Copy the SavedModel directory with the new saved_model.pb, then swap it into place."""
    if output_dir.resolve() == input_dir.resolve():
        raise AmpError("the output directory is the input SavedModel: refusing to overwrite it")
    if output_dir.exists() and (not output_dir.is_dir() or (
            any(output_dir.iterdir()) and not (output_dir / "saved_model.pb").exists())):
        raise AmpError(f"{output_dir}: exists and is not a SavedModel directory; refusing to "
                       f"replace it")
    parent = output_dir.resolve().parent
    if not parent.is_dir():
        raise AmpError(f"{output_dir}: output folder {parent} does not exist")
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=".amp-rewriter-"))
    try:
        staged = tmp / "model"
        shutil.copytree(input_dir, staged)
        (staged / "saved_model.pbtxt").unlink(missing_ok=True)
        (staged / "saved_model.pb").write_bytes(saved.SerializeToString(deterministic=True))
        fingerprint = staged / "fingerprint.pb"
        if fingerprint.exists():
            fingerprint.unlink()
            _write_fingerprint(staged)
        if output_dir.exists():
            shutil.rmtree(output_dir)
        os.replace(staged, output_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_fingerprint(export_dir: Path) -> None:
    """A fresh fingerprint.pb for the new saved_model.pb (skipped if TF cannot make one)."""
    try:
        from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting
        data = fingerprinting.CreateFingerprintDef(str(export_dir))
    except Exception:  # fingerprints are optional metadata
        return
    (export_dir / "fingerprint.pb").write_bytes(data)


def check_saved_model(path: Path) -> None:
    try:
        tf.saved_model.load(str(path))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AmpError(f"the converted SavedModel does not load: {first}") from None


def merge_reports(reports: list[Report], options: ConversionOptions) -> Report:
    """One report for many function bodies: nodes concatenated, counts added."""
    summary: dict = {}
    nodes, constants, passes = [], [], {}
    for report in reports:
        for key, value in report.summary.items():
            summary[key] = summary.get(key, 0) + value
        nodes.extend(report.nodes)
        constants.extend(report.constants)
        for entry in report.passes:
            merged = passes.setdefault(entry["name"], {"name": entry["name"], "changed": 0,
                                                       "notes": []})
            merged["changed"] += entry["changed"]
    summary["graphs_converted"] = len(reports)  # function bodies and main graphs
    return Report(options.target, options.backend, summary, nodes, constants, list(passes.values()))


# -- files -------------------------------------------------------------------------------------

def is_saved_model_dir(path: str | os.PathLike) -> bool:
    path = Path(path)
    return path.is_dir() and ((path / "saved_model.pb").is_file()
                              or (path / "saved_model.pbtxt").is_file())


def write_graphdef(graph_def: graph_pb2.GraphDef | meta_graph_pb2.MetaGraphDef,
                   path: str | os.PathLike) -> None:
    """Write a GraphDef (or MetaGraphDef) atomically; text format for .pbtxt, binary otherwise."""
    path = Path(path)
    if path.suffix in (".pbtxt", ".txt"):
        data = text_format.MessageToString(graph_def).encode()
    else:
        data = graph_def.SerializeToString(deterministic=True)
    write_atomically(path, data)


def convert_tf_file(input_path: str | os.PathLike, output_path: str | os.PathLike,
                    outputs: Iterable[str] | None = None, **options) -> Report:
    """Convert a GraphDef file (.pb/.pbtxt) or a SavedModel directory; the input is untouched."""
    input_path, output_path = Path(input_path), Path(output_path)
    if output_path.exists() and input_path.exists() and os.path.samefile(input_path, output_path):
        raise AmpError("the output path is the input: refusing to overwrite the input")
    if is_saved_model_dir(input_path):
        if outputs:
            raise AmpError("--outputs is for GraphDefs: a SavedModel's signatures name its "
                           "outputs")
        return convert_saved_model(input_path, output_path, **options)
    if input_path.suffix == ".meta":
        return convert_meta_graph_file(input_path, output_path, outputs, **options)
    graph_def = read_graphdef(input_path)
    converted, report = convert_graphdef(graph_def, outputs, **options)
    write_graphdef(converted, output_path)
    return report


# -- validation --------------------------------------------------------------------------------

SYMBOLIC_DIM_SIZE = 2


def _random_array(rng: np.random.Generator, dtype: tf.DType, shape: list[int | None], name: str
                  ) -> np.ndarray:
    shape = [SYMBOLIC_DIM_SIZE if d is None or d < 0 else d for d in shape]
    if dtype.is_floating:
        return rng.standard_normal(shape).astype(np.float32).astype(dtype.as_numpy_dtype)
    if dtype.is_integer:
        return rng.integers(0, 4, size=shape).astype(dtype.as_numpy_dtype)
    if dtype.is_bool:
        return rng.integers(0, 2, size=shape).astype(bool)
    raise AmpError(f"cannot make random data of dtype {dtype.name} for {name!r}: give --inputs")


def graphdef_feeds(graph_def: graph_pb2.GraphDef, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random data for every Placeholder (unknown dims get size 2)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for nd in graph_def.node:
        if nd.op not in ("Placeholder", "PlaceholderV2"):
            continue
        shape = nd.attr["shape"].shape
        if shape.unknown_rank:
            raise AmpError(f"placeholder {nd.name!r} has an unknown rank: give --inputs")
        feeds[nd.name] = _random_array(rng, tf.as_dtype(nd.attr["dtype"].type),
                                       [d.size for d in shape.dim], nd.name)
    return feeds


def run_graphdef(graph_def: graph_pb2.GraphDef, fetches: list[str],
                 feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run a GraphDef in a tf.compat.v1 Session on the CPU (variables are initialized by running
    their initializers, `<variable>/Assign`, first; a Saver's restore assigns are left alone)."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    names = [f if ":" in f else f"{f}:0" for f in fetches]
    feed = {f"{k}:0" if ":" not in k else k: v for k, v in feeds.items()}
    assigns = [nd.name for nd in graph_def.node
               if nd.op in ("Assign", "AssignVariableOp") and nd.name.endswith("/Assign")]
    config = tf.compat.v1.ConfigProto(device_count={"GPU": 0})
    try:
        with tf.compat.v1.Session(graph=graph, config=config) as session:
            if assigns:
                session.run(assigns)
            return session.run(names, feed_dict=feed)
    except Exception as exc:
        # TF's first line is often just "Graph execution error:"; the cause follows it.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = " ".join(lines[:2]) if lines else type(exc).__name__
        raise AmpError(f"TensorFlow failed to run a graph: {detail}") from None


def _as_float(array) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype.name in ("bfloat16", "float16"):
        return array.astype(np.float32)
    return array


def compare_graphdefs(reference: graph_pb2.GraphDef, candidate: graph_pb2.GraphDef,
                      fetches: list[str], feeds: dict[str, np.ndarray] | None = None
                      ) -> list[OutputComparison]:
    """Run both GraphDefs on the same feeds; per-output errors of `candidate`."""
    feeds = graphdef_feeds(reference) if feeds is None else feeds
    ref = run_graphdef(reference, fetches, feeds)
    new = run_graphdef(candidate, fetches, feeds)
    return [compare_outputs(name, _as_float(r), _as_float(n))
            for name, r, n in zip(fetches, ref, new)]


def signature_feeds(function, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random data for a concrete function's keyword inputs (unknown dims get size 2)."""
    rng = np.random.default_rng(seed)
    specs = function.structured_input_signature[1]
    return {name: _random_array(rng, spec.dtype, spec.shape.as_list()
                                if spec.shape.rank is not None else [], name)
            for name, spec in sorted(specs.items())}


def compare_saved_models(reference: str | os.PathLike, candidate: str | os.PathLike,
                         feeds: dict[str, np.ndarray] | None = None, seed: int = 0
                         ) -> list[OutputComparison]:
    """Serve every signature of both SavedModels on the same inputs; per-output errors.

    An output whose dtype differs from the reference's counts as failed (infinite error). String
    outputs are not compared: no precision decision touches them, and asset paths differ between
    the two directories by design.
    """
    ref_model = tf.saved_model.load(str(reference))
    new_model = tf.saved_model.load(str(candidate))
    results = []
    for name, ref_fn in sorted(ref_model.signatures.items()):
        new_fn = new_model.signatures[name]
        inputs = feeds if feeds is not None else signature_feeds(ref_fn, seed)
        ref_out = ref_fn(**{k: tf.constant(v) for k, v in inputs.items()})
        new_out = new_fn(**{k: tf.constant(v) for k, v in inputs.items()})
        for key in sorted(ref_out):
            label = f"{name}/{key}"
            if ref_out[key].dtype == tf.string and new_out[key].dtype == tf.string:
                continue
            if new_out[key].dtype != ref_out[key].dtype:
                results.append(OutputComparison(label, float("inf"), float("inf"), False))
                continue
            results.append(compare_outputs(label, _as_float(ref_out[key].numpy()),
                                           _as_float(new_out[key].numpy())))
    return results


def validation_dict(comparisons: list[OutputComparison], rtol: float) -> dict:
    failed = [c for c in comparisons if c.relative > rtol or c.nonfinite_new]
    return {"rtol": rtol, "passed": not failed, "outputs": [c.to_dict() for c in comparisons]}
