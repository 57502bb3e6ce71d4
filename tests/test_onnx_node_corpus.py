"""A curated slice of the ONNX backend test corpus through convert + checker + onnxruntime.

`scripts/corpus_check.py` (testkit.onnx_corpus) sweeps the whole corpus (about 2000 models); this test keeps a
representative 90 of them that pass today, so a regression in the loader, the passes or the
emitter on any of these op types shows up in the normal test run:

- single-op node tests for the ops of every list (allow, infer, deny, clear) and a few unlisted
  ones, plus ops whose float slots carry meaning (Resize, Dropout, LayerNormalization, Range);
- multi-node models: function-expanded node tests (attention, layer norm, GELU, affine grid with
  If, linear attention with Scan, Range with Loop), If/Loop/Scan and sequence models, a few
  pytorch exports and AlexNet from `data/light` (weights made by ConstantOfShape).

Each model runs as `onnx_corpus.check_case` does it: `amp_rewriter.convert` in-process, then
`onnx.checker.check_model(full_check=True)`, graph I/O dtypes kept, and the fp32 and converted
models run in onnxruntime's CPU provider on the test's own inputs (bf16 emulated), outputs within
max|a-b|/max|a| <= 5e-2 (fp16) / 2.5e-1 (bf16). "allow-all" configurations move every op type of
the model into the allow list (the documented `allow=` override), which forces low precision
wherever a schema allows it: most single-op tests convert nothing without it.

The node tests are generated once from onnx's own test-case generators when the installed wheel
does not ship `onnx/backend/test/data/node` (about 15 s, cached under ~/.cache/amp-rewriter).

Bugs the sweep found are kept as regression cases (FIXED_BUGS), with what went wrong.
"""

from __future__ import annotations

import pytest

from testkit import onnx_corpus

#: name -> check_case options.
CONFIGS: dict[str, dict] = {
    "fp16": dict(target="fp16"),
    "bf16": dict(target="bf16"),
    "fp16-allow-all": dict(target="fp16", mode="allow-all"),
    "bf16-allow-all": dict(target="bf16", mode="allow-all"),
    "fp16-allow-all-noio": dict(target="fp16", mode="allow-all", keep_io_types=False),
    "bf16-cpu-allow-all": dict(target="bf16", backend="ort-cpu", mode="allow-all"),
}
FOUR = ("fp16", "bf16", "fp16-allow-all", "bf16-allow-all")
SIX = tuple(CONFIGS)

