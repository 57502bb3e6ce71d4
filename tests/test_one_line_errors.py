"""Messages and exit codes (issue 35, items 5, 6 and 8, ONNX side): inputs that ended in
"unexpected <Exception>" are one line naming the problem; a user `--metric` runs guarded (an
exception, `sys.exit`, a value that is no finite number: one line naming the metric, exit 2,
never the metric's exit status); onnxruntime's own log lines never reach stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import REPO_ROOT, one_error_line
from conftest import run_in_process as run
from onnx import TensorProto, helper, numpy_helper
from test_outputs import _refused as refused


def _save(model: onnx.ModelProto, path: Path) -> Path:
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def _matmul(path: Path) -> Path:
    weight = numpy_helper.from_array(np.eye(16, dtype=np.float32) * 0.5, "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])], [weight])
    return _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def _refused(capsys, folder: Path, *args) -> str:
    """test_outputs' refusal (exit 2, one line, nothing changed), never an unexpected one."""
    line = refused(capsys, folder, *args)
    assert "unexpected" not in line, line
    return line


# -- item 5 ---------------------------------------------------------------------------------------

def test_a_config_whose_ops_is_not_a_table_is_one_line(tmp_path: Path, capsys) -> None:
    model = _matmul(tmp_path / "m.onnx")
    config = tmp_path / "c.toml"
    config.write_text("ops = 5\n")
    assert "'ops' must be a table" in _refused(capsys, tmp_path, "convert", model,
                                               tmp_path / "out.onnx", "--config", config)


@pytest.mark.parametrize("clamp", [[], ["--clamp"]])
def test_a_node_with_fewer_inputs_than_its_schema_is_refused_by_the_loader(
        tmp_path: Path, capsys, clamp) -> None:
    """A Cast without an input (convert_constants indexed it: IndexError inside a pass)."""
    weight = numpy_helper.from_array(np.full(4, 70000.0, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Cast", [], ["c"], to=TensorProto.FLOAT, name="cast0"),
         helper.make_node("Add", ["x", "c"], ["y"], name="add")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [weight])
    model = _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                  tmp_path / "m.onnx")
    message = _refused(capsys, tmp_path, "convert", model, tmp_path / "out.onnx", *clamp)
    assert "node 'cast0' (Cast) has 0 inputs, its schema takes 1" in message


# -- item 6: a user metric runs guarded -----------------------------------------------------------

_METRICS = '''
import sys
import numpy as np

def exits(reference, outputs):
    sys.exit(7)

def raises(reference, outputs):
    raise ValueError("no good")

def huge(reference, outputs):
    return 10**400

def nan(reference, outputs):
    return float("nan")

def inf(reference, outputs):
    return np.inf

def text(reference, outputs):
    return "0.1"

def nothing(reference, outputs):
    pass

def writes(reference, outputs):
    reference["y"][...] = 0  # would corrupt the reference every later trial compares with
    return 0.0

def fine(reference, outputs):
    return float(np.max(np.abs(outputs["y"] - reference["y"])))
'''


@pytest.mark.parametrize("function, message", [
    ("exits", "failed (it called sys.exit(7))"),
    ("raises", "failed (ValueError: no good)"),
    ("huge", "returned 10000000000000000000...00000000 (401 characters) on finite outputs: "
             "a metric must give a finite number"),
    ("nan", "returned nan on finite outputs: a metric must give a finite number"),
    ("inf", "returned inf on finite outputs: a metric must give a finite number"),
    ("text", "returned str, expected a number"),
    ("nothing", "returned NoneType, expected a number"),
    ("writes", "failed (ValueError: assignment destination is read-only)"),
])
def test_a_misbehaving_metric_is_one_line_exit_2(tmp_path: Path, capsys, function,
                                                 message) -> None:
    model = _matmul(tmp_path / "m.onnx")
    (tmp_path / "metrics.py").write_text(_METRICS)
    spec = f"{tmp_path / 'metrics.py'}:{function}"
    line = _refused(capsys, tmp_path, "convert", model, tmp_path / "out.onnx", "--auto",
                    "--max-error", "1", "--metric", spec, "--report", tmp_path / "r.json")
    assert line.startswith(f"amp-rewriter: error: --metric {spec} {message}"), line


