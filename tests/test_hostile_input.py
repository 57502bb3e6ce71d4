"""Hostile inputs, in process: what the loaders and readers refuse, and the compact tensors and
linear-time patterns that keep memory and time bounded (issue 13, items 6-8). The cases that
crashed, hung or blew memory before run through the CLI in tests/test_fuzz.py."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from amp_rewriter import OnnxOptions, Options
from amp_rewriter.errors import AmpError
from amp_rewriter.fileio import read_input_bytes
from amp_rewriter.formats.onnx import convert_file, convert_model
from amp_rewriter.ir import LazyTensor
from amp_rewriter.ir.tensors import check_range
from testkit.models import BUILDERS


def _cnn() -> onnx.ModelProto:
    return BUILDERS["cnn"]()


def _first_weight(model: onnx.ModelProto) -> onnx.TensorProto:
    return next(t for t in model.graph.initializer if t.name == "conv1.weight")


def _refused(model: onnx.ModelProto, fragment: str) -> None:
    with pytest.raises(AmpError, match=fragment):
        convert_model(model, OnnxOptions())


def test_initializer_declaring_more_elements_than_it_holds_is_refused() -> None:
    model = _cnn()
    weight = _first_weight(model)
    weight.ClearField("raw_data")
    weight.ClearField("dims")
    weight.dims.extend([40000, 30000])
    weight.float_data.append(1.0)
    _refused(model, r"'conv1.weight': holds 1 value entries, its shape \[40000, 30000\]")


def test_raw_data_of_the_wrong_length_is_refused() -> None:
    model = _cnn()
    weight = _first_weight(model)
    weight.raw_data = weight.raw_data[:-3]
    _refused(model, r"raw_data holds \d+ bytes, its shape \[\d+, \d+, \d+, \d+\] needs \d+")


def test_negative_dimension_and_unknown_data_type_are_refused() -> None:
    model = _cnn()
    _first_weight(model).dims[0] = -4
    _refused(model, "negative dimension")
    model = _cnn()
    _first_weight(model).data_type = 999
    _refused(model, "unknown data type 999")


def test_cast_to_an_unknown_data_type_is_refused() -> None:
    model = _cnn()
    model.graph.node.insert(0, helper.make_node("Cast", ["image"], ["cast_out"], to=999))
    model.graph.output.add().name = "cast_out"
    _refused(model, "unknown ONNX data type")


def test_loop_body_that_does_not_fit_its_node_is_refused() -> None:
    model = BUILDERS["control_flow"]()
    loop = next(n for n in model.graph.node if n.op_type == "Loop")
    body = next(a for a in loop.attribute if a.name == "body")
    body.g.input.append(helper.make_tensor_value_info("unused", TensorProto.FLOAT, [1]))
    _refused(model, r"its body has \d input\(s\), the node calls for \d")


def _external_cnn(folder: Path) -> Path:
    folder.mkdir()
    path = folder / "model.onnx"
    onnx.save_model(_cnn(), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=0)
    return path


def _set_external(path: Path, key: str, value: str) -> None:
    model = onnx.load(str(path), load_external_data=False)
    tensor = model.graph.initializer[0]
    for entry in tensor.external_data:
        if entry.key == key:
            entry.value = value
    path.write_bytes(model.SerializeToString())


def test_external_data_past_the_end_of_its_file_is_refused(tmp_path: Path) -> None:
    path = _external_cnn(tmp_path / "m")
    _set_external(path, "length", str(10**9))
    with pytest.raises(AmpError, match="runs past the end of its file"):
        convert_file(path, tmp_path / "out.onnx")
    _set_external(path, "length", "abc")
    with pytest.raises(AmpError, match="not a non-negative integer"):
        convert_file(path, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_external_data_that_is_a_fifo_is_refused_by_name(tmp_path: Path) -> None:
    path = _external_cnn(tmp_path / "m")
    os.mkfifo(tmp_path / "m" / "pipe.data")
    _set_external(path, "location", "pipe.data")
    with pytest.raises(AmpError, match="is a FIFO"):
        convert_file(path, tmp_path / "out.onnx")


def _unblock_later(fifo: Path, seconds: float) -> threading.Timer:
    """Open `fifo` for writing after `seconds`: a reader stuck in open() (the old behaviour)
    then gets EOF, so a regression fails the test instead of hanging it."""
    def open_for_writing() -> None:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader waiting: nothing to unblock
            pass
    timer = threading.Timer(seconds, open_for_writing)
    timer.start()
    return timer


def test_reader_refuses_a_fifo_without_opening_it(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.onnx"
    os.mkfifo(fifo)
    timer = _unblock_later(fifo, 5)
    started = time.monotonic()
    try:
        with pytest.raises(AmpError, match=r"pipe.onnx: is a FIFO \(named pipe\), not a regular "
                                           r"file"):
            read_input_bytes(fifo, "expected a file")
    finally:
        timer.cancel()
    assert time.monotonic() - started < 4


def test_input_path_in_a_symlink_loop_is_one_line(tmp_path: Path) -> None:
    from amp_rewriter.fileio import check_input_path

    (tmp_path / "a.onnx").symlink_to("b.onnx")
    (tmp_path / "b.onnx").symlink_to("a.onnx")
    with pytest.raises(AmpError, match="cannot read"):
        check_input_path(tmp_path / "a.onnx")


def test_keep_node_patterns_match_in_linear_time() -> None:
    from amp_rewriter.node_patterns import NodePattern

    pattern = NodePattern("(a|aa)*b")  # exponential for a backtracking engine
    started = time.monotonic()
    assert not pattern.fullmatch("a" * 100_000)
    assert time.monotonic() - started < 1
    assert NodePattern("/lm_head/.*").fullmatch("/lm_head/MatMul")
    assert not NodePattern("conv").fullmatch("conv1")  # whole names only


def test_keep_node_pattern_re2_cannot_run_is_refused_in_one_line() -> None:
    for pattern in (r"(a)\1", "(?=a)a", "["):
        with pytest.raises(AmpError, match="--keep-node .*not a valid regex") as error:
            Options(keep_nodes=[pattern])
        assert "\n" not in str(error.value)


def test_range_check_of_a_compact_tensor_counts_every_element() -> None:
    # 2 stored values, the last standing for 999_999 elements: 1e-9 flushes to zero in fp16
    values = np.asarray([1.0, 1e-9], np.float32)
    result = check_range(values, "float16", repeat_last=999_998)
    assert (result.flushed_to_zero, result.nonzero, result.overflowed) == (999_999, 1_000_000, 0)
    tensor = LazyTensor.repeating_last("float32", (1000, 1000), values)
    assert tensor.compact and tensor.size == 1_000_000 and tensor.stored().size == 2
    expanded = tensor.numpy()
    assert expanded.shape == (1000, 1000) and expanded[0, 0] == 1.0 and expanded[-1, -1] == values[1]