#: "suite/name" -> configurations that pass today.
CURATED: dict[str, tuple[str, ...]] = {
    # allow list
    "node/test_conv_with_strides_padding": SIX,
    "node/test_convtranspose_pad": FOUR,
    "node/test_matmul_2d": SIX,
    "node/test_gemm_all_attributes": SIX,
    "node/test_einsum_batch_matmul": FOUR,
    "node/test_lstm_with_initial_bias": FOUR,
    "node/test_gru_defaults": FOUR,
    "node/test_simple_rnn_bidirectional": FOUR,
    # infer list
    "node/test_add_bcast": FOUR,
    "node/test_mul": FOUR,
    "node/test_div_example": FOUR,
    "node/test_sum_two_inputs": FOUR,
    "node/test_batchnorm_epsilon": SIX,
    "node/test_instancenorm_epsilon": FOUR,
    "node/test_sigmoid_example": FOUR,
    "node/test_tanh": FOUR,
    "node/test_gelu_default_2": FOUR,
    "node/test_elu": FOUR,
    "node/test_leakyrelu_default": FOUR,
    "node/test_prelu_example": FOUR,
    "node/test_mish": FOUR,
    "node/test_sqrt": FOUR,
    "node/test_log": FOUR,
    "node/test_averagepool_2d_same_lower": FOUR,
    "node/test_globalaveragepool_precomputed": FOUR,
    "node/test_lppool_2d_strides": FOUR,
    # deny list
    "node/test_exp_example": FOUR,
    "node/test_pow_bcast_scalar": FOUR,
    "node/test_softmax_example": FOUR,
    "node/test_logsoftmax_example_1": FOUR,
    "node/test_layer_normalization_4d_axis3": SIX,
    "node/test_group_normalization_example": FOUR,
    "node/test_reduce_sum_do_not_keepdims_random": FOUR,
    "node/test_reduce_mean_default_axes_keepdims_random": FOUR,
    "node/test_reduce_l2_keep_dims_example": FOUR,
    "node/test_cumsum_2d_axis_0": FOUR,
    "node/test_nllloss_NCd1d2": FOUR,
    "node/test_det_2d": FOUR,
    "node/test_l1normalization_axis_0": FOUR,
    # clear list
    "node/test_reshape_reordered_all_dims": SIX,
    "node/test_transpose_default": FOUR,
    "node/test_unsqueeze_axis_2": FOUR,
    "node/test_concat_2d_axis_0": FOUR,
    "node/test_split_variable_parts_2d_opset18": SIX,
    "node/test_slice_default_steps": FOUR,
    "node/test_gather_2d_indices": FOUR,
    "node/test_expand_dim_changed": FOUR,
    "node/test_constant_pad_negative_axes": FOUR,
    "node/test_resize_downsample_scales_linear_antialias": FOUR,
    "node/test_resize_upsample_sizes_nearest": FOUR,
    "node/test_scatternd": FOUR,
    "node/test_scatter_elements_with_negative_indices": FOUR,
    "node/test_where_example": FOUR,
    "node/test_dropout_default_mask_ratio": FOUR,
    "node/test_clip_default_inbounds": FOUR,
    "node/test_maxpool_1d_default": FOUR,
    "node/test_reduce_max_do_not_keepdims_example": FOUR,
    "node/test_top_k_negative_axis": FOUR,
    "node/test_argmax_default_axis_example": FOUR,
    "node/test_constantofshape_float_ones": FOUR,
    "node/test_center_crop_pad_crop": FOUR,
    # unlisted (fp32 barriers) and inputs that follow their producer
    "node/test_cast_DOUBLE_to_FLOAT": FOUR,
    "node/test_castlike_DOUBLE_to_FLOAT": FOUR,
    "node/test_shape_clip_end": FOUR,
    "node/test_attention_24_qk_matmul_output_mode3_softmax_precision": FOUR,
    "node/test_rotary_embedding_3d_input": FOUR,
    "node/test_range_float_type_positive_delta": FOUR,
    # multi-node: function-expanded tests
    "node/test_attention_3d_expanded": SIX,
    "node/test_layer_normalization_4d_axis_negative_1_expanded": SIX,
    "node/test_group_normalization_example_expanded": SIX,
    "node/test_gelu_tanh_2_expanded": SIX,
    "node/test_softmax_example_expanded": SIX,
    "node/test_sce_mean_weight_expanded": SIX,
    "node/test_rotary_embedding_expanded": SIX,
    # control flow: If, Scan, Loop
    "node/test_affine_grid_2d_expanded": SIX,
    "node/test_linear_attention_linear_expanded": SIX,
    "node/test_range_float_type_positive_delta_expanded": SIX,
    "node/test_if": ("fp16", "bf16", "fp16-allow-all", "fp16-allow-all-noio"),
    "node/test_loop11": ("fp16", "bf16", "fp16-allow-all", "fp16-allow-all-noio"),
    "node/test_scan9_sum": ("fp16", "bf16", "fp16-allow-all", "fp16-allow-all-noio"),
    # sequences
    "node/test_sequence_map_add_2_sequences_expanded": SIX,
    "node/test_sequence_map_identity_2_sequences": SIX,
    "node/test_sequence_insert_at_back": FOUR,
    "node/test_if_seq": ("fp16", "bf16", "bf16-allow-all", "bf16-cpu-allow-all"),
    "simple/test_sequence_model2": SIX,
    "simple/test_sequence_model4": SIX,
    # other suites
    "simple/test_expand_shape_model1": FOUR,
    "pytorch-operator/test_operator_symbolic_override_nested": FOUR,
    "pytorch-converted/test_PixelShuffle": FOUR,
    "light/light_bvlc_alexnet": ("fp16",),  # ~3 s: ORT runs its 4096-wide Gemms
}

_IR3 = ("IR < 4 model: convert_constants adds the fp16 copy of an initializer (or a folded "
        "Constant) as a new initializer that is not a graph input, which IR < 4 requires "
        "('X_float16 in initializer but not in graph input')")
_SEQ = ("a type group with a sequence/optional-typed slot is painted on its tensor slots only "
        "(--allow on a sequence op): the sequence's element type stays float")
_CF_BF16 = ("If/Loop/Scan groups have no type constraint (allowed=None): with the op allowed, "
            "bf16 casts are inserted into an opset < 13 model, where Cast has no bf16")

