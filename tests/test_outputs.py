"""A run's outputs are one transaction: written whole after validation passed, or not at all.

A failed run leaves the output folder exactly as it was (names, bytes, modes), an existing output
and its external data included; no output or report may name a file the run reads; re-running a
conversion with external data gives the same bytes; a report that cannot be written takes the
model with it. The CLI runs in-process (`cli.main`) to keep these fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import one_error_line
from conftest import run_in_process as run
from onnx import TensorProto, helper

from testkit.models import BUILDERS


def snapshot(folder: Path) -> dict[str, tuple]:
    """Relative path -> (kind, mode, sha256) for everything under `folder`, hidden files too."""
    state = {}
    for path in sorted(folder.rglob("*")):
        info = path.lstat()
        kind = stat.S_IFMT(info.st_mode)
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(info.st_mode) else ""
        state[str(path.relative_to(folder))] = (kind, stat.S_IMODE(info.st_mode), digest)
    return state


def save_external(model: onnx.ModelProto, path: Path, threshold: int = 1024) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=threshold)
    return path


@pytest.fixture
def external_block(tmp_path: Path) -> Path:
    """The transformer block with its weights in model/block.onnx.data."""
    return save_external(BUILDERS["transformer_block"](), tmp_path / "model" / "block.onnx")


# -- item 1: a failed run leaves an earlier output as it was ------------------------------------

def test_failed_validation_and_bad_inputs_keep_the_earlier_output_and_its_data(
        external_block: Path, tmp_path: Path, capsys) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    output = out_dir / "block_fp16.onnx"
    code, _, _ = run(capsys, "convert", external_block, output)
    assert code == 0 and (out_dir / "block_fp16.onnx.data").is_file()
    os.chmod(output, 0o640)  # modes count too
    before = snapshot(out_dir)
    bad_inputs = tmp_path / "bad.npz"
    np.savez(bad_inputs, no_such_input=np.zeros(3, np.float32))

    # bf16 output differs from the fp16 one, so an overwrite would show.
    code, out, err = run(capsys, "convert", external_block, output, "--target", "bf16",
                         "--validate", "--rtol", "0")
    assert code == 1 and "nothing was written" in err
    assert snapshot(out_dir) == before
    code, _, err = run(capsys, "convert", external_block, output, "--target", "bf16",
                       "--validate", "--inputs", bad_inputs)
    assert code == 2 and "'no_such_input' matches no input" in one_error_line(err)
    assert snapshot(out_dir) == before


def test_success_replaces_the_output_and_its_data_together(external_block: Path, tmp_path: Path,
                                                           capsys) -> None:
    output = tmp_path / "block.onnx"
    assert run(capsys, "convert", external_block, output, "--target", "bf16")[0] == 0
    assert run(capsys, "convert", external_block, output)[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["block.onnx", "block.onnx.data", "model"]
    assert onnx.load(str(output)).graph.initializer  # loads with its (new) data
    onnx.checker.check_model(str(output), full_check=True)


# -- item 2: no output or report may be a file the run reads -------------------------------------

def _refused(capsys, folder: Path, *args) -> str:
    before = snapshot(folder)
    code, _, err = run(capsys, *args)
    assert code == 2, err
    assert snapshot(folder) == before
    return one_error_line(err)


def test_outputs_naming_an_input_file_are_refused(external_block: Path, tmp_path: Path,
                                                  capsys) -> None:
    data = external_block.parent / "block.onnx.data"
    hard = tmp_path / "hard_link.onnx"
    os.link(data, hard)
    soft = tmp_path / "soft_link.onnx"
    soft.symlink_to(external_block)
    config = tmp_path / "lists.toml"
    config.write_text('deny = ["Exp"]\n')
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, x=np.zeros(1, np.float32))
    out = tmp_path / "out.onnx"
    cases = {
        "the input model's external data": ["convert", external_block, data],
        "the input model's external data 'block.onnx.data'": ["convert", external_block, hard],
        "is the input model": ["convert", external_block, soft],
        "--report": ["convert", external_block, out, "--report", data],
        "the --config file": ["convert", external_block, out, "--config", config, "--report", config],
        "the --inputs file": ["convert", external_block, out, "--validate", "--inputs", inputs,
                              "--report", inputs],
    }
    for expected, args in cases.items():
        assert expected in _refused(capsys, tmp_path, *args), args
    assert not out.exists()


def test_check_report_may_not_overwrite_what_check_reads(external_block: Path, tmp_path: Path,
                                                         capsys) -> None:
    converted = tmp_path / "c" / "block_fp16.onnx"
    converted.parent.mkdir()
    assert run(capsys, "convert", external_block, converted)[0] == 0
    for report in (converted, converted.parent / "block_fp16.onnx.data", external_block,
                   external_block.parent / "block.onnx.data"):
        message = _refused(capsys, tmp_path, "check", converted, "--reference", external_block,
                           "--report", report)
        assert "refusing to overwrite" in message


def test_a_fifo_as_output_or_report_is_refused_not_replaced(tmp_path: Path, capsys) -> None:
    source = tmp_path / "cnn.onnx"
    source.write_bytes(BUILDERS["cnn"]().SerializeToString())
    fifo = tmp_path / "pipe.onnx"
    os.mkfifo(fifo)
    assert "not a regular file" in _refused(capsys, tmp_path, "convert", source, fifo)
    assert "not a regular file" in _refused(capsys, tmp_path, "convert", source,
                                            tmp_path / "out.onnx", "--report", fifo)
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


# -- item 3: external data, again and again -------------------------------------------------------

def test_rerun_with_external_data_in_the_output_folder_gives_the_same_bytes(
        external_block: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    monkeypatch.chdir(out_dir)  # the output named relative to the current folder
    assert run(capsys, "convert", external_block, "block_fp16.onnx")[0] == 0
    first = snapshot(out_dir)
    code, _, err = run(capsys, "convert", external_block, "block_fp16.onnx")
    assert code == 0, err
    assert snapshot(out_dir) == first
    monkeypatch.chdir(tmp_path)  # and from elsewhere, with a stray .data in the current folder
    (tmp_path / "block_fp16.onnx.data").write_bytes(b"not ours")
    assert run(capsys, "convert", external_block, out_dir / "block_fp16.onnx")[0] == 0
    assert snapshot(out_dir) == first
    assert (tmp_path / "block_fp16.onnx.data").read_bytes() == b"not ours"


def test_model_whose_external_tensors_are_all_small_converts(tmp_path: Path, capsys) -> None:
    source = save_external(BUILDERS["control_flow"](), tmp_path / "in" / "cf.onnx", threshold=0)
    assert max(p.stat().st_size for p in source.parent.iterdir()) < 4096
    output = tmp_path / "cf_fp16.onnx"
    code, _, err = run(capsys, "convert", source, output, "--validate")
    assert code == 0, err
    onnx.checker.check_model(str(output), full_check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cf_fp16.onnx", "in"]


# -- item 4: the report is part of the transaction ------------------------------------------------

def test_a_report_that_cannot_be_written_leaves_no_model(tmp_path: Path, capsys) -> None:
    source = tmp_path / "cnn.onnx"
    source.write_bytes(BUILDERS["cnn"]().SerializeToString())
    output = tmp_path / "cnn_fp16.onnx"
    message = _refused(capsys, tmp_path, "convert", source, output, "--report",
                       tmp_path / "missing" / "report.json")
    assert "does not exist" in message and not output.exists()
    assert run(capsys, "convert", source, output)[0] == 0
    assert "is also written" in _refused(capsys, tmp_path, "convert", source, output,
                                         "--target", "bf16", "--report", output)


def _model_with_node_named(raw_name: bytes) -> bytes:
    """The cnn model with its first node's name replaced by `raw_name` (any bytes)."""
    model = BUILDERS["cnn"]()
    placeholder = "N" * len(raw_name)
    model.graph.node[0].name = placeholder
    return model.SerializeToString().replace(placeholder.encode(), raw_name)


