"""Robustness sweep: run amp_rewriter over the ONNX backend test corpus and classify each outcome.

The corpus is the one the onnx package ships for backend tests (`onnx/backend/test/data/`):

- `node/`: one model per test case of every operator (about 1900 at onnx 1.23), each with
  `test_data_set_0/input_*.pb` and `output_*.pb`. Some onnx wheels leave this folder out; then it is
  generated once from the test-case generators that do ship (`onnx.backend.test.case.node`, the code
  that produced the folder upstream) into a cache folder (`--cache-dir`, about 20 s);
- `simple/`, `pytorch-converted/`, `pytorch-operator/`: small multi-node models with test data;
- `light/`: real CNN architectures (ResNet-50, DenseNet-121, VGG-19, ...) whose weights are
  ConstantOfShape fills; they have no test inputs, so seeded random ones are used.

For every model and target the sweep converts in-process (`amp_rewriter.convert(..., check=False)`)
and classifies the result (first failing stage wins):

    ok                  converted, passes the full checker, runs, outputs within tolerance
    ok_unverified       converted and passes the checker, but the fp32 original itself cannot run
                        in onnxruntime's CPU provider (or has no test data): nothing to compare
    refused             AmpError: amp_rewriter declined the input (the message is recorded)
    crash               any other exception in convert: a bug (type, message, traceback tail)
    checker_fail        the converted model fails onnx.checker (full_check) and the original passes
    io_dtype_changed    a graph input/output changed its elem_type although keep_io_types is on
    ort_fail            the fp32 original runs in ORT CPU, the converted model does not load/run
    ort_missing_kernel  as ort_fail, but a hand-made low-precision copy of the failing op alone
                        fails the same way (NOT_IMPLEMENTED): an ORT CPU limitation, not ours
    emulation_fail      bf16 only: emulate_low_precision (amp_rewriter.formats.onnx.emulation)
                        raised, or its model does not load/run
    mismatch            outputs differ from fp32: max|a-b|/max|a| above the tolerance, NaN/Inf where
                        fp32 is finite, integer/bool outputs that differ, or a different structure
    nondeterministic    outputs differ, but so do two runs of the fp32 original (random ops)
    timeout, worker_died  the case ran past --timeout, or killed its worker (a segfault)

bf16 models run emulated (`emulate_low_precision`, every node), since ORT's CPU provider lacks bf16
kernels.

`--mode allow-all` additionally moves every op type of the model into the allow list (the
documented `allow=` override), which forces low precision wherever a schema allows it: a stress test
of type groups, casts and constants on every operator. Its mismatches are expected for
range-sensitive ops; its crashes, checker and ORT failures are bugs all the same.

    .venv/bin/python scripts/corpus_check.py                       # fp16, whole corpus
    .venv/bin/python scripts/corpus_check.py --target bf16 --json out/corpus_bf16.json
    .venv/bin/python scripts/corpus_check.py --filter 'loop|scan' --limit 20 -v
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import re
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

SUITES = ("node", "simple", "pytorch-converted", "pytorch-operator", "light")
#: Loose tolerance on max|converted - fp32| / max|fp32| per output: this sweep looks for wrong
#: casts and broken graphs, not for the last digit (the CLI's --validate default is 2e-2 / 1e-1).
DEFAULT_RTOL = {"fp16": 5e-2, "bf16": 2.5e-1}
#: Outcomes that point at a defect in amp_rewriter (mismatch only in the default mode: with
#: --mode allow-all the user forced range-sensitive ops into low precision).
BUG_OUTCOMES = {"crash", "checker_fail", "io_dtype_changed", "ort_fail", "emulation_fail",
                "timeout", "worker_died"}
OUTCOME_ORDER = ("ok", "ok_unverified", "refused", "crash", "checker_fail", "io_dtype_changed",
                 "ort_fail", "ort_missing_kernel", "emulation_fail", "mismatch",
                 "nondeterministic", "timeout", "worker_died")
LOW_DTYPE = {"fp16": 10, "bf16": 16}  # onnx.TensorProto.FLOAT16 / BFLOAT16
#: Ops --mode allow-all leaves alone: forcing them is meaningless, and what amp_rewriter does with
#: them is a finding of its own (see the report): `--allow Constant` paints a Constant's output
#: fp16 without converting its value; `--allow BitCast` repaints BitCast's bit-pattern input.
ALLOW_ALL_EXCLUDED = frozenset({"Constant", "BitCast"})


# ------------------------------------------------------------------------------------------------
# The corpus
# ------------------------------------------------------------------------------------------------
def onnx_data_dir() -> Path:
    """The backend test data folder of the installed onnx package."""
    import onnx
    return Path(onnx.__file__).resolve().parent / "backend" / "test" / "data"


def default_cache_dir() -> Path:
    """Where the generated node corpus is kept, per onnx version (XDG cache)."""
    import onnx
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "amp-rewriter" / f"onnx-{onnx.__version__}-backend-node"


def _write_value(path: Path, value: Any, type_proto: Any, name: str) -> None:
    """One input_/output_ .pb the way onnx's `backend-test-tools generate-data` writes it."""
    from onnx import TensorProto, numpy_helper

    if type_proto.HasField("map_type"):
        proto = numpy_helper.from_dict(value, name)
    elif type_proto.HasField("sequence_type"):
        proto = numpy_helper.from_list(value, name)
    elif type_proto.HasField("optional_type"):
        proto = numpy_helper.from_optional(value, name)
    elif isinstance(value, TensorProto):
        proto = value
    else:
        proto = numpy_helper.from_array(value, name)
    path.write_bytes(proto.SerializeToString())


