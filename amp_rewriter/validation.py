"""Comparing a converted model's outputs with the fp32 model's (format-neutral; numpy only)."""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .arrays import read_npz
from .errors import AmpError
from .ir import DENY, LOW_PRECISION_DTYPES, LazyTensor, Node
from .ir.dtypes import NUMPY_DTYPES
from .op_lists import OpLists
from .passes.base import FormatRules
from .passes.structures.rms_norm import rescaled_mean_square
from .passes.structures.tanh_gelu import tanh_gelu_cube
from .report import CheckRule

#: OutputComparison.computed for an output that some emulated op fed.
EMULATED = "emulated"


@dataclass
class OutputComparison:
    """Errors of one output of the converted model against the fp32 one."""

    name: str
    max_abs: float
    relative: float
    nonfinite_new: bool
    #: How the converted model computed this output: "emulated" (some op on its path had no
    #: low-precision kernel where it ran and computed in fp32 with rounding), "low-precision
    #: kernels", "fp32" (no low-precision tensor on its path), or the device's provider.
    computed: str = ""
    #: With "emulated": the ops on the output's path that ran emulated.
    emulated_ops: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        data: dict[str, Any] = {"name": self.name, "max_abs_error": self.max_abs,
                                "relative_error": self.relative,
                                "new_nan_or_inf": self.nonfinite_new}
        if self.computed:
            data["computed"] = self.computed
        if self.emulated_ops:
            data["emulated_ops"] = self.emulated_ops
        return data

    def how(self) -> str:
        """A short note for the CLI: which ops ran emulated on the way to this output."""
        if self.computed != EMULATED:
            return ""
        return f" [emulated: {', '.join(self.emulated_ops)}]"


@dataclass
class Validation:
    """Every output's comparison against `rtol`, and notes on how the models were run."""

    comparisons: list[OutputComparison]
    rtol: float
    notes: list[str] = field(default_factory=list)

    def failed(self, comparison: OutputComparison) -> bool:
        """Whether one output is off: above `rtol`, or NaN/Inf where fp32 has none."""
        return comparison.relative > self.rtol or comparison.nonfinite_new

    @property
    def passed(self) -> bool:
        return not any(self.failed(c) for c in self.comparisons)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"rtol": self.rtol, "passed": self.passed,
                                "outputs": [c.to_dict() for c in self.comparisons]}
        if self.notes:
            data["notes"] = list(self.notes)
        return data


def compare_outputs(name: str, ref: Any, new: Any) -> OutputComparison:
    """Max-abs and relative (max-abs / max|ref|) error of one output; exact match for non-floats."""
    ref = _as_float(ref)
    new = _as_float(new)
    if not np.issubdtype(ref.dtype, np.floating):
        mismatch = float(np.count_nonzero(ref != new))
        return OutputComparison(name, mismatch, mismatch / max(ref.size, 1), False)
    ref64, new64 = ref.astype(np.float64), new.astype(np.float64)
    finite = np.isfinite(ref64)
    nonfinite_new = bool(np.any(finite & ~np.isfinite(new64)))
    diff = np.abs(ref64[finite] - new64[finite]) if finite.any() else np.zeros(1)
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(ref64[finite]).max()) if finite.any() else 0.0
    relative = max_abs / scale if scale > 0 else max_abs
    if nonfinite_new:
        relative = float("inf")
    return OutputComparison(name, max_abs, relative, nonfinite_new)


def _as_float(array: Any) -> np.ndarray:
    """An array with bf16 (which numpy cannot compute in) widened to fp32."""
    array = np.asarray(array)
    if array.dtype.name == "bfloat16":
        return array.astype(np.float32)
    return array


#: Most elements one random input may have (256 MiB of float32): a declared shape is memory the
#: model file never paid for; a bigger input comes from --inputs.
MAX_RANDOM_ELEMENTS = 1 << 26


def check_random_shape(name: str, shape: list[int]) -> None:
    """Refuse to make random data for an input whose declared shape is too big."""
    elements = math.prod(shape)
    if elements > MAX_RANDOM_ELEMENTS:
        raise AmpError(f"input {name!r}: its declared shape {shape} has {elements} elements, too "
                       f"many to make random data for; give --inputs")


