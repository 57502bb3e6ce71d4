"""One rule for every path a run writes (issue 35, items 1, 2, 4 and 7): the model, its external
data in every layout, `--report` and `diagnose --json` are staged in the output transaction and
refused, before anything is written, when they are, lead to or would overwrite anything the run
reads or writes, each other included; the commit checks its files in linear time.

The CLI runs in-process (`cli.main`); the models are tiny and their weights easy to recognise,
so an output whose data was overwritten shows in its values, not only in its loading.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import one_error_line
from conftest import run_in_process as run
from onnx import TensorProto, helper, numpy_helper
from test_outputs import _refused, snapshot

import amp_rewriter


def _scale(index: int) -> float:
    return 0.125 if index % 2 == 0 else 8.0


def _matmul_chain(count: int, features: int = 16) -> onnx.ModelProto:
    """x @ w0 @ w1 ... with the weights 0.125 * I, 8 * I, 0.125 * I, ...: what y must be is
    easy to say (`_computes_the_chain`), and exact in fp16."""
    nodes, weights, previous = [], [], "x"
    for index in range(count):
        weights.append(numpy_helper.from_array(
            np.eye(features, dtype=np.float32) * np.float32(_scale(index)), f"w{index}"))
        nodes.append(helper.make_node("MatMul", [previous, f"w{index}"], [f"h{index}"],
                                      name=f"mm{index}"))
        previous = f"h{index}"
    nodes.append(helper.make_node("Identity", [previous], ["y"], name="out"))
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, features])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _save_external(model: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=0)
    return path


@pytest.fixture
def chain(tmp_path: Path) -> Path:
    """Two weights in model/m.onnx.data."""
    return _save_external(_matmul_chain(2), tmp_path / "model" / "m.onnx")


def _computes_the_chain(path: Path, count: int = 2) -> None:
    """The output loads with its data and computes what `_matmul_chain(count)` computes."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.full((1, 16), 64.0, np.float32)
    (y,) = session.run(None, {"x": x})
    expected = x * np.prod([_scale(index) for index in range(count)])
    np.testing.assert_array_equal(np.asarray(y, np.float32), expected)


# -- item 1: --report over the output's own external data ---------------------------------------

@pytest.mark.parametrize("layout, data_name", [
    (["--external-data-threshold", "0"], "out.onnx.data"),
    (["--external-data", "single", "--external-data-threshold", "0"], "out.onnx.data"),
    (["--external-data", "per-tensor", "--external-data-threshold", "0"], "out.onnx.0.data"),
    (["--external-data", "per-tensor", "--external-data-threshold", "0"], "out.onnx.1.data"),
])
def test_a_report_named_as_the_outputs_external_data_is_refused(chain: Path, tmp_path: Path,
                                                                 capsys, layout, data_name) -> None:
    out = tmp_path / "out.onnx"
    message = _refused(capsys, tmp_path, "convert", chain, out, *layout, "--report",
                       tmp_path / data_name)
    assert f"--report {tmp_path / data_name} is also written as the output {out}'s external " \
           f"data ({data_name})" in message
    # The same, spelled through another path to the folder, and through a link to it.
    (tmp_path / "sub").mkdir()
    message = _refused(capsys, tmp_path, "convert", chain, out, *layout, "--report",
                       tmp_path / "sub" / ".." / data_name)
    assert "is also written as the output" in message
    (tmp_path / "link.json").symlink_to(tmp_path / data_name)
    assert "is also written as the output" in _refused(
        capsys, tmp_path, "convert", chain, out, *layout, "--report", tmp_path / "link.json")


def test_a_report_named_as_the_outputs_data_is_refused_with_auto(chain: Path, tmp_path: Path,
                                                                  capsys) -> None:
    out = tmp_path / "out.onnx"
    message = _refused(capsys, tmp_path, "convert", chain, out, "--auto", "--max-error", "1",
                       "--external-data-threshold", "0", "--report", tmp_path / "out.onnx.data")
    assert "is also written as the output" in message


def test_the_report_may_still_sit_beside_the_output(chain: Path, tmp_path: Path, capsys) -> None:
    """Names the layout does not write stay free: the rule is not "nothing beside the model"."""
    out = tmp_path / "out.onnx"
    for layout, report in ((["--external-data", "per-tensor"], "out.onnx.data"),
                           (["--external-data", "single"], "out.onnx.0.data"),
                           (["--external-data", "inline"], "out.onnx.data"),
                           ([], "out.onnx.json")):
        code, _, err = run(capsys, "convert", chain, out, *layout, "--external-data-threshold",
                           "0", "--report", tmp_path / report)
        assert code == 0, err
        assert json.loads((tmp_path / report).read_text())["target"] == "fp16"
        _computes_the_chain(out)
        (tmp_path / report).unlink()


