"""The IR guards its invariants: mutators keep both ends of every edge in step, `lint` finds
what a hand edit breaks, and a pipeline names the pass (and node) that broke something."""

from __future__ import annotations

import numpy as np
import pytest

from amp_rewriter.formats.onnx.load import load_onnx
from amp_rewriter.formats.onnx.rules import ONNX_RULES
from amp_rewriter.ir import Graph, IRError, IRInvariantError, Model, Node, Value, lint
from amp_rewriter.op_lists import OpLists
from amp_rewriter.options import Options
from amp_rewriter.passes import REGISTRY, PassContext, PassError, run_pipeline
from amp_rewriter.passes.base import register_pass
from amp_rewriter.passes.pipeline import PIPELINES
from testkit.models import BUILDERS


def chain_graph() -> tuple[Graph, list[Node], Value]:
    """x -> a -> b -> c (one output each), c's output a graph output."""
    graph = Graph("g")
    x = graph.add_value(Value("x", graph, "float32"))
    graph.add_input(x)
    nodes, value = [], x
    for name in "abc":
        node = Node(name, "Relu", graph=graph)
        node.add_input(value)
        value = graph.add_value(Value(f"{name}_out", graph, "float32"))
        node.add_output(value)
        graph.append_node(node)
        nodes.append(node)
    graph.add_output(value)
    return graph, nodes, x


def test_mutators_keep_both_ends_in_step():
    graph, (a, b, c), x = chain_graph()
    assert lint(graph) == []
    b.set_input(0, x)  # b now reads x instead of a's output
    assert (b, 0) in x.uses and not a.outputs[0].uses
    assert lint(graph) == []
    a.outputs[0].uses.append((c, 0))  # a hand edit the IR does not know about
    assert any("uses list" in p for p in lint(graph))


def test_replace_all_uses_and_remove_only_unused_nodes():
    graph, (a, b, c), x = chain_graph()
    with pytest.raises(IRError):
        graph.remove_nodes([a])  # b still reads it
    a.outputs[0].replace_all_uses_with(x)
    assert graph.remove_nodes([a]) == 1
    assert [n.name for n in graph.nodes] == ["b", "c"] and x.uses == [(b, 0)]
    assert "a_out" not in graph.values and lint(graph) == []


def test_insert_before_and_after_keep_order():
    graph, (a, b, c), x = chain_graph()
    early = Node("early", "Relu", graph=graph)
    early.add_input(x)
    early.add_output(graph.add_value(Value("early_out", graph, "float32")))
    graph.insert_before(a, [early])
    late = Node("late", "Relu", graph=graph)
    late.add_input(c.outputs[0])
    late.add_output(graph.add_value(Value("late_out", graph, "float32")))
    graph.insert_after(c, [late])
    assert [n.name for n in graph.nodes] == ["early", "a", "b", "c", "late"]
    assert lint(graph) == []
    graph.insert_after(early, [graph.nodes.pop()])  # late before c: read before it is made
    assert any("used before it is produced" in p for p in lint(graph))


def test_graph_outputs_move_with_set_output():
    graph, (a, b, c), x = chain_graph()
    graph.set_output(0, b.outputs[0])
    assert graph.outputs == [b.outputs[0]] and not c.outputs[0].graph_output_uses
    assert lint(graph) == []


def test_control_edges_keep_both_ends_and_lint_checks_them():
    graph, (a, b, c), x = chain_graph()
    c.add_control_inputs([a, a])  # repeats are skipped
    assert list(c.control_inputs) == [a] and list(a.control_users) == [c]
    assert lint(graph) == []
    c.remove_control_input(a)
    assert not c.control_inputs and not a.control_users and lint(graph) == []
    with pytest.raises(IRError):
        c.remove_control_input(a)
    with pytest.raises(IRError):
        c.add_control_input(c)
    a.add_control_input(c)  # a would wait for c, which runs after it
    assert any("runs after it" in p for p in lint(graph))
    a.remove_control_input(c)
    c.add_control_input(b)
    b.control_users = []  # a hand edit leaves the other end stale
    assert any("control_users miss it" in p for p in lint(graph))


