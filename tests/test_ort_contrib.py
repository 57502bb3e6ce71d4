"""onnxruntime's contrib ops as first-class ops: schemas from onnxruntime, op-list entries per
backend, `--optimize` (onnxruntime's transformer optimizer first), validation that emulates what
the CPU provider cannot run in low precision, `--device`, and the report's cost summary."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

import amp_rewriter
from amp_rewriter.cli import main
from amp_rewriter.formats.onnx import ort_registry
from amp_rewriter.formats.onnx.emulation import EVERY_NODE, emulate_low_precision
from amp_rewriter.formats.onnx.load import load_onnx
from amp_rewriter.formats.onnx.validate import validate_conversion
from amp_rewriter.op_lists import read_list_file
from testkit import ort_kernels
from testkit.builder import GraphBuilder, assert_close, run

MS = "com.microsoft"


def fused_block(extra_ms_op: str | None = None) -> onnx.ModelProto:
    """Attention (with an int32 mask_index) -> SkipLayerNormalization -> MatMul -> BiasGelu
    -> MatMul: the shape of an onnxruntime-fused BERT layer."""
    b = GraphBuilder(opset=17)
    b.extra_opsets[MS] = 1
    x = b.input("x", [2, 4, 16])
    mask = b.input("mask_index", [2], np.int32)
    att = b.op("Attention", x, b.weight("qkv_w", [16, 48]), b.weight("qkv_b", [48]), mask,
               name="attn", domain=MS, num_heads=2)
    ln = b.op("SkipLayerNormalization", att, x, b.weight("gamma", [16]), b.weight("beta", [16]),
              name="skip_ln", domain=MS)
    h = b.op("MatMul", ln, b.weight("w1", [16, 32]), name="ffn_in")
    g = b.op("BiasGelu", h, b.weight("b1", [32]), name="gelu", domain=MS)
    if extra_ms_op:
        g = b.op(extra_ms_op, g, name="mystery", domain=MS)
    y = b.op("MatMul", g, b.weight("w2", [32, 16]), name="ffn_out")
    b.output(y, dtype=np.float32, shape=[2, 4, 16])
    return b.build()


def block_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((2, 4, 16)).astype(np.float32),
            "mask_index": np.array([4, 2], np.int32)}


def node_dtypes(model: onnx.ModelProto, op_type: str) -> set[str | None]:
    """The dtypes of every float input/output of the model's `op_type` nodes (our loader)."""
    ir = load_onnx(model)
    return {v.dtype for n in ir.graph.walk_nodes() if n.op_type == op_type
            for v in n.inputs + n.outputs if v is not None and v.dtype not in ("int32", "int64")}


# -- schemas ------------------------------------------------------------------------------------
def test_contrib_op_type_groups_come_from_onnxruntime_schemas():
    ir = load_onnx(fused_block())
    attention = next(n for n in ir.graph.walk_nodes() if n.op_type == "Attention")
    assert attention.has_schema
    groups = {g.name: g for g in attention.type_groups}
    assert groups["T"].input_slots == (0, 1, 2) and groups["T"].output_slots == (0,)
    assert groups["M"].allowed == frozenset({"int32"}) and groups["M"].input_slots == (3,)
    skip_ln = next(n for n in ir.graph.walk_nodes() if n.op_type == "SkipLayerNormalization")
    assert {g.name for g in skip_ln.type_groups} >= {"T"}


def test_fused_ops_run_fp16_on_ort_cuda_and_fixed_slots_keep_their_dtype():
    model = fused_block()
    converted, report = amp_rewriter.convert(model)
    by_name = {e["name"]: e for e in report.nodes}
    for name in ("attn", "skip_ln", "ffn_in", "gelu", "ffn_out"):
        assert by_name[name]["precision"] == "fp16", by_name[name]
    assert by_name["attn"]["kind"] == "op_list" and "attention_softmax.h" in by_name["attn"]["reason"]
    # mask_index (type M, int32 only) is never repainted: the input is read as it is.
    attention = next(n for n in converted.graph.node if n.op_type == "Attention")
    assert attention.input[3] == "mask_index"
    assert node_dtypes(converted, "Attention") == {"float16"}
    assert report.summary["casts_inserted"] == 2  # the graph input in, the output back
    assert_close(model, converted, block_feeds())