def generate_node_corpus(target: Path, quiet: bool = False) -> Path:
    """Write onnx's node test cases (model.onnx + test_data_set_0) under `target`; returns it.

    Written into a temporary sibling folder and renamed, so an interrupted run leaves nothing
    half-written behind.
    """
    import warnings

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from onnx.backend.test.case import node as node_cases
        cases = node_cases.collect_testcases()
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".node-corpus-"))
    for case in cases:
        if case.model is None:  # a model-zoo case (a URL); the node cases all carry their model
            continue
        case_dir = tmp / case.name
        case_dir.mkdir()
        (case_dir / "model.onnx").write_bytes(case.model.SerializeToString())
        graph = case.model.graph
        for k, (inputs, outputs) in enumerate(case.data_sets or []):
            data_dir = case_dir / f"test_data_set_{k}"
            data_dir.mkdir()
            for j, value in enumerate(inputs):
                _write_value(data_dir / f"input_{j}.pb", value, graph.input[j].type,
                             graph.input[j].name)
            for j, value in enumerate(outputs):
                _write_value(data_dir / f"output_{j}.pb", value, graph.output[j].type,
                             graph.output[j].name)
    if target.exists():  # another process won the race
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, target)
    if not quiet:
        print(f"generated {len(cases)} node test cases in {time.perf_counter() - started:.1f} s "
              f"-> {target}", file=sys.stderr)
    return target


def node_corpus_dir(cache_dir: Path | None = None, generate: bool = True) -> Path | None:
    """The folder of node test cases: onnx's own if shipped, else the (generated) cache."""
    shipped = onnx_data_dir() / "node"
    if shipped.is_dir() and any(shipped.iterdir()):
        return shipped
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if (cache / "node").is_dir():
        return cache / "node"
    if not generate:
        return None
    return generate_node_corpus(cache / "node")


def list_cases(suites: tuple[str, ...] = SUITES, cache_dir: Path | None = None,
               name_filter: str | None = None) -> list[tuple[str, str, str]]:
    """(suite, name, model path) for every corpus model, sorted."""
    data = onnx_data_dir()
    pattern = re.compile(name_filter) if name_filter else None
    cases: list[tuple[str, str, str]] = []
    for suite in suites:
        if suite == "node":
            folder = node_corpus_dir(cache_dir)
        else:
            folder = data / suite
        if folder is None or not folder.is_dir():
            continue
        if suite == "light":
            entries = [(p.stem, p) for p in sorted(folder.glob("*.onnx"))]
        else:
            entries = [(d.name, d / "model.onnx") for d in sorted(folder.iterdir())
                       if (d / "model.onnx").is_file()]
        for name, path in entries:
            if pattern is None or pattern.search(f"{suite}/{name}"):
                cases.append((suite, name, str(path)))
    return cases


# ------------------------------------------------------------------------------------------------
# Test data and onnxruntime
# ------------------------------------------------------------------------------------------------
def _read_pb(path: Path, type_proto: Any) -> Any:
    import onnx
    from onnx import numpy_helper

    data = path.read_bytes()
    if type_proto is not None and type_proto.HasField("sequence_type"):
        proto = onnx.SequenceProto()
        proto.ParseFromString(data)
        return numpy_helper.to_list(proto)
    if type_proto is not None and type_proto.HasField("optional_type"):
        proto = onnx.OptionalProto()
        proto.ParseFromString(data)
        return numpy_helper.to_optional(proto)
    if type_proto is not None and type_proto.HasField("map_type"):
        proto = onnx.MapProto()
        proto.ParseFromString(data)
        return numpy_helper.to_dict(proto)
    proto = onnx.TensorProto()
    proto.ParseFromString(data)
    return numpy_helper.to_array(proto)


