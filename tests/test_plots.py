"""`convert --plot` and `diagnose --plot` through the CLI: the precision map of a 300-layer
transformer (a pinned layer shows as fp32 cells), diagnose's picture naming a planted culprit,
byte-identical files for the same run, and bad or colliding --plot paths refused in one line."""

from __future__ import annotations

import struct
from pathlib import Path
from xml.etree import ElementTree

import numpy as np
import onnx
import pytest
from conftest import describe_run, one_error_line, run_amp_rewriter

from testkit.builder import GraphBuilder
from testkit.models import BUILDERS
from testkit.models.transformer_block import build_stack

pytest.importorskip("matplotlib")


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's header, which must be a PNG's."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def svg_text(path: Path) -> str:
    """Every piece of text an SVG shows (matplotlib writes text as text with svg.fonttype
    none), joined by spaces."""
    root = ElementTree.parse(path).getroot()
    return " ".join(" ".join(element.itertext()) for element in root.iter()
                    if element.tag.endswith("}text"))


def test_precision_map_of_a_300_layer_transformer(tmp_path: Path) -> None:
    model = tmp_path / "stack300.onnx"
    onnx.save(build_stack(300), str(model))
    png, svg = tmp_path / "map.png", tmp_path / "map.svg"
    result = run_amp_rewriter("convert", model, tmp_path / "out.onnx", "--keep-node",
                              "layer.150/.*", "--plot", png, "--plot", svg)
    assert result.returncode == 0, describe_run(result)
    cost_line = next(line for line in result.stdout.splitlines() if line.startswith("cost: "))
    width, height = png_size(png)
    assert width >= 1500 and 600 <= height < width  # wide: rows of layers, not a long strip
    text = " ".join(svg_text(svg).split())
    assert cost_line in text  # the title is the cost line
    # Layer 150 pinned fp32: its 8 MatMuls are the fp32 compute ops, the other 2392 run fp16.
    assert "fp32 compute op (8)" in text and "fp16 compute op (2392)" in text
    assert "cast (" in text
    # Rows hold whole layers, so that they line up, and are labelled by their first node.
    assert "the graph repeats every 35 nodes" in text and "layer.299/" in text


def test_precision_map_is_the_same_bytes_twice(tmp_path: Path) -> None:
    model = tmp_path / "block.onnx"
    onnx.save(BUILDERS["transformer_block"](), str(model))
    runs = []
    png, svg = tmp_path / "map.png", tmp_path / "map.svg"
    for _ in range(2):  # the same command: the second run replaces the first's files
        result = run_amp_rewriter("convert", model, tmp_path / "out.onnx", "--plot", png,
                                  "--plot", svg)
        assert result.returncode == 0, describe_run(result)
        runs.append((png.read_bytes(), svg.read_bytes()))
    assert runs[0] == runs[1]
    assert b"Date" not in runs[0][1] and b"Matplotlib v" not in runs[0][1]


def _overflowing_model(folder: Path) -> tuple[Path, Path]:
    """A MatMul by 1500s whose output passes fp16's 65504 on the loud calibration batch."""
    b = GraphBuilder(opset=17)
    x = b.input("x", ["batch", 16])
    h = b.op("Relu", b.op("MatMul", x, b.weight("w1", [16, 16], 0.3), name="mm1"), name="relu")
    big = b.op("MatMul", h, b.const("hot_w", np.full((16, 16), 1500.0, np.float32)),
               name="hot_big")
    scaled = b.op("Mul", big, b.const("hot_s", np.float32(1e-5)), name="hot_scale")
    b.output(b.op("MatMul", b.op("Tanh", scaled, name="hot_tanh"), b.weight("w3", [16, 8]),
                  name="mm_out"))
    model = folder / "overflow.onnx"
    onnx.save(b.build(), str(model))
    calibration = folder / "calibration"
    calibration.mkdir()
    rng = np.random.default_rng(0)
    for index in range(4):
        scale = 8.0 if index == 3 else 1.0
        np.savez(calibration / f"batch{index}.npz",
                 x=(rng.standard_normal((4, 16)) * scale).astype(np.float32))
    return model, calibration


def test_diagnose_plot_names_the_culprit(tmp_path: Path) -> None:
    model, calibration = _overflowing_model(tmp_path)
    runs = []
    png, svg = tmp_path / "diagnose.png", tmp_path / "diagnose.svg"
    for _ in range(2):
        result = run_amp_rewriter("diagnose", model, "--inputs", calibration, "--plot", png,
                                  "--plot", svg, "--json", tmp_path / "diagnose.json")
        assert result.returncode == 0, describe_run(result)
        runs.append((png.read_bytes(), svg.read_bytes()))
    assert runs[0] == runs[1]
    width, height = png_size(png)
    assert width > height > 400
    text = " ".join(svg_text(svg).split())
    assert "culprit: hot_big (MatMul): output 'hot_big' absmax" in text
    assert "overflows in a low-precision node" in text
    assert "local error the node adds" in text and "accumulated error" in text


def test_bad_and_colliding_plot_paths_are_one_line_errors(tmp_path: Path) -> None:
    model = tmp_path / "cnn.onnx"
    onnx.save(BUILDERS["cnn"](), str(model))
    out = tmp_path / "out.onnx"
    for args, expected in ((["--plot", tmp_path / "map.jpg"], "expected a file name ending in"),
                           (["--plot", model.with_suffix(".svg"), "--report",
                             model.with_suffix(".svg")], "is also written as the --report"),
                           (["--plot", out.with_suffix(".onnx.png"), "--validate", "--rtol", "0"],
                            "validation failed")):
        result = run_amp_rewriter("convert", model, out, *args)
        assert result.returncode in (1, 2), describe_run(result)
        assert expected in one_error_line(result.stderr)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cnn.onnx"]
    result = run_amp_rewriter("diagnose", model, "--plot", model)
    assert result.returncode == 2 and "expected a file name ending in" in result.stderr
    svg_model = tmp_path / "cnn.svg"  # an input that happens to end in .svg
    svg_model.write_bytes(model.read_bytes())
    result = run_amp_rewriter("diagnose", svg_model, "--plot", svg_model)
    assert result.returncode == 2 and "refusing to overwrite it" in one_error_line(result.stderr)
    assert svg_model.read_bytes() == model.read_bytes()
