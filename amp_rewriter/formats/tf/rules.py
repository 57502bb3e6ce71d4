"""What TensorFlow op names mean for precision: the data the loader and the generic passes need.

The loader reads the fixed-dtype type attributes, the FusedBatchNorm V1 -> V2 mapping and the ref
variable ops (Grappler's rules that are plain data); the passes receive `TF_RULES`.
"""

from __future__ import annotations

from ...passes.base import FormatRules

#: Type attrs whose dtype carries meaning: FusedBatchNorm's statistics stay fp32 (what TF's kernels
#: accept: scale/offset/mean/variance and the batch statistics are float for every `T`).
FIXED_TYPE_ATTRS: dict[tuple[str, str], str] = {
    (op, "U"): f"{op} statistics (scale, offset, mean, variance) stay fp32"
    for op in ("FusedBatchNormV2", "FusedBatchNormV3", "FusedBatchNormGradV2",
               "FusedBatchNormGradV3", "_FusedBatchNormEx")
}
#: FusedBatchNorm V1 ops and the V2 op with the same semantics and a separate `U` attr.
BATCH_NORM_V2 = {"FusedBatchNorm": "FusedBatchNormV2", "FusedBatchNormGrad": "FusedBatchNormGradV2"}
REF_VARIABLE_OPS = frozenset({"Variable", "VariableV2"})
#: A TF1 while loop's back edge: NextIteration feeds its value back into a Merge.
BACK_EDGE_OPS = frozenset({"NextIteration", "RefNextIteration"})
MERGE_OPS = frozenset({"Merge", "RefMerge"})

TF_RULES = FormatRules(
    name="tf",
    # A divisor that flushes to zero turns x / c into inf: `x / c` is RealDiv, `1 / c` Reciprocal
    # (Inv in old graphs); the integer-style divisions and Pow's exponent likewise.
    divisor_slots=frozenset({
        ("RealDiv", 1), ("Div", 1), ("DivNoNan", 1), ("FloorDiv", 1), ("TruncateDiv", 1),
        ("FloorMod", 1), ("TruncateMod", 1), ("Mod", 1), ("Xdivy", 1), ("Pow", 1),
        ("Reciprocal", 0), ("Inv", 0), ("Rsqrt", 0),
    }),
    # These only inspect their input (Shape, Size) or convert it anyway (Cast's source `SrcT`).
    follow_producer_inputs={"Shape": ("T",), "Size": ("T",), "Cast": ("SrcT",)},
    recurrent_edges={op: MERGE_OPS for op in BACK_EDGE_OPS},
    compute_ops=frozenset({
        "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv2D", "Conv3D",
        "DepthwiseConv2dNative", "Conv2DBackpropInput", "Conv2DBackpropFilter",
        "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2", "_FusedMatMul", "_FusedConv2D",
        "CudnnRNN", "CudnnRNNV2", "CudnnRNNV3", "BlockLSTM", "BlockLSTMV2", "LSTMBlockCell",
        "GRUBlockCell", "Conv",
    }),
    arithmetic={"Add": "add", "AddV2": "add", "Sub": "sub", "Mul": "mul", "RealDiv": "div",
                "Div": "div", "Pow": "pow", "Tanh": "tanh", "Softmax": "softmax",
                "Sqrt": "sqrt", "Rsqrt": "rsqrt", "Reciprocal": "reciprocal", "Inv": "reciprocal",
                "Mean": "mean", "Square": "square", "Cast": "cast"},
    # Float inputs that are sizes or bounds (TF takes most shapes as int tensors, which a float
    # computation reaches through a Cast, itself a seed of the index-math rule).
    index_slots=frozenset({("Range", 0), ("Range", 1), ("Range", 2), ("Reshape", 1),
                           ("Fill", 0), ("BroadcastTo", 1), ("Tile", 1),
                           ("ResizeBilinear", 1), ("ResizeNearestNeighbor", 1),
                           ("StridedSlice", 1), ("StridedSlice", 2), ("StridedSlice", 3),
                           ("Slice", 1), ("Slice", 2)}),
    rounding_ops=frozenset({"Floor", "Ceil", "Round", "Rint"}),
    metadata_ops=frozenset({"Shape", "ShapeN", "Size", "Rank"}),
    lookup_ops=frozenset({"Gather", "GatherV2", "GatherNd", "ResourceGather"}),
    # Ops that hand on their input's values unchanged or only selected: a constant's range
    # guard follows them (frozen TF2 graphs read every weight through an Identity).
    carry_ops={"Identity": (0,), "Snapshot": (0,), "StopGradient": (0,), "Reshape": (0,),
               "ExpandDims": (0,), "Squeeze": (0,), "Transpose": (0,), "Tile": (0,),
               "BroadcastTo": (0,), "GatherV2": (0,), "Gather": (0,), "StridedSlice": (0,),
               "Slice": (0,)},
    # No saturate_op yet (the emitter writes any op a pass adds, ClipByValue included, but the
    # rule is not measured on TF graphs): the attention-mask rule is off for TF graphs, whose
    # masks keep the constant-range rule.
)
