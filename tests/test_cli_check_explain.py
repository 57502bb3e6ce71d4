"""`check` and `explain` through the CLI, on models built by testkit/models/."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
from conftest import run_in_process
from onnx import TensorProto, helper

from testkit.models import BUILDERS


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "amp_rewriter", *args], capture_output=True,
                          text=True, timeout=120)


def _write(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save_model(model, str(path))
    return path


def test_check_passes_our_conversion_and_compares_with_the_reference(tmp_path: Path) -> None:
    source = _write(BUILDERS["transformer_block"](), tmp_path / "block.onnx")
    converted = tmp_path / "block_fp16.onnx"
    assert run_cli("convert", str(source), str(converted)).returncode == 0
    findings = tmp_path / "findings.json"
    result = run_cli("check", str(converted), "--reference", str(source), "--report", str(findings))
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(findings.read_text())
    assert data["ok"] and data["target"] == "fp16"
    assert data["outputs"] and data["outputs"][0]["relative_error"] < 2e-2


def _exp_in_fp16_model() -> onnx.ModelProto:
    """x -> Cast(fp16) -> Exp (a deny op) in fp16 -> Cast(fp32), plus an fp16 constant that is inf."""
    nodes = [helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16, name="to16"),
             helper.make_node("Exp", ["x16"], ["e16"], name="exp"),
             helper.make_node("Add", ["e16", "c"], ["s16"], name="add"),
             helper.make_node("Cast", ["s16"], ["y"], to=TensorProto.FLOAT, name="to32")]
    const = helper.make_tensor("c", TensorProto.FLOAT16, [1], [float("inf")])
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], [const])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _exp_fp32_reference() -> onnx.ModelProto:
    """The fp32 model `_exp_in_fp16_model` claims to come from: its constant is a finite 1e6."""
    nodes = [helper.make_node("Exp", ["x"], ["e"], name="exp"),
             helper.make_node("Add", ["e", "c"], ["y"], name="add")]
    const = helper.make_tensor("c", TensorProto.FLOAT, [1], [1e6])
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], [const])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_check_flags_deny_ops_in_low_precision_and_overflowed_constants(tmp_path: Path) -> None:
    model = _write(_exp_in_fp16_model(), tmp_path / "bad.onnx")
    result = run_cli("check", str(model))
    assert result.returncode == 1
    assert "deny_op_in_low_precision" in result.stdout and "exp (Exp)" in result.stdout
    # Without the fp32 model an inf may have been inf already (a mask): only a note...
    assert "constant_overflow" not in result.stdout and "are ±inf in fp16" in result.stdout
    # ...with it, the finite 1e6 that became inf is an overflow.
    reference = _write(_exp_fp32_reference(), tmp_path / "reference.onnx")
    result = run_cli("check", str(model), "--reference", str(reference))
    assert result.returncode == 1
    assert "constant_overflow: constant 'c': 1 value(s) overflowed to inf in fp16" in result.stdout


def test_check_flags_an_invalid_model(tmp_path: Path) -> None:
    model = _exp_in_fp16_model()
    model.graph.node[2].input[1] = "missing"
    path = _write(model, tmp_path / "invalid.onnx")
    result = run_cli("check", str(path))
    assert result.returncode == 1
    assert "invalid_model" in result.stdout


def test_explain_from_report_and_from_model_follows_the_chain(tmp_path: Path) -> None:
    source = _write(BUILDERS["transformer_block"](), tmp_path / "block.onnx")
    report = tmp_path / "report.json"
    assert run_cli("convert", str(source), str(tmp_path / "out.onnx"), "--report",
                   str(report)).returncode == 0
    softmax = next(n["name"] for n in json.loads(report.read_text())["nodes"]
                   if n["op"] == "Softmax")
    for source_arg in (str(report), str(source)):
        result = run_cli("explain", source_arg, softmax)
        assert result.returncode == 0, result.stderr
        assert "precision: fp16" in result.stdout
        # The chain leads to the allow op after it (the Softmax is between allow ops).
        assert "because" in result.stdout and "allow list" in result.stdout
        # The mask's construction (the Mul by the fp32-min constant) stays fp32, by structure.
        result = run_cli("explain", source_arg, "mask/additive")
        assert result.returncode == 0, result.stderr
        assert "precision: fp32" in result.stdout and "decided by: structure" in result.stdout
        assert "attention mask from constant 'mask.min_value'" in result.stdout


def test_explain_unknown_node_is_one_line_exit_2(tmp_path: Path) -> None:
    source = _write(BUILDERS["cnn"](), tmp_path / "cnn.onnx")
    result = run_cli("explain", str(source), "no_such_node")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_convert_option_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    source = _write(BUILDERS["cnn"](), tmp_path / "cnn.onnx")
    out = tmp_path / "out.onnx"
    for args in (["--rtol", "nan", "--validate"], ["--rtol", "-1", "--validate"], ["--rtol", "0.1"],
                 ["--allow", "Relu", "--deny", "Relu"]):
        result = run_cli("convert", str(source), str(out), *args)
        assert result.returncode == 2, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
        assert not out.exists()


def test_validate_rtol_zero_fails_with_exit_1_and_typos_warn(tmp_path: Path) -> None:
    source = _write(BUILDERS["cnn"](), tmp_path / "cnn.onnx")
    result = run_cli("convert", str(source), str(tmp_path / "out.onnx"), "--validate",
                     "--rtol", "0", "--deny", "Matmul")
    assert result.returncode == 1
    assert "did you mean MatMul" in result.stderr


def test_the_report_and_explain_name_the_pass_that_inserted_each_cast(tmp_path: Path,
                                                                       capsys) -> None:
    source = _write(BUILDERS["cnn"](), tmp_path / "m.onnx")
    report = tmp_path / "r.json"
    assert run_in_process(capsys, "convert", source, tmp_path / "o.onnx", "--report", report)[0] == 0
    data = json.loads(report.read_text())
    casts = data["cost"]["inserted_casts"]
    assert len(casts) == data["summary"]["casts_inserted"] > 0
    assert {cast["inserted_by"] for cast in casts} == {"insert_casts"}
    code, out, _ = run_in_process(capsys, "explain", report, casts[0]["name"])
    assert code == 0
    assert f"{casts[0]['name']} (Cast to {casts[0]['to']}): inserted by pass insert_casts" in out
    assert casts[0]["reason"] in out