def test_unknown_contrib_op_stays_an_fp32_barrier():
    _, report = amp_rewriter.convert(fused_block(extra_ms_op="NoSuchFusedOp"))
    entry = next(e for e in report.nodes if e["name"] == "mystery")
    assert entry["precision"] == "fp32" and entry["kind"] == "schema"


def test_model_local_function_wins_over_onnxruntime_schema():
    b = GraphBuilder(opset=17)
    x = b.input("x", [2, 8])
    h = b.op("MatMul", x, b.weight("w", [8, 8]), name="mm")
    body = [onnx.helper.make_node("Relu", ["a"], ["c"])]
    b.function(MS, "BiasGelu", ["a", "b"], ["c"], body)
    g = b.op("BiasGelu", h, b.weight("bias", [8]), name="local_gelu", domain=MS)
    b.output(b.op("MatMul", g, b.weight("w2", [8, 8]), name="mm2"), dtype=np.float32, shape=[2, 8])
    _, report = amp_rewriter.convert(b.build())
    entry = next(e for e in report.nodes if e["name"] == "local_gelu")
    assert entry["precision"] == "fp32" and entry["kind"] == "schema"


def test_default_domain_op_only_onnxruntime_defines_has_a_schema():
    """SimplifiedLayerNormalization (RMSNorm, default domain) is onnxruntime's, not onnx's: X and
    Y (T and V, tied) run fp16 between MatMuls on ort-cuda, its inv_std_var (U) stays fp32."""
    b = GraphBuilder(opset=17)
    x = b.input("x", [2, 16])
    h = b.op("MatMul", x, b.weight("w", [16, 16]), name="mm")
    y, inv_std = b.op("SimplifiedLayerNormalization", h, b.weight("scale", [16]), name="rms",
                      outputs=2, axis=-1, epsilon=1e-5)
    b.output(b.op("MatMul", y, b.weight("w2", [16, 16]), name="mm2"), dtype=np.float32,
             shape=[2, 16])
    b.output(inv_std, dtype=np.float32, shape=[2, 1])
    model = b.build(check=False)  # onnx's checker alone has no schema for it
    converted, report = amp_rewriter.convert(model)  # ours checks it as the custom op it is
    rms = next(e for e in report.nodes if e["name"] == "rms")
    assert rms["precision"] == "fp16"
    assert {g["group"]: g["precision"] for g in rms["groups"]} == {"T": "fp16"}
    ir = load_onnx(converted)
    node = next(n for n in ir.graph.walk_nodes() if n.op_type == "SimplifiedLayerNormalization")
    assert [v.dtype for v in node.inputs + node.outputs] == ["float16"] * 3 + ["float32"]
    assert_close(model, converted, {"x": np.random.default_rng(1).standard_normal((2, 16))
                                    .astype(np.float32)})


@pytest.mark.parametrize("target, backend, node, precision, kind", [
    ("fp16", "ort-cpu", "attn", "fp32", "op_list"),           # generic: softmax inside
    ("fp16", "ort-cpu", "skip_ln", "fp32", "propagation"),    # deny spreads from Attention
    ("bf16", "ort-cuda", "attn", "bf16", "op_list"),
    ("bf16", "ort-cuda", "gelu", "bf16", "propagation"),
    ("bf16", "ort-cpu", "attn", "fp32", "backend_kernel"),    # no bf16 CPU kernel: measured
])
def test_backend_profiles_classify_fused_ops(target, backend, node, precision, kind):
    _, report = amp_rewriter.convert(fused_block(), target=target, backend=backend)
    entry = next(e for e in report.nodes if e["name"] == node)
    assert (entry["precision"], entry["kind"]) == (precision, kind), entry


def test_ort_cpu_bf16_contrib_entries_agree_with_onnxruntimes_kernel_registry():
    """The ort-cpu bf16 table lists exactly the classified contrib ops that have a bf16 CPU
    kernel (fails when onnxruntime changes: re-run scripts/ort_cpu_kernels.py)."""
    data = read_list_file("onnx")
    listed = set(data["backends"]["ort-cpu"]["bf16"]["kernels"])
    classified = {op for table in ("fp16", "bf16") for ops in data[table].values() for op in ops
                  if op.startswith(MS + ".") or op == "SimplifiedLayerNormalization"}
    for op in sorted(classified):
        domain, _, name = op.rpartition(".")
        has = ort_registry.cpu_kernel_for(name, domain, 1, [("T", "bfloat16")])
        assert has == (op in listed), op


