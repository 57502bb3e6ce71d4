"""One checked reader for every file a run reads (issue 35, item 3 and part of 5): calibration
inputs of `--auto` and `diagnose` in every format (.npz, folders, Polygraphy JSON), `--inputs` of
`--validate` and `check`, and external data are regular files only, read within the bytes they
hold: a FIFO is refused at once, a link to /dev/zero too, an archive cannot inflate past what its
size allows, arrays of Python objects and broken Polygraphy files are one-line errors.

Runs that could block or balloon go through a subprocess with a time limit, so the old
behaviour fails the test instead of hanging the suite.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import REPO_ROOT, one_error_line
from conftest import run_in_process as run
from onnx import TensorProto, helper, numpy_helper
from test_outputs import snapshot

#: Seconds a refusal may take (a blocked read is killed here, and the test fails).
REFUSAL_TIMEOUT_S = 60

# VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across exec, so a child of a big
# pytest process would report the parent's size.
_RUN_AND_REPORT_RSS = """
import sys
from amp_rewriter.cli import main
code = main(sys.argv[1:])
with open("/proc/self/status") as status:
    peak = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
print(f"peak-rss-kib {peak}")
sys.exit(code)
"""


def _cli(*args: str | os.PathLike) -> tuple[subprocess.CompletedProcess, int]:
    """The CLI in a fresh process with a time limit: (result, its peak RSS in MiB)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", _RUN_AND_REPORT_RSS, *map(str, args)],
                            capture_output=True, text=True, env=env, timeout=REFUSAL_TIMEOUT_S)
    peak = next(int(line.split()[1]) for line in result.stdout.splitlines()
                if line.startswith("peak-rss-kib"))
    return result, peak // 1024


def _model(folder: Path, features: int = 16) -> Path:
    """y = x @ w: one input x [1, features], weights in the model."""
    weight = numpy_helper.from_array(np.eye(features, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, features])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "m.onnx"
    onnx.save(model, str(path))
    return path