def test_a_metric_may_say_nan_of_outputs_that_overflowed() -> None:
    """NaN (or inf) from a user metric is an error on finite outputs, but "fails" on outputs
    that hold NaN or inf themselves: a candidate that overflowed (scripts/allclose_metric.py
    says NaN there), which the search must be able to reject and go on."""
    import math

    from amp_rewriter.accuracy.metrics import Metric

    def nan_when_nonfinite(reference, outputs):
        return float(np.max(np.abs(outputs["y"] - reference["y"]))) \
            if np.isfinite(outputs["y"]).all() else float("nan")

    metric = Metric("file.py:nan_when_nonfinite", nan_when_nonfinite, 1.0)
    reference = {"y": np.ones(4, np.float32)}
    assert metric.evaluate(reference, {"y": np.ones(4, np.float32)}) == 0.0
    overflowed = metric.evaluate(reference, {"y": np.array([1, np.inf, 1, 1], np.float16)})
    assert overflowed == math.inf and not metric.passes(overflowed)
    minus = Metric("file.py:minus_inf", lambda reference, outputs: -math.inf, 1.0)
    with pytest.raises(Exception, match="returned -inf: a metric must give a finite number"):
        minus.evaluate(reference, {"y": np.array([np.nan] * 4, np.float32)})


def test_a_metric_module_that_exits_on_import_is_one_line(tmp_path: Path, capsys) -> None:
    model = _matmul(tmp_path / "m.onnx")
    (tmp_path / "bye.py").write_text("import sys\nsys.exit(3)\n")
    line = _refused(capsys, tmp_path, "convert", model, tmp_path / "out.onnx", "--auto",
                    "--max-error", "1", "--metric", f"{tmp_path / 'bye.py'}:f")
    assert "cannot import" in line and "it called sys.exit(3)" in line


def test_a_sound_user_metric_still_runs(tmp_path: Path, capsys) -> None:
    model = _matmul(tmp_path / "m.onnx")
    (tmp_path / "metrics.py").write_text(_METRICS)
    code, out, err = run(capsys, "convert", model, tmp_path / "out.onnx", "--auto",
                         "--max-error", "1", "--metric", f"{tmp_path / 'metrics.py'}:fine")
    assert code == 0, err
    assert (tmp_path / "out.onnx").is_file()


def test_the_metric_file_is_an_input_no_output_may_overwrite(tmp_path: Path, capsys) -> None:
    model = _matmul(tmp_path / "m.onnx")
    metric = tmp_path / "metrics.py"
    metric.write_text(_METRICS)
    line = _refused(capsys, tmp_path, "convert", model, tmp_path / "out.onnx", "--auto",
                    "--max-error", "1", "--metric", f"{metric}:fine", "--report", metric)
    assert f"--report {metric} is the --metric file: refusing to overwrite it" in line


# -- item 8: onnxruntime's own log lines ----------------------------------------------------------

def _cli(*args: str | os.PathLike, home: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    if home is not None:
        env["HOME"] = home
    return subprocess.run([sys.executable, "-m", "amp_rewriter", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


def test_no_onnxruntime_warning_where_home_is_not_writable(tmp_path: Path) -> None:
    """onnxruntime warned on every import that it cannot persist a telemetry device id."""
    model = _matmul(tmp_path / "m.onnx")
    unwritable_home = "/proc/version"  # a file: nothing can be made under it, root or not
    result = _cli("convert", model, tmp_path / "out.onnx", "--validate", home=unwritable_home)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_a_model_that_fails_to_run_is_our_one_line_only(tmp_path: Path, capfd) -> None:
    """onnxruntime printed its coloured "[E:onnxruntime ...] ExecuteKernel" line before ours
    (straight to file descriptor 2: capfd sees it, in this process)."""
    from amp_rewriter import cli

    shape = numpy_helper.from_array(np.array([5], np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
         helper.make_node("Relu", ["r"], ["y"], name="relu")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5])], [shape])
    model = _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                  tmp_path / "m.onnx")
    converted = tmp_path / "m16.onnx"
    assert cli.main(["convert", str(model), str(converted), "--quiet"]) == 0
    capfd.readouterr()
    for args in (["check", converted, "--reference", model], ["diagnose", model]):
        code = cli.main([str(a) for a in args])
        err = capfd.readouterr().err
        assert code == 2, err
        line = one_error_line(err)
        assert line.startswith("amp-rewriter: error:") and "Reshape" in line
