"""What ONNX op names mean for precision: the data the loader and the generic passes need.

The loader reads the fixed-dtype parameters and attribute-typed outputs; the passes receive
`ONNX_RULES` (divisor slots, inputs that follow their producer, constant-fill attributes).
"""

from __future__ import annotations

from ...passes.base import FormatRules

#: Slots whose dtype carries meaning rather than precision: never repainted.
#: (op, type constraint) -> why.
FIXED_TYPE_PARAMS: dict[tuple[str, str], str] = {
    ("Resize", "T2"): "Resize scales/roi are coordinates, not activations",
    ("Dropout", "T1"): "Dropout ratio is a probability input",
    ("LayerNormalization", "U"): "LayerNormalization mean/inv-std outputs are fp32 statistics",
    ("GroupNormalization", "U"): "GroupNormalization statistics stay fp32",
}

#: Ops whose output dtype comes from an attribute (or, for BitCast, is a reinterpretation):
#: repainting them would need the attribute rewritten, so their outputs keep their dtype.
ATTRIBUTE_TYPED_OUTPUTS = frozenset({
    "Constant", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
    "EyeLike", "Bernoulli", "Multinomial", "HannWindow", "HammingWindow", "BlackmanWindow",
    "MelWeightMatrix", "BitCast",
})

#: Ops with a body graph whose groups tie outer slots to body inputs and outputs.
CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan"})

ONNX_RULES = FormatRules(
    name="onnx",
    # A divisor (or exponent) that flushes to zero changes the result completely.
    divisor_slots=frozenset({("Div", 1), ("Reciprocal", 0), ("Pow", 1), ("Mod", 1)}),
    # These only inspect their input (Shape, Size, IsNaN) or convert it anyway (Cast, CastLike).
    follow_producer_inputs={"Shape": ("T",), "Size": ("T",), "Cast": ("T1",), "IsNaN": ("T1",),
                            "IsInf": ("T1",), "CastLike": ("T1",)},
    constant_fill_attrs={"ConstantOfShape": "value"},
    compute_ops=frozenset({
        "MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "LSTM", "GRU", "RNN", "Attention",
        "com.microsoft.Attention", "com.microsoft.MultiHeadAttention",
        "com.microsoft.GroupQueryAttention", "com.microsoft.FusedMatMul",
        "com.microsoft.FusedConv", "com.microsoft.FusedGemm",
    }),
)
