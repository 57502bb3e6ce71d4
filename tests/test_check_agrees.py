"""`check`, `--validate` and `explain` agree with `convert` (ONNX; TensorFlow in tests/tf).

What `convert --validate` accepts, `check` passes on the same inputs; bf16 validates on a CPU-only
machine for models with external data too; a bf16 conversion that leaves the compute ops fp32
says why; the summary counts compute ops; --keep-node matches dynamo exports' module paths.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx.version_converter
import pytest
from conftest import one_error_line
from conftest import run_in_process as run
from onnx import TensorProto, helper, numpy_helper

from testkit.builder import GraphBuilder
from testkit.models import BUILDERS


def write(model: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def masked_attention_model(mask_value: float) -> onnx.ModelProto:
    """scores = x @ W; softmax(scores + mask) @ V, the mask's last column `mask_value`."""
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    scores = b.op("MatMul", x, b.weight("w", [8, 4], scale=0.5), name="scores")
    mask = np.zeros((1, 4), np.float32)
    mask[0, -1] = mask_value
    masked = b.op("Add", scores, b.const("mask", mask), name="masked")
    probs = b.op("Softmax", masked, axis=-1, name="probs")
    b.output(b.op("MatMul", probs, b.weight("v", [4, 8]), name="context"))
    return b.build()


# -- item 10: check passes the tool's own validated output ---------------------------------------

def test_check_passes_a_validated_output_whose_mask_was_minus_inf_already(tmp_path: Path,
                                                                         capsys) -> None:
    source = write(masked_attention_model(float("-inf")), tmp_path / "masked.onnx")
    output = tmp_path / "masked_fp16.onnx"
    assert run(capsys, "convert", source, output, "--validate")[0] == 0
    assert numpy_helper.to_array(next(t for t in onnx.load(str(output)).graph.initializer
                                      if t.name == "mask")).dtype == np.float16
    for args in ([], ["--reference", source]):
        code, out, _ = run(capsys, "check", output, *args)
        assert code == 0, out
        assert "constant_overflow" not in out
    assert "'mask': 1 value(s) are ±inf in fp16" in run(capsys, "check", output)[1]


def test_check_flags_an_overflow_that_the_reference_shows(tmp_path: Path, capsys) -> None:
    """A -3.4e38 mask that some converter turned into fp16 -inf: a problem with --reference."""
    source = write(masked_attention_model(-3.4e38), tmp_path / "masked.onnx")
    broken = masked_attention_model(-3.4e38)
    mask = next(t for t in broken.graph.initializer if t.name == "mask")
    with np.errstate(over="ignore"):
        mask.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(mask).astype(np.float16), "mask"))
    cast = helper.make_node("Cast", ["mask"], ["mask32"], to=TensorProto.FLOAT, name="mask_to_fp32")
    broken.graph.node.insert(0, cast)
    next(n for n in broken.graph.node if n.name == "masked").input[1] = "mask32"
    path = write(broken, tmp_path / "broken.onnx")
    code, out, _ = run(capsys, "check", path, "--reference", source)
    assert code == 1 and "constant_overflow: constant 'mask': 1 value(s) overflowed" in out


def _tiny_weight_model() -> onnx.ModelProto:
    b = GraphBuilder()
    weight = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    weight[0, 0] = 1e-9  # below fp16's smallest subnormal: flushes to zero
    b.output(b.op("MatMul", b.input("x", [2, 8]), b.const("w", weight), name="mm"))
    return b.build()


def test_a_flushed_weight_is_a_note_when_the_outputs_agree(tmp_path: Path, capsys) -> None:
    source = write(_tiny_weight_model(), tmp_path / "tiny.onnx")
    output = tmp_path / "tiny_fp16.onnx"
    code, out, _ = run(capsys, "convert", source, output, "--validate")
    assert code == 0 and "1 values flushed to zero" in out
    code, out, _ = run(capsys, "check", output, "--reference", source)
    assert code == 0, out
    assert "note: constant 'w': 1 non-zero value(s) flushed to zero in fp16; the outputs agree" in out
    code, out, _ = run(capsys, "check", output, "--reference", source, "--rtol", "0")
    assert code == 1 and "constant_flushed" in out and "output_mismatch" in out


