"""`check` for TensorFlow graphs (.meta, .pb, .pbtxt; training graphs included) and SavedModels:
optimizer updates in low precision, optimizer constants that underflow or overflow in the type
they are cast to, deny-list ops running in low precision, low-precision constants, and with a
reference model its constants and outputs."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from ...cost import model_cost
from ...errors import AmpError
from ...ir import TARGET_DTYPES, LazyTensor, Model
from ...ir.dtypes import NUMPY_DTYPES
from ...ir.rounding import ROUNDING_FORMATS
from ...op_lists import Overrides
from ...report import CheckResult, CheckRule
from ...validation import (
    COMMON_CHECK_RULES,
    ConstantOrigins,
    OutputComparison,
    check_constants,
    default_rtol,
    deny_op_findings,
    flushed_verdict,
    load_inputs,
    output_verdict,
)
from .convert import convertible_function, meta_graph_fetches
from .files import is_saved_model_dir, read_saved_model
from .lists import default_backend, load_tf_lists
from .load import default_fetches, load_function, load_graphdef, parse_graph_input
from .optimizers import EPSILON, HYPERPARAMETER, LEARNING_RATE, write_args
from .rules import TF_RULES
from .training.rewrite import as_meta_graph
from .validate import ConvertedGraphFailed, compare_graphdefs, compare_saved_models

#: Ops a constant passes through unchanged on its way to an optimizer input.
_PASS_THROUGH = frozenset({"Identity", "Snapshot", "StopGradient", "Cast", "Switch", "RefSwitch"})
_LOW_TF_DTYPES = {tf.float16.as_datatype_enum: "fp16", tf.bfloat16.as_datatype_enum: "bf16"}
_FLOAT_TF_DTYPES = {dtype.as_datatype_enum for dtype in (tf.float16, tf.bfloat16, tf.float32)}


#: What `check` looks for in a TensorFlow graph (a JUnit test case each).
TF_CHECK_RULES = (
    CheckRule("deny_op_in_low_precision", "no op of the backend's deny list runs in low "
                                          "precision"),
    CheckRule("low_precision_update", "optimizer updates keep fp32 master weights"),
    CheckRule("optimizer_constant_underflow", "no optimizer constant (epsilon, learning rate) "
                                              "underflows in the type it is cast to"),
    CheckRule("optimizer_constant_overflow", "no optimizer constant overflows in the type it "
                                             "is cast to"),
    CheckRule("swallowed_update", "no 16-bit weight is updated with round-to-nearest by steps "
                                  "smaller than half an ulp of its values"),
    *COMMON_CHECK_RULES,
)


def _in_dtype(value: float, target: str) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(value, np.float32).astype(NUMPY_DTYPES[TARGET_DTYPES[target]]).astype(
            np.float32)


#: The inputs of an optimizer update that `check` traces to their constants.
_CHECKED_ROLES = frozenset({LEARNING_RATE, EPSILON, HYPERPARAMETER})


def _const_value(nd) -> np.ndarray | None:
    """The value of a Const node (None for a malformed one)."""
    try:
        return tf.make_ndarray(nd.attr["value"].tensor)
    except Exception:  # a malformed constant: TF's own import check reports it
        return None


def _producer(ref: str) -> str:
    """The node a NodeDef input names ("^n", "n", "n:1" -> "n")."""
    return parse_graph_input(ref.lstrip("^"))[0]


def _trace_constant(nodes: dict, ref: str) -> tuple[np.ndarray | None, str | None, str]:
    """Follow `ref` back through Identity/Cast to a Const: (value, first low-precision type on
    the way or None, the Const's name)."""
    low = None
    name = _producer(ref)
    for _ in range(64):
        nd = nodes.get(name)
        if nd is None:
            return None, None, name
        if nd.op == "Const":
            dtype = nd.attr["dtype"].type
            low = low or _LOW_TF_DTYPES.get(dtype)
            return _const_value(nd), low, name
        if nd.op not in _PASS_THROUGH or not nd.input:
            return None, None, name
        if nd.op == "Cast":
            low = low or _LOW_TF_DTYPES.get(nd.attr["DstT"].type)
        name = _producer(nd.input[0])
    return None, None, name


def check_tf_graph(path: str | os.PathLike, target: str | None = None,
                   backend: str | None = None, reference: str | os.PathLike | None = None,
                   rtol: float | None = None, inputs: str | os.PathLike | None = None,
                   overrides: Overrides | None = None) -> CheckResult:
    """`check` for TensorFlow graphs (.meta, .pb, .pbtxt) and SavedModel directories: optimizer
    updates in low precision, optimizer constants (Adam's epsilon, learning rates) that
    underflow or overflow in the low precision type they are cast to, deny-list ops running in
    low precision and low-precision constants (in every function of a SavedModel); with
    `reference` (the fp32 model), constants against its constants and the outputs against its
    outputs on `inputs` (an .npz) or seeded random ones. `overrides`: the --config's backend
    profiles and class moves, as convert had them."""
    path = Path(path)
    metas = _meta_graphs(path)
    if target is None:
        found = [_LOW_TF_DTYPES[a.type] for _, nodes in _graphs(metas) for nd in nodes
                 for a in nd.attr.values() if a.type in _LOW_TF_DTYPES]
        target = found[0] if found else "fp16"
    backend = backend or default_backend(target)
    result = CheckResult(target, backend=backend,
                         cost=model_cost(_node_precisions(metas), TF_RULES.compute_ops))
    for meta in metas:
        _check_optimizer(meta, target, result)
        _check_swallowed_updates(meta, result)
    lists = load_tf_lists(target, backend, overrides)
    for graph, model in _graph_irs(metas):
        problems, notes = deny_op_findings(model.graph.walk_nodes(), lists, TF_RULES, target,
                                           "" if graph == "main" else f" (in {graph})")
        result.problems.extend(problems)
        result.notes.extend(notes)
    origins = None
    if reference is not None:
        ref_metas = _meta_graphs(Path(reference))
        origins = ConstantOrigins(_constants(ref_metas))
    constants = check_constants(_constants(metas), origins, target)
    result.problems.extend(constants.problems)
    result.notes.extend(constants.notes)
    outputs_agree = False
    if reference is not None:
        rtol = default_rtol(target) if rtol is None else rtol
        comparisons = _compare(Path(reference), path, ref_metas, inputs, result)
        outputs, mismatches, outputs_agree = output_verdict(comparisons, rtol)
        result.outputs.extend(outputs)
        result.problems.extend(mismatches)
    problems, notes = flushed_verdict(constants, target, outputs_agree, rtol)
    result.problems.extend(problems)
    result.notes.extend(notes)
    return result


def _node_precisions(metas: list[meta_graph_pb2.MetaGraphDef]
                     ) -> Iterator[tuple[str, bool, bool, bool]]:
    """(op, float data, low precision, cast to or from low precision) per node of every graph,
    from the nodes' type attributes (`T`, `dtype`, a Cast's `SrcT`/`DstT`)."""
    for _, nodes in _graphs(metas):
        for nd in nodes:
            if nd.op == "Cast":
                ends = (nd.attr["SrcT"].type, nd.attr["DstT"].type)
                yield nd.op, False, False, any(t in _LOW_TF_DTYPES for t in ends)
                continue
            types = [a.type for a in nd.attr.values() if a.type in _FLOAT_TF_DTYPES]
            yield nd.op, bool(types), any(t in _LOW_TF_DTYPES for t in types), False


def _meta_graphs(path: Path) -> list[meta_graph_pb2.MetaGraphDef]:
    """The MetaGraphs of a SavedModel directory, or one for a graph file."""
    if is_saved_model_dir(path):
        return list(read_saved_model(path).meta_graphs)
    return [as_meta_graph(path)]


def _graphs(metas: list[meta_graph_pb2.MetaGraphDef]) -> Iterator[tuple[str, list]]:
    """(name, nodes) of every graph: each MetaGraph's own graph and its library's functions."""
    seen: set[str] = set()
    for meta in metas:
        yield "main", list(meta.graph_def.node)
        for fdef in meta.graph_def.library.function:
            if fdef.signature.name not in seen:
                seen.add(fdef.signature.name)
                yield fdef.signature.name, list(fdef.node_def)


def _graph_irs(metas: list[meta_graph_pb2.MetaGraphDef]) -> Iterator[tuple[str, Model]]:
    """(name, IR) of every graph `_graphs` yields that convert rewrites, as convert loads them:
    the rules that read structure (the tanh-GELU cube) see what convert saw, and the functions
    convert copies as they are (checkpoint save and restore) are not judged."""
    seen: set[str] = set()
    for meta in metas:
        graph_def = graph_pb2.GraphDef()
        graph_def.CopyFrom(meta.graph_def)  # the loader renames FusedBatchNorm in place
        yield "main", load_graphdef(graph_def, [], keep_fetch_nodes=False, label="the graph")
        for fdef in meta.graph_def.library.function:
            if fdef.signature.name not in seen and convertible_function(fdef):
                seen.add(fdef.signature.name)
                yield fdef.signature.name, load_function(fdef, meta.graph_def.library)


def _constants(metas: list[meta_graph_pb2.MetaGraphDef]) -> dict[str, LazyTensor]:
    """Every float Const of every graph, by name (`FUNCTION/NODE` inside functions)."""
    found: dict[str, LazyTensor] = {}
    for graph, nodes in _graphs(metas):
        for nd in nodes:
            if nd.op != "Const" or nd.attr["dtype"].type not in _FLOAT_TF_DTYPES:
                continue
            tensor = nd.attr["value"].tensor
            name = nd.name if graph == "main" else f"{graph}/{nd.name}"
            found.setdefault(name, LazyTensor(
                tf.as_dtype(tensor.dtype).name, tuple(d.size for d in tensor.tensor_shape.dim),
                functools.partial(_const_array, tensor)))
    return found


def _const_array(tensor) -> np.ndarray:
    try:
        return tf.make_ndarray(tensor)
    except Exception:  # a malformed constant: TF's own import check reports it
        return np.zeros(0, np.float32)


def _compare(reference: Path, path: Path, ref_metas: list[meta_graph_pb2.MetaGraphDef],
             inputs: str | os.PathLike | None, result: CheckResult) -> list[OutputComparison]:
    """Run both models on the same inputs; the checked model failing to run is a problem."""
    feeds = load_inputs(inputs) if inputs else None
    try:
        if is_saved_model_dir(reference):
            if not is_saved_model_dir(path):
                raise AmpError(f"--reference {reference} is a SavedModel, {path} is not")
            return compare_saved_models(reference, path, feeds)
        fetches = (meta_graph_fetches(ref_metas[0]) if reference.suffix == ".meta"
                   else default_fetches(ref_metas[0].graph_def))
        if not fetches:
            raise AmpError(f"--reference {reference}: no outputs found to compare")
        candidate = _meta_graphs(path)[0].graph_def
        return compare_graphdefs(ref_metas[0].graph_def, candidate, fetches, feeds)
    except ConvertedGraphFailed as exc:
        result.problems.append({"kind": "run_failed", "message": str(exc)})
        return []


def _check_optimizer(meta: meta_graph_pb2.MetaGraphDef, target: str, result: CheckResult
                     ) -> None:
    """Optimizer updates in low precision and optimizer constants that do not survive it: the
    inputs the optimizer tables (`optimizers.py`) call learning rate, epsilon or another
    hyperparameter, traced to their constants."""
    nodes = {nd.name: nd for nd in meta.graph_def.node}
    for nd in meta.graph_def.node:
        args = write_args(nd.op)
        if args is None or not args.is_optimizer_update:
            continue
        dtype = nd.attr["T"].type if "T" in nd.attr else nd.attr["dtype"].type
        if dtype in _LOW_TF_DTYPES:
            result.problems.append({
                "kind": "low_precision_update", "node": nd.name, "op": nd.op,
                "message": f"{nd.name} ({nd.op}) updates its variable in "
                           f"{_LOW_TF_DTYPES[dtype]}: optimizer updates need fp32 master "
                           f"weights"})
        data_inputs = [ref for ref in nd.input if not ref.startswith("^")]
        for (arg, role), ref in zip(args.args, data_inputs):
            if role not in _CHECKED_ROLES:
                continue
            value, low, const = _trace_constant(nodes, ref)
            if value is None or value.dtype.kind != "f" or value.size != 1:
                continue
            v = float(np.asarray(value, np.float32).reshape(()))
            where = f"{nd.name} input {arg!r} (constant {const}, {v:g})"
            if low is not None:
                stored = float(_in_dtype(v, low).reshape(()))
                if v != 0 and stored == 0:
                    kind, detail = "optimizer_constant_underflow", f"underflows to 0 in {low}"
                elif math.isfinite(v) and not math.isfinite(stored):
                    kind, detail = "optimizer_constant_overflow", f"overflows to inf in {low}"
                elif v == 0 and role == EPSILON:
                    kind, detail = "optimizer_constant_underflow", f"is 0 in {low}"
                else:
                    continue
                result.problems.append({"kind": kind, "node": nd.name, "constant": const,
                                        "message": f"{where} {detail}"})
            elif v != 0 and float(_in_dtype(v, target).reshape(())) == 0:
                result.notes.append(f"{where} would underflow in {target}; it is fp32 here and "
                                    f"amp-rewriter keeps optimizer constants fp32")


#: Variables `_check_swallowed_updates` looks at, and the ops that write one.
_VARIABLE_OPS = frozenset({"VariableV2", "Variable", "VarHandleOp", "TemporaryVariable"})
_ASSIGNS = frozenset({"Assign", "AssignVariableOp"})
#: Ops between a variable and what reads or fills it.
_READS = frozenset({"Identity", "Snapshot", "ReadVariableOp", "Cast", "DestroyTemporaryVariable",
                    "Assign"})
_RANDOM_OPS = frozenset({"RandomUniform", "TruncatedNormal", "RandomStandardNormal"})


def _low_dtype(nd) -> str | None:
    """"fp16"/"bf16" when a variable node stores a 16-bit float."""
    return _LOW_TF_DTYPES.get(nd.attr["dtype"].type) if "dtype" in nd.attr else None


def _back_to(nodes: dict, ref: str, ops: frozenset[str]) -> tuple[Any, bool]:
    """Follow `ref` back through reads and casts to a node of `ops`: (it or None, whether a
    Cast was on the way)."""
    cast = False
    nd = nodes.get(_producer(ref))
    for _ in range(16):
        if nd is None or nd.op in ops:
            return nd, cast
        if nd.op not in _READS or not nd.input:
            return None, cast
        cast = cast or nd.op == "Cast"
        nd = nodes.get(_producer(nd.input[0]))
    return None, cast


def _typical_magnitude(nodes: dict, ref: str) -> float | None:
    """A typical |value| of a variable's initial value (a constant: the median of its nonzero
    magnitudes; a random initializer `random * a + b`: half its reach), or None."""
    nd = nodes.get(_producer(ref))
    for _ in range(8):
        if nd is None or nd.op not in ("Identity", "Cast") or not nd.input:
            break
        nd = nodes.get(_producer(nd.input[0]))
    if nd is None:
        return None
    if nd.op == "Const":
        value = _const_value(nd)
        if value is not None and value.dtype.name == "bfloat16":
            value = value.astype(np.float32)  # numpy's kind of bfloat16 is not "f"
        if value is None or value.dtype.kind != "f":
            return None
        magnitudes = np.abs(value[value != 0].astype(np.float64))
        return float(np.median(magnitudes)) if magnitudes.size else None
    if nd.op in ("Add", "AddV2") and len(nd.input) == 2:
        scaled, offset = nodes.get(_producer(nd.input[0])), nodes.get(_producer(nd.input[1]))
        if scaled is None or scaled.op != "Mul" or len(scaled.input) != 2:
            return None
        random = nodes.get(_producer(scaled.input[0]))
        factor = _number(nodes, scaled.input[1])
        shift = _number(nodes, nd.input[1]) if offset is not None else None
        if random is None or random.op not in _RANDOM_OPS or factor is None or shift is None:
            return None
        if random.op == "RandomUniform":  # uniform in [shift, shift + factor)
            return max(abs(shift), abs(shift + factor)) / 2
        return abs(shift) + 0.8 * abs(factor)  # the mean |x| of a normal is 0.8 sigma
    return None


def _number(nodes: dict, ref: str) -> float | None:
    """The scalar a constant (or the difference of two, as random_uniform's max - min) holds."""
    nd = nodes.get(_producer(ref))
    if nd is not None and nd.op == "Sub" and len(nd.input) == 2:
        a, b = _number(nodes, nd.input[0]), _number(nodes, nd.input[1])
        return None if a is None or b is None else a - b
    value, _, _ = _trace_constant(nodes, ref)
    if value is None or value.dtype.kind != "f" or value.size != 1:
        return None
    return float(np.asarray(value, np.float64).reshape(()))


def _rounds_to_nearest_from(nodes: dict, ref: str, scratch: str) -> bool:
    """Whether `ref` is a plain Cast of what variable `scratch` holds."""
    cast = nodes.get(_producer(ref))
    if cast is None or cast.op != "Cast" or not cast.input:
        return False
    source, _ = _back_to(nodes, cast.input[0], _VARIABLE_OPS)
    return source is not None and source.name == scratch


def _learning_rate(nodes: dict, ref: str) -> float | None:
    """The learning rate an update reads: a constant, or one that --unscale optimizer
    multiplied by 1/scale (Mul(learning rate, fold)): then the one before the multiply, since
    the gradients it meets are scaled by as much."""
    nd = nodes.get(_producer(ref))
    if nd is not None and nd.op == "Mul" and nd.input and "/unscale/" in nd.name:
        return _number(nodes, nd.input[0])
    return _number(nodes, ref)


def _half_ulp(magnitude: float, low: str) -> float:
    """Half the spacing of the 16-bit type `low` at `magnitude`."""
    fmt = ROUNDING_FORMATS[TARGET_DTYPES[low]]
    smallest_normal = fmt.smallest_normal_field - 127  # float32's exponent bias
    exponent = max(math.floor(math.log2(magnitude)), smallest_normal)
    return 2.0 ** (exponent - fmt.mantissa_bits) / 2


def _check_swallowed_updates(meta: meta_graph_pb2.MetaGraphDef, result: CheckResult) -> None:
    """16-bit weights written back with round-to-nearest (a plain Cast from fp32: --weights
    with --rounding nearest) or updated by a 16-bit kernel, whose step, estimated statically,
    is below half an ulp of their typical value: such updates are swallowed. The step is the
    learning rate (Adam's and RMSProp's normalized steps are about that; SGD's is lr x |g|,
    taken with |g| about 1), divided by 1 - momentum for momentum; the typical value comes from
    the variable's initializer."""
    nodes = {nd.name: nd for nd in meta.graph_def.node}
    writers: dict[str, list] = {}
    for nd in meta.graph_def.node:
        if nd.op in _ASSIGNS and len([i for i in nd.input if not i.startswith("^")]) == 2:
            writers.setdefault(_producer(nd.input[0]), []).append(nd)
    for nd in meta.graph_def.node:
        args = write_args(nd.op)
        if args is None or not args.is_optimizer_update:
            continue
        data_inputs = [ref for ref in nd.input if not ref.startswith("^")]
        roles = {arg: ref for (arg, _), ref in zip(args.args, data_inputs)}
        by_role = {role: ref for (_, role), ref in zip(args.args, data_inputs)}
        if "var" not in roles or LEARNING_RATE not in by_role:
            continue
        learning_rate = _learning_rate(nodes, by_role[LEARNING_RATE])
        if learning_rate is None or learning_rate <= 0:
            continue
        step = learning_rate
        momentum = _number(nodes, roles["momentum"]) if "momentum" in roles else None
        if momentum is not None and 0 <= momentum < 1:
            step /= 1 - momentum
        variable, _ = _back_to(nodes, roles["var"], _VARIABLE_OPS)
        if variable is None:
            continue
        stored, how = variable, f"{nd.op} updates it in 16 bits"
        if _low_dtype(variable) is None:  # an fp32 scratch copy filled from a 16-bit variable?
            fills = writers.get(variable.name, [])
            source = _back_to(nodes, fills[0].input[1], _VARIABLE_OPS)[0] if fills else None
            if source is None or _low_dtype(source) is None:
                continue
            stored = source
            write_backs = [w for w in writers.get(stored.name, [])
                           if _rounds_to_nearest_from(nodes, w.input[1], variable.name)]
            if not write_backs:
                continue  # not rounded to nearest (stochastic rounding's bit ops)
            how = f"its write-back {write_backs[0].name} rounds to nearest"
        low = _low_dtype(stored)
        assert low is not None
        # the initializer (`<variable>/Assign`; a saver's `save/Assign` restores instead)
        magnitudes = [_typical_magnitude(nodes, w.input[1]) for w in writers.get(stored.name, [])
                      if w.name.endswith("/Assign")]
        magnitude = next((m for m in magnitudes if m is not None), None)
        if magnitude is None or magnitude <= 0:
            continue
        half_ulp = _half_ulp(magnitude, low)
        if step < half_ulp:
            result.problems.append({
                "kind": "swallowed_update", "node": nd.name, "variable": stored.name,
                "message": f"{low} weight {stored.name}: {how}, and its steps (about "
                           f"{step:.3g}, from learning rate {learning_rate:g}) are below half an "
                           f"ulp ({half_ulp:.3g}) of its typical value {magnitude:.3g}: they are "
                           f"swallowed; use --rounding stochastic or fp32 master weights"})
