"""What every pass is (`Pass`), sees (`PassContext`) and returns (`PassResult`), the registry of
passes by name, and the format rules (`FormatRules`) through which a format tells the generic
passes what its op names mean."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol

from ..ir import LazyTensor, Model, Node, RangeCheck, decisions
from ..ir.dtypes import TARGET_DTYPES
from ..ir.tensors import tensor_range, tensor_ranges
from ..op_lists import OpLists

if TYPE_CHECKING:  # the passes read options, they never build them
    from ..options import Options
    from ..training.passes import TrainingContext


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
    compute_ops: the ops that carry a model's arithmetic (GEMMs, convolutions, recurrent cells,
        fused attention), as `Node.qualified_op`: the report's summary counts how many of them run
        in low precision (what decides the speed-up) and its cost summary those left fp32, and why.

    The structural rules (passes/structures/) read:

    arithmetic: op -> its role ("add", "sub", "mul", "div", "pow", "tanh", "softmax", "sqrt",
        "rsqrt", "reciprocal", "mean", "square", "cast"), for patterns written in roles rather
        than op names.
    index_slots: (op, input slot) pairs that take a shape, size, coordinate or index (Range's
        bounds, Resize's sizes/scales, Reshape's shape, Slice's starts/ends, ...).
    rounding_ops: ops that round to integers (Floor, Ceil, Round): their input is index math.
    metadata_ops: ops that read only a tensor's shape (Shape, Size), not its values.
    lookup_ops: ops that look values up in a table by index (Gather): a float table read by
        indices is data (an embedding), not index math.
    mask_build_ops: ops an additive attention mask may be built with (Where, Mul, Expand, ...).
    carry_ops: op -> input slots through which a value passes with its values unchanged or only
        selected (Reshape's data, Where's branches, Concat's inputs, ...): how an attention
        mask's masked sum reaches the Softmax, or a rotary angle its Cos and Sin.
    saturate_op: the op that clips a tensor to [min, max] with both bounds as inputs (ONNX Clip);
        empty: the format cannot saturate a masked sum, and the attention-mask rule is off.
    saturate_pair: (max, min) ops that saturate in two steps (ONNX Max, Min), used where the
        backend has no low-precision kernel for `saturate_op`.
    rescale_ops: role -> op name for the ops the RMS norm's rescaled mean square is built with
        ("abs", "reduce_max" (the same signature as the norm's mean), "clip" (bounds as inputs),
        "div", "mul", and for the inverse root in low precision "add", "sqrt", "reciprocal";
        casts are the IR's own); empty: the format keeps an RMS norm's mean square fp32.
    periodic_ops: ops periodic in their input with period 2*pi (Cos, Sin): an angle read only by
        them may be reduced modulo 2*pi.
    integer_ops: role -> op name for the int64 arithmetic a rotary angle is reduced with
        ("mul", "add", "sub", "mod" (the remainder with the divisor's sign), "div" (the integer
        quotient)); empty: the format leaves rotary angles to the painting.
    """

    name: str
    divisor_slots: frozenset[tuple[str, int]] = frozenset()
    follow_producer_inputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    constant_fill_attrs: Mapping[str, str] = field(default_factory=dict)
    recurrent_edges: Mapping[str, frozenset[str]] = field(default_factory=dict)
    compute_ops: frozenset[str] = frozenset()
    arithmetic: Mapping[str, str] = field(default_factory=dict)
    index_slots: frozenset[tuple[str, int]] = frozenset()
    rounding_ops: frozenset[str] = frozenset()
    metadata_ops: frozenset[str] = frozenset()
    lookup_ops: frozenset[str] = frozenset()
    mask_build_ops: frozenset[str] = frozenset()
    carry_ops: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    saturate_op: str = ""
    saturate_pair: tuple[str, ...] = ()
    rescale_ops: Mapping[str, str] = field(default_factory=dict)
    periodic_ops: frozenset[str] = frozenset()
    integer_ops: Mapping[str, str] = field(default_factory=dict)

    def role(self, op: str) -> str:
        """The arithmetic role of `op` ("" for none)."""
        return self.arithmetic.get(op, "")


@dataclass(frozen=True)
class Pin:
    """Why a front end keeps a node fp32: the reason users read, and the kind of rule behind it
    (`decisions.PIN` for a plan such as the training rewrite's, `decisions.MEASUREMENT` for what
    `convert --auto` measured on calibration data). A `barrier` pin makes the node an fp32
    barrier, as `--keep-node` does (its infer/clear neighbours may follow it to fp32); otherwise
    only the node returns to fp32 after the painting, its neighbours decided as without it."""

    reason: str
    kind: str = decisions.PIN
    barrier: bool = True