# -- --optimize ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torchscript_bert(tmp_path_factory) -> Path:
    """A tiny BERT exported the way onnxruntime's optimizer fuses completely (eager attention,
    TorchScript exporter)."""
    pytest.importorskip("torch")
    from testkit.models import torch_export

    path = tmp_path_factory.mktemp("bert") / "bert.onnx"
    return torch_export.export_bert(path, 17, attn_implementation="eager", torchscript=True)


def optimize_flags() -> list[str]:
    from testkit.models import torch_export

    return ["--optimize", "bert", "--num-heads", str(torch_export.SMALL_NUM_HEADS),
            "--hidden-size", str(torch_export.SMALL_HIDDEN_SIZE)]


def cli(capsys, *args: object) -> tuple[int, str, str]:
    """The CLI in-process: (exit code, stdout, stderr)."""
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_optimize_bert_runs_every_fused_op_in_fp16(capsys, torchscript_bert, tmp_path):
    """Acceptance: `--optimize bert` on a torch-exported BERT gives a model whose fused ops are
    all fp16 on ort-cuda, validated against fp32, with the input untouched."""
    before = hashlib.sha256(torchscript_bert.read_bytes()).hexdigest()
    out, report_path = tmp_path / "bert_fp16.onnx", tmp_path / "report.json"
    code, stdout, stderr = cli(capsys, "convert", torchscript_bert, out, *optimize_flags(),
                               "--validate", "--report", report_path)
    assert code == 0, stderr
    assert "optimized with onnxruntime" in stdout and "cost:" in stdout
    assert hashlib.sha256(torchscript_bert.read_bytes()).hexdigest() == before
    report = json.loads(report_path.read_text())
    added = report["optimizer"]["ops_added"]
    for op in ("Attention", "EmbedLayerNormalization", "SkipLayerNormalization", "BiasGelu"):
        assert added.get(f"{MS}.{op}", 0) > 0, added
    converted = onnx.load(str(out))
    fused = [n for n in converted.graph.node if n.domain == MS]
    assert len(fused) == sum(count for op, count in added.items() if op.startswith(MS))
    for op in {n.op_type for n in fused}:
        assert node_dtypes(converted, op) == {"float16"}, op
    assert all(e["precision"] == "fp16" for e in report["nodes"] if e["op"].startswith(MS))
    assert report["summary"]["casts_inserted"] <= 4
    assert report["validation"]["passed"]
    assert {o["computed"] for o in report["validation"]["outputs"]} == {"emulated"}
    assert report["cost"]["compute_ops"]["fp32"] == 0
    assert report["cost"]["activation_bytes"]["low_precision_share"] > 0.8


def test_optimize_is_deterministic_and_keeps_external_data(torchscript_bert, tmp_path):
    kwargs = dict(optimize="bert", num_heads=4, hidden_size=64)
    first, _ = amp_rewriter.convert(torchscript_bert, **kwargs)
    second, _ = amp_rewriter.convert(torchscript_bert, **kwargs)
    assert first.SerializeToString() == second.SerializeToString()

    source = tmp_path / "external" / "bert.onnx"
    source.parent.mkdir()
    onnx.save_model(onnx.load(str(torchscript_bert)), str(source), save_as_external_data=True,
                    location="bert.onnx.data", size_threshold=0)
    out = tmp_path / "out" / "bert_fp16.onnx"
    out.parent.mkdir()
    _, report = amp_rewriter.convert_file(source, out, **kwargs)
    assert (out.parent / "bert_fp16.onnx.data").is_file()
    assert report.optimizer["ops_added"][f"{MS}.Attention"] == 2
    feeds = {"input_ids": np.array([[1, 5, 7, 9], [3, 2, 8, 4]], np.int64),
             "attention_mask": np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.int64)}
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    reference = ort.InferenceSession(str(torchscript_bert), providers=["CPUExecutionProvider"])
    for got, want in zip(session.run(None, feeds), reference.run(None, feeds)):
        assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want))


