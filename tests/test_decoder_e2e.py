"""A LLaMA-style decoder exported by torch (RMSNorm, RoPE, grouped-query attention, SwiGLU, KV
cache) through the CLI: where the backend allows it (ort-cpu) every RMS norm's mean square runs
fp16 on its rescaled row and no fp32 copy of the residual stream is left; on ort-cuda, whose fp16
ReduceMax was measured slow and wrong, the statistics stay fp32. Either way the outputs match
fp32 with fp16 rounding emulated."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from amp_rewriter.cli import main  # noqa: E402
from testkit.builder import run, run_as_fp16  # noqa: E402

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

DIMS = dict(vocab=1000, hidden=64, layers=2, heads=4, kv_heads=2, ffn=172)
BATCH, NEW, PAST = 2, 6, 8
NORMS = 2 * DIMS["layers"] + 1  # two per layer and the final one


@pytest.fixture(scope="module")
def decoder(tmp_path_factory) -> Path:
    from testkit.models.torch_export import export_llama_with_cache

    torch.manual_seed(0)
    return export_llama_with_cache(DIMS, tmp_path_factory.mktemp("decoder") / "decoder.onnx")


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    mask = np.ones((BATCH, PAST + NEW), np.int64)
    mask[1, :5] = 0  # left padding
    feeds = {"input_ids": rng.integers(0, DIMS["vocab"], (BATCH, NEW), dtype=np.int64),
             "attention_mask": mask}
    head_dim = DIMS["hidden"] // DIMS["heads"]
    for layer in range(DIMS["layers"]):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kind}"] = rng.standard_normal(
                (BATCH, DIMS["kv_heads"], PAST, head_dim)).astype(np.float32)
    return feeds


def test_decoder_rms_norms_run_their_mean_square_fp16(decoder: Path, tmp_path: Path) -> None:
    out = tmp_path / "decoder16.onnx"
    assert main(["convert", str(decoder), str(out), "--backend", "ort-cpu", "--quiet"]) == 0
    converted = onnx.load(str(out))
    ops = [n.op_type for n in converted.graph.node]
    assert ops.count("ReduceMax") == NORMS and "Pow" not in ops, ops
    onnx.checker.check_model(converted, full_check=True)
    # No fp32 activation with the residual stream's shape [batch, new tokens, hidden].
    fixed = onnx.ModelProto()
    fixed.CopyFrom(converted)
    feeds = _feeds()
    for info in fixed.graph.input:
        for dim, size in zip(info.type.tensor_type.shape.dim, feeds[info.name].shape):
            dim.Clear()
            dim.dim_value = size
    inferred = onnx.shape_inference.infer_shapes(fixed, data_prop=True)
    wide_rows = [v.name for v in inferred.graph.value_info
                 if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
                 and [d.dim_value for d in v.type.tensor_type.shape.dim]
                 == [BATCH, NEW, DIMS["hidden"]]]
    assert wide_rows == []
    original = onnx.load(str(decoder))
    expected = run(original, feeds)
    for actual, wanted in zip(run_as_fp16(converted, feeds), expected):
        assert np.isfinite(actual).all()
        assert np.abs(actual - wanted).max() <= 1e-2 * np.abs(wanted).max()


def test_decoder_rms_norms_keep_fp32_statistics_on_ort_cuda(decoder: Path, tmp_path: Path) -> None:
    out = tmp_path / "decoder16.onnx"
    assert main(["convert", str(decoder), str(out), "--backend", "ort-cuda", "--quiet"]) == 0
    converted = onnx.load(str(out))
    ops = [n.op_type for n in converted.graph.node]
    assert "ReduceMax" not in ops and ops.count("Pow") == NORMS, ops
    feeds = _feeds()
    expected = run(onnx.load(str(decoder)), feeds)
    for actual, wanted in zip(run_as_fp16(converted, feeds), expected):
        assert np.isfinite(actual).all()
        assert np.abs(actual - wanted).max() <= 1e-2 * np.abs(wanted).max()
