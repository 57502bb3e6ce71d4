"""TF1 GraphDefs through the TensorFlow path: one test per Grappler rule, each checking node
precisions and cast counts and running the converted graph in a tf.compat.v1 Session against fp32
(bf16 on the CPU; fp16 where TensorFlow has CPU kernels)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")

from amp_rewriter import cli  # noqa: E402
from amp_rewriter.formats.tf import compare_graphdefs, convert_graphdef  # noqa: E402
from testkit.models import tf_graphs  # noqa: E402

v1 = tf.compat.v1
RNG = np.random.default_rng(0)
BF16 = tf.bfloat16.as_datatype_enum
FP16 = tf.float16.as_datatype_enum
FP32 = tf.float32.as_datatype_enum


def weights(*shape: int, scale: float = 0.3) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


class Converted:
    """A conversion and what the tests look at: precisions, casts, the new NodeDefs."""

    def __init__(self, graph_def, outputs, target="bf16", backend="tf-cpu", **options):
        self.original = graph_def
        self.outputs = outputs
        self.graph_def, self.report = convert_graphdef(graph_def, outputs, target, backend,
                                                       **options)
        self.entries = {e["name"]: e for e in self.report.nodes}
        self.nodes = {n.name: n for n in self.graph_def.node}
        old_casts = {n.name for n in graph_def.node if n.op == "Cast"}
        self.new_casts = [n for n in self.graph_def.node if n.op == "Cast"
                          and n.name not in old_casts]

    def precision(self, name: str) -> str:
        return self.entries[name]["precision"]

    def casts_to(self, dtype_enum: int) -> list:
        return [n for n in self.new_casts if n.attr["DstT"].type == dtype_enum]

    def run(self, rtol: float = 5e-2) -> None:
        for comparison in compare_graphdefs(self.original, self.graph_def, self.outputs):
            assert not comparison.nonfinite_new, comparison
            assert comparison.relative < rtol, comparison


def build(fn) -> tf.compat.v1.GraphDef:
    graph = tf.Graph()
    with graph.as_default():
        fn()
    return graph.as_graph_def()


def test_matmul_conv_allow_relu_identity_clear():
    c = Converted(*tf_graphs.conv_matmul())
    for name in ("conv", "relu", "ident", "flat", "mm"):
        assert c.precision(name) == "bf16", (name, c.entries[name])
    assert c.nodes["conv"].attr["T"].type == BF16
    assert c.precision("y") == "fp32"  # the fetch node is preserved
    assert c.precision("x") == "fp32"
    # One cast into the low-precision region (x), one out (mm -> y); weights are converted
    # constants, not casts.
    assert len(c.casts_to(BF16)) == 1 and len(c.casts_to(FP32)) == 1
    assert c.report.summary["constants_converted"] == 2
    c.run()


def test_sqrt_log_infer():
    c = Converted(*tf_graphs.sqrt_log_infer())
    assert c.precision("sqrt") == "bf16"
    assert c.precision("abs") == "bf16"
    assert c.precision("log_in") == "fp32"
    # bf16 only (Grappler's infer-after-allow rule): an infer op fed by an allow op goes low.
    assert c.precision("sig") == "bf16"
    # Fetch nodes are preserved: log_out stays fp32 behind a cast.
    assert c.precision("log_out") == "fp32"
    assert c.nodes[c.nodes["log_out"].input[0]].op == "Cast"
    c.run()


def test_exp_pow_deny_spread_through_infer_and_clear_until_allow():
    c = Converted(*tf_graphs.exp_pow_deny())
    for name in ("exp", "relu", "sqrt", "pow", "sig"):
        assert c.precision(name) == "fp32", (name, c.entries[name])
    assert "deny" in c.entries["sqrt"]["reason"]
    assert c.precision("mm") == "bf16" and c.precision("tanh") == "bf16"
    assert c.precision("mm3") == "bf16"
    c.run()


def test_exp_deny_fp16_on_tf_gpu_lists():
    c = Converted(*tf_graphs.reduce_sum_exp(), target="fp16", backend="tf-gpu")
    assert c.precision("mm") == "fp16"
    assert c.precision("sum") == "fp32" and c.precision("exp") == "fp32"
    assert c.nodes["mm"].attr["T"].type == FP16


def test_add_between_allow_is_low_alone_is_fp32():
    c = Converted(*tf_graphs.add_between_allow())
    assert c.precision("add_mid") == "bf16"
    assert c.precision("add_alone") == "fp32"
    assert c.nodes["add_mid"].attr["T"].type == BF16
    c.run()


@pytest.mark.parametrize("target", ["bf16", "fp16"])
def test_fused_batch_norm_t_low_u_fp32(target):
    graph_def, outputs = tf_graphs.fused_batch_norm_v3()
    assert {n.op for n in graph_def.node} & {"FusedBatchNorm", "FusedBatchNormV3"}
    c = Converted(graph_def, outputs, target=target, backend="tf-cpu")
    bn = c.nodes["bn"]
    assert bn.op in ("FusedBatchNormV2", "FusedBatchNormV3")
    low = BF16 if target == "bf16" else FP16
    assert bn.attr["T"].type == low and bn.attr["U"].type == FP32
    groups = {g["group"]: g["precision"] for g in c.entries["bn"]["groups"]}
    assert groups["T"] == target and groups.get("U", "fp32") == "fp32"
    # scale/offset/mean/variance stay fp32 constants: no casts for them.
    assert len(c.casts_to(low)) == 1  # x only
    c.run()


def test_identity_n_and_add_n_list_attrs():
    c = Converted(*tf_graphs.identity_n_add_n())
    assert c.precision("addn") == "bf16"
    assert c.nodes["addn"].attr["T"].type == BF16
    groups = {g["group"]: g["precision"] for g in c.entries["idn"]["groups"]}
    assert groups == {"T[0]": "bf16", "T[1]": "fp32"}
    assert list(c.nodes["idn"].attr["T"].list.type) == [BF16, FP32]
    c.run()


def test_existing_casts_retargeted():
    c = Converted(*tf_graphs.existing_casts(), keep_io_types=False)
    assert c.nodes["to_float"].attr["DstT"].type == BF16  # retargeted, not followed by a cast
    assert not c.casts_to(BF16)
    c.run()


def test_ref_variable_read_stays_fp32_and_gets_a_cast():
    graph_def, outputs = tf_graphs.ref_variable()
    ops = {n.name: n.op for n in graph_def.node}
    assert ops["w"] == "VariableV2" and ops["w/read"] == "Identity"
    c = Converted(graph_def, outputs)
    assert c.precision("w/read") == "fp32"
    assert "ref variable" in c.entries["w/read"]["reason"]
    assert c.precision("mm") == "bf16"
    cast_inputs = sorted(n.input[0] for n in c.casts_to(BF16))
    assert cast_inputs == ["w/read", "x"]
    assert c.nodes["w/Assign"].attr["T"].type == FP32
    c.run()


def test_v1_while_loop():
    graph_def, outputs = tf_graphs.while_loop_v1()
    ops = {n.op for n in graph_def.node}
    assert {"Enter", "Merge", "Switch", "NextIteration", "Exit"} <= ops
    c = Converted(graph_def, outputs)
    by_op: dict[str, list[str]] = {}
    for e in c.report.nodes:
        by_op.setdefault(e["op"], []).append(e["name"])
    assert c.precision("loop/mm") == "bf16"
    # The float loop variable's Merge and NextIteration agree (int counter ones have no float).
    float_merges = [n for n in by_op["Merge"] if c.nodes[n].attr["T"].type != tf.int32.as_datatype_enum]
    assert float_merges
    for merge in float_merges:
        next_iteration = c.nodes[merge].input[1].split(":")[0]
        assert c.nodes[next_iteration].op == "NextIteration"
        assert c.nodes[merge].attr["T"].type == c.nodes[next_iteration].attr["T"].type
    # No cast sits on the back edge.
    for merge in float_merges:
        assert all(c.nodes[i.split(":")[0]].op != "Cast" for i in c.nodes[merge].input[1:])
    c.run()


def test_fp16_on_cpu_runs():
    c = Converted(*tf_graphs.mlp_relu(), target="fp16", backend="tf-cpu")
    assert c.precision("mm") == "fp16" and c.precision("relu") == "fp16"
    c.run(rtol=2e-2)


def test_grappler_env_variables(monkeypatch):
    graph_def, outputs = tf_graphs.two_matmuls_relu()
    monkeypatch.setenv("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_CLEARLIST_REMOVE", "Relu")
    monkeypatch.setenv("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_DENYLIST_ADD", "Relu")
    c = Converted(graph_def, outputs)
    assert c.precision("relu") == "fp32"
    assert "DENYLIST_ADD" in c.entries["relu"]["reason"]
    monkeypatch.setenv("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_DENYLIST_ADD", "")
    monkeypatch.setenv("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_ALLOWLIST_REMOVE", "MatMul")
    c = Converted(graph_def, outputs)
    assert c.precision("mm") == "fp32" and c.precision("relu") == "fp32"


def test_cli_in_process(tmp_path, capsys):
    def model():
        x = v1.placeholder(tf.float32, [None, 8], name="x")
        tf.identity(tf.nn.relu(tf.matmul(x, weights(8, 8), name="mm")), name="y")

    graph_def = build(model)
    src = tmp_path / "m.pb"
    src.write_bytes(graph_def.SerializeToString())
    out = tmp_path / "o.pbtxt"
    code = cli.main(["convert", str(src), str(out), "--outputs", "y", "--target", "bf16",
                     "--backend", "tf-cpu", "--validate", "--report", str(tmp_path / "r.json")])
    printed = capsys.readouterr()
    assert code == 0, printed
    assert "validate y:" in printed.out and "ok" in printed.out
    assert out.read_text().startswith("node {")

    code = cli.main(["convert", str(src), str(tmp_path / "o2.pb"), "--outputs", "nope"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "nope" in err

    bad = tmp_path / "bad.pb"
    bad.write_bytes(b"\x0a\xff\xff\xff garbage")
    code = cli.main(["convert", str(bad), str(tmp_path / "o3.pb")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "not a GraphDef" in err

    code = cli.main(["explain", str(src), "mm", "--outputs", "y", "--target", "bf16"])
    assert code == 0 and "allow" in capsys.readouterr().out

    # A SavedModel's option: refused, not silently ignored (the constants convert all the same).
    code = cli.main(["convert", str(src), str(tmp_path / "o5.pb"), "--outputs", "y",
                     "--keep-fp32-weights"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--keep-fp32-weights" in err
    assert not (tmp_path / "o5.pb").exists()

    code = cli.main(["convert", str(src), str(tmp_path / "o4.pb"), "--outputs", "y",
                     "--deny", "Rellu", "--quiet"])
    assert code == 0 and "--deny Rellu: no such TensorFlow op" in capsys.readouterr().err


def test_bf16_on_tf_cpu_without_native_bf16_warns_once(tmp_path, capsys, monkeypatch):
    """TensorFlow emulates bf16 kernels on a CPU without avx512_bf16 / amx_bf16: one warning
    that the model will likely run slower than fp32 here; the report records the check."""
    def model():
        x = v1.placeholder(tf.float32, [None, 8], name="x")
        tf.identity(tf.nn.relu(tf.matmul(x, weights(8, 8), name="mm")), name="y")

    src = tmp_path / "m.pb"
    src.write_bytes(build(model).SerializeToString())
    for flags, slower in (("fpu sse avx2 fma", True), ("avx2 avx512f avx512_bf16", False)):
        (tmp_path / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        monkeypatch.setenv("AMP_REWRITER_CPUINFO", str(tmp_path / "cpuinfo"))
        code = cli.main(["convert", str(src), str(tmp_path / "o.pb"), "--outputs", "y",
                         "--target", "bf16", "--report", str(tmp_path / "r.json")])
        err = capsys.readouterr().err
        assert code == 0, err
        warned = [line for line in err.splitlines() if "slower than fp32" in line]
        assert len(warned) == int(slower), err
        if slower:
            assert "bf16 on tf-cpu" in warned[0] and "TensorFlow emulates" in warned[0]
            assert "avx512_bf16 or amx_bf16" in warned[0]
        host = json.loads((tmp_path / "r.json").read_text())["host"]
        assert host["native_bf16"] is not slower and host["looked_for"] == ["avx512_bf16",
                                                                           "amx_bf16"]


def test_cli_subprocess_one_line_errors(tmp_path, amp_cli):
    bad = tmp_path / "bad.pbtxt"
    bad.write_text("node { name: ")
    result = amp_cli("convert", bad, tmp_path / "o.pb")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "not a text GraphDef" in result.stderr


def test_control_edges_on_removed_nodes_are_kept_valid():
    """A no-op Cast that fold_casts removes, and a constant replaced by its converted copy, may
    be the target of control edges: those edges move to what the removed node waited for (the
    cast's input; nothing for a constant, so waiting for it goes)."""
    c = Converted(*tf_graphs.noop_cast_control_edges())
    assert "noop_cast" not in c.nodes
    assert c.nodes["w"].attr["dtype"].type == BF16
    controls = [i for i in c.nodes["mm"].input if i.startswith("^")]
    assert controls == ["^x"]
    c.run()


def test_fp16_overflowing_constant_keeps_its_consumer_fp32():
    """Const nodes are constants to the range guard: a -1e9 attention-style mask stays exact, the
    Add that reads it and the Softmax after it stay fp32, the MatMul goes fp16."""
    c = Converted(*tf_graphs.fp16_mask(), target="fp16", backend="tf-gpu")
    assert c.precision("mm") == "fp16"
    assert c.precision("masked") == "fp32" and c.precision("probs") == "fp32"
    assert "finite range" in c.entries["masked"]["reason"]
    assert c.report.constants and c.report.constants[0]["action"] == "kept_fp32"
    c.run(rtol=2e-2)


def test_an_overflowing_constant_read_through_identity_keeps_its_reader_fp32():
    """Frozen TF2 graphs read each weight through an Identity: the range guard follows it, so
    the MatMul behind it stays fp32 rather than casting the 1e5 weight to fp16 (inf)."""
    def model():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        w = tf.constant(np.full((4, 4), 1e5, np.float32), name="w")
        read = tf.identity(w, name="w_read")
        tf.identity(tf.matmul(x, read, name="mm") * 1e-5, name="y")

    c = Converted(build(model), ["y"], target="fp16", backend="tf-gpu")
    assert c.precision("w_read") == "fp32" and c.precision("mm") == "fp32"
    assert "w_read" in c.entries["mm"]["reason"]
    c.run(rtol=1e-3)


def test_a_divisor_that_partly_flushes_keeps_the_division_fp32():
    """`x / c` (RealDiv) with one element of c below fp16's smallest subnormal stays fp32, as
    ONNX's Div does: in fp16 that element would be 0, and relu's zeros / 0 NaN."""
    def model():
        x = v1.placeholder(tf.float32, [4, 4], name="x")
        h = tf.nn.relu(tf.matmul(x, weights(4, 4), name="mm"), name="relu")
        q = tf.math.truediv(h, np.array([1.0, 1e-9, 2.0, 4.0], np.float32), name="div")
        t = tf.tanh(q, name="tanh")
        tf.identity(tf.matmul(t, weights(4, 4), name="mm2"), name="y")

    graph_def = build(model)
    assert next(n for n in graph_def.node if n.name == "div").op == "RealDiv"
    c = Converted(graph_def, ["y"], target="fp16", backend="tf-gpu")
    assert c.precision("mm") == "fp16"
    assert c.precision("div") == "fp32"
    assert c.entries["div"]["kind"] == "constant_range"
    assert "a divisor" in c.entries["div"]["reason"]
    for comparison in compare_graphdefs(c.original, c.graph_def, ["y"]):
        assert not comparison.nonfinite_new and comparison.relative < 2e-2, comparison


def test_v1_while_loop_constant_inside_the_frame_keeps_its_control_input():
    """A Const inside a TF1 loop body is placed in the loop frame by a control input; its bf16
    copy needs the same one, or TF refuses the graph ("inputs from different frames")."""
    graph_def, outputs = tf_graphs.while_loop_v1()
    frame_consts = {n.name: [i for i in n.input if i.startswith("^")] for n in graph_def.node
                    if n.op == "Const" and any(i.startswith("^") for i in n.input)}
    assert frame_consts  # TF gave the body's constants a control input into the frame
    c = Converted(graph_def, outputs)
    for name, controls in frame_consts.items():
        if name in c.nodes:
            assert [i for i in c.nodes[name].input if i.startswith("^")] == controls
    c.run()


def test_saved_model_without_its_variables_is_bad_input(tmp_path, amp_cli):
    module = tf.Module()
    module.w = tf.Variable(weights(4, 4))
    module.f = tf.function(lambda x: tf.matmul(x, module.w),
                           input_signature=[tf.TensorSpec([2, 4], tf.float32)])
    saved = tmp_path / "sm"
    tf.saved_model.save(module, str(saved))
    import shutil
    shutil.rmtree(saved / "variables")
    result = amp_cli("convert", str(saved), str(tmp_path / "out"), "--target", "bf16")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "variables" in result.stderr
    assert not (tmp_path / "out").exists()


def test_meta_graph_file_converts_and_keeps_collections(tmp_path, amp_cli):
    """A TF1 .meta (MetaGraphDef) converts in place of its graph; collections and saver stay."""
    meta = tf_graphs.meta_graph_with_saver(use_resource=True)
    (tmp_path / "model.meta").write_bytes(meta.SerializeToString())
    result = amp_cli("convert", str(tmp_path / "model.meta"), str(tmp_path / "out.meta"),
                     "--outputs", "y", "--target", "bf16", "--validate")
    assert result.returncode == 0, result.stderr
    from tensorflow.core.protobuf import meta_graph_pb2
    out = meta_graph_pb2.MetaGraphDef()
    out.ParseFromString((tmp_path / "out.meta").read_bytes())
    assert out.saver_def == meta.saver_def
    assert set(out.collection_def) == set(meta.collection_def)
    mm = next(n for n in out.graph_def.node if n.name == "mm")
    assert mm.attr["T"].type == BF16
    # check agrees: the MetaGraph passes against its fp32 source
    assert cli.main(["check", str(tmp_path / "out.meta"), "--reference",
                     str(tmp_path / "model.meta")]) == 0


def test_check_graphdef_against_its_reference_on_the_validation_inputs(tmp_path, capsys):
    """What convert --validate accepted, check --reference passes on the same --inputs."""
    def model():
        x = v1.placeholder(tf.float32, [None, 8], name="x")
        h = tf.nn.relu(tf.matmul(x, weights(8, 8), name="mm"))
        tf.identity(tf.matmul(h, weights(8, 4), name="mm2"), name="y")

    src = tmp_path / "m.pb"
    src.write_bytes(build(model).SerializeToString())
    inputs = tmp_path / "x.npz"
    np.savez(inputs, x=RNG.standard_normal((3, 8)).astype(np.float32))
    out = tmp_path / "o.pb"
    assert cli.main(["convert", str(src), str(out), "--target", "bf16", "--validate",
                     "--inputs", str(inputs)]) == 0
    capsys.readouterr()
    assert cli.main(["check", str(out), "--reference", str(src), "--inputs", str(inputs)]) == 0
    assert "output y: relative error" in capsys.readouterr().out
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, z=np.zeros((3, 8), np.float32))
    assert cli.main(["check", str(out), "--reference", str(src), "--inputs", str(wrong)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'z' matches no placeholder of the graph (its placeholders: x)" in err


def test_check_accepts_the_tanh_gelu_cube_convert_runs_low(tmp_path, capsys):
    """Issue 39: a frozen GraphDef with a tanh-GELU converts to fp16 with its cube in fp16 (on
    purpose: the overflow is harmless by structure), and `check` on that output now agrees with
    convert (a note, exit 0) instead of failing on Pow; a Pow that is not such a cube still
    fails the check."""
    def model():
        x = v1.placeholder(tf.float32, [None, 8], name="x")
        h = tf.matmul(x, weights(8, 8), name="mm")
        cube = tf.pow(h, 3.0, name="cube")
        inner = tf.multiply(tf.add(h, tf.multiply(cube, 0.044715)), 0.7978845608, name="inner")
        gelu = tf.multiply(tf.multiply(h, 0.5), tf.add(1.0, tf.tanh(inner)), name="gelu")
        tf.identity(tf.matmul(gelu, weights(8, 4), name="mm2"), name="y")

    src, out = tmp_path / "gelu.pb", tmp_path / "gelu16.pb"
    src.write_bytes(build(model).SerializeToString())
    assert cli.main(["convert", str(src), str(out), "--target", "fp16", "--backend", "tf-gpu",
                     "--outputs", "y", "--quiet"]) == 0
    converted = tf.compat.v1.GraphDef()
    converted.ParseFromString(out.read_bytes())
    cube = next(n for n in converted.node if n.name == "cube")
    assert cube.attr["T"].type == tf.float16.as_datatype_enum
    capsys.readouterr()
    assert cli.main(["check", str(out)]) == 0
    assert "cube (Pow) runs in low precision: the cube of tanh-GELU" in capsys.readouterr().out

    def squares():
        x = v1.placeholder(tf.float16, [None, 8], name="x")
        tf.identity(tf.pow(x, 2.0, name="square"), name="y")

    plain = tmp_path / "square16.pb"
    plain.write_bytes(build(squares).SerializeToString())
    assert cli.main(["check", str(plain)]) == 1
    assert "square (Pow) runs in low precision but is on the fp16 deny list" \
        in capsys.readouterr().out


def _rms_norm_model():
    x = v1.placeholder(tf.float32, [None, 16], name="x")
    h = tf.matmul(x, weights(16, 16), name="mm")
    mean = tf.reduce_mean(tf.square(h, name="square"), axis=-1, keepdims=True, name="mean")
    normed = tf.multiply(h, tf.math.rsqrt(tf.add(mean, 1e-6), name="inverse"), name="normed")
    tf.identity(tf.matmul(normed, weights(16, 4), name="mm2"), name="y")


def _index_math_model():
    x = v1.placeholder(tf.float32, [None, 8], name="x")
    lengths = v1.placeholder(tf.float32, [None], name="lengths")
    h = tf.nn.relu(tf.matmul(x, weights(8, 8), name="mm"))
    tf.identity(tf.matmul(h, weights(8, 4), name="mm2"), name="y")
    frames = tf.floor(tf.add(tf.divide(tf.subtract(lengths, 3.0), 2.0), 1.0), name="floor")
    tf.identity(tf.cast(frames, tf.int64), name="frames")


@pytest.mark.parametrize("name,model,outputs,rule", [
    ("rms_norm", _rms_norm_model, "y", "rms_norm"),
    ("index_math", _index_math_model, "y,frames", None)])
def test_check_passes_what_convert_wrote_for_each_structural_rule(tmp_path, capsys, name, model,
                                                                  outputs, rule):
    """Issue 39: every structural rule TF convert applies is one check knows; check exits 0 on
    the output, alone and against the fp32 graph."""
    src, out, report = tmp_path / f"{name}.pb", tmp_path / f"{name}16.pb", tmp_path / "r.json"
    src.write_bytes(build(model).SerializeToString())
    assert cli.main(["convert", str(src), str(out), "--target", "fp16", "--backend", "tf-gpu",
                     "--outputs", outputs, "--report", str(report), "--quiet"]) == 0
    written = json.loads(report.read_text())
    if rule is not None:
        assert any(rule in s["rule"] for s in written["structures"]), written["structures"]
    else:  # the lengths' float arithmetic stays fp32, whichever rule or propagation says so
        assert {n["name"]: n["precision"] for n in written["nodes"]}["floor"] == "fp32"
    capsys.readouterr()
    for reference in ([], ["--reference", str(src)]):
        assert cli.main(["check", str(out), *reference]) == 0, capsys.readouterr().out