def _zip_bomb(path: Path, name: str, shape: tuple[int, ...]) -> Path:
    """An .npz whose one float32 array of `shape` is all zeros, deflated (a thousandfold)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": shape})
    zero_chunk = bytes(1 << 24)
    left = int(np.prod(shape)) * 4
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive, \
            archive.open(f"{name}.npy", "w", force_zip64=True) as member:
        member.write(header.getvalue())
        while left > 0:
            member.write(zero_chunk[:min(left, len(zero_chunk))])
            left -= min(left, len(zero_chunk))
    return path


def _polygraphy(path: Path, encoded: str) -> Path:
    path.write_text(json.dumps([{"x": {"array": encoded, "polygraphy_class": "ndarray"}}]))
    return path


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# -- FIFOs and devices --------------------------------------------------------------------------

@pytest.mark.parametrize("name, command", [("pipe.npz", "diagnose"), ("pipe.json", "auto")])
def test_a_fifo_as_calibration_input_is_refused_at_once(tmp_path: Path, name: str,
                                                        command: str) -> None:
    model = _model(tmp_path)
    fifo = tmp_path / name
    os.mkfifo(fifo)
    args = (["diagnose", model, "--inputs", fifo] if command == "diagnose" else
            ["convert", model, tmp_path / "out.onnx", "--auto", "--max-error", "1", "--inputs",
             fifo])
    result, _ = _cli(*args)
    assert result.returncode == 2, result.stderr
    assert "is a FIFO (named pipe), not a regular file" in one_error_line(result.stderr)
    assert not (tmp_path / "out.onnx").exists()


def test_a_fifo_or_device_link_inside_a_calibration_folder_is_refused(tmp_path: Path,
                                                                      capsys) -> None:
    model = _model(tmp_path)
    folder = tmp_path / "calib"
    folder.mkdir()
    np.savez(folder / "a.npz", x=np.ones((1, 16), np.float32))
    (folder / "b.npz").symlink_to("/dev/zero")
    code, _, err = run(capsys, "diagnose", model, "--inputs", folder)
    assert code == 2 and "b.npz: is a character device" in one_error_line(err)


def test_a_json_linked_to_dev_zero_is_refused_at_once(tmp_path: Path) -> None:
    model = _model(tmp_path)
    link = tmp_path / "feeds.json"
    link.symlink_to("/dev/zero")
    result, peak = _cli("diagnose", model, "--inputs", link)
    assert result.returncode == 2, result.stderr
    assert "is a character device, not a regular file" in one_error_line(result.stderr)
    assert peak < 1024, peak


# -- sizes bounded by the bytes on disk ---------------------------------------------------------

def test_a_compressed_archive_cannot_inflate_past_its_size(tmp_path: Path, capsys) -> None:
    """512 MiB of zeros in a 0.5 MiB .npz: refused from the sizes the archive declares, before
    anything is inflated (it was inflated whole, then its shape refused)."""
    model = _model(tmp_path)
    bomb = _zip_bomb(tmp_path / "bomb.npz", "x", (1, 1 << 27))
    assert bomb.stat().st_size < 2 << 20
    np.savez(tmp_path / "good.npz", x=np.ones((1, 16), np.float32))
    baseline_result, baseline = _cli("diagnose", model, "--inputs", tmp_path / "good.npz")
    assert baseline_result.returncode == 0, baseline_result.stderr
    result, peak = _cli("diagnose", model, "--inputs", bomb)
    assert result.returncode == 2, result.stderr
    assert "declares 536871040 bytes" in one_error_line(result.stderr)
    assert peak < baseline + 256, (peak, baseline)
    # --validate's and check's --inputs go through the same reader (in this process: quicker)
    for args in (["convert", model, tmp_path / "out.onnx", "--validate", "--inputs", bomb],
                 ["check", model, "--reference", model, "--inputs", bomb]):
        code, _, err = run(capsys, *args)
        assert code == 2 and "declares 536871040 bytes" in one_error_line(err), args


def test_an_array_is_checked_against_the_model_before_its_data_is_read(tmp_path: Path,
                                                                       capsys) -> None:
    """A modest archive that may inflate: its wrong shape is refused from the header."""
    model = _model(tmp_path)
    wrong = _zip_bomb(tmp_path / "wrong.npz", "x", (1, 1 << 20))
    code, _, err = run(capsys, "diagnose", model, "--inputs", wrong)
    assert code == 2
    assert "input 'x' has shape [1, 1048576], the model takes [1, 16]" in one_error_line(err)


def test_a_truncated_array_is_refused(tmp_path: Path, capsys) -> None:
    model = _model(tmp_path)
    array = io.BytesIO()
    np.save(array, np.ones((1, 16), np.float32))
    short = tmp_path / "short.json"
    _polygraphy(short, _b64(array.getvalue()[:-8]))
    code, _, err = run(capsys, "diagnose", model, "--inputs", short)
    assert code == 2 and "needs 64 bytes, the file holds 56" in one_error_line(err)


# -- Polygraphy JSON and archives that are no arrays --------------------------------------------

def test_broken_polygraphy_files_are_one_line_errors(tmp_path: Path, capsys) -> None:
    model = _model(tmp_path)
    objects = io.BytesIO()
    np.save(objects, np.array([1, "a"], dtype=object), allow_pickle=True)
    empty_zip = io.BytesIO()
    zipfile.ZipFile(empty_zip, "w").close()
    nested_objects = io.BytesIO()
    np.savez(nested_objects, x=np.array([None], dtype=object))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    cases = {
        deep: "not a Polygraphy JSON input file (RecursionError)",
        _polygraphy(tmp_path / "objects.json", _b64(objects.getvalue())):
            "holds Python objects (dtype object), not numbers",
        _polygraphy(tmp_path / "empty_zip.json", _b64(empty_zip.getvalue())):
            "an .npz with 0 arrays, expected one",
        _polygraphy(tmp_path / "nested_objects.json", _b64(nested_objects.getvalue())):
            "holds Python objects",
        _polygraphy(tmp_path / "empty.json", ""): "cannot decode the array",
    }
    for path, message in cases.items():
        code, _, err = run(capsys, "diagnose", model, "--inputs", path)
        assert code == 2 and message in one_error_line(err), (path.name, err)
        assert "unexpected" not in err


def test_an_npz_of_objects_is_refused_for_validate_and_check(tmp_path: Path, capsys) -> None:
    model = _model(tmp_path)
    objects = tmp_path / "objects.npz"
    np.savez(objects, x=np.array([{"a": 1}], dtype=object))
    before = snapshot(tmp_path)
    for args in (["convert", model, tmp_path / "out.onnx", "--validate", "--inputs", objects],
                 ["check", model, "--reference", model, "--inputs", objects],
                 ["diagnose", model, "--inputs", objects]):
        code, _, err = run(capsys, *args)
        assert code == 2 and "holds Python objects" in one_error_line(err), args
    assert snapshot(tmp_path) == before


def test_calibration_batches_still_read(tmp_path: Path, capsys) -> None:
    """The checks refuse nothing sound: a compressed .npz (a thousandfold, small), an
    uncompressed one, a folder, Polygraphy's base64 .npy and its old .npz form."""
    model = _model(tmp_path)
    ones = np.ones((1, 16), np.float32)
    np.savez_compressed(tmp_path / "compressed.npz", x=ones)
    (tmp_path / "folder").mkdir()
    np.savez(tmp_path / "folder" / "a.npz", x=ones * 2)
    array, archive = io.BytesIO(), io.BytesIO()
    np.save(array, ones * 3)
    np.savez(archive, x=ones * 4)
    new = _polygraphy(tmp_path / "new.json", _b64(array.getvalue()))
    old = _polygraphy(tmp_path / "old.json", _b64(archive.getvalue()))
    code, out, err = run(capsys, "diagnose", model, "--inputs", tmp_path / "compressed.npz",
                         tmp_path / "folder", new, old, "--json", tmp_path / "d.json")
    assert code == 0, err
    assert json.loads((tmp_path / "d.json").read_text())["batches"] == 4


# -- external data through a link inside the model's folder ---------------------------------------

def test_external_data_through_a_link_inside_the_folder_converts(tmp_path: Path,
                                                                 capsys) -> None:
    """onnx's own reader refuses such links ("unexpected ValidationError"); ours reads them
    like any file inside the folder, and everything that reads the model agrees."""
    folder = tmp_path / "model"
    folder.mkdir()
    weight = numpy_helper.from_array(np.full((16, 16), 0.5, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(folder / "m.onnx"), save_as_external_data=True,
                    location="weights.bin", size_threshold=0)
    (folder / "weights.bin").rename(folder / "real.bin")
    (folder / "weights.bin").symlink_to("real.bin")
    source = folder / "m.onnx"
    before = snapshot(folder)
    for args in (["convert", source, tmp_path / "a.onnx", "--external-data-threshold", "0"],
                 ["convert", source, tmp_path / "b.onnx", "--validate"],
                 ["convert", source, tmp_path / "c.onnx", "--external-data", "inline"],
                 ["check", tmp_path / "a.onnx", "--reference", source],
                 ["diagnose", source]):
        code, _, err = run(capsys, *args)
        assert code == 0, (args, err)
        assert "unexpected" not in err
    assert snapshot(folder) == before
    converted = onnx.load(str(tmp_path / "c.onnx"))
    assert np.all(numpy_helper.to_array(converted.graph.initializer[0]) == np.float16(0.5))
