"""The cost summary's inference of a big graph looks a node's output types up by what decides
them (`shapes._NodeMemo`) where the graph repeats itself: the summary and the type check must
come out exactly as inferring each slice whole does, and the lookup must step aside wherever
it cannot know (contents a Reshape reads, shapes computed at run time, no repetition)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import amp_rewriter
from amp_rewriter.formats.onnx import shapes
from testkit.builder import GraphBuilder


def _layers(count: int, hidden: int = 8, targets: list[list[int]] | None = None
            ) -> onnx.ModelProto:
    """`count` identical layers (MatMul, bias, Reshape and back, LayerNormalization, Relu),
    each with its own weights; `targets`: each layer's own Reshape target (the same contents
    by default, in a constant of each layer's own)."""
    b = GraphBuilder(opset=17)
    h = b.input("x", [2, 4, hidden])
    for layer in range(count):
        target = targets[layer] if targets is not None else [2, 4, 2, hidden // 2]
        h = b.op("MatMul", h, b.weight(f"w{layer}", [hidden, hidden]), name=f"mm{layer}")
        h = b.op("Add", h, b.const(f"bias{layer}", np.full([hidden], 0.1, np.float32)),
                 name=f"bias_add{layer}")
        split = b.op("Reshape", h, b.const(f"split_target{layer}", np.array(target, np.int64)),
                     name=f"split{layer}")
        h = b.op("Reshape", split, b.const(f"merge_target{layer}", np.array([2, 4, hidden], np.int64)),
                 name=f"merge{layer}")
        h = b.op("LayerNormalization", h, b.const(f"gamma{layer}", np.ones([hidden], np.float32)),
                 b.const(f"beta{layer}", np.zeros([hidden], np.float32)), name=f"norm{layer}",
                 axis=-1)
        h = b.op("Relu", h, name=f"relu{layer}")
    b.output(h)
    return b.build()


def _memos(monkeypatch: pytest.MonkeyPatch, enabled: bool = True) -> list[shapes._NodeMemo]:
    """Slices of 7 nodes; each slicer's memo, noted (and switched off unless `enabled`)."""
    monkeypatch.setattr(shapes, "SLICE_NODES", 7)
    made: list[shapes._NodeMemo] = []
    start = shapes._NodeMemo.__init__

    def noted(memo: shapes._NodeMemo) -> None:
        start(memo)
        memo.enabled = enabled
        made.append(memo)

    monkeypatch.setattr(shapes._NodeMemo, "__init__", noted)
    return made


def _traffic(model: onnx.ModelProto) -> tuple[dict, bool]:
    sizes = shapes.validation_input_shapes(model)
    return shapes.checked_activation_traffic(model, sizes, type_check=True)


def _whole_slices(model: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, bool]:
    with monkeypatch.context() as patch:
        _memos(patch, enabled=False)
        return _traffic(model)


def test_repeated_layers_are_looked_up_and_come_out_as_inferred_whole(monkeypatch):
    model = _layers(12)
    expected = _whole_slices(model, monkeypatch)
    memos = _memos(monkeypatch)
    found = _traffic(model)
    assert found == expected and found[1]
    memo = memos[0]
    # The first layer's six nodes are inferred alone (the first reads the graph input, the
    # second layer's MatMul reads a Relu's output: one more); every later node is looked up.
    assert memo.enabled and memo.seen >= 60 and memo.misses <= 8


def test_a_converted_model_of_repeated_layers_gets_the_same_summary(monkeypatch):
    """In a conversion the nodes come from the emitted encoding (casts inserted, fp16)."""
    model = _layers(12)
    converted, _ = amp_rewriter.convert(model, keep_io_types=True)
    expected = _whole_slices(converted, monkeypatch)
    memos = _memos(monkeypatch)
    assert _traffic(converted) == expected
    assert memos[0].enabled and memos[0].seen > 5 * memos[0].misses


def test_a_reshape_is_looked_up_by_its_targets_contents(monkeypatch):
    """Layers alike in everything but their Reshape target: a later one must not take an
    earlier one's shapes."""
    targets = [[2, 4, 2, 4]] * 3 + [[2, 4, 4, 2]] * 3
    b = GraphBuilder(opset=17)
    h = b.input("x", [2, 4, 8])
    split = []
    for layer, target in enumerate(targets):
        split.append(b.op("Relu", b.op("Reshape", h, b.const(f"t{layer}", np.array(
            target, np.int64)), name=f"split{layer}"), name=f"relu{layer}"))
        h = b.op("Reshape", split[-1], b.const(f"m{layer}", np.array([2, 4, 8], np.int64)),
                 name=f"merge{layer}")
    b.output(h)
    model = b.build()
    memos = _memos(monkeypatch)
    slicer = shapes._Slicer(model, shapes.validation_input_shapes(model), True, None)
    found = slicer.infer(0, shapes._node_names(model.graph.node))
    assert found is not None and memos[0].seen > 0
    assert [found[name][1] for name in split] == [tuple(target) for target in targets]


def test_a_shape_computed_at_run_time_is_inferred_with_its_source(monkeypatch):
    """Shape -> Gather -> Concat -> Reshape: data propagation carries the contents, which a
    lookup by types cannot; the slice that computes them is inferred whole."""
    b = GraphBuilder(opset=17)
    h = b.input("x", [2, 4, 8])
    for layer in range(4):
        h = b.op("Relu", b.op("MatMul", h, b.weight(f"w{layer}", [8, 8]), name=f"mm{layer}"),
                 name=f"relu{layer}")
        shape = b.op("Shape", h, name=f"shape{layer}")
        first = b.op("Gather", shape, b.const(f"zero{layer}", np.array([0], np.int64)),
                     name=f"first{layer}")
        target = b.op("Concat", first, b.const(f"rest{layer}", np.array([4, 8], np.int64)),
                      name=f"target{layer}", axis=0)
        h = b.op("Reshape", h, target, name=f"reshape{layer}")
    b.output(h)
    model = b.build()
    expected = _whole_slices(model, monkeypatch)
    _memos(monkeypatch)
    found = _traffic(model)
    assert found == expected and found[0]["values_without_shape"] == 0


def test_a_type_error_in_a_looked_up_node_fails_the_check_as_inferred_whole(monkeypatch):
    """An Add of fp16 and fp32 (a converter's bug): the node inferred alone fails the strict
    check, so does its slice inferred whole, and the check is left to the checker."""
    model = _layers(4)
    graph = model.graph
    last_relu = graph.node[-1]
    graph.initializer.append(onnx.numpy_helper.from_array(
        np.zeros([8], np.float16), "half_bias"))
    bad = onnx.helper.make_node("Add", [last_relu.output[0], "half_bias"], ["bad_sum"],
                                name="bad_add")
    graph.node.append(bad)
    graph.node.append(onnx.helper.make_node("Relu", ["bad_sum"], ["tail"], name="tail"))
    del graph.output[:]
    graph.output.append(onnx.helper.make_tensor_value_info("tail", TensorProto.FLOAT, None))
    expected = _whole_slices(model, monkeypatch)
    _memos(monkeypatch)
    found = _traffic(model)
    assert found == expected and not found[1]


def test_a_graph_without_repetition_gives_the_lookup_up(monkeypatch):
    """Every node unlike the ones before: after its trial the memo stops (each node inferred
    alone would be slower than a slice at a time) and the slices are inferred whole."""
    model = _layers(10)
    for index, node in enumerate(model.graph.node):  # each node's own attribute value
        node.doc_string = f"node {index}"
    expected = _whole_slices(model, monkeypatch)
    monkeypatch.setattr(shapes, "_MEMO_TRIAL", 8)
    memos = _memos(monkeypatch)
    assert _traffic(model) == expected
    assert not memos[0].enabled