def default_rtol(target: str) -> float:
    """Tolerance on the relative error: fp16 keeps ~3 decimal digits, bf16 ~2."""
    return 2e-2 if target == "fp16" else 1e-1


def load_inputs(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Inputs from an .npz file, keyed by input name (read by `arrays.read_npz`: a regular file,
    its arrays no bigger than the file can hold)."""
    if not os.path.exists(path):
        raise AmpError(f"{path}: inputs file not found")
    return read_npz(path, "inputs file")


# -- `check`: low-precision constants against the fp32 model's ---------------------------------

#: The name a converted copy of a constant gets when other readers still read the fp32 original:
#: `<name>_float16` / `<name>_bfloat16` (with `_N` when that name was taken).
_CONVERTED_COPY = re.compile(r"^(?P<source>.+)_(?:float16|bfloat16)(?:_\d+)?$")


class ConstantOrigins:
    """Finds the fp32 reference constant a low-precision constant was converted from: by name,
    by the name of a converted copy, or by value (its conversion gives exactly these bytes)."""

    def __init__(self, reference: dict[str, LazyTensor]):
        self.reference = {name: t for name, t in reference.items() if t.dtype == "float32"}
        #: dtype -> digest of a reference constant converted to it -> that constant's name.
        self.by_value: dict[str, dict[bytes, str]] = {}

    def find(self, name: str, data: np.ndarray, dtype: str) -> np.ndarray | None:
        """The fp32 values `data` (a constant of `dtype` named `name`) came from, or None."""
        candidates = [name]
        match = _CONVERTED_COPY.match(name) if isinstance(name, str) else None
        if match:
            candidates.append(match.group("source"))
        for candidate in candidates:
            tensor = self.reference.get(candidate)
            if tensor is not None and tuple(tensor.shape) == tuple(data.shape):
                return np.asarray(tensor.numpy(), dtype=np.float32)
        source = self._value_index(dtype).get(_digest(data))
        return None if source is None else np.asarray(self.reference[source].numpy(), np.float32)

    def _value_index(self, dtype: str) -> dict[bytes, str]:
        index = self.by_value.get(dtype)
        if index is None:
            index = self.by_value[dtype] = {}
            for name, tensor in self.reference.items():
                with np.errstate(over="ignore"):
                    converted = np.asarray(tensor.numpy(), np.float32).astype(NUMPY_DTYPES[dtype])
                index.setdefault(_digest(converted), name)
        return index


def _digest(array: np.ndarray) -> bytes:
    return hashlib.sha256(repr(array.shape).encode() + np.ascontiguousarray(array).tobytes()
                          ).digest()


#: What `check` looks for in every format's low-precision constants and, with the fp32 model,
#: its outputs (the kinds `check_constants`, `output_verdict` and `flushed_verdict` report; a
#: model that fails to run is `run_failed`).
COMMON_CHECK_RULES = (
    CheckRule("constant_overflow", "no finite fp32 constant became inf", needs_reference=True),
    CheckRule("constant_flushed", "no non-zero constant flushed to zero, unless the outputs "
                                  "agree with the fp32 model's"),
    CheckRule("run_failed", "the model loads and runs", needs_reference=True),
    CheckRule("output_mismatch", "every output is within rtol of the fp32 model's, with no new "
                                 "NaN/Inf", needs_reference=True),
)


@dataclass
class ConstantFindings:
    """What `check` found in a model's low-precision constants."""

    problems: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: (constant, count) of non-zero values that became zero: a note when the outputs agree
    #: within the tolerance, a problem when they do not (see `flushed_verdict`).
    flushed: list[tuple[str, int]] = field(default_factory=list)


def check_constants(constants: dict[str, LazyTensor], origins: ConstantOrigins | None,
                    target: str) -> ConstantFindings:
    """Overflowed and flushed values in the low-precision constants of a model.

    Without a reference (`origins` None), a ±inf value is only a note: an fp32 mask of -inf
    converts to -inf exactly as an overflowed -3.4e38 does, and only the fp32 model tells them
    apart. With one, a finite fp32 value that became inf is a problem (`constant_overflow`).
    """
    findings = ConstantFindings()
    for name, const in constants.items():
        if const.dtype not in LOW_PRECISION_DTYPES:
            continue
        raw = np.asarray(const.numpy())
        data = raw.astype(np.float32)
        original = origins.find(name, raw, const.dtype) if origins is not None else None
        if original is None:
            infinite = int(np.count_nonzero(np.isinf(data)))
            if infinite:
                how = ("no fp32 constant of --reference converts to it" if origins is not None
                       else "give --reference to tell")
                findings.notes.append(f"constant {name!r}: {infinite} value(s) are ±inf in "
                                      f"{target}: an overflow if they were finite in fp32, a "
                                      f"mask if they were ±inf already ({how})")
            continue
        overflow = int(np.count_nonzero(np.isfinite(original) & ~np.isfinite(data)))
        flushed = int(np.count_nonzero((original != 0) & (data == 0)))
        if overflow:
            findings.problems.append({"kind": "constant_overflow", "constant": name,
                                      "message": f"constant {name!r}: {overflow} value(s) "
                                                 f"overflowed to inf in {target}"})
        if flushed:
            findings.flushed.append((name, flushed))
    return findings


def deny_op_findings(nodes: Iterable[Node], lists: OpLists, rules: FormatRules, target: str,
                     where: str = "") -> tuple[list[dict[str, Any]], list[str]]:
    """`check`'s deny-list rule over a converted graph's nodes, for every format: a deny-list op
    with a low-precision input or output is a problem, unless it is a structure `convert` runs
    low on purpose (the cube of a tanh-GELU, an RMS norm's rescaled mean square), which is a
    note. `where` follows a node's name (" (in FUNCTION)"). Returns (problems, notes)."""
    problems: list[dict[str, Any]] = []
    notes: list[str] = []
    backend = lists.backend
    for node in nodes:
        op_class, why = lists.class_of(node.qualified_op)
        if op_class != DENY or not any(v is not None and v.dtype in LOW_PRECISION_DTYPES
                                       for v in node.inputs + node.outputs):
            continue
        harmless = tanh_gelu_cube(node, rules) or rescaled_mean_square(node, rules, lists)
        if harmless is not None:  # convert runs it low precision on purpose
            notes.append(f"{node.name} ({node.op_type}){where} runs in low precision: {harmless}")
            continue
        problems.append({
            "kind": "deny_op_in_low_precision", "node": node.name, "op": node.op_type,
            "message": f"{node.name} ({node.op_type}){where} runs in low precision but is on "
                       f"the {target} deny list for {backend}: {why}"})
    return problems, notes


def output_verdict(comparisons: list[OutputComparison], rtol: float
                   ) -> tuple[list[dict], list[dict], bool]:
    """(outputs, problems, agree) for `check --reference`: each comparison as a dict, a problem
    for each output off by more than `rtol` or with new NaN/Inf, and whether all outputs agree
    (False when none was compared)."""
    outputs, problems = [], []
    for c in comparisons:
        outputs.append(c.to_dict())
        if c.relative > rtol or c.nonfinite_new:
            problems.append({"kind": "output_mismatch", "output": c.name,
                             "message": f"output {c.name!r}: relative error {c.relative:.3g} > "
                                        f"rtol {rtol:g}"})
    return outputs, problems, bool(comparisons) and not problems


def flushed_verdict(findings: ConstantFindings, target: str, outputs_agree: bool,
                    rtol: float | None) -> tuple[list[dict], list[str]]:
    """(problems, notes) for the flushed constants: notes when the outputs agree within
    `rtol`, problems when they do not or were not compared."""
    problems, notes = [], []
    for name, count in findings.flushed:
        message = f"constant {name!r}: {count} non-zero value(s) flushed to zero in {target}"
        if outputs_agree:
            notes.append(f"{message}; the outputs agree within rtol {rtol:g}")
        else:
            problems.append({"kind": "constant_flushed", "constant": name, "message": message})
    return problems, notes
