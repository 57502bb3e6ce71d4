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
        "CudnnRNN", "CudnnRNNV2", "CudnnRNNV3", "BlockLSTM", "BlockLSTMV2",
    }),
)