def test_removing_a_node_hands_its_waiters_over_to_what_it_waited_for():
    graph, (a, b, c), x = chain_graph()
    guard = Node("guard", "NoOp", graph=graph)
    graph.insert_before(a, [guard])
    sink = Node("sink", "NoOp", graph=graph)
    graph.append_node(sink)
    b.add_control_input(guard)
    sink.add_control_inputs([b, guard])
    graph.set_control_output("done", b)
    # b reads a's output and waits for guard: what waited for b now waits for a and guard
    c.set_input(0, a.outputs[0])
    assert graph.remove_nodes([b]) == 1
    assert [n.name for n in sink.control_inputs] == ["a", "guard"]
    assert {n.name for n in a.control_users} == {"sink"}
    assert graph.control_outputs == {"done": a}
    assert [n.name for n in b.control_inputs] == ["guard"]  # kept by the removed node
    assert [n.name for n in guard.control_users] == ["sink"]  # b no longer waits
    assert lint(graph) == []
    # a constant-like node that waits for nothing: its waiters simply stop waiting
    sink.remove_control_input(a)
    graph.remove_nodes([guard])
    assert not sink.control_inputs and lint(graph) == []
    with pytest.raises(IRError):
        graph.set_control_output("other", Node("elsewhere", "NoOp", graph=Graph("h")))


def _context(model_name: str = "transformer_block") -> PassContext:
    options = Options()
    ir_model: Model = load_onnx(BUILDERS[model_name]())
    lists = OpLists.load("onnx", "fp16", "ort-cuda", options.overrides)
    return PassContext(ir_model, lists, options, ONNX_RULES)


@pytest.fixture
def scratch_pass():
    """Register throw-away passes; removed from the registry afterwards."""
    added: list[str] = []

    def register(name, run):
        register_pass(name)(run)
        added.append(name)
    yield register
    for name in added:
        REGISTRY.pop(name, None)


def test_a_pass_that_breaks_an_invariant_is_named(scratch_pass, monkeypatch):
    monkeypatch.setenv("AMP_REWRITER_LINT", "1")

    def break_uses(ctx):
        """Drop a use by hand."""
        node = next(n for n in ctx.model.graph.nodes if n.inputs)
        node.inputs[0].uses.clear()
        return 1, []
    scratch_pass("test_break_uses", break_uses)
    with pytest.raises(IRInvariantError, match="after pass test_break_uses"):
        run_pipeline(_context(), ["classify_ops", "test_break_uses"])


def test_a_pass_that_fails_says_which_pass_and_node(scratch_pass):
    def fail(ctx):
        """Fail on the third node."""
        for index, node in enumerate(ctx.model.graph.walk_nodes()):
            ctx.focus = node
            if index == 2:
                raise KeyError("boom")
        return 0, []
    scratch_pass("test_fail", fail)
    ctx = _context()
    third = list(ctx.model.graph.walk_nodes())[2]
    with pytest.raises(PassError, match=rf"pass test_fail failed at node '{third.name}'.*KeyError"):
        run_pipeline(ctx, ["test_fail"])


@pytest.mark.parametrize("model_name", list(BUILDERS))
def test_every_pipeline_pass_leaves_the_ir_sound(model_name, monkeypatch):
    monkeypatch.setenv("AMP_REWRITER_LINT", "1")
    results = run_pipeline(_context(model_name), "onnx")
    assert [r.name for r in results] == PIPELINES["onnx"]
    assert PIPELINES["onnx"][:4] == ["drop_identity_casts", "pin_nodes", "pin_front_end",
                                     "classify_ops"]
    assert PIPELINES["onnx"][-6:] == ["insert_casts", "rescale_rms_statistics",
                                      "reduce_rotary_angles", "saturate_masked_sums", "fold_casts",
                                      "convert_constants"]


def test_passes_are_registered_with_a_summary():
    for name, step in REGISTRY.items():
        assert step.name == name and step.summary, name


