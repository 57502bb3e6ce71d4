"""`check` for ONNX: lint a mixed-precision model for CI (deny ops in low precision, bad constants,
the checker, and with a reference model the outputs)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from ...cost import model_cost
from ...errors import AmpError, ConvertedModelFailed, first_line
from ...ir import FLOAT_DTYPES, LOW_PRECISION_DTYPES, LazyTensor, Model
from ...op_lists import OpLists, Overrides, default_backend
from ...report import CheckResult, CheckRule
from ...validation import (
    COMMON_CHECK_RULES,
    ConstantOrigins,
    check_constants,
    default_rtol,
    deny_op_findings,
    flushed_verdict,
    load_inputs,
    output_verdict,
)
from .convert import onnx_full_check
from .execution import select_execution
from .load import load_onnx, read_model_file
from .rules import ONNX_RULES
from .shapes import activation_traffic, validation_input_shapes
from .validate import random_inputs, validate_conversion

TARGET_OF_DTYPE = {"float16": "fp16", "bfloat16": "bf16"}

#: What `check` looks for in an ONNX model (a JUnit test case each).
ONNX_CHECK_RULES = (
    CheckRule("invalid_model", "the model passes onnx.checker's full check"),
    CheckRule("deny_op_in_low_precision", "no op of the backend's deny list runs in low "
                                          "precision"),
    *COMMON_CHECK_RULES,
)


def _detect_target(model_ir: Model) -> str | None:
    for node in model_ir.graph.walk_nodes():
        for value in node.outputs:
            if value is not None and value.dtype in LOW_PRECISION_DTYPES:
                return TARGET_OF_DTYPE[value.dtype]
    for graph in model_ir.graph.walk_graphs():
        for value in graph.initializers.values():
            if value.dtype in LOW_PRECISION_DTYPES:
                return TARGET_OF_DTYPE[value.dtype]
    return None


def _constants(model_ir: Model) -> dict[str, LazyTensor]:
    """Every constant of a model by name: initializers and Constant nodes' values, all graphs."""
    found: dict[str, LazyTensor] = {}
    for graph in model_ir.graph.walk_graphs():
        for name, value in graph.initializers.items():
            if value.const is not None:
                found.setdefault(name, value.const)
    for node in model_ir.graph.walk_nodes():
        if node.op_type == "Constant" and node.outputs and node.outputs[0] is not None \
                and node.outputs[0].const is not None:
            found.setdefault(node.outputs[0].name, node.outputs[0].const)
    return found


def _node_precisions(model_ir: Model) -> Iterator[tuple[str, bool, bool, bool]]:
    """(op, float data, low precision, cast to or from low precision) per node, as
    `cost.model_cost` reads them: a node is low precision when its float outputs are (its float
    inputs, for a node without float outputs), and a Cast is counted as a cast, not a node."""
    for node in model_ir.graph.walk_nodes():
        outputs = [v.dtype for v in node.outputs if v is not None and v.dtype in FLOAT_DTYPES]
        inputs = [v.dtype for v in node.inputs if v is not None and v.dtype in FLOAT_DTYPES]
        if node.op_type == "Cast":
            yield node.qualified_op, False, False, any(
                dtype in LOW_PRECISION_DTYPES for dtype in outputs + inputs)
            continue
        data = outputs or inputs
        yield (node.qualified_op, bool(data), any(d in LOW_PRECISION_DTYPES for d in data),
               False)


def check_model(path: str | os.PathLike, target: str | None = None, backend: str | None = None,
                reference: str | os.PathLike | None = None, rtol: float | None = None,
                inputs: str | os.PathLike | None = None, device: str | None = None,
                overrides: Overrides | None = None) -> CheckResult:
    """Check a converted model; see the CLI's `check` for what counts as a problem.

    Constants: without `reference`, a ±inf value in a low-precision constant is only a note
    (an fp32 mask of -inf converts to -inf, as an overflowed -3.4e38 does: only the fp32 model
    tells them apart). With `reference`, each low-precision constant is matched to the fp32
    constant it came from, and a finite value that became inf is a problem; a non-zero value
    flushed to zero is a note when the outputs agree within `rtol`, a problem when they do not.
    The outputs are compared with the converted model run where the backend profile runs (or
    on `device`). `backend`: the profile (default: the format's for the target); `overrides`:
    the --config's profiles and class moves, as convert had them.
    """
    path = Path(path)
    model = read_model_file(path)  # not ONNX at all: bad input (exit 2), not a failed check
    base_dir = path.resolve().parent
    invalid = None
    try:
        onnx_full_check(str(path))
    except Exception as exc:  # the checker raises several exception types
        invalid = first_line(exc)
    try:
        model_ir = load_onnx(model, base_dir)
    except AmpError as exc:
        return CheckResult(target or "fp16", [{"kind": "invalid_model",
                                                "message": invalid or str(exc)}],
                           backend=backend or default_backend("onnx", target or "fp16"))
    target = target or _detect_target(model_ir) or "fp16"
    backend = backend or default_backend("onnx", target)
    lists = OpLists.load("onnx", target, backend, overrides)
    result = CheckResult(target, backend=backend)
    if invalid is not None:
        result.problems.append({"kind": "invalid_model", "message": invalid})
    # The activation bytes need shape inference, which only a valid model is sure to pass.
    traffic = (activation_traffic(model, validation_input_shapes(model)) if invalid is None
               else None)
    result.cost = model_cost(_node_precisions(model_ir), ONNX_RULES.compute_ops, traffic)

    problems, notes = deny_op_findings(model_ir.graph.walk_nodes(), lists, ONNX_RULES, target)
    result.problems.extend(problems)
    result.notes.extend(notes)

    origins = None
    if reference is not None:
        ref_model = read_model_file(reference)
        origins = ConstantOrigins(_constants(load_onnx(ref_model,
                                                       Path(reference).resolve().parent)))
        feeds = load_inputs(inputs) if inputs else random_inputs(ref_model)
        del ref_model
    constants = check_constants(_constants(model_ir), origins, target)
    result.problems.extend(constants.problems)
    result.notes.extend(constants.notes)

    outputs_agree = False
    if reference is not None:
        rtol = default_rtol(target) if rtol is None else rtol
        try:
            execution = select_execution(lists.profile, target, device)
            comparisons, notes = validate_conversion(  # the parsed model serves the emulation
                reference, path, feeds, execution, inputs_given=inputs is not None, model=model)
            result.notes.extend(notes)
        except ConvertedModelFailed as exc:
            result.problems.append({"kind": "run_failed", "message": str(exc)})
            comparisons = []
        outputs, mismatches, outputs_agree = output_verdict(comparisons, rtol)
        result.outputs.extend(outputs)
        result.problems.extend(mismatches)
    problems, notes = flushed_verdict(constants, target, outputs_agree, rtol)
    result.problems.extend(problems)
    result.notes.extend(notes)
    return result
