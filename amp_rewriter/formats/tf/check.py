"""`check` for TensorFlow graphs (.meta, .pb, .pbtxt; training graphs included): optimizer updates
in low precision, optimizer constants that underflow or overflow in the type they are cast to,
and deny-list ops running in low precision."""

from __future__ import annotations

import math
import os

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from ...ir import DENY, TARGET_DTYPES
from ...ir.dtypes import NUMPY_DTYPES
from ...report import CheckResult
from .lists import default_backend, load_tf_lists
from .training.plan import const_value, is_optimizer_op, is_update_op, split_ref
from .training.rewrite import as_meta_graph

#: Ops a constant passes through unchanged on its way to an optimizer input.
_PASS_THROUGH = frozenset({"Identity", "Snapshot", "StopGradient", "Cast", "Switch", "RefSwitch"})
_LOW_TF_DTYPES = {tf.float16.as_datatype_enum: "fp16", tf.bfloat16.as_datatype_enum: "bf16"}


def _in_dtype(value: float, target: str) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(value, np.float32).astype(NUMPY_DTYPES[TARGET_DTYPES[target]]).astype(
            np.float32)


def _trace_constant(nodes: dict, ref: str) -> tuple[np.ndarray | None, str | None, str]:
    """Follow `ref` back through Identity/Cast to a Const: (value, first low-precision type on
    the way or None, the Const's name)."""
    low = None
    name = split_ref(ref)[0]
    for _ in range(64):
        nd = nodes.get(name)
        if nd is None:
            return None, None, name
        if nd.op == "Const":
            dtype = nd.attr["dtype"].type
            low = low or _LOW_TF_DTYPES.get(dtype)
            return const_value(nd), low, name
        if nd.op not in _PASS_THROUGH or not nd.input:
            return None, None, name
        if nd.op == "Cast":
            low = low or _LOW_TF_DTYPES.get(nd.attr["DstT"].type)
        name = split_ref(nd.input[0])[0]
    return None, None, name


def check_tf_graph(path: str | os.PathLike, target: str | None = None,
                   backend: str | None = None):
    """`check` for TensorFlow graphs (.meta, .pb, .pbtxt): optimizer updates in low precision,
    optimizer constants (Adam's epsilon, learning rates) that underflow or overflow in the low
    precision type they are cast to, and deny-list ops running in low precision."""
    meta = as_meta_graph(path)
    nodes = {nd.name: nd for nd in meta.graph_def.node}
    if target is None:
        found = [_LOW_TF_DTYPES[a.type] for nd in meta.graph_def.node for a in nd.attr.values()
                 if a.type in _LOW_TF_DTYPES]
        target = found[0] if found else "fp16"
    result = CheckResult(target)
    for nd in meta.graph_def.node:
        if not is_update_op(nd.op):
            continue
        op_def = op_def_registry.get(nd.op)
        dtype = nd.attr["T"].type if "T" in nd.attr else nd.attr["dtype"].type
        if dtype in _LOW_TF_DTYPES and is_optimizer_op(nd.op):
            result.problems.append({
                "kind": "low_precision_update", "node": nd.name, "op": nd.op,
                "message": f"{nd.name} ({nd.op}) updates its variable in "
                           f"{_LOW_TF_DTYPES[dtype]}: optimizer updates need fp32 master "
                           f"weights"})
        if op_def is None or not is_optimizer_op(nd.op):
            continue
        data_inputs = [ref for ref in nd.input if not ref.startswith("^")]
        for arg, ref in zip(op_def.input_arg, data_inputs):
            if arg.is_ref or arg.name in ("var", "accum", "m", "v", "ms", "mom", "mg", "grad",
                                          "indices", "linear", "accum_update"):
                continue
            value, low, const = _trace_constant(nodes, ref)
            if value is None or value.dtype.kind != "f" or value.size != 1:
                continue
            v = float(np.asarray(value, np.float32).reshape(()))
            where = f"{nd.name} input {arg.name!r} (constant {const}, {v:g})"
            if low is not None:
                stored = float(_in_dtype(v, low).reshape(()))
                if v != 0 and stored == 0:
                    kind, detail = "optimizer_constant_underflow", f"underflows to 0 in {low}"
                elif math.isfinite(v) and not math.isfinite(stored):
                    kind, detail = "optimizer_constant_overflow", f"overflows to inf in {low}"
                elif v == 0 and arg.name == "epsilon":
                    kind, detail = "optimizer_constant_underflow", f"is 0 in {low}"
                else:
                    continue
                result.problems.append({"kind": kind, "node": nd.name, "constant": const,
                                        "message": f"{where} {detail}"})
            elif v != 0 and float(_in_dtype(v, target).reshape(())) == 0:
                result.notes.append(f"{where} would underflow in {target}; it is fp32 here and "
                                    f"amp-rewriter keeps optimizer constants fp32")
    lists = load_tf_lists(target, backend or default_backend(target))
    for nd in meta.graph_def.node:
        op_class, why = lists.class_of(nd.op)
        if op_class == DENY and any(a.type in _LOW_TF_DTYPES for a in nd.attr.values()):
            result.problems.append({
                "kind": "deny_op_in_low_precision", "node": nd.name, "op": nd.op,
                "message": f"{nd.name} ({nd.op}) runs in low precision but is on the {target} "
                           f"deny list: {why}"})
    return result