@dataclass(frozen=True)
class StoredRange:
    """What a node's output holds when a front end knows it from storage and checked its range
    (a SavedModel variable's checkpoint value, read by ReadVariableOp): `guard_constant_ranges`
    treats that output as it treats a constant."""

    #: What users know the stored tensor by (the variable's name).
    name: str
    check: RangeCheck
    elements: int


@dataclass(slots=True)
class ConstantRecord:
    """One constant the conversion looked at, for the report."""

    name: str
    action: str  # "converted" | "kept_fp32" | "clamped"
    elements: int
    overflowed: int = 0
    flushed_to_zero: int = 0
    detail: str = ""


@dataclass
class StructureRecord:
    """A structural rule applied to a part of the graph, for the report: which rule, on which
    nodes, and what it did (with its numeric argument)."""

    rule: str  # "attention_mask", "tanh_gelu_cube", "rms_norm", "rotary_angle", "index_math", ...
    nodes: list[str]
    detail: str
    #: Nodes a rewrite pass added for the rule (the attention mask's saturation).
    added: list[str] = field(default_factory=list)


class StructurePlan(Protocol):
    """What a structural rule's analysis plans for its rewrite pass (passes/structures/)."""

    @property
    def anchor(self) -> Node:
        """The node the rewrite's nodes go before (and a failure is blamed on)."""

    def planned_nodes(self) -> list[Node]:
        """The nodes the rewrite works on: `convert_constants` leaves the casts of the
        constants they read, which the rewrite expects."""

    def kept_constants(self) -> list[str]:
        """Constants the rule takes care of: the constant-range rule leaves them to it."""


def _every_op(op: str) -> bool:
    return True


@dataclass
class PassContext:
    """The model being rewritten plus everything a pass may read or record."""

    model: Model
    lists: OpLists
    options: Options
    rules: FormatRules
    #: Node name -> why a front end keeps it fp32 (the training rewrite's optimizer path,
    #: `convert --auto`'s measurements, ...).
    pins: dict[str, Pin] = field(default_factory=dict)
    #: Node name -> the range of the stored tensor its output holds (see StoredRange).
    stored_ranges: dict[str, StoredRange] = field(default_factory=dict)
    constants: list[ConstantRecord] = field(default_factory=list)
    #: The node a pass is working on, so a failure can say where it happened.
    focus: Node | None = None
    #: Structural rules applied (attention masks, tanh-GELU cubes, index math, pattern rules).
    structures: list[StructureRecord] = field(default_factory=list)
    #: What a structural rule's analysis plans for its rewrite pass, by rule (each rule's
    #: module in passes/structures/ reads and writes its own list).
    plans: dict[str, list[StructurePlan]] = field(default_factory=dict)
    #: The nodes a user's pattern rule decided: structural rules leave them as the user said.
    user_rule_nodes: set[Node] = field(default_factory=set)
    #: Whether the model may hold an op a rewrite would add (ONNX: the op exists at the model's
    #: opset; Mod, which the rotary rule needs, came with opset 10).
    op_available: Callable[[str], bool] = _every_op
    #: A training front end's plan, rule and format ops, and what the training passes made
    #: (training pipelines only: see amp_rewriter/training).
    training: TrainingContext | None = None

    @property
    def target_dtype(self) -> str:
        return TARGET_DTYPES[self.options.target]

    def range_check_all(self, tensors: Iterable[LazyTensor], dtype: str) -> None:
        """Compute the range checks of many constants at once (`tensor_ranges`), for the
        `range_check` calls that follow."""
        missing = list(dict.fromkeys(t for t in tensors if _known_range(t, dtype) is None))
        for tensor, result in zip(missing, tensor_ranges(missing, dtype)):
            _remember_range(tensor, dtype, result)

    def range_check(self, tensor: LazyTensor, dtype: str) -> RangeCheck:
        """`check_range` of a constant in `dtype`, computed once per conversion (kept with the
        tensor)."""
        result = _known_range(tensor, dtype)
        if result is None:
            result = tensor_range(tensor, dtype)  # a file's big tensor: a chunk at a time
            _remember_range(tensor, dtype, result)
        return result


def _known_range(tensor: LazyTensor, dtype: str) -> RangeCheck | None:
    """The range check of `tensor` in `dtype` a pass computed already, if any."""
    checked = tensor.checked_range
    return checked[1] if checked is not None and checked[0] == dtype else None


def _remember_range(tensor: LazyTensor, dtype: str, result: RangeCheck) -> None:
    """Keep `result` with the tensor and let go of the values it was computed from."""
    tensor.checked_range = _range_entry(dtype, result)
    tensor.release()


@lru_cache(maxsize=1 << 12)
def _range_entry(dtype: str, result: RangeCheck) -> tuple[str, RangeCheck]:
    # One tuple for the many weights with the same result (see `range_check_of`).
    return dtype, result


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