def test_optimize_gpt2_fuses_attention_in_the_classic_attention_export(capsys, tmp_path):
    """transformers 5's GPT-2 exports fuse no attention in onnxruntime's optimizer; the export
    with the pre-4.27 attention code computes the same function as GPT2Model and `--optimize
    gpt2` fuses one Attention per layer, converted to fp16 and validated against fp32."""
    torch = pytest.importorskip("torch")
    from transformers import GPT2Config, GPT2Model

    from testkit.models import torch_export

    config = GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_inner=64,
                        n_positions=64, use_cache=False, attn_implementation="eager")
    torch.manual_seed(0)
    with torch_export.quiet_transformers():
        gpt2 = GPT2Model(config).eval()
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        expected = gpt2(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        classic = torch_export.GPT2WithClassicAttention(gpt2)(ids)
    assert torch.allclose(classic, expected, atol=1e-6)

    dims = dict(vocab=100, hidden=32, layers=2, heads=4, ffn=64)
    source = torch_export.export_gpt2_classic_attention(dims, tmp_path / "gpt2.onnx")
    out, report_path = tmp_path / "gpt2_fp16.onnx", tmp_path / "report.json"
    code, _, stderr = cli(capsys, "convert", source, out, "--optimize", "gpt2", "--num-heads", 4,
                          "--hidden-size", 32, "--validate", "--report", report_path)
    assert code == 0, stderr
    report = json.loads(report_path.read_text())
    assert report["optimizer"]["ops_added"].get(f"{MS}.Attention") == 2, report["optimizer"]
    assert node_dtypes(onnx.load(str(out)), "Attention") == {"float16"}
    assert report["validation"]["passed"]


@pytest.mark.parametrize("flags, message", [
    (["--optimize", "gtp2"], "unknown model type 'gtp2'"),
    (["--num-heads", "4"], "--num-heads only applies with --optimize"),
    (["--optimize", "bert", "--hidden-size", "0"], "--hidden-size must be a positive integer"),
    (["--optimize", "bert", "--num-heads", "four"], "invalid int value"),
])
def test_optimize_bad_usage_is_one_line(capsys, tmp_path, flags, message):
    source = tmp_path / "block.onnx"
    onnx.save(fused_block(), str(source))
    out = tmp_path / "out.onnx"
    code, _, stderr = cli(capsys, "convert", source, out, *flags)
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not out.exists()


# -- validation: emulation and --device ---------------------------------------------------------
#: Ops onnxruntime's CPU provider runs with a real fp16 kernel (measured: scripts/ort_cpu_kernels.py).
REAL_FP16_CPU_OPS = ["SkipLayerNormalization", "SkipSimplifiedLayerNormalization",
                     "SimplifiedLayerNormalization", "RotaryEmbedding", "GroupQueryAttention"]


@pytest.mark.parametrize("op", REAL_FP16_CPU_OPS)
def test_emulation_agrees_with_a_real_fp16_cpu_kernel(op):
    """Acceptance: wherever ORT CPU runs the op in fp16, the emulation (fp32 compute, fp16
    rounding at every fp16 tensor) gives what the real kernel gives, to within one fp16 step."""
    model = ort_kernels.build(op, TensorProto.FLOAT16)
    feeds = ort_kernels.feeds_for(op, np.float16)
    assert validate_ready(model)
    real = run(model, feeds)[0].astype(np.float32)
    emulation = emulate_low_precision(model, policy=EVERY_NODE)
    assert len(emulation.emulated) == 1
    emulated = run(emulation.model, feeds)[0].astype(np.float32)
    step = float(np.spacing(np.float16(np.abs(real).max())))
    assert np.max(np.abs(real - emulated)) <= step


def validate_ready(model: onnx.ModelProto) -> bool:
    """The model's op has a real fp16 CPU kernel (else the test would compare emulations)."""
    node = model.graph.node[0]
    return bool(ort_registry.cpu_kernel_for(node.op_type, node.domain, 1, [("T", "float16")]))


def test_emulation_rounds_at_every_low_precision_tensor():
    """Two fp16 MatMuls (no fp16 CPU kernel): the emulated run equals numpy's fp32 products
    rounded to fp16 after each one."""
    b = GraphBuilder(opset=17)
    x = b.input("x", [4, 8], np.float16)
    w1 = b.const("w1", np.random.default_rng(2).standard_normal((8, 8)), np.float16)
    w2 = b.const("w2", np.random.default_rng(3).standard_normal((8, 8)), np.float16)
    y = b.op("MatMul", b.op("MatMul", x, w1, name="mm1"), w2, name="mm2")
    b.output(y, dtype=np.float16, shape=[4, 8])
    model = b.build()
    emulation = emulate_low_precision(model)
    assert emulation.emulated == ["mm1 (MatMul)", "mm2 (MatMul)"]
    assert emulation.outputs[y] == ("emulated", ["MatMul"])
    xs = np.random.default_rng(4).standard_normal((4, 8)).astype(np.float16)
    got = run(emulation.model, {"x": xs})[0]
    w1v = onnx.numpy_helper.to_array(model.graph.initializer[0]).astype(np.float32)
    w2v = onnx.numpy_helper.to_array(model.graph.initializer[1]).astype(np.float32)
    h = (xs.astype(np.float32) @ w1v).astype(np.float16).astype(np.float32)
    want = (h @ w2v).astype(np.float16)
    assert np.array_equal(got, want)


def test_validation_says_how_each_output_was_computed(tmp_path):
    model = fused_block()
    b = GraphBuilder(opset=17)
    b.extra_opsets[MS] = 1
    x = b.input("x", [2, 4, 16])
    ln = b.op("SkipLayerNormalization", x, x, b.weight("gamma", [16]), b.weight("beta", [16]),
              name="skip_ln", domain=MS)
    b.output(ln, dtype=np.float32, shape=[2, 4, 16])
    b.output(b.op("Relu", x, name="relu"), dtype=np.float32, shape=[2, 4, 16])
    only_kernels = b.build()
    for name, fp32 in (("block", model), ("kernels", only_kernels)):
        onnx.save(fp32, str(tmp_path / f"{name}.onnx"))
        # keep_io_types off, --allow SkipLayerNormalization: the LN runs fp16 on its own
        _, report = amp_rewriter.convert_file(tmp_path / f"{name}.onnx",
                                              tmp_path / f"{name}_fp16.onnx",
                                              allow=[f"{MS}.SkipLayerNormalization"])
    feeds = block_feeds()
    comparisons, notes = validate_conversion(tmp_path / "block.onnx",
                                             tmp_path / "block_fp16.onnx", feeds)
    assert comparisons[0].computed == "emulated"
    assert comparisons[0].emulated_ops == ["MatMul", f"{MS}.Attention", f"{MS}.BiasGelu"]
    assert notes and "ran emulated" in notes[0]
    comparisons, notes = validate_conversion(tmp_path / "kernels.onnx",
                                             tmp_path / "kernels_fp16.onnx", {"x": feeds["x"]})
    assert [(c.name, c.computed) for c in comparisons] == [
        (ln, "low-precision kernels"), ("relu", "fp32")]
    assert notes == [] and all(c.relative < 2e-2 for c in comparisons)


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(),
                    reason="this onnxruntime has a CUDA provider")