def test_the_output_and_a_report_into_a_savedmodel_output_are_refused(tmp_path: Path,
                                                                       capsys) -> None:
    """A report inside a directory output (or a directory output holding the report) would
    be moved away with the old directory at commit."""
    from amp_rewriter.fileio import OutputTransaction

    (tmp_path / "saved").mkdir()
    with OutputTransaction() as outputs:
        outputs.stage(tmp_path / "saved", "output", "dir", replace_dir=lambda _: True)
        with pytest.raises(amp_rewriter.AmpError, match="is also written as something inside "
                                                        "the output"):
            outputs.stage(tmp_path / "saved" / "report.json", "--report")
    with OutputTransaction() as outputs:
        outputs.stage(tmp_path / "saved" / "report.json", "--report")
        with pytest.raises(amp_rewriter.AmpError, match="is also written as the --report"):
            outputs.stage(tmp_path / "saved", "output", "dir", replace_dir=lambda _: True)


def test_an_output_whose_data_file_would_overwrite_an_input_is_refused(tmp_path: Path,
                                                                        capsys) -> None:
    """The input's external data is named out.onnx.data: writing out.onnx beside it with the
    single layout would replace it."""
    source = tmp_path / "m.onnx"
    onnx.save_model(_matmul_chain(2), str(source), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="out.onnx.data", size_threshold=0)
    message = _refused(capsys, tmp_path, "convert", source, tmp_path / "out.onnx")
    assert "external data" in message and "refusing to overwrite it" in message
    code, _, err = run(capsys, "convert", source, tmp_path / "out.onnx", "--external-data",
                       "inline")
    assert code == 0, err


def test_the_api_follows_the_same_rule(chain: Path, tmp_path: Path) -> None:
    config = chain.parent / "m2.onnx.0.data"  # a config file named as a per-tensor data file
    config.write_text("deny = []\n")
    before = snapshot(tmp_path)
    with pytest.raises(amp_rewriter.AmpError, match=r"m2.onnx's external data .*m2.onnx.0.data "
                                                    r"is the --config file: refusing"):
        amp_rewriter.convert_file(chain, chain.parent / "m2.onnx", external_data="per-tensor",
                                  external_data_threshold=0, config=config)
    assert snapshot(tmp_path) == before


# -- item 2: diagnose --json is an output like any other --------------------------------------

def test_diagnose_json_may_not_overwrite_what_the_run_reads(chain: Path, tmp_path: Path,
                                                            capsys) -> None:
    config = tmp_path / "lists.toml"
    config.write_text('deny = ["Relu"]\n')
    inputs = tmp_path / "x.npz"
    np.savez(inputs, x=np.ones((1, 16), np.float32))
    cases = {
        chain: "is the input model",
        chain.parent / "m.onnx.data": "is the input model's external data 'm.onnx.data'",
        config: "is the --config file",
        inputs: "is the --inputs file",
    }
    for json_path, expected in cases.items():
        message = _refused(capsys, tmp_path, "diagnose", chain, "--config", config, "--inputs",
                           inputs, "--json", json_path)
        assert f"--json {json_path} {expected}: refusing to overwrite it" in message
    (tmp_path / "data_link.json").symlink_to(chain.parent / "m.onnx.data")
    assert "refusing to overwrite" in _refused(capsys, tmp_path, "diagnose", chain, "--json",
                                               tmp_path / "data_link.json")
    # and the model still converts and computes what it did
    code, _, err = run(capsys, "convert", chain, tmp_path / "ok.onnx")
    assert code == 0, err
    _computes_the_chain(tmp_path / "ok.onnx")