def runtime_inputs(model: Any) -> list[Any]:
    """Graph inputs that are not initializers (what a caller must feed), in order."""
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def load_feeds(model_path: str, model: Any) -> tuple[dict[str, Any] | None, str]:
    """Inputs for the model: its test_data_set_0, or seeded random ones (light models)."""
    case_dir = Path(model_path).parent
    data_dir = case_dir / "test_data_set_0"
    inputs = runtime_inputs(model)
    if data_dir.is_dir():
        files = sorted(data_dir.glob("input_*.pb"), key=lambda p: int(p.stem.split("_")[1]))
        feeds: dict[str, Any] = {}
        by_name = {i.name: i for i in inputs}
        for index, path in enumerate(files):
            info = inputs[index] if index < len(inputs) else None
            value = _read_pb(path, info.type if info is not None else None)
            if info is None:
                continue
            feeds[info.name] = value
        if set(feeds) != set(by_name):
            missing = sorted(set(by_name) - set(feeds))
            return None, f"test data lacks inputs {missing}"
        return feeds, "test_data_set_0"
    from amp_rewriter.formats.onnx.validate import random_inputs
    try:
        return random_inputs(model, seed=0), "random (seed 0)"
    except Exception as exc:  # noqa: BLE001 - e.g. an input dtype it cannot make
        return None, f"no test data and no random inputs: {exc}"