def test_check_takes_the_same_inputs_as_convert(tmp_path: Path, capsys) -> None:
    source = write(BUILDERS["transformer_block"](), tmp_path / "block.onnx")
    output = tmp_path / "block_fp16.onnx"
    rng = np.random.default_rng(5)
    inputs = tmp_path / "inputs.npz"
    mask = np.ones((1, 6), np.int64)
    mask[0, 4:] = 0
    np.savez(inputs, hidden=rng.standard_normal((1, 6, 64)).astype(np.float32),
             attention_mask=mask)
    assert run(capsys, "convert", source, output, "--validate", "--inputs", inputs)[0] == 0
    code, out, _ = run(capsys, "check", output, "--reference", source, "--inputs", inputs)
    assert code == 0 and "output out: relative error" in out
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, hidden=np.zeros((1, 6, 64), np.float32), mask=mask)
    code, _, err = run(capsys, "check", output, "--reference", source, "--inputs", wrong)
    assert code == 2
    assert one_error_line(err) == ("amp-rewriter: error: --inputs: 'mask' matches no input of "
                                   "the model (its inputs: hidden, attention_mask)")
    wrong_dtype = tmp_path / "wrong_dtype.npz"
    np.savez(wrong_dtype, hidden=np.zeros((1, 6, 64), np.float64), attention_mask=mask)
    code, _, err = run(capsys, "convert", source, tmp_path / "x.onnx", "--validate", "--inputs",
                       wrong_dtype)
    line = one_error_line(err)
    assert code == 2 and "'hidden' is float64, the model takes float32" in line
    assert "give real inputs" not in line


@pytest.mark.parametrize("args", [["--rtol", "nan"], ["--rtol", "-1"], ["--inputs", "x.npz"]])
def test_check_refuses_bad_options_in_one_line(tmp_path: Path, capsys, args: list[str]) -> None:
    source = write(BUILDERS["cnn"](), tmp_path / "cnn.onnx")
    full = [*args, "--reference", source] if args[0] == "--rtol" else args
    code, _, err = run(capsys, "check", source, *full)
    assert code == 2
    assert "--rtol must be a number >= 0" in err or "--inputs only makes sense" in err
    one_error_line(err)


# -- items 9 and 11: bf16 on a CPU-only machine ---------------------------------------------------

def test_bf16_validates_and_checks_with_external_data(tmp_path: Path, capsys) -> None:
    source = tmp_path / "in" / "block.onnx"
    source.parent.mkdir()
    onnx.save_model(BUILDERS["transformer_block"](), str(source), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="block.onnx.data")
    output = tmp_path / "out" / "block_bf16.onnx"
    output.parent.mkdir()
    code, out, err = run(capsys, "convert", source, output, "--target", "bf16", "--validate")
    assert code == 0, err
    assert "ran emulated" in out and (output.parent / "block_bf16.onnx.data").is_file()
    code, out, err = run(capsys, "check", output, "--reference", source)
    assert code == 0, out + err
    assert "output out: relative error" in out


def test_bf16_on_ort_cpu_says_why_nothing_converted(tmp_path: Path, capsys) -> None:
    source = write(BUILDERS["cnn"](), tmp_path / "cnn.onnx")
    report = tmp_path / "report.json"
    code, out, err = run(capsys, "convert", source, tmp_path / "out.onnx", "--target", "bf16",
                         "--backend", "ort-cpu", "--validate", "--report", report)
    assert code == 0 and "compute ops 0/4" in out
    warning = [line for line in err.splitlines() if "ort-cpu" in line]
    assert len(warning) == 1 and "converted nothing" in warning[0]
    assert "--target fp16" in warning[0] and "--backend ort-cuda" in warning[0]
    assert any("converted nothing" in w for w in json.loads(report.read_text())["warnings"])


def test_bf16_cnn_on_ort_cuda_suggests_opset_22_which_then_converts_conv(tmp_path: Path,
                                                                          capsys) -> None:
    model = BUILDERS["cnn"]()
    source = write(model, tmp_path / "cnn17.onnx")
    code, out, err = run(capsys, "convert", source, tmp_path / "out17.onnx", "--target", "bf16")
    assert code == 0 and "Conv 0/3" in out
    assert ("3 of 3 Conv node(s) stay fp32: the Conv schema takes bf16 only from opset 22 "
            "(this model: opset 17)") in err
    source22 = write(onnx.version_converter.convert_version(model, 22), tmp_path / "cnn22.onnx")
    code, out, err = run(capsys, "convert", source22, tmp_path / "out22.onnx", "--target", "bf16",
                         "--validate")
    assert code == 0 and "Conv 3/3" in out and "opset 22" not in err


