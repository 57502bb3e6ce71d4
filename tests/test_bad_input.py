"""Bad input must fail cleanly: exit code 2, one line on stderr, no traceback, nothing written.

Each case builds its input inside ``tmp_path`` and returns the CLI arguments; the test then
checks that the CLI neither wrote an output nor touched any file in that folder.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CliRunner, describe_run
from onnx import TensorProto, helper

from testkit.models import BUILDERS

OUTPUT_NAME = "converted.onnx"


def snapshot(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 (or "<dir>") for everything under a folder."""
    return {
        str(path.relative_to(folder)): "<dir>" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
    }


def write_cnn(path: Path) -> Path:
    """Write the (valid) cnn test model, for cases whose problem is in the options."""
    path.write_bytes(BUILDERS["cnn"]().SerializeToString())
    return path


def missing_file(tmp_path: Path) -> list[str | Path]:
    """An input path that does not exist."""
    return ["convert", tmp_path / "does_not_exist.onnx", tmp_path / OUTPUT_NAME]


def directory(tmp_path: Path) -> list[str | Path]:
    """A directory (named like a model) as the input."""
    folder = tmp_path / "a_folder.onnx"
    folder.mkdir()
    return ["convert", folder, tmp_path / OUTPUT_NAME]


def text_file(tmp_path: Path) -> list[str | Path]:
    """A plain text file with an .onnx name."""
    text = tmp_path / "x.onnx"
    text.write_text("this is not an ONNX model\n")
    return ["convert", text, tmp_path / OUTPUT_NAME]


def truncated_protobuf(tmp_path: Path) -> list[str | Path]:
    """The first half of a real model's bytes."""
    model_bytes = BUILDERS["cnn"]().SerializeToString()
    truncated = tmp_path / "truncated.onnx"
    # Cut mid-message: protobuf rejects this as corrupt wire format.
    truncated.write_bytes(model_bytes[: len(model_bytes) // 2])
    return ["convert", truncated, tmp_path / OUTPUT_NAME]


def unknown_target(tmp_path: Path) -> list[str | Path]:
    """A valid model with an unsupported ``--target``."""
    return ["convert", write_cnn(tmp_path / "cnn.onnx"), tmp_path / OUTPUT_NAME, "--target", "fp8"]


def savedmodel_option(tmp_path: Path) -> list[str | Path]:
    """A valid model with an option for TensorFlow SavedModels only (it was ignored)."""
    return ["convert", write_cnn(tmp_path / "cnn.onnx"), tmp_path / OUTPUT_NAME,
            "--keep-fp32-weights"]


def output_is_input(tmp_path: Path) -> list[str | Path]:
    """Output path equal to the input path (must not overwrite the input)."""
    model = write_cnn(tmp_path / "cnn.onnx")
    return ["convert", model, model]


def external_data_escape(tmp_path: Path) -> list[str | Path]:
    """An initializer whose external data `location` climbs out of the model's folder."""
    weight = TensorProto(name="weight", data_type=TensorProto.FLOAT, dims=[4])
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../../etc/passwd"), ("offset", "0"), ("length", "16")):
        weight.external_data.add(key=key, value=value)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "weight"], ["y"], name="add")],
        "external_data_escape",
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        initializer=[weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    model_dir = tmp_path / "nested" / "model"
    model_dir.mkdir(parents=True)
    # Make the escaped path resolve to a real, well-sized file, so a converter that follows it
    # would succeed: only an explicit "outside the model folder" check makes this case fail.
    escaped_target = model_dir / "../../etc/passwd"
    escaped_target.parent.mkdir(parents=True)
    escaped_target.write_bytes(b"secret:x:0:0:ab\n")  # 16 bytes = 4 float32
    model_path = model_dir / "model.onnx"
    # Serialized by hand: onnx.save would try to resolve the external data itself.
    model_path.write_bytes(model.SerializeToString())
    return ["convert", model_path, tmp_path / OUTPUT_NAME]


def ancient_opset(tmp_path: Path) -> list[str | Path]:
    """A valid opset-5 model: its casts would name their type (Cast before opset 6), which onnx
    cannot type-check and onnxruntime does not run."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")], "ancient",
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 5)], ir_version=3)
    path = tmp_path / "ancient.onnx"
    path.write_bytes(model.SerializeToString())
    return ["convert", path, tmp_path / OUTPUT_NAME]


BAD_INPUTS: dict[str, Callable[[Path], list[str | Path]]] = {
    "missing_file": missing_file,
    "directory": directory,
    "text_file": text_file,
    "truncated_protobuf": truncated_protobuf,
    "unknown_target": unknown_target,
    "savedmodel_option": savedmodel_option,
    "output_is_input": output_is_input,
    "external_data_escape": external_data_escape,
    "ancient_opset": ancient_opset,
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_exits_2_cleanly(case: str, tmp_path: Path, amp_cli: CliRunner) -> None:
    args = BAD_INPUTS[case](tmp_path)
    before = snapshot(tmp_path)

    result = amp_cli(*args)

    assert result.returncode == 2, describe_run(result)
    stderr_lines = result.stderr.splitlines()
    assert len(stderr_lines) == 1 and stderr_lines[0].strip(), f"want one stderr line, got:\n{result.stderr}"
    assert "Traceback" not in result.stderr
    assert not (tmp_path / OUTPUT_NAME).exists()
    # Same files with the same bytes: the input is untouched and no partial output/temp file is left.
    assert snapshot(tmp_path) == before