def ort_session(model: Any):
    """An onnxruntime CPU session on `model` with graph optimizations off."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def run_ort(model: Any, feeds: dict[str, Any]) -> tuple[list[Any] | None, str, str]:
    """(outputs, stage, error): stage is 'load' or 'run' when it failed.

    float32 feeds for an input the model declares float16 are cast (--no-keep-io-types).
    """
    import numpy as np

    try:
        session = ort_session(model)
    except Exception as exc:  # noqa: BLE001
        return None, "load", _first_line(exc)
    try:
        run_feeds = {}
        for info in session.get_inputs():
            if info.name not in feeds:
                continue
            value = feeds[info.name]
            if info.type == "tensor(float16)" and getattr(value, "dtype", None) == np.float32:
                value = value.astype(np.float16)
            run_feeds[info.name] = value
        names = [o.name for o in session.get_outputs()]
        return session.run(names, run_feeds), "", ""
    except Exception as exc:  # noqa: BLE001
        return None, "run", _first_line(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}"[:500]


def _flatten(value: Any) -> list[Any]:
    if value is None:
        return [None]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)] or ["<empty>"]
    if isinstance(value, dict):
        return [x for k in sorted(value) for x in _flatten(value[k])]
    return [value]


def compare_outputs(names: list[str], ref: list[Any], new: list[Any], rtol: float,
                    float_dtype_may_change: bool = False) -> tuple[bool, list[dict]]:
    """Per output: relative error (float) or mismatch count (other dtypes); ok if all within."""
    import numpy as np

    ok = True
    rows = []
    for name, r_value, n_value in zip(names, ref, new):
        r_items, n_items = _flatten(r_value), _flatten(n_value)
        row: dict[str, Any] = {"name": name}
        if len(r_items) != len(n_items):
            row.update(problem=f"structure differs: {len(r_items)} vs {len(n_items)} tensors")
            ok = False
            rows.append(row)
            continue
        worst, new_nonfinite, problems = 0.0, False, []
        for r, n in zip(r_items, n_items):
            if r is None or n is None or isinstance(r, str) or isinstance(n, str):
                if (r is None) != (n is None) or r != n:
                    problems.append("optional/empty presence differs")
                continue
            r, n = np.asarray(r), np.asarray(n)
            if r.shape != n.shape:
                problems.append(f"shape {r.shape} vs {n.shape}")
                continue
            floats = r.dtype.kind == "f" and n.dtype.kind == "f"
            if r.dtype != n.dtype and not (floats and float_dtype_may_change):
                problems.append(f"dtype {r.dtype} vs {n.dtype}")
            if np.issubdtype(r.dtype, np.floating) and np.issubdtype(n.dtype, np.floating):
                r64, n64 = r.astype(np.float64), n.astype(np.float64)
                finite = np.isfinite(r64)
                if np.any(finite & ~np.isfinite(n64)):
                    new_nonfinite = True
                # NaN where fp32 has NaN, +-Inf where fp32 has the same Inf are fine.
                same_nonfinite = (np.isnan(r64) & np.isnan(n64)) | (r64 == n64)
                if np.any(~finite & ~same_nonfinite):
                    problems.append("non-finite values differ")
                if finite.any():
                    diff = np.abs(r64[finite] - n64[finite])
                    both = np.isfinite(n64[finite])
                    diff = diff[both] if both.any() else np.zeros(1)
                    scale = float(np.abs(r64[finite]).max())
                    max_abs = float(diff.max()) if diff.size else 0.0
                    worst = max(worst, max_abs / scale if scale > 0 else max_abs)
            else:
                if r.dtype.kind == "O" or n.dtype.kind == "O":
                    differ = int(sum(1 for a, b in zip(r.ravel(), n.ravel()) if a != b))
                else:
                    differ = int(np.count_nonzero(r != n))
                if differ:
                    problems.append(f"{differ}/{r.size} non-float elements differ")
        row.update(relative_error=worst, new_nan_or_inf=new_nonfinite)
        if problems:
            row["problem"] = "; ".join(problems)
        if worst > rtol or new_nonfinite or problems:
            ok = False
        rows.append(row)
    return ok, rows


# ------------------------------------------------------------------------------------------------
# Hand-made low-precision op: is a failing load an ORT CPU gap or our dtype mix?
# ------------------------------------------------------------------------------------------------
_NOT_IMPLEMENTED = re.compile(
    r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'")
_RUN_FAILED = re.compile(r"while running (\w+) node\. Name:'([^']*)'")


def _find_node(graph: Any, op_type: str, name: str) -> Any | None:
    stack = [graph]
    while stack:
        g = stack.pop()
        for node in g.node:
            if node.op_type == op_type and node.name == name:
                return node
            for attr in node.attribute:
                if attr.HasField("g"):
                    stack.append(attr.g)
                stack.extend(attr.graphs)
    return None


def _lower_array(array: Any, target: str) -> Any:
    import numpy as np
    if array.dtype != np.float32:
        return array
    if target == "fp16":
        return array.astype(np.float16)
    import ml_dtypes
    return array.astype(ml_dtypes.bfloat16)


def handmade_low_precision_op(original: Any, op_type: str, name: str, target: str,
                              feeds: dict[str, Any] | None = None) -> tuple[bool | None, str]:
    """The failing op alone, every float32 tensor of it in the target dtype (no amp_rewriter
    involved): does ORT CPU load it, and, when its inputs are graph inputs or initializers of the
    original, run it on the same (lowered) data?

    Returns (works, detail); works is None when no such single-op model could be built.
    """
    import onnx
    from onnx import helper, numpy_helper

    node = _find_node(original.graph, op_type, name)
    if node is None or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                           for a in node.attribute):
        return None, "op not found in the original, or it has a subgraph"
    try:
        inferred = onnx.shape_inference.infer_shapes(original)
    except Exception as exc:  # noqa: BLE001
        return None, f"shape inference failed: {_first_line(exc)}"
    types: dict[str, Any] = {}
    inits: dict[str, Any] = {}
    stack = [inferred.graph]
    while stack:
        g = stack.pop()
        for info in list(g.input) + list(g.output) + list(g.value_info):
            types.setdefault(info.name, info.type)
        for init in g.initializer:
            inits.setdefault(init.name, init)
            types.setdefault(init.name, helper.make_tensor_type_proto(init.data_type, init.dims))
        for n in g.node:
            for attr in n.attribute:
                if n.op_type == "Constant" and attr.name == "value":
                    types.setdefault(n.output[0], helper.make_tensor_type_proto(
                        attr.t.data_type, attr.t.dims))
                if attr.HasField("g"):
                    stack.append(attr.g)
                stack.extend(attr.graphs)
    low = LOW_DTYPE[target]

    def lowered(value_name: str) -> Any:
        type_proto = onnx.TypeProto()
        type_proto.CopyFrom(types[value_name])
        pending = [type_proto]
        while pending:  # tensors inside sequences/optionals too
            t = pending.pop()
            if t.HasField("tensor_type"):
                if t.tensor_type.elem_type == onnx.TensorProto.FLOAT:
                    t.tensor_type.elem_type = low
                t.tensor_type.ClearField("shape")
            elif t.HasField("sequence_type"):
                pending.append(t.sequence_type.elem_type)
            elif t.HasField("optional_type"):
                pending.append(t.optional_type.elem_type)
        return type_proto

    missing = [n for n in list(node.input) + list(node.output) if n and n not in types]
    if missing:
        return None, f"no inferred type for {missing}"
    lone = onnx.NodeProto()
    lone.CopyFrom(node)
    for attr in lone.attribute:  # float attribute tensors (ConstantOfShape's value) too
        if attr.HasField("t") and attr.t.data_type == onnx.TensorProto.FLOAT:
            lowered_t = _lower_array(numpy_helper.to_array(attr.t), target)
            attr.t.CopyFrom(numpy_helper.from_array(lowered_t, attr.t.name))
    graph_inputs, initializers, run_feeds = [], [], {}
    runnable = feeds is not None
    for input_name in dict.fromkeys(node.input):
        if not input_name:
            continue
        if input_name in inits:
            array = _lower_array(numpy_helper.to_array(inits[input_name]), target)
            initializers.append(numpy_helper.from_array(array, input_name))
            continue
        graph_inputs.append(helper.make_value_info(input_name, lowered(input_name)))
        if feeds is not None and input_name in feeds and hasattr(feeds[input_name], "dtype"):
            run_feeds[input_name] = _lower_array(feeds[input_name], target)
        else:
            runnable = False
    outputs = [helper.make_value_info(n, lowered(n)) for n in node.output if n]
    graph = helper.make_graph([lone], "handmade", graph_inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=list(original.opset_import),
                              ir_version=max(original.ir_version, 4))
    try:
        session = ort_session(model)
    except Exception as exc:  # noqa: BLE001
        return False, _first_line(exc)
    if not runnable:
        return True, "loads (not run: its inputs are computed)"
    try:
        session.run(None, run_feeds)
    except Exception as exc:  # noqa: BLE001
        return False, _first_line(exc)
    return True, "loads and runs"


# ------------------------------------------------------------------------------------------------
# One case
# ------------------------------------------------------------------------------------------------
def _op_types(model: Any) -> list[str]:
    ops: set[str] = set()
    stack = [model.graph]
    while stack:
        g = stack.pop()
        for node in g.node:
            standard = node.domain in ("", "ai.onnx")
            ops.add(node.op_type if standard else f"{node.domain}.{node.op_type}")
            for attr in node.attribute:
                if attr.HasField("g"):
                    stack.append(attr.g)
                stack.extend(attr.graphs)
    return sorted(ops)


def _elem_types(model: Any) -> list[tuple[str, str, int]]:
    """(kind, name, elem_type of the tensor, or of a sequence's/optional's tensor) per graph I/O."""
    g = model.graph
    inits = {t.name for t in g.initializer}

    def elem(t: Any) -> int:
        while True:
            if t.HasField("tensor_type"):
                return t.tensor_type.elem_type
            if t.HasField("sequence_type"):
                t = t.sequence_type.elem_type
            elif t.HasField("optional_type"):
                t = t.optional_type.elem_type
            else:
                return -1

    return ([("input", i.name, elem(i.type)) for i in g.input if i.name not in inits]
            + [("output", o.name, elem(o.type)) for o in g.output])


def has_bfloat16_anywhere(model: Any) -> bool:
    """bf16 anywhere in the model (subgraphs included): what emulation must handle."""
    import onnx
    bf16 = onnx.TensorProto.BFLOAT16
    if bf16 in {e for _k, _n, e in _elem_types(model)}:
        return True
    stack = [model.graph]
    while stack:
        g = stack.pop()
        if any(t.data_type == bf16 for t in g.initializer):
            return True
        for node in g.node:
            for attr in node.attribute:
                if node.op_type == "Cast" and attr.name == "to" and attr.i == bf16:
                    return True
                if attr.HasField("t") and attr.t.data_type == bf16:
                    return True
                if attr.HasField("g"):
                    stack.append(attr.g)
                stack.extend(attr.graphs)
    return False


def _traceback_tail(exc: BaseException, frames: int = 6) -> list[str]:
    entries = traceback.extract_tb(exc.__traceback__)[-frames:]
    return [f"{Path(e.filename).name}:{e.lineno} {e.name}: {e.line}" for e in entries]


def _amp_frame(exc: BaseException) -> str:
    """The innermost traceback frame inside amp_rewriter (where the bug most likely is)."""
    for entry in reversed(traceback.extract_tb(exc.__traceback__)):
        if f"{os.sep}amp_rewriter{os.sep}" in entry.filename:
            rel = entry.filename.split(f"{os.sep}amp_rewriter{os.sep}", 1)[1]
            return f"amp_rewriter/{rel}:{entry.lineno} {entry.name}"
    return ""


def check_case(model_path: str, target: str = "fp16", backend: str = "ort-cuda",
               mode: str = "default", rtol: float | None = None, keep_io_types: bool = True,
               keep_model: bool = False) -> dict[str, Any]:
    """Convert one corpus model and classify the outcome; returns a JSON-able record."""
    import onnx

    from amp_rewriter import AmpError, convert

    started = time.perf_counter()
    rtol = DEFAULT_RTOL[target] if rtol is None else rtol
    record: dict[str, Any] = {"target": target, "backend": backend, "mode": mode,
                              "keep_io_types": keep_io_types}

    def done(outcome: str, **extra: Any) -> dict[str, Any]:
        record.update(extra)
        record["outcome"] = outcome
        record["bug"] = outcome in BUG_OUTCOMES or (outcome == "mismatch" and mode == "default")
        record["seconds"] = round(time.perf_counter() - started, 3)
        return record

    try:
        original = onnx.load(model_path)
    except Exception as exc:  # noqa: BLE001 - the corpus file itself, not our problem
        return done("refused", message=f"onnx.load failed: {_first_line(exc)}", stage="load")
    ops = _op_types(original)
    record["ops"] = ops
    record["opset"] = max((o.version for o in original.opset_import
                           if o.domain in ("", "ai.onnx")), default=0)
    allow = ([op for op in ops if "." not in op and op not in ALLOW_ALL_EXCLUDED]
             if mode == "allow-all" else [])

    # 1. convert
    try:
        converted, report = convert(original, target=target, backend=backend, check=False,
                                    allow=allow, keep_io_types=keep_io_types)
    except AmpError as exc:
        return done("refused", stage="convert", message=str(exc), exc_type=type(exc).__name__)
    except Exception as exc:  # noqa: BLE001
        return done("crash", stage="convert", exc_type=type(exc).__name__,
                    message=_first_line(exc), where=_amp_frame(exc),
                    traceback=_traceback_tail(exc))
    summary = report.summary
    record["nodes"] = summary.get("nodes")
    record["low_precision_nodes"] = summary.get("low_precision_nodes")
    record["casts_inserted"] = summary.get("casts_inserted")
    if keep_model:
        record["_converted"] = converted

    # 2. checker (the original is checked too: a few corpus models fail it themselves)
    try:
        onnx.checker.check_model(converted, full_check=True)
    except Exception as exc:  # noqa: BLE001
        try:
            onnx.checker.check_model(original, full_check=True)
            original_ok = True
        except Exception:  # noqa: BLE001
            original_ok = False
        if original_ok:
            return done("checker_fail", stage="checker", message=_first_line(exc))
        record["note"] = f"converted and original both fail the checker: {_first_line(exc)}"

    # 3. graph I/O dtypes are kept
    float_codes = {onnx.TensorProto.FLOAT, LOW_DTYPE[target]}
    changed = [f"{k} {n}: {a} -> {b}" for (k, n, a), (_k, _n, b)
               in zip(_elem_types(original), _elem_types(converted))
               if a != b and (keep_io_types or {a, b} - float_codes)]
    if len(_elem_types(original)) != len(_elem_types(converted)):
        changed.append("number of graph inputs/outputs changed")
    if changed:
        return done("io_dtype_changed", stage="io", message="; ".join(changed[:4]))

    # 4. onnxruntime (CPU): fp32 original first
    feeds, feed_source = load_feeds(model_path, original)
    record["inputs"] = feed_source
    if feeds is None:
        return done("ok_unverified", stage="inputs", message=feed_source)
    ref, stage, error = run_ort(original, feeds)
    if ref is None:
        return done("ok_unverified", stage=f"fp32_{stage}",
                    message=f"fp32 original does not {stage} in ORT CPU: {error}")
    candidate = converted
    if target == "bf16":
        from amp_rewriter.formats.onnx.emulation import EVERY_NODE, emulate_low_precision
        from amp_rewriter.formats.onnx.validate import has_bfloat16
        record["bf16_in_model"] = has_bfloat16_anywhere(converted)
        if (record["bf16_in_model"] and not has_bfloat16(converted)
                and not has_bfloat16_anywhere(original)):
            record["note"] = ("bf16 only inside subgraphs: validate.has_bfloat16 says no, so "
                              "`convert --validate` would run it unemulated")
        if backend == "ort-cpu" and record["bf16_in_model"]:
            # The ort-cpu bf16 profile converts only ops with a bf16 CPU kernel: it must load.
            direct, stage, error = run_ort(converted, feeds)
            if direct is None:
                return done("ort_fail", stage=f"ort_{stage}",
                            message=f"bf16 model (ort-cpu profile) does not {stage}: {error}")
        try:
            candidate = emulate_low_precision(converted, policy=EVERY_NODE).model
        except Exception as exc:  # noqa: BLE001
            return done("emulation_fail", stage="emulate", exc_type=type(exc).__name__,
                        message=_first_line(exc), where=_amp_frame(exc),
                        traceback=_traceback_tail(exc))
    new, stage, error = run_ort(candidate, feeds)
    if new is None:
        if target == "bf16":
            return done("emulation_fail", stage=f"ort_{stage}",
                        message=f"emulated bf16 model does not {stage}: {error}")
        match = _NOT_IMPLEMENTED.search(error)
        failing = (match.group(1), match.group(3)) if match else None
        match = _RUN_FAILED.search(error)
        failing = failing or ((match.group(1), match.group(2)) if match else None)
        top = original.graph.node
        if failing is None and len(top) == 1 and not any(a.HasField("g") for a in top[0].attribute):
            failing = (top[0].op_type, top[0].name)  # a single-op model: that op
        if failing:
            works, detail = handmade_low_precision_op(original, *failing, target, feeds)
            record["handmade"] = {"op": failing[0], "works": works, "detail": detail}
            same_kind = all(("NOT_IMPLEMENTED" in text, "Type Error" in text)
                            == ("NOT_IMPLEMENTED" in error, "Type Error" in error)
                            for text in (detail,))
            if works is False and same_kind:
                return done("ort_missing_kernel", stage=f"ort_{stage}", message=error)
        return done("ort_fail", stage=f"ort_{stage}", message=error)

    # 5. outputs
    names = [o.name for o in ort_session(original).get_outputs()]
    ok, rows = compare_outputs(names, ref, new, rtol, float_dtype_may_change=not keep_io_types)
    record["outputs"] = rows
    if not ok:
        again, _stage, _error = run_ort(original, feeds)
        if again is not None and not compare_outputs(names, ref, again, rtol)[0]:
            return done("nondeterministic", stage="compare",
                        message="two fp32 runs differ (random op): nothing to compare")
        bad = [r for r in rows if r.get("problem") or r.get("new_nan_or_inf")
               or r.get("relative_error", 0) > rtol]
        text = "; ".join(f"{r['name']}: " + (r.get("problem") or
                         ("new NaN/Inf" if r.get("new_nan_or_inf") else
                          f"relative error {r['relative_error']:.3g}")) for r in bad[:3])
        return done("mismatch", stage="compare", message=text)
    return done("ok")


# ------------------------------------------------------------------------------------------------
# The sweep: at most 2 worker processes, each case guarded by a timeout
# ------------------------------------------------------------------------------------------------
def _worker(tasks: Any, results: Any) -> None:
    import warnings
    warnings.simplefilter("ignore")
    while True:
        item = tasks.get()
        if item is None:
            return
        index, case, options = item
        suite, name, path = case
        try:
            record = check_case(path, **options)
        except Exception as exc:  # noqa: BLE001 - a bug in this script, not in the converter
            record = {"outcome": "crash", "bug": True, "stage": "harness",
                      "message": _first_line(exc), "traceback": _traceback_tail(exc)}
        record.update(suite=suite, name=name)
        results.put((index, record))


def sweep(cases: list[tuple[str, str, str]], options: dict[str, Any], jobs: int = 2,
          timeout: float = 120.0, verbose: bool = False) -> list[dict[str, Any]]:
    """Run `check_case` over `cases` in `jobs` (<= 2) processes; a hung or crashed case is
    recorded (timeout / worker_died) and its worker replaced."""
    jobs = max(1, min(2, jobs))
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    workers: list[dict[str, Any]] = []
    records: dict[int, dict[str, Any]] = {}
    pending = list(enumerate(cases))[::-1]

    def spawn() -> dict[str, Any]:
        tasks = ctx.Queue()
        proc = ctx.Process(target=_worker, args=(tasks, results_q), daemon=True)
        proc.start()
        return {"proc": proc, "tasks": tasks, "busy": None, "since": 0.0}

    def feed(worker: dict[str, Any]) -> None:
        if pending:
            index, case = pending.pop()
            worker["tasks"].put((index, case, options))
            worker["busy"], worker["since"] = index, time.monotonic()
        else:
            worker["busy"] = None

    for _ in range(min(jobs, len(cases))):
        worker = spawn()
        workers.append(worker)
        feed(worker)
    total = len(cases)
    while len(records) < total:
        try:
            index, record = results_q.get(timeout=0.5)
            records[index] = record
            for worker in workers:
                if worker["busy"] == index:
                    feed(worker)
            if verbose or record.get("bug"):
                print(f"[{len(records)}/{total}] {record['suite']}/{record['name']}: "
                      f"{record['outcome']} {record.get('message', '')[:150]}", file=sys.stderr)
            elif len(records) % 100 == 0:
                print(f"[{len(records)}/{total}]", file=sys.stderr)
            continue
        except queue.Empty:
            pass
        for slot, worker in enumerate(workers):
            index = worker["busy"]
            if index is None:
                continue
            if index in records:  # its result arrived while draining after another's death
                feed(worker)
                continue
            proc = worker["proc"]
            dead = not proc.is_alive()
            late = time.monotonic() - worker["since"] > timeout
            if not dead and not late:
                continue
            if dead:
                time.sleep(0.2)  # its last result may still be in the pipe
                try:
                    while True:
                        i, r = results_q.get_nowait()
                        records[i] = r
                except queue.Empty:
                    pass
                if index in records:
                    continue
            else:
                proc.kill()
            proc.join(5)
            suite, name, _path = cases[index]
            outcome = "worker_died" if dead else "timeout"
            message = (f"worker exited with code {proc.exitcode}" if dead
                       else f"ran past {timeout:g} s")
            records[index] = {"suite": suite, "name": name, "outcome": outcome, "bug": True,
                              "message": message, **options}
            print(f"[{len(records)}/{total}] {suite}/{name}: {outcome} {message}",
                  file=sys.stderr)
            replacement = spawn()
            workers[slot] = replacement
            feed(replacement)
    for worker in workers:
        worker["tasks"].put(None)
    for worker in workers:
        worker["proc"].join(10)
        if worker["proc"].is_alive():
            worker["proc"].kill()
    return [records[i] for i in range(total)]


def summarize(records: list[dict[str, Any]]) -> str:
    """Counts per outcome (bugs marked), split by suite, plus how many actually changed."""
    suites = sorted({r["suite"] for r in records}, key=lambda s: SUITES.index(s)
                    if s in SUITES else 99)
    by: defaultdict[str, Counter[str]] = defaultdict(Counter)
    for r in records:
        by[r["outcome"]][r["suite"]] += 1
    header = f"{'outcome':<20}{'total':>7}" + "".join(f"{s[:12]:>14}" for s in suites)
    lines = [header, "-" * len(header)]
    for outcome in OUTCOME_ORDER:
        if outcome not in by:
            continue
        counts = by[outcome]
        mark = " *" if outcome in BUG_OUTCOMES else ""
        lines.append(f"{outcome + mark:<20}{sum(counts.values()):>7}"
                     + "".join(f"{counts.get(s, 0):>14}" for s in suites))
    lines.append("-" * len(header))
    lines.append(f"{'all':<20}{len(records):>7}"
                 + "".join(f"{sum(1 for r in records if r['suite'] == s):>14}" for s in suites))
    ok = [r for r in records if r["outcome"] == "ok"]
    changed = sum(1 for r in ok if (r.get("low_precision_nodes") or 0) > 0)
    lines.append(f"ok with at least one low-precision node: {changed}/{len(ok)}")
    bugs = sum(1 for r in records if r.get("bug"))
    lines.append(f"cases pointing at a bug (* and default-mode mismatches): {bugs}")
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for r in records:
        if r["outcome"] not in ("ok", "ok_unverified", "nondeterministic"):
            groups[(r["outcome"], _normalise(r.get("message", "")))].append(r["name"])
    if groups:
        lines.append("\nnot ok, grouped by message (numbers and quoted names blanked):")
        for (outcome, message), names in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            where = "".join(f" [{r['where']}]" for r in records
                            if r["name"] == names[0] and r.get("where"))
            lines.append(f"{len(names):>5}  {outcome}: {message[:150]}{where}")
            lines.append(f"       e.g. {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}")
    return "\n".join(lines)


def _normalise(message: str) -> str:
    message = re.sub(r"'[^']*'|\"[^\"]*\"", "'X'", message)
    return re.sub(r"\d+", "N", message)