# -- item 13: the summary counts compute ops; --keep-node matches module paths -------------------

def test_summary_counts_compute_ops_apart_from_shape_arithmetic(tmp_path: Path, capsys) -> None:
    b = GraphBuilder()
    x = b.input("x", ["B", 8])
    h = b.op("MatMul", x, b.weight("w", [8, 8]), name="mm")
    shape = b.op("Shape", h, name="shape")
    for i in range(6):  # integer shape arithmetic: many nodes, no float compute
        shape = b.op("Add", shape, b.const(f"zero{i}", np.zeros(2, np.int64)), name=f"shape_add{i}")
    b.output(b.op("Reshape", h, shape, name="reshape"))
    source = write(b.build(), tmp_path / "shapes.onnx")
    report = tmp_path / "report.json"
    code, out, _ = run(capsys, "convert", source, tmp_path / "out.onnx", "--report", report)
    assert code == 0
    assert "compute ops 1/1 (MatMul 1/1), nodes 3/9" in out
    summary = json.loads(report.read_text())["summary"]
    assert summary["compute_ops_by_type"] == {"MatMul": [1, 1]}


def _with_module_scopes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Node metadata as torch's dynamo exporter writes it (see testkit/models/torch_export.py)."""
    for index, node in enumerate(model.graph.node):
        layer = f"model.layers.{index % 2}"
        scopes = ["", "model", layer, f"{layer}.proj", f"op_{index}"]
        node.metadata_props.add(key="pkg.torch.onnx.name_scopes", value=repr(scopes))
        namespace = "/".join(f"{s}: torch.nn.Module" for s in scopes[:-1]) + f"/op_{index}: aten.op"
        node.metadata_props.add(key="namespace", value=namespace)
    return model


def test_keep_node_matches_the_module_paths_of_dynamo_exports(tmp_path: Path, capsys) -> None:
    b = GraphBuilder()
    h = b.input("x", [2, 8])
    for i in range(4):
        h = b.op("MatMul", h, b.weight(f"w{i}", [8, 8]), name=f"mm{i}")
    b.output(h)
    source = write(_with_module_scopes(b.build()), tmp_path / "scoped.onnx")
    report = tmp_path / "report.json"
    code, _, err = run(capsys, "convert", source, tmp_path / "out.onnx", "--keep-node",
                       r"model\.layers\.1", "--report", report)
    assert code == 0 and "matches no node" not in err
    precisions = {n["name"]: n["precision"] for n in json.loads(report.read_text())["nodes"]}
    assert precisions == {"mm0": "fp16", "mm1": "fp32", "mm2": "fp16", "mm3": "fp32"}
    code, out, _ = run(capsys, "explain", report, "mm1")
    assert "pinned to fp32 by --keep-node 'model\\\\.layers\\\\.1' (module model.layers.1)" in out


def test_a_bf16_emulation_over_the_protobuf_limit_runs_from_a_file(tmp_path: Path, capsys,
                                                                   monkeypatch) -> None:
    """An emulated model over protobuf's 2 GiB cannot go to onnxruntime as bytes: it is written
    with external data to a temporary folder beside the output (our limit lowered to get there)."""
    from amp_rewriter.formats.onnx import validate

    source = write(BUILDERS["transformer_block"](), tmp_path / "block.onnx")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, in_memory, _ = run(capsys, "convert", source, out_dir / "a.onnx", "--target", "bf16",
                             "--validate")
    assert code == 0
    monkeypatch.setattr(validate, "PROTOBUF_LIMIT", 1024)
    code, from_file, err = run(capsys, "convert", source, out_dir / "b.onnx", "--target", "bf16",
                               "--validate")
    assert code == 0, err
    numbers = [line for line in in_memory.splitlines() if line.startswith("validate out")]
    assert numbers and numbers == [line for line in from_file.splitlines()
                                   if line.startswith("validate out")]
    assert sorted(p.name for p in out_dir.iterdir()) == ["a.onnx", "b.onnx"]
    code, out, _ = run(capsys, "check", out_dir / "b.onnx", "--reference", source)
    assert code == 0, out
