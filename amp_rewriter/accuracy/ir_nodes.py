"""What a converted node reads and computes, in terms of the fp32 model: shared by the formats'
runners, which see the conversion through the IR the passes left."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np

from ..ir import FLOAT_DTYPES, LOW_PRECISION_DTYPES, LazyTensor, Node, Value, short_name
from ..ir.dtypes import NUMPY_DTYPES
from .runner import NodeInfo

#: The IR's cast op (the passes insert it as "Cast" whatever the format).
CAST = "Cast"


@dataclass
class Ref:
    """What a converted node reads in one input slot, in terms of the fp32 model."""

    kind: str  # "activation" | "constant"
    #: The fp32 model's tensor (for a constant: the original it was converted from).
    reference: str | None
    #: The dtype the converted node reads, and the reference tensor's dtype.
    dtype: str | None
    reference_dtype: str | None
    #: The value the converted node reads, and that value before any cast a pass inserted.
    value: Value
    source: Value


def resolve(value: Value, original_name: Callable[[Value], str | None]) -> Ref:
    """Follow the casts the conversion inserted back to the fp32 model's tensor."""
    source = value
    while (source.producer is not None and source.producer.created_by is not None
           and source.producer.op_type == CAST and source.producer.inputs[0] is not None):
        source = source.producer.inputs[0]
    if value.const is not None or source.const is not None:
        origin = source
        while origin.origin is not None:
            origin = origin.origin
        return Ref("constant", original_name(origin), value.dtype, origin.original_dtype, value,
                   source)
    return Ref("activation", original_name(source), value.dtype, source.original_dtype, value,
               source)


def node_info(node: Node, where: str, order: int, original_name: Callable[[Value], str | None],
              divisor_slots: Collection[tuple[str, int]], reduce_ops: Collection[str],
              matmul_ops: Collection[str], measurable: bool) -> NodeInfo:
    """The `NodeInfo` of one original node of a conversion's IR."""
    low = sorted({g.precision for g in node.type_groups if g.precision in LOW_PRECISION_DTYPES})
    fp32 = any(g.precision == "float32" for g in node.type_groups)
    precision = "fp32" if not low else ("mixed" if fp32 or len(low) > 1
                                        else short_name(low[0]) or "")
    outputs = [original_name(v) or v.name for v in node.outputs
               if v is not None and v.original_dtype in FLOAT_DTYPES]
    refs = [None if v is None else resolve(v, original_name) for v in node.inputs]
    inputs: list[str] = []
    low_inputs: list[str] = []
    producers: list[str] = []
    divisors: list[str] = []
    for slot, ref in enumerate(refs):
        if ref is None or ref.kind != "activation" or ref.reference is None \
                or ref.reference_dtype not in FLOAT_DTYPES:
            continue
        inputs.append(ref.reference)
        if ref.dtype in LOW_PRECISION_DTYPES and ref.dtype != ref.reference_dtype:
            low_inputs.append(ref.reference)
            producer = ref.source.producer
            producers.append(producer.name if producer is not None
                             and producer.handle is not None else "")
        if (node.op_type, slot) in divisor_slots:
            divisors.append(ref.reference)
    reduction = None
    first = refs[0] if refs else None
    if first is not None and first.kind == "activation" and first.reference and outputs:
        if node.op_type in reduce_ops:
            reduction = ("ratio", first.reference, outputs[0])
        elif node.op_type in matmul_ops:
            reduction = ("last", first.reference, "")
    return NodeInfo(node.name, node.qualified_op, where, order, precision, outputs, inputs,
                    low_inputs, producers, divisors, reduction, bool(low) and measurable)


def constant_as_read(ref: Ref) -> LazyTensor:
    """The data of a constant as the converted node reads it (through an inserted cast that
    was not folded, the cast is applied here)."""
    if ref.value.const is not None:
        return ref.value.const
    source = ref.source.const
    dtype = ref.dtype or "float32"
    assert source is not None

    def load() -> np.ndarray:
        data = np.asarray(source.numpy())
        with np.errstate(over="ignore"):
            return data.astype(NUMPY_DTYPES.get(dtype, data.dtype))

    return LazyTensor(dtype, source.shape, load)