def test_node_names_that_are_not_utf8_are_escaped_in_the_report(tmp_path: Path, capsys) -> None:
    source = tmp_path / "odd_names.onnx"
    source.write_bytes(_model_with_node_named(b"conv\xff\xfe1"))
    report = tmp_path / "report.json"
    code, _, err = run(capsys, "convert", source, tmp_path / "out.onnx", "--report", report,
                       "--keep-node", "conv.*1")
    assert code == 0, err
    entry = next(n for n in json.loads(report.read_text())["nodes"] if n["op"] == "Conv")
    assert entry["name"] == "conv\\xff\\xfe1" and entry["kind"] == "user_override"
    code, out, _ = run(capsys, "explain", report, "conv\\xff\\xfe1")
    assert code == 0 and "pinned to fp32 by --keep-node" in out


# -- item 14: onnx's own warnings do not come before our error line ------------------------------

def _unknown_external_key_model(folder: Path) -> Path:
    weight = TensorProto(name="weight", data_type=TensorProto.FLOAT, dims=[4])
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "w.bin"), ("offset", "0"), ("length", "16"), ("colour", "1")):
        weight.external_data.add(key=key, value=value)
    graph = helper.make_graph([helper.make_node("Add", ["x", "weight"], ["y"], name="add")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                              [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir()
    (folder / "w.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    (folder / "m.onnx").write_bytes(model.SerializeToString())
    return folder / "m.onnx"


def test_onnx_warnings_become_one_line_and_never_precede_an_error(tmp_path: Path, capsys) -> None:
    source = _unknown_external_key_model(tmp_path / "in")
    code, _, err = run(capsys, "convert", source, tmp_path / "out.onnx")
    assert code == 0, err
    assert err.strip().splitlines() == [
        next(line for line in err.splitlines() if "unknown external data key" in line)]
    assert err.startswith("amp-rewriter: warning: Ignoring unknown external data key(s) ['colour']")
    # The same model in a run that fails: the error is the only line.
    code, _, err = run(capsys, "convert", source, tmp_path / "out2.onnx", "--validate")
    assert code == 2
    assert one_error_line(err).startswith("amp-rewriter: error: onnxruntime cannot load")


def test_api_convert_file_is_a_transaction_too(external_block: Path, tmp_path: Path) -> None:
    import amp_rewriter

    output = tmp_path / "api.onnx"
    amp_rewriter.convert_file(external_block, output)
    before = snapshot(tmp_path)
    with pytest.raises(amp_rewriter.AmpError, match="input model's external data"):
        amp_rewriter.convert_file(external_block, external_block.parent / "block.onnx.data")
    with pytest.raises(amp_rewriter.AmpError):
        amp_rewriter.convert_file(external_block, output, target="fp8")
    assert snapshot(tmp_path) == before


_TERMINATE_AFTER_WRITING = """
import importlib, os, signal, sys
# the module (the package's `convert` attribute is the function of that name)
convert = importlib.import_module("amp_rewriter.formats.onnx.convert")
write = convert.save_onnx

def write_then_terminate(*args, **kwargs):
    write(*args, **kwargs)  # the model and its .data are staged: now `kill` arrives
    os.kill(os.getpid(), signal.SIGTERM)

convert.save_onnx = write_then_terminate
from amp_rewriter.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_terminated_run_leaves_nothing_behind(external_block: Path, tmp_path: Path) -> None:
    """SIGTERM (a CI job's timeout, `kill`) unwinds the run like Ctrl-C: the staged model and
    data file are removed, the earlier output stays as it was, one line on stderr, exit 143."""
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    (out / "block_fp16.onnx").write_bytes(b"earlier output")
    before = snapshot(out)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = subprocess.run([sys.executable, "-c", _TERMINATE_AFTER_WRITING, "convert",
                             str(external_block), str(out / "block_fp16.onnx"), "--report",
                             str(out / "report.json")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 143, result.stderr
    assert "terminated by signal 15" in one_error_line(result.stderr)
    assert snapshot(out) == before


_KILL_AFTER_WRITING = _TERMINATE_AFTER_WRITING.replace("signal.SIGTERM", "signal.SIGKILL")


def test_what_a_killed_run_left_is_swept_by_the_next_run(external_block: Path, tmp_path: Path,
                                                          capsys) -> None:
    """SIGKILL (the out-of-memory killer) leaves the staged output behind, hidden and tagged
    with the dead run's process id; the next run writing to that folder removes it, while a
    live process's staging and unrelated hidden files stay."""
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    killed = subprocess.run([sys.executable, "-c", _KILL_AFTER_WRITING, "convert",
                             str(external_block), str(out / "block_fp16.onnx")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert killed.returncode == -9
    left = sorted(p.name for p in out.iterdir())
    assert left and all(name.startswith(".amp-rewriter-") and name.split("-")[2].isdigit()
                        for name in left), left
    live = out / f".amp-rewriter-{os.getppid()}-staging"  # a live process: not ours to remove
    live.mkdir()
    (out / ".amp-rewriter-notes").write_text("not a run's")
    code, _, _ = run(capsys, "convert", external_block, out / "again.onnx")
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".amp-rewriter-notes", live.name, "again.onnx", "again.onnx.data"])


_KILL_DURING_AUTO = """
import importlib, os, signal, sys
accuracy = importlib.import_module("amp_rewriter.formats.onnx.accuracy")
accuracy.OnnxRunner.close = lambda self: os.kill(os.getpid(), signal.SIGKILL)
from amp_rewriter.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_work_folder_of_a_killed_auto_run_is_swept_by_the_next_one(tmp_path: Path) -> None:
    import subprocess
    import sys
    import tempfile

    model = tmp_path / "block.onnx"
    onnx.save(BUILDERS["transformer_block"](), str(model))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    args = ["convert", str(model), str(tmp_path / "out.onnx"), "--auto", "--max-error", "0.5"]
    temp = Path(tempfile.gettempdir())
    killed = subprocess.Popen([sys.executable, "-c", _KILL_DURING_AUTO, *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _, stderr = killed.communicate(timeout=300)
    assert killed.returncode == -9, stderr
    # Its own folders only (they carry its pid): another worker's live --auto run may be running.
    abandoned = set(temp.glob(f"amp-rewriter-{killed.pid}-auto-*"))
    assert abandoned, "the killed run had a work folder"
    finished = subprocess.run([sys.executable, "-m", "amp_rewriter", *args], capture_output=True,
                              text=True, env=env, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert not any(folder.exists() for folder in abandoned)
    assert not list(tmp_path.glob(".amp-rewriter-*"))


def test_a_converted_onnx_model_that_does_not_load_is_a_validation_failure() -> None:
    """Validation blames the converted model (exit 1) when it cannot load, the fp32 one
    (exit 2, bad input) when that cannot."""
    from amp_rewriter.errors import AmpError, CheckFailed
    from amp_rewriter.formats.onnx.validate import compare_models

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": np.ones(2, np.float32)}
    with pytest.raises(CheckFailed) as failed:
        compare_models(model, b"not an onnx model", feeds)
    assert failed.value.exit_code == 1
    with pytest.raises(AmpError) as bad_input:
        compare_models(b"not an onnx model", model, feeds)
    assert bad_input.value.exit_code == 2
