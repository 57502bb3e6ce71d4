"""TensorFlow's lowering of the IR's stochastic rounding Cast (`ir/rounding.py`) to ordinary ops.

Each step of the bit procedure is one op on int64 (Bitcast, BitwiseAnd/Or, RightShift, LeftShift,
Maximum, Minimum, AddV2, Sub, GreaterEqual, SelectV2), the random bits come from
StatelessRandomUniformFullInt keyed by the Cast's key (no state: the same key gives the same
bits on every device and replica), and the result is Bitcast from uint16 to the target. Where
|x| is beyond the target's largest finite value the ordinary Cast's result is taken. All of
these ops exist in GraphDefs and function bodies alike, so TF1 and TF2 graphs get the same
subgraph; `tests/tf/test_rounding.py` compares it with `ir.rounding.stochastic_round` bit for
bit.
"""

from __future__ import annotations

import numpy as np

from ...ir import FP32, Model, Node, Value, decisions, present
from ...ir.rounding import (
    MAX_DROPPED_BITS,
    ROUNDING_FORMATS,
    STOCHASTIC,
    rounding_of,
)
from ...passes.rewrite.building import CAST, array_constant, new_node

#: Why the lowered nodes are what they are (the report's reason).
LOWERED_REASON = "stochastic rounding of a weight update, lowered to integer ops"
#: The op that draws the random bits (tests fetch its output to compare with the reference).
RANDOM_BITS_OP = "StatelessRandomUniformFullInt"


class _Lowering:
    """The nodes that replace one stochastic Cast, made in order, named under the cast."""

    def __init__(self, model: Model, cast: Node):
        assert cast.graph is not None, "the cast is in its graph"
        self.model, self.cast, self.graph = model, cast, cast.graph
        self.nodes: list[Node] = []

    def op(self, op: str, inputs: list[Value], out_dtype: str, label: str, **attrs: object
           ) -> Value:
        node = new_node(self.model, self.graph, f"{self.cast.name}/{label}", op,
                        list[Value | None](inputs), None, out_dtype, None, op_class=FP32,
                        reason=LOWERED_REASON, order=self.cast.order, kind=decisions.PIN,
                        attrs=attrs)
        node.pin_reason, node.pin_kind = LOWERED_REASON, decisions.PIN
        self.nodes.append(node)
        return present(node.outputs[0])

    def const(self, value: int, label: str) -> Value:
        return array_constant(self.model, self.graph, f"{self.cast.name}/{label}",
                              np.asarray(value, np.int64))


def lower_stochastic_cast(model: Model, cast: Node) -> list[Node]:
    """Replace one stochastic Cast by the ops of the bit procedure; returns the new nodes."""
    x, key = present(cast.inputs[0]), present(cast.inputs[1])
    output = present(cast.outputs[0])
    dtype = present(output).dtype
    assert dtype is not None
    fmt = ROUNDING_FORMATS[dtype]
    low = _Lowering(model, cast)
    i64 = "int64"
    bits = low.op(CAST, [low.op("Bitcast", [x], "int32", "bits32")], i64, "bits",
                  to=i64)
    magnitude = low.op("BitwiseAnd", [bits, low.const(0x7FFFFFFF, "magnitude_mask")], i64,
                       "magnitude")
    exponent = low.op("RightShift", [magnitude, low.const(23, "mantissa_width")], i64,
                      "exponent")
    one, zero = low.const(1, "one"), low.const(0, "zero")
    exponent1 = low.op("Maximum", [exponent, one], i64, "exponent_at_least_1")
    implicit = low.op("SelectV2", [low.op("GreaterEqual", [exponent, one], "bool", "normal"),
                                   low.const(1 << 23, "implicit_bit"), zero],
                      i64, "implicit")
    significand = low.op("BitwiseOr", [low.op("BitwiseAnd", [magnitude,
                                                             low.const(0x7FFFFF, "mantissa_mask")],
                                              i64, "mantissa"), implicit], i64, "significand")
    smallest_normal = low.const(fmt.smallest_normal_field, "smallest_normal_field")
    below_normal = low.op("Maximum", [low.op("Sub", [smallest_normal, exponent1], i64,
                                             "binades_below_normal"), zero], i64, "below_normal")
    dropped = low.op("AddV2", [below_normal, low.const(23 - fmt.mantissa_bits, "dropped_bits")],
                     i64, "dropped")
    most = low.const(MAX_DROPPED_BITS, "most_dropped")
    capped = low.op("Minimum", [dropped, most], i64, "dropped_capped")
    mask = low.op("Sub", [low.op("LeftShift", [one, capped], i64, "unit"), one], i64, "noise_mask")
    shape = low.op("Shape", [x], "int32", "shape")
    random = low.op(RANDOM_BITS_OP, [shape, key], i64, "random_bits")
    noise = low.op("BitwiseAnd", [random, mask], i64, "noise")
    kept = low.op("RightShift", [low.op("AddV2", [significand, noise], i64, "noisy"), capped],
                  i64, "kept_rounded")
    kept = low.op("SelectV2", [low.op("Greater", [dropped, most], "bool", "too_small"), zero,
                               kept], i64, "kept")
    exponent_part = low.op("LeftShift", [
        low.op("Maximum", [low.op("Sub", [exponent1, smallest_normal], i64, "target_exponent"),
                           zero], i64, "target_exponent_field"),
        low.const(fmt.mantissa_bits, "target_mantissa_width")], i64, "exponent_part")
    unsigned = low.op("AddV2", [exponent_part, kept], i64, "unsigned_bits")
    sign = low.op("BitwiseAnd", [low.op("RightShift", [bits, low.const(16, "sign_shift")], i64,
                                        "shifted"), low.const(1 << 15, "sign_bit")], i64, "sign")
    target_bits = low.op(CAST, [low.op("BitwiseOr", [unsigned, sign], i64, "signed_bits")],
                         "uint16", "target_bits", to="uint16")
    rounded = low.op("Bitcast", [target_bits], dtype, "rounded")
    nearest = low.op(CAST, [x], dtype, "nearest", to=dtype)
    beyond = low.op("Greater", [magnitude, low.const(fmt.largest_finite_bits, "largest_finite")],
                    "bool", "beyond_finite")
    result = low.op("SelectV2", [beyond, nearest, rounded], dtype, "stochastic")
    output.replace_all_uses_with(result)
    return low.nodes


def lower_rounding_casts(model: Model) -> int:
    """Lower every stochastic Cast of `model`'s graphs; returns how many there were."""
    lowered = 0
    for graph in list(model.graph.walk_graphs()):
        casts = [node for node in graph.nodes
                 if node.op_type == CAST and rounding_of(node.attrs) == STOCHASTIC]
        for cast in casts:
            graph.insert_before(cast, lower_stochastic_cast(model, cast))
        graph.remove_nodes(casts)
        lowered += len(casts)
    return lowered