#: Regression cases for bugs the corpus sweep found and that are fixed:
#: (case, configuration, what went wrong, outcomes that count as fixed).
FIXED_BUGS: list[tuple[str, str, str, tuple[str, ...]]] = [
    ("pytorch-converted/test_Conv2d", "fp16", _IR3, ("ok",)),
    ("pytorch-operator/test_operator_mm", "fp16", _IR3 + "; here a folded Constant", ("ok", "ok_unverified")),
    ("light/light_squeezenet", "fp16", _IR3, ("ok",)),
    ("pytorch-converted/test_Conv1d", "fp16-allow-all-noio",
     "keep_io_types=False lowers the declared type of a graph input that is also an "
     "initializer, but not the initializer (insert_casts._lower_graph_inputs)", ("ok",)),
    ("node/test_scan_sum", "fp16",
     "Scan-8 (sequence_lens first, batch axis) crashes the loader with IndexError "
     "(loaders/onnx.py _control_flow_groups assumes the opset-9 layout)", ("ok", "refused")),
    ("node/test_split_to_sequence_1", "fp16-allow-all", _SEQ, ("ok",)),
    ("simple/test_sequence_model1", "fp16-allow-all", _SEQ, ("ok",)),
    ("node/test_bernoulli_seed_expanded", "fp16-allow-all",
     "RandomUniformLike's output group is painted fp16 but its dtype attribute stays FLOAT "
     "(outputs typed by an attribute are not fixed, and the emitter patches only Cast.to)",
     ("ok", "ok_unverified")),
    ("node/test_if", "bf16-allow-all", _CF_BF16, ("ok",)),
    ("node/test_loop11", "bf16-allow-all", _CF_BF16, ("ok",)),
    ("node/test_center_crop_pad_crop_expanded", "bf16-cpu-allow-all",
     "the ort-cpu bf16 kernel table lists Pad, but ORT CPU has a bf16 Pad only from opset 21",
     ("ok",)),
    ("node/test_scatternd_add", "bf16-cpu-allow-all",
     "the ort-cpu bf16 kernel table lists ScatterND, but ORT CPU refuses bf16 with a reduction",
     ("ok",)),
]


def _params():
    params = [pytest.param(case, config, ("ok",), id=f"{config}:{case}")
              for case, configs in CURATED.items() for config in configs]
    for case, config, _what_went_wrong, fixed in FIXED_BUGS:
        params.append(pytest.param(case, config, fixed, id=f"{config}:{case}"))
    return params


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """'suite/name' -> model path, generating the node tests once if the wheel lacks them."""
    try:
        cases = onnx_corpus.list_cases()
    except OSError:  # the cache folder is not writable: generate into this session's tmp
        cases = onnx_corpus.list_cases(cache_dir=tmp_path_factory.mktemp("onnx-node-corpus"))
    return {f"{suite}/{name}": path for suite, name, path in cases}


def _describe(record: dict) -> str:
    keys = ("outcome", "stage", "message", "exc_type", "where", "traceback", "handmade",
            "outputs", "note")
    return "\n".join(f"{k}: {record[k]}" for k in keys if record.get(k) is not None)


@pytest.mark.parametrize(("case", "config", "fixed"), _params())
def test_corpus_model(corpus: dict[str, str], case: str, config: str, fixed: tuple[str, ...]):
    path = corpus.get(case)
    if path is None:
        pytest.skip(f"{case} is not in the corpus of this onnx version")
    record = onnx_corpus.check_case(path, **CONFIGS[config])
    assert record["outcome"] in fixed, _describe(record)


def test_curated_set_converts_something(corpus: dict[str, str]):
    """The default fp16 conversion really lowers the multi-node models (not a silent no-op)."""
    for case in ("node/test_attention_3d_expanded", "node/test_affine_grid_2d_expanded",
                 "node/test_linear_attention_linear_expanded"):
        if case not in corpus:
            continue
        record = onnx_corpus.check_case(corpus[case], target="fp16")
        assert record["outcome"] == "ok", _describe(record)
        assert record["low_precision_nodes"] > 0, f"{case}: nothing converted"


def test_has_bfloat16_sees_subgraphs(corpus: dict[str, str]):
    import amp_rewriter
    from amp_rewriter.formats.onnx.validate import has_bfloat16

    case = "node/test_linear_attention_linear_expanded"
    if case not in corpus:
        pytest.skip(f"{case} is not in the corpus of this onnx version")
    converted, _report = amp_rewriter.convert(corpus[case], target="bf16")
    assert onnx_corpus.has_bfloat16_anywhere(converted)
    assert has_bfloat16(converted)