def test_check_range_counts_overflow_and_flush():
    from amp_rewriter.ir import check_range
    result = check_range(np.array([1e5, 1e-9, 1.0, 0.0], np.float32), "float16")
    assert (result.overflowed, result.flushed_to_zero, result.nonzero) == (1, 1, 3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_range_checks_in_batches_count_as_one_at_a_time(dtype):
    """tensor_ranges checks many constants' values together: each count must be the one
    tensor_range gives that constant alone (edge values, empty and compact tensors included),
    across batch boundaries."""
    from amp_rewriter.ir import LazyTensor
    from amp_rewriter.ir import tensors as tensor_module

    rng = np.random.default_rng(0)
    edges = np.array([0, -0.0, 1e-8, -3e-8, 5.96e-8, 6e-8, 1e-40, 1e-45, 65504, 65519, 65520, -7e4,
                      1e38, 3.4e38, np.inf, -np.inf, np.nan], np.float32)
    arrays = [np.zeros(0, np.float32)]
    for index in range(400):
        size = int(rng.integers(1, 40))
        arrays.append(rng.choice(edges, size) if index % 2 else
                      (rng.standard_normal(size) * 10.0 ** rng.uniform(-9, 6)).astype(np.float32))

    def tensors() -> list:
        made = [LazyTensor("float32", a.shape, lambda a=a: a) for a in arrays]
        made.append(LazyTensor.repeating_last("float32", (50,), np.array([1.0, 1e6], np.float32)))
        return made

    alone = [tensor_module.tensor_range(t, dtype) for t in tensors()]
    assert sum(r.overflowed for r in alone) and sum(r.flushed_to_zero for r in alone)
    original = tensor_module._BATCH_VALUES
    try:
        tensor_module._BATCH_VALUES = 100  # many batches
        assert tensor_module.tensor_ranges(tensors(), dtype) == alone
    finally:
        tensor_module._BATCH_VALUES = original
    assert tensor_module.tensor_ranges(tensors(), dtype) == alone


def test_release_frees_the_ir_without_the_cyclic_collector():
    """After emitting, a conversion releases its IR: every object must go by reference counting
    alone (the collector is paused during conversions), or a million-node IR stays in memory."""
    import gc

    ctx = _context()
    run_pipeline(ctx, "onnx")
    model = ctx.model
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        del ctx
        model.release()
        assert model.graph.nodes == [] and model.graph.values == {}
        del model
        assert gc.collect() == 0  # nothing was left in a reference cycle
    finally:
        if was_enabled:
            gc.enable()


@pytest.mark.parametrize("model_name", sorted(BUILDERS))
def test_emitting_node_by_node_releases_as_it_goes(model_name):
    """Conversion writes the main graph's nodes last and releases each as it is encoded
    (`Emission`, `Node.release`): the encoding must be the one a kept IR gives, the report's
    view of a node (name, op) must survive its release, and what is left must go by reference
    counting alone, bodies of control-flow nodes included."""
    import gc

    import onnx

    from amp_rewriter.formats.onnx.emit import Emission, emit_onnx_parts

    def converted(release: bool) -> tuple[bytes, Model, list[Node]]:
        ctx = _context(model_name)
        run_pipeline(ctx, "onnx")
        written = list(ctx.model.graph.nodes)
        emitted = (Emission(ctx.model, release=True).finish() if release
                   else emit_onnx_parts(ctx.model))
        return emitted.assemble().SerializeToString(), ctx.model, written

    kept_bytes, _, _ = converted(release=False)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        released_bytes, model, nodes = converted(release=True)
        assert released_bytes == kept_bytes
        assert model.graph.nodes == [] and model.graph.values == {}
        assert nodes and all(node.name and node.op_type and not node.inputs
                             and node.graph is None for node in nodes)
        onnx.checker.check_model(onnx.ModelProto.FromString(released_bytes))
        model.release()
        del model, nodes
        assert gc.collect() == 0
    finally:
        if was_enabled:
            gc.enable()


def test_attributes_and_subgraphs_are_set_through_the_node():
    """Nodes share one read-only empty mapping until an attribute is set, so a direct write
    cannot leak into every other node."""
    graph, (a, b, _c), _x = chain_graph()
    with pytest.raises(TypeError):
        a.attrs["alpha"] = 0.5  # type: ignore[index]
    a.set_attr("alpha", 0.5)
    a.set_attr("beta", 1)
    assert a.attrs == {"alpha": 0.5, "beta": 1} and b.attrs == {}
    body = Graph("body", parent=graph, owner=a)
    a.add_subgraph("body", body)
    assert a.subgraphs == {"body": body} and b.subgraphs == {}


@pytest.mark.parametrize("compress", [False, True])
def test_packed_records_read_back_as_appended(compress):
    """Records read back in order and by index from full blocks, a block sealed early, and
    records still pending; the buffer keeps growing after blocks were read."""
    from amp_rewriter.packed import PackedRecords

    records = PackedRecords(4, compress=compress)
    expected = [("node", i, ("in",) * (i % 3), None) for i in range(10)]
    for record in expected[:6]:
        records.append(record)
    records.seal()  # a partial block of 2
    assert [records[i] for i in range(len(records))] == expected[:6]
    for record in expected[6:]:
        records.append(record)  # the last two stay pending
    assert len(records) == 10
    assert [records[i] for i in reversed(range(10))] == expected[::-1]
    records.seal()
    assert [records[i] for i in range(10)] == expected