def test_device_cuda_without_a_cuda_provider_is_one_line(capsys, tmp_path):
    source, out = tmp_path / "block.onnx", tmp_path / "out.onnx"
    onnx.save(fused_block(), str(source))
    code, _, stderr = cli(capsys, "convert", source, out, "--validate", "--device", "cuda")
    assert code == 2 and "--device cuda" in stderr and "amp-rewriter[gpu]" in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1 and not out.exists()
    code, _, stderr = cli(capsys, "check", source, "--reference", source, "--device", "cuda")
    assert code == 2 and "--device cuda" in stderr, stderr
    code, _, stderr = cli(capsys, "convert", source, out, "--device", "cuda")
    assert code == 2 and "only makes sense with --validate" in stderr


# -- cost summary -------------------------------------------------------------------------------
def test_cost_summary_bytes_compute_ops_and_casts(capsys, tmp_path):
    """x -> MatMul -> Softmax -> y on ort-cuda: the MatMul runs fp16, the Softmax (infer, not
    between allow ops) fp32; two casts. Bytes: each activation written once, read per use."""
    b = GraphBuilder(opset=17)
    x = b.input("x", [2, "n"])
    h = b.op("MatMul", x, b.weight("w", [8, 8]), name="mm")
    b.output(b.op("Softmax", h, name="softmax", axis=-1), dtype=np.float32, shape=[2, "n"])
    model = b.build()
    _, report = amp_rewriter.convert(model)
    cost = report.cost
    assert cost["casts_by_reason"] == {"fp32 consumer (propagation)": 1,
                                       "graph input kept fp32": 1}
    assert cost["compute_ops"] == {"total": 1, "fp32": 0, "fp32_by_kind": {}, "fp32_nodes": []}
    elements = 2 * 8  # the symbolic dim takes validation's sequence size, 8
    traffic = cost["activation_bytes"]
    assert traffic["input_shapes"] == {"x": [2, 8]}
    # low: x cast to fp16 (write + read), the MatMul's output (write + read by its cast)
    assert traffic["low_precision"] == elements * 2 * 2 * 2
    # fp32: x (read by its cast), the cast back (write + read), softmax's y (write + caller)
    assert traffic["fp32"] == elements * 4 * (1 + 2 + 2)
    assert traffic["low_precision_share"] == round(128 / (128 + 320), 4)
    _, denied = amp_rewriter.convert(model, deny=["MatMul"])
    assert denied.cost["compute_ops"]["fp32_by_kind"] == {"user_override": 1}
    assert denied.cost["compute_ops"]["fp32_nodes"][0]["name"] == "mm"

    source = tmp_path / "m.onnx"
    onnx.save(model, str(source))
    code, stdout, stderr = cli(capsys, "convert", source, tmp_path / "out.onnx")
    assert code == 0, stderr
    line = next(line for line in stdout.splitlines() if line.startswith("cost:"))
    assert "29% of" in line and "compute ops fp32 0/1" in line
    assert "1 graph input kept fp32" in line


