"""What every pass is (`Pass`), sees (`PassContext`) and returns (`PassResult`), the registry of
passes by name, and the format rules (`FormatRules`) through which a format tells the generic
passes what its op names mean."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..ir import LazyTensor, Model, Node, RangeCheck, check_range
from ..ir.dtypes import TARGET_DTYPES
from ..op_lists import OpLists

if TYPE_CHECKING:  # the passes read options, they never build them
    from ..options import Options


@dataclass(frozen=True)
class FormatRules:
    """What a format's op names mean to the generic passes (each format package fills one in).

    divisor_slots: (op, input slot) pairs where a constant that flushes to zero changes the
        result completely (x / 0): such constants keep their consumer in fp32.
    follow_producer_inputs: op -> the type groups of inputs that only inspect a value (Shape's
        input, Cast's source): they take whatever dtype their producer has, so no cast is needed.
    constant_fill_attrs: op -> the attribute that holds its fill value (ONNX ConstantOfShape's
        `value`), converted with the op's output.
    recurrent_edges: op carrying a loop value back (TF's NextIteration) -> the ops it feeds that
        must share its dtype (Merge).
    compute_ops: the ops that carry a model's arithmetic (GEMMs, convolutions, fused
        attention), as `Node.qualified_op`: the report's cost summary counts those left fp32.
    """

    name: str
    divisor_slots: frozenset[tuple[str, int]] = frozenset()
    follow_producer_inputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    constant_fill_attrs: Mapping[str, str] = field(default_factory=dict)
    recurrent_edges: Mapping[str, frozenset[str]] = field(default_factory=dict)
    compute_ops: frozenset[str] = frozenset()


@dataclass
class ConstantRecord:
    """One constant the conversion looked at, for the report."""

    name: str
    action: str  # "converted" | "kept_fp32" | "clamped"
    elements: int
    overflowed: int = 0
    flushed_to_zero: int = 0
    detail: str = ""


@dataclass
class PassContext:
    """The model being rewritten plus everything a pass may read or record."""

    model: Model
    lists: OpLists
    options: Options
    rules: FormatRules
    #: Node name -> why a front end keeps it fp32 (the training rewrite's optimizer path, ...).
    pins: dict[str, str] = field(default_factory=dict)
    constants: list[ConstantRecord] = field(default_factory=list)
    #: (id of a LazyTensor, dtype) -> its range check, shared by the passes that need it.
    range_checks: dict[tuple[int, str], RangeCheck] = field(default_factory=dict)
    #: The node a pass is working on, so a failure can say where it happened.
    focus: Node | None = None

    @property
    def target_dtype(self) -> str:
        return TARGET_DTYPES[self.options.target]

    def range_check(self, tensor: LazyTensor, dtype: str) -> RangeCheck:
        """`check_range` of a constant in `dtype`, computed once per conversion."""
        import numpy as np

        key = (id(tensor), dtype)
        result = self.range_checks.get(key)
        if result is None:
            values = np.asarray(tensor.stored(), dtype=np.float32)  # compact: not expanded
            result = check_range(values, dtype, tensor.size - values.size)
            self.range_checks[key] = result
        return result


@dataclass
class PassResult:
    """What a pass changed: a count and short notes for the log and report."""

    name: str
    changed: int
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Pass:
    """A named step of a pipeline. `run` returns how much it changed (and notes)."""

    name: str
    run: Callable[[PassContext], tuple[int, list[str]]]
    summary: str

    def __call__(self, ctx: PassContext) -> PassResult:
        changed, notes = self.run(ctx)
        return PassResult(self.name, changed, notes)


#: Every pass by name; pipelines (passes/pipeline.py) are lists of these names.
REGISTRY: dict[str, Pass] = {}


def register_pass(name: str) -> Callable[[Callable[[PassContext], tuple[int, list[str]]]],
                                         Callable[[PassContext], tuple[int, list[str]]]]:
    """Register a function `run(ctx) -> (changed, notes)` as the pass `name` (its docstring's
    first line is the pass's summary)."""
    def register(run: Callable[[PassContext], tuple[int, list[str]]]
                 ) -> Callable[[PassContext], tuple[int, list[str]]]:
        if name in REGISTRY:
            raise ValueError(f"pass {name!r} registered twice")
        summary = (run.__doc__ or "").strip().splitlines()[0] if run.__doc__ else ""
        REGISTRY[name] = Pass(name, run, summary)
        return run
    return register
