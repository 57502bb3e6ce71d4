"""A big conversion's structural check runs in a second process while the cost summary's
inference runs in this one: its verdict must be onnx.checker's own, and anything that keeps the
worker from answering must leave the check to this process."""

from __future__ import annotations

import importlib

import onnx
import pytest

import amp_rewriter
from amp_rewriter.errors import AmpError
from amp_rewriter.formats.onnx import background_check, shapes
from amp_rewriter.formats.onnx.background_check import BackgroundCheck
from testkit.builder import GraphBuilder

# The module (the package exports a function of the same name).
convert = importlib.import_module("amp_rewriter.formats.onnx.convert")


@pytest.fixture(autouse=True)
def two_cores(monkeypatch):
    """The worker runs wherever a second core is; these tests run it on any machine."""
    monkeypatch.setattr(background_check, "usable_cores", lambda: 2)
    monkeypatch.delenv(background_check.ENVIRONMENT_SWITCH, raising=False)


def _chain(length: int = 12) -> onnx.ModelProto:
    b = GraphBuilder(opset=17)
    h = b.input("x", [2, 8])
    for i in range(length):
        h = b.op("MatMul", h, b.weight(f"w{i}", [8, 8]), name=f"mm{i}")
        h = b.op("Relu", h, name=f"relu{i}")
    b.output(h)
    return b.build()


def _unknown_op() -> onnx.ModelProto:
    model = _chain(1)
    model.graph.node[-1].op_type = "NoSuchOp"
    return model


def test_the_worker_passes_a_valid_model_and_gives_the_checkers_message_for_an_invalid_one():
    worker = BackgroundCheck.start(_chain().SerializeToString())
    assert worker is not None and worker.verdict() == ""
    bad = _unknown_op()
    with pytest.raises(Exception) as in_process:
        onnx.checker.check_model(bad)
    worker = BackgroundCheck.start(bad.SerializeToString())
    assert worker is not None
    assert worker.verdict() == str(in_process.value).strip().splitlines()[0]


def test_a_worker_that_dies_gives_no_verdict():
    worker = BackgroundCheck.start(_chain().SerializeToString())
    assert worker is not None
    worker.process.kill()
    assert worker.verdict() is None


def test_the_switch_keeps_the_check_in_process(monkeypatch):
    monkeypatch.setenv(background_check.ENVIRONMENT_SWITCH, "0")
    assert BackgroundCheck.start(_chain().SerializeToString()) is None


def _big_conversion(monkeypatch, started):
    """Make the chain (26 nodes converted) count as big, inferred in slices of 5 nodes; note
    each worker started."""
    monkeypatch.setattr(convert, "BIG_GRAPH_NODES", 10)
    monkeypatch.setattr(shapes, "SLICE_NODES", 5)
    start = BackgroundCheck.start

    def noted(encoding):
        worker = start(encoding)
        started.append(worker)
        return worker

    monkeypatch.setattr(BackgroundCheck, "start", staticmethod(noted))


def test_a_big_conversion_is_checked_by_the_worker_with_the_same_result(monkeypatch):
    model = _chain()
    expected, expected_report = amp_rewriter.convert(model, keep_io_types=True)
    started: list[BackgroundCheck | None] = []
    _big_conversion(monkeypatch, started)
    checked_here = []
    monkeypatch.setattr(convert, "check_valid", lambda *args, **kwargs: checked_here.append(1))
    converted, report = amp_rewriter.convert(model, keep_io_types=True)
    assert len(started) == 1 and started[0] is not None
    assert started[0].process.returncode is not None  # done: waited for, not left running
    assert not checked_here  # the worker's verdict was the check
    assert converted.SerializeToString() == expected.SerializeToString()
    assert report.cost == expected_report.cost


def test_the_workers_refusal_fails_the_conversion_with_the_checkers_message(monkeypatch):
    started: list[BackgroundCheck | None] = []
    _big_conversion(monkeypatch, started)
    monkeypatch.setattr(BackgroundCheck, "verdict", lambda self: "Nodes in a graph must be ...")
    with pytest.raises(AmpError, match="fails the ONNX checker: Nodes in a graph must be"):
        amp_rewriter.convert(_chain(), keep_io_types=True)
    assert started and started[0] is not None and started[0].process.returncode is not None


def test_without_a_verdict_the_conversion_checks_in_process(monkeypatch):
    started: list[BackgroundCheck | None] = []
    _big_conversion(monkeypatch, started)
    monkeypatch.setattr(BackgroundCheck, "verdict", lambda self: None)
    checked_here = []
    check_valid = convert.check_valid

    def noted(*args, **kwargs):
        checked_here.append(kwargs.get("full", True))
        return check_valid(*args, **kwargs)

    monkeypatch.setattr(convert, "check_valid", noted)
    amp_rewriter.convert(_chain(), keep_io_types=True)
    assert checked_here == [False]  # structural only: the sliced inference checked the types
