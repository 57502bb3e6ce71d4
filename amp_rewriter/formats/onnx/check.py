"""`check` for ONNX: lint a mixed-precision model for CI (deny ops in low precision, bad constants,
the checker, and with a reference model the outputs)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ...errors import AmpError
from ...ir import DENY, LOW_PRECISION_DTYPES, LazyTensor
from ...op_lists import OpLists
from ...passes.analysis.structures import tanh_gelu_cube
from ...report import CheckResult
from ...validation import default_rtol
from .convert import onnx_full_check
from .load import load_onnx, read_model_file
from .rules import ONNX_RULES
from .validate import random_inputs, validate_conversion

TARGET_OF_DTYPE = {"float16": "fp16", "bfloat16": "bf16"}


def _detect_target(model_ir) -> str | None:
    for node in model_ir.graph.walk_nodes():
        for value in node.outputs:
            if value is not None and value.dtype in LOW_PRECISION_DTYPES:
                return TARGET_OF_DTYPE[value.dtype]
    for graph in model_ir.graph.walk_graphs():
        for value in graph.initializers.values():
            if value.dtype in LOW_PRECISION_DTYPES:
                return TARGET_OF_DTYPE[value.dtype]
    return None


def check_model(path: str | os.PathLike, target: str | None = None, backend: str = "ort-cuda",
                reference: str | os.PathLike | None = None, rtol: float | None = None,
                device: str = "cpu") -> CheckResult:
    """Check a converted model; see the CLI's `check` for what counts as a problem."""
    path = Path(path)
    model = read_model_file(path)  # not ONNX at all: bad input (exit 2), not a failed check
    base_dir = path.resolve().parent
    invalid = None
    try:
        onnx_full_check(str(path))
    except Exception as exc:  # the checker raises several exception types
        invalid = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    try:
        model_ir = load_onnx(model, base_dir)
    except AmpError as exc:
        return CheckResult(target or "fp16", [{"kind": "invalid_model",
                                                "message": invalid or str(exc)}])
    target = target or _detect_target(model_ir) or "fp16"
    lists = OpLists.load("onnx", target, backend)
    result = CheckResult(target)
    if invalid is not None:
        result.problems.append({"kind": "invalid_model", "message": invalid})

    for node in model_ir.graph.walk_nodes():
        op_class, why = lists.class_of(node.qualified_op)
        if op_class != DENY:
            continue
        harmless = tanh_gelu_cube(node, ONNX_RULES)
        if harmless is not None:  # convert runs it low precision on purpose
            result.notes.append(f"{node.name} ({node.op_type}) runs in low precision: {harmless}")
            continue
        low = [v.name for v in node.inputs + node.outputs
               if v is not None and v.dtype in LOW_PRECISION_DTYPES]
        if low:
            result.problems.append({
                "kind": "deny_op_in_low_precision", "node": node.name, "op": node.op_type,
                "message": f"{node.name} ({node.op_type}) runs in low precision but is on the "
                           f"{target} deny list for {backend}: {why}"})

    ref_constants: dict[str, LazyTensor] = {}
    if reference is not None:
        ref_model = read_model_file(reference)
        ref_ir = load_onnx(ref_model, Path(reference).resolve().parent)
        for graph in ref_ir.graph.walk_graphs():
            for name, value in graph.initializers.items():
                if value.const is not None:
                    ref_constants[name] = value.const
    for graph in model_ir.graph.walk_graphs():
        for name, value in graph.initializers.items():
            if value.dtype not in LOW_PRECISION_DTYPES or value.const is None:
                continue
            data = np.asarray(value.const.numpy()).astype(np.float32)
            original = ref_constants.get(name)
            if original is not None and original.dtype == "float32":
                ref_data = np.asarray(original.numpy(), dtype=np.float32)
                if ref_data.shape == data.shape:
                    overflow = int(np.count_nonzero(np.isfinite(ref_data) & ~np.isfinite(data)))
                    flushed = int(np.count_nonzero((ref_data != 0) & (data == 0)))
                else:
                    overflow, flushed = int(np.count_nonzero(np.isinf(data))), 0
            else:
                overflow, flushed = int(np.count_nonzero(np.isinf(data))), 0
            if overflow:
                result.problems.append({"kind": "constant_overflow", "constant": name,
                                        "message": f"constant {name!r}: {overflow} value(s) "
                                                   f"overflowed to inf in {target}"})
            if flushed:
                result.problems.append({"kind": "constant_flushed", "constant": name,
                                        "message": f"constant {name!r}: {flushed} non-zero "
                                                   f"value(s) flushed to zero in {target}"})

    if reference is not None:
        rtol = default_rtol(target) if rtol is None else rtol
        feeds = random_inputs(read_model_file(reference))
        try:
            comparisons, notes = validate_conversion(reference, path, feeds, device)
        except AmpError as exc:
            if str(exc).startswith("--device"):
                raise  # the device is unusable: bad usage, not a finding about the model
            result.problems.append({"kind": "run_failed", "message": str(exc)})
            comparisons, notes = [], []
        result.notes.extend(notes)
        for c in comparisons:
            result.outputs.append(c.to_dict())
            if c.relative > rtol or c.nonfinite_new:
                result.problems.append({"kind": "output_mismatch", "output": c.name,
                                        "message": f"output {c.name!r}: relative error "
                                                   f"{c.relative:.3g} > rtol {rtol:g}"})
    return result