def test_activation_accesses_counted_on_the_emitted_model():
    """The cost summary counts each activation's accesses on the emitted model: one write and a
    read per consumer, Constant outputs and initializers left out, a value read twice by one
    node counted twice, a graph output read by the caller, reads inside an If branch not
    counted at the top level."""
    from onnx import helper

    from amp_rewriter.formats.onnx.convert import convert_model_ir
    from amp_rewriter.formats.onnx.shapes import activation_traffic, validation_input_shapes
    from amp_rewriter.options import OnnxOptions

    branch_out = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n", 4])
    then_branch = helper.make_graph([helper.make_node("Relu", ["h"], ["b"])], "then", [],
                                    [branch_out])
    else_branch = helper.make_graph([helper.make_node("Neg", ["h"], ["b"])], "else", [],
                                    [branch_out])
    nodes = [
        helper.make_node("Constant", [], ["c"], value=helper.make_tensor(
            "c", TensorProto.FLOAT, [4], [1.0, 2.0, 3.0, 4.0])),
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("Add", ["m", "c"], ["h"]),
        helper.make_node("Mul", ["h", "h"], ["sq"]),
        helper.make_node("ReduceSum", ["sq"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["p"]),
        helper.make_node("If", ["p"], ["y"], then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Softmax", ["h"], ["z"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 4]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.eye(4, dtype=np.float32).ravel()),
         helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    converted, report, _ = convert_model_ir(model, OnnxOptions(target="fp16"))
    # x's cast and the MatMul's cast back to fp32 are the converter's; h: Mul twice, Softmax,
    # the graph output (the If branches' reads are theirs); c and w are constants.
    counted = {"x": 1, "x_fp16": 2, "m": 2, "m_fp32": 2, "h": 5, "sq": 2, "s": 2, "p": 2,
               "y": 2, "z": 2}
    at_validation_sizes = validation_input_shapes(converted)
    sized = onnx.ModelProto()
    sized.CopyFrom(converted)
    dims = sized.graph.input[0].type.tensor_type.shape.dim
    for dim, size in zip(dims, at_validation_sizes["x"]):
        dim.dim_value = size
    inferred = onnx.shape_inference.infer_shapes(sized)
    infos = {info.name: info.type.tensor_type for info in
             [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]}
    expected = {"low_precision": 0, "fp32": 0}
    for name, accesses in counted.items():
        tensor_type = infos[name]
        elements = int(np.prod([dim.dim_value for dim in tensor_type.shape.dim]))
        if tensor_type.elem_type == TensorProto.FLOAT16:
            expected["low_precision"] += 2 * elements * accesses
        elif tensor_type.elem_type == TensorProto.FLOAT:
            expected["fp32"] += 4 * elements * accesses
    moved = report.cost["activation_bytes"]
    assert {key: moved[key] for key in expected} == expected
    assert moved == activation_traffic(converted, at_validation_sizes)


def test_the_cost_inference_stands_in_for_the_checkers_type_check_only_when_it_passes():
    """The cost summary's shape inference runs in the checker's strict, type-checking mode so the
    full check need not run it again; a model it refuses (a declared type that contradicts the
    inferred one) is reported as not checked, and the full check still fails it."""
    from amp_rewriter.errors import AmpError
    from amp_rewriter.formats.onnx.convert import check_valid
    from amp_rewriter.formats.onnx.shapes import checked_activation_traffic

    b = GraphBuilder(opset=17)
    x = b.input("x", [2, "n"])
    h = b.op("MatMul", x, b.weight("w", [8, 8]), name="mm")
    b.output(b.op("Relu", h, name="relu"))
    good = b.build()
    good.graph.value_info.append(onnx.helper.make_tensor_value_info(h, TensorProto.FLOAT,
                                                                    [2, "n"]))
    traffic, checked = checked_activation_traffic(good, {"x": (2, 8)}, type_check=True)
    assert checked and traffic["fp32"] > 0
    assert not checked_activation_traffic(good, {"x": (2, 8)})[1]  # not asked

    bad = onnx.ModelProto()
    bad.CopyFrom(good)
    bad.graph.value_info[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    bad_traffic, checked = checked_activation_traffic(bad, {"x": (2, 8)}, type_check=True)
    assert not checked
    assert bad_traffic == traffic  # shapes still come from the lenient inference
    with pytest.raises(AmpError, match="fails the ONNX checker"):
        check_valid(bad)


def _reshape_by_computed_shape() -> onnx.ModelProto:
    """A Reshape whose target is computed from the input's shape (Shape -> Gather -> Mul ->
    Concat), and a mask of a partly known shape added by broadcasting: what a slice boundary
    must not lose (data propagation, partly known shapes)."""
    b = GraphBuilder(opset=17)
    x = b.input("x", ["batch", 4, 8])
    mask = b.input("mask", ["batch", 1, 8])
    h = b.op("MatMul", x, b.weight("w", [8, 8]), name="mm")
    shape = b.op("Shape", h, name="shape")
    batch = b.op("Gather", shape, b.const("zero", np.array([0], np.int64)), name="batch")
    rows = b.op("Mul", b.op("Gather", shape, b.const("one", np.array([1], np.int64)),
                            name="rows"), b.const("two", np.array([2], np.int64)), name="twice")
    target = b.op("Concat", batch, rows, b.const("four", np.array([4], np.int64)), name="cat",
                  axis=0)
    # Expanded to [batch, ?, 8] (a length no inference knows): partly known, and the Add
    # with h still gives [batch, 4, 8].
    longest = b.op("ReduceMax", b.input("lengths", [2], np.int64), name="longest", keepdims=1)
    spread = b.op("Concat", batch, longest, b.const("eight", np.array([8], np.int64)),
                  name="spread", axis=0)
    scaled = b.op("Mul", mask, b.const("big", np.array(-1e4, np.float32)), name="scale")
    masked = b.op("Add", h, b.op("Expand", scaled, spread, name="expand"), name="masked")
    soft = b.op("Softmax", masked, name="softmax", axis=-1)
    b.output(b.op("Relu", b.op("Reshape", soft, target, name="reshape"), name="relu"))
    return b.build()


@pytest.mark.parametrize("name", ["computed_shape", "transformer_block", "cnn"])
def test_the_cost_inference_of_a_big_graph_in_slices_finds_the_same_shapes(name, monkeypatch):
    """Graphs over `SLICE_NODES` nodes are inferred a slice at a time (bounded memory); with
    slices down to one node the cost summary and the type check come out as inferring the
    whole graph does."""
    from amp_rewriter.formats.onnx import shapes
    from testkit.models import BUILDERS

    model = _reshape_by_computed_shape() if name == "computed_shape" else BUILDERS[name]()
    converted, _ = amp_rewriter.convert(model, keep_io_types=True)
    sizes = shapes.validation_input_shapes(converted)
    whole = shapes.checked_activation_traffic(converted, sizes, type_check=True)
    # Only the expanded mask has no concrete shape.
    assert whole[1] and whole[0]["values_without_shape"] == (name == "computed_shape")
    for size in (1, 2, 5):
        monkeypatch.setattr(shapes, "SLICE_NODES", size)
        ops = {(node.domain, node.op_type) for node in converted.graph.node}
        assert shapes._sliceable(len(converted.graph.node), ops)
        assert shapes._traffic_in_slices(converted, sizes, True) is not None  # no fallback
        assert shapes.checked_activation_traffic(converted, sizes, type_check=True) == whole


@pytest.mark.parametrize("name", ["computed_shape", "transformer_block"])
def test_the_conversions_cost_summary_reads_slices_from_the_emitted_encoding(name, monkeypatch):
    """In a conversion the sliced inference takes each node's bytes and names from where the
    emitter encoded them (`EncodedNodes`, names kept in chunks) instead of from protobuf: the
    summary must be the whole graph's."""
    from amp_rewriter.formats.onnx import encoding, shapes
    from testkit.models import BUILDERS

    model = _reshape_by_computed_shape() if name == "computed_shape" else BUILDERS[name]()
    whole, _ = amp_rewriter.convert(model, keep_io_types=True)
    expected = shapes.activation_traffic(whole, shapes.validation_input_shapes(whole))
    monkeypatch.setattr(shapes, "SLICE_NODES", 4)
    monkeypatch.setattr(encoding, "NAME_CHUNK", 3)
    read_from_protobuf = []
    monkeypatch.setattr(shapes._Slicer, "_fields", lambda self, first, last: (
        read_from_protobuf.append(self.encoded is None)
        or self.encoded.fields(first, last)))
    def no_whole_graph_inference(*args, **kwargs):
        raise AssertionError("a slice failed: the whole graph was inferred instead")

    monkeypatch.setattr(shapes, "_inferred", no_whole_graph_inference)
    converted, report = amp_rewriter.convert(model, keep_io_types=True)
    assert converted.SerializeToString() == whole.SerializeToString()
    assert read_from_protobuf and not any(read_from_protobuf)
    assert report.cost["activation_bytes"] == expected


def test_a_type_error_in_a_slice_leaves_the_check_to_the_checker(monkeypatch):
    """A declared type that contradicts the inferred one, found in one slice: as with the whole
    graph, the inference counts as not checked and the shapes come from the lenient run."""
    from amp_rewriter.formats.onnx import shapes

    model = _reshape_by_computed_shape()
    whole = shapes.checked_activation_traffic(model, {"x": (2, 4, 8), "mask": (2, 1, 8), "lengths": (2,)},
                                              type_check=True)
    relu_input = model.graph.node[-1].input[0]
    model.graph.value_info.append(onnx.helper.make_tensor_value_info(
        relu_input, TensorProto.FLOAT16, None))
    monkeypatch.setattr(shapes, "SLICE_NODES", 3)
    traffic, checked = shapes.checked_activation_traffic(
        model, {"x": (2, 4, 8), "mask": (2, 1, 8), "lengths": (2,)}, type_check=True)
    assert not checked and traffic == whole[0]


def test_skeleton_bytes_parse_as_the_skeleton():
    """The cost summary's inference reads a skeleton serialized node by node; it must parse as
    the skeleton message (large initializers turned into inputs, concrete input sizes), with
    the declared value_info when asked."""
    from amp_rewriter.formats.onnx.shapes import skeleton, skeleton_bytes

    b = GraphBuilder(opset=17)
    x = b.input("x", [2, "n"])
    h = b.op("MatMul", x, b.weight("w", [8, 300]), name="mm")
    b.output(b.op("Relu", b.op("Add", h, b.weight("bias", [300]), name="add"), name="relu"))
    model = b.build()
    model.graph.value_info.append(onnx.helper.make_tensor_value_info(h, TensorProto.FLOAT,
                                                                    [2, 300]))
    shapes = {"x": (2, 8)}
    want = skeleton(model, shapes)
    assert [i.name for i in want.graph.input] == ["w", "bias", "x"]  # both over 64 elements
    assert onnx.ModelProto.FromString(skeleton_bytes(model, shapes)) == want
    want.graph.value_info.extend(model.graph.value_info)
    assert onnx.ModelProto.FromString(skeleton_bytes(model, shapes, value_info=True)) == want