def test_diagnose_json_is_written_whole_or_not_at_all(chain: Path, tmp_path: Path,
                                                      capsys) -> None:
    out = tmp_path / "diag.json"
    code, _, err = run(capsys, "diagnose", chain, "--json", out)
    assert code == 0, err
    assert "nodes" in json.loads(out.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diag.json", "model"]
    before = snapshot(tmp_path)
    bad = tmp_path / "bad.npz"
    np.savez(bad, nope=np.ones(2, np.float32))
    code, _, err = run(capsys, "diagnose", chain, "--json", out, "--inputs", bad)
    assert code == 2 and "'nope' not in the model" in one_error_line(err)
    bad.unlink()
    assert snapshot(tmp_path) == before
    assert "names a folder" in _refused(capsys, tmp_path, "diagnose", chain, "--json",
                                        f"{tmp_path}/diag2.json/")


# -- item 4: the commit is linear in the number of files ----------------------------------------

def _stat_calls_converting(tmp_path: Path, capsys, monkeypatch, count: int) -> int:
    """os.stat and os.lstat calls of one per-tensor conversion of `count` weights (the
    conversion itself stats nothing per tensor; the output transaction does)."""
    source = tmp_path / f"in{count}.onnx"
    onnx.save(_matmul_chain(count), str(source))
    folder = tmp_path / f"out{count}"
    folder.mkdir()
    calls = [0]
    real_stat, real_lstat = os.stat, os.lstat

    def counted_stat(*args, **kwargs):
        calls[0] += 1
        return real_stat(*args, **kwargs)

    def counted_lstat(*args, **kwargs):
        calls[0] += 1
        return real_lstat(*args, **kwargs)

    monkeypatch.setattr(os, "stat", counted_stat)
    monkeypatch.setattr(os, "lstat", counted_lstat)
    try:
        code, _, err = run(capsys, "convert", source, folder / "out.onnx", "--external-data",
                           "per-tensor", "--external-data-threshold", "0", "--quiet")
    finally:
        monkeypatch.undo()
    assert code == 0, err
    assert len(list(folder.glob("out.onnx.*.data"))) == count
    _computes_the_chain(folder / "out.onnx", count)
    return calls[0]


def test_the_commit_of_a_per_tensor_layout_is_linear(tmp_path: Path, capsys, monkeypatch) -> None:
    """Twice the tensors cost at most about twice the file-system checks (the old commit
    compared every data file with every other: four times)."""
    small = _stat_calls_converting(tmp_path, capsys, monkeypatch, 150)
    large = _stat_calls_converting(tmp_path, capsys, monkeypatch, 300)
    assert large < 2.5 * small, (small, large)


# -- item 7: a trailing slash names a folder ----------------------------------------------------

@pytest.mark.parametrize("suffix", ["/", "/.", "/.."])
def test_an_output_or_report_naming_a_folder_is_refused(chain: Path, tmp_path: Path, capsys,
                                                        suffix: str) -> None:
    message = _refused(capsys, tmp_path, "convert", chain, f"{tmp_path}/out.onnx{suffix}")
    assert "names a folder, expected an output file name" in message
    message = _refused(capsys, tmp_path, "convert", chain, tmp_path / "out.onnx", "--report",
                       f"{tmp_path}/report.json{suffix}")
    assert "names a folder" in message


# -- what the fuzzer's new families and review found beside the items --------------------------

def test_a_directory_output_may_not_be_dot_or_hold_the_current_folder(tmp_path: Path, capsys,
                                                                      monkeypatch) -> None:
    """`convert sm .` was an unexpected FileExistsError; `convert sm ../here` from inside
    `here` moved the current folder away mid-commit and lost it."""
    from amp_rewriter.fileio import OutputTransaction

    here = tmp_path / "here"
    here.mkdir()
    (here / "keep.txt").write_text("mine\n")
    monkeypatch.chdir(here)
    for name in (".", "./", "..", "/"):
        with OutputTransaction() as outputs, pytest.raises(amp_rewriter.AmpError,
                                                           match="names no folder of its own"):
            outputs.stage(name, "output", "dir", replace_dir=lambda _: True)
    for name in ("../here", str(here), "../../" + tmp_path.name):
        with OutputTransaction() as outputs, pytest.raises(amp_rewriter.AmpError,
                                                           match="holds\\) the current folder"):
            outputs.stage(name, "output", "dir", replace_dir=lambda _: True)
    assert (here / "keep.txt").read_text() == "mine\n"


def test_a_folder_where_the_output_writes_its_data_is_refused_at_stage(chain: Path,
                                                                        tmp_path: Path,
                                                                        capsys) -> None:
    (tmp_path / "out.onnx.data").mkdir()
    message = _refused(capsys, tmp_path, "convert", chain, tmp_path / "out.onnx")
    assert "external data" in message and "is a directory" in message


def test_a_metric_module_found_by_name_is_an_input_too(chain: Path, tmp_path: Path, capsys,
                                                       monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_metric.py").write_text("def zero(reference, outputs):\n    return 0.0\n")
    message = _refused(capsys, tmp_path, "convert", chain, tmp_path / "out.onnx", "--auto",
                       "--max-error", "1", "--metric", "my_metric:zero", "--report",
                       "my_metric.py")
    assert "is the --metric module: refusing to overwrite it" in message
