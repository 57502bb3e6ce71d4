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
    # onnxruntime's normalisations (schemas from onnxruntime: their statistics are float only)
    ("SimplifiedLayerNormalization", "U"): "SimplifiedLayerNormalization's inv_std_var output "
                                           "is an fp32 statistic",
    ("SkipLayerNormalization", "U"): "SkipLayerNormalization's mean/inv_std_var outputs are fp32 "
                                     "statistics",
    ("SkipSimplifiedLayerNormalization", "U"): "SkipSimplifiedLayerNormalization's statistics "
                                               "outputs are fp32",
}

#: Type params a schema keeps apart that the conversion treats as one group: op -> {param: the
#: param whose group it joins}. onnxruntime's SimplifiedLayerNormalization (and its pre-opset-17
#: LayerNormalization) type X as T and scale/Y as V; its kernels run T == V, and with two groups
#: X would sit in a group with no output, never between two low-precision ops.
TIED_TYPE_PARAMS: dict[str, dict[str, str]] = {
    "SimplifiedLayerNormalization": {"V": "T"},
    "LayerNormalization": {"V": "T"},
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
        # onnxruntime's fused ops that hold GEMMs (contrib domain)
        "com.microsoft.Attention", "com.microsoft.MultiHeadAttention",
        "com.microsoft.GroupQueryAttention", "com.microsoft.FusedMatMul",
        "com.microsoft.FusedConv", "com.microsoft.FusedGemm", "com.microsoft.GemmFastGelu",
        "com.microsoft.DecoderMaskedMultiHeadAttention", "com.microsoft.PackedAttention",
        "com.microsoft.PackedMultiHeadAttention", "com.microsoft.MatMulNBits",
    }),
    arithmetic={"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow",
                "Tanh": "tanh", "Softmax": "softmax", "Sqrt": "sqrt", "Reciprocal": "reciprocal",
                "ReduceMean": "mean", "Cast": "cast"},
    # Inputs that are shapes, sizes, coordinates or indices (float ones included: Range's
    # bounds, Resize's roi/scales); a float computation feeding them is index math.
    index_slots=frozenset({
        ("Range", 0), ("Range", 1), ("Range", 2), ("Reshape", 1), ("Expand", 1), ("Tile", 1),
        ("ConstantOfShape", 0), ("Slice", 1), ("Slice", 2), ("Slice", 3), ("Slice", 4),
        ("Resize", 1), ("Resize", 2), ("Resize", 3), ("Upsample", 1), ("Pad", 1), ("TopK", 1),
        ("OneHot", 1), ("Squeeze", 1), ("Unsqueeze", 1), ("Trilu", 1), ("CenterCropPad", 1),
    }),
    rounding_ops=frozenset({"Floor", "Ceil", "Round"}),
    metadata_ops=frozenset({"Shape", "Size"}),
    lookup_ops=frozenset({"Gather", "GatherElements", "GatherND"}),
    mask_build_ops=frozenset({
        "Where", "Mul", "Sub", "Add", "Div", "Neg", "Expand", "Cast", "Reshape", "Unsqueeze",
        "Squeeze", "Concat", "Tile", "Slice", "Transpose", "Gather", "Identity", "Trilu",
        "Min", "Max", "Clip", "Flatten",
    }),
    carry_ops={
        "Reshape": (0,), "Transpose": (0,), "Squeeze": (0,), "Unsqueeze": (0,), "Expand": (0,),
        "Slice": (0,), "Gather": (0,), "Tile": (0,), "Identity": (0,), "Flatten": (0,),
        "Split": (0,), "Cast": (0,), "Where": (1, 2), "Concat": tuple(range(64)),
    },
    saturate_op="Clip",
    saturate_pair=("Max", "Min"),
    rescale_ops={"abs": "Abs", "reduce_max": "ReduceMax", "clip": "Clip", "div": "Div",
                 "mul": "Mul", "add": "Add", "sqrt": "Sqrt", "reciprocal": "Reciprocal"},
    periodic_ops=frozenset({"Cos", "Sin"}),
    # Mod without fmod: the remainder takes the divisor's sign (integers only).
    integer_ops={"mul": "Mul", "add": "Add", "sub": "Sub", "mod": "Mod", "div": "Div"},
)
