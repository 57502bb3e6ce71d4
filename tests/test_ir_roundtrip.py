"""Loading into the IR and emitting again, with no pass in between, gives back the same model.

Also: external data survives `convert_file`, `ir.lint` finds nothing wrong with loaded graphs, and
the IR's node order and reachability agree with networkx on random DAG models.
"""

from __future__ import annotations

import os
from pathlib import Path

import networkx as nx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import amp_rewriter
from amp_rewriter.formats.onnx import emit
from amp_rewriter.formats.onnx.emit import emit_onnx, emit_onnx_parts
from amp_rewriter.formats.onnx.load import load_onnx
from amp_rewriter.ir import lint
from amp_rewriter.passes.analysis.group_graph import GroupGraph
from testkit.builder import GraphBuilder, assert_close, check, feeds_for, run
from testkit.models import BUILDERS

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.onnx"))


def roundtrip(model: onnx.ModelProto, base_dir: str | os.PathLike | None = None
              ) -> onnx.ModelProto:
    """load_onnx + emit_onnx on a copy (the emitter patches the loaded proto in place)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return emit_onnx(load_onnx(copy, base_dir))


def assert_equivalent(original: onnx.ModelProto, emitted: onnx.ModelProto) -> None:
    """Byte-equal, or else the same nodes, initializers, metadata, opsets, functions, docs."""
    if emitted.SerializeToString() == original.SerializeToString():
        return
    assert list(emitted.graph.node) == list(original.graph.node)
    assert list(emitted.graph.initializer) == list(original.graph.initializer)
    assert list(emitted.graph.input) == list(original.graph.input)
    assert list(emitted.graph.output) == list(original.graph.output)
    assert list(emitted.graph.value_info) == list(original.graph.value_info)
    assert list(emitted.metadata_props) == list(original.metadata_props)
    assert list(emitted.opset_import) == list(original.opset_import)
    assert list(emitted.functions) == list(original.functions)
    assert emitted.doc_string == original.doc_string
    assert emitted.graph.doc_string == original.graph.doc_string
    assert emitted.ir_version == original.ir_version
    assert emitted.producer_name == original.producer_name
    pytest.fail("models are equivalent field by field but not byte-equal")


# -- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_roundtrip_of_test_models_is_byte_equal(name):
    model = BUILDERS[name]()
    emitted = roundtrip(model)
    assert_equivalent(model, emitted)
    assert emitted.SerializeToString() == model.SerializeToString()


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_roundtrip_of_example_files_is_byte_equal(path):
    data = path.read_bytes()
    model = onnx.load_from_string(data)
    emitted = roundtrip(model, path.parent)
    assert emitted.SerializeToString() == data


@pytest.mark.parametrize("over_limit", [False, True], ids=["parsed", "merged"])
def test_nodes_emitted_encoded_assemble_to_the_same_model(over_limit, monkeypatch):
    """The main graph's nodes encoded apart from the rest (`emit_onnx_parts`, what conversion
    uses) assemble into exactly the model patched in place gives, also when the model is too
    big to parse whole and the nodes are merged into the rest instead."""
    if over_limit:
        monkeypatch.setattr(emit, "PROTOBUF_LIMIT", 0)
    for model in [rich_model()] + [BUILDERS[name]() for name in sorted(BUILDERS)]:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        parts = emit_onnx_parts(load_onnx(copy))
        assert not parts.head.graph.node
        assert parts.size_bound() >= model.ByteSize()
        assert parts.assemble().SerializeToString() == model.SerializeToString()


@pytest.mark.parametrize("name", ["rich"] + sorted(BUILDERS))
def test_converting_a_model_in_memory_reads_it_only(name):
    """`convert` on a ModelProto works on the caller's model without copying it: what changed
    is written into new messages, so the input keeps every byte (nodes with bodies included),
    and the result is the one converting a private copy (patched in place) gives."""
    model = rich_model() if name == "rich" else BUILDERS[name]()
    before = model.SerializeToString()
    converted, report = amp_rewriter.convert(model, keep_io_types=True)
    assert model.SerializeToString() == before
    from amp_rewriter.formats.onnx.convert import convert_model_ir
    from amp_rewriter.options import OnnxOptions
    on_copy, copy_report, _ = convert_model_ir(model, OnnxOptions(keep_io_types=True))
    assert converted.SerializeToString() == on_copy.SerializeToString()
    assert report.to_json() == copy_report.to_json()
    assert "".join(report.json_pieces()) == report.to_json()  # what convert --report writes
    converted.graph.node[0].name = "changed"  # the result shares nothing with the input
    assert model.SerializeToString() == before


def rich_model() -> onnx.ModelProto:
    """Metadata, doc strings everywhere, a model-local function, value_info and a subgraph."""
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    cond = b.input("c", [], np.bool_)
    h = b.op("MatMul", x, b.weight("w1", [8, 8]), name="mm1")
    b.value_info_for(h, [2, 8])
    b.function("my.ops", "Swish", ["X"], ["Y"],
               [helper.make_node("Sigmoid", ["X"], ["S"]), helper.make_node("Mul", ["X", "S"], ["Y"])])
    s = b.op("Swish", h, name="swish", domain="my.ops")
    b.value_info_for(s, [2, 8])
    then = b.subgraph("then")
    then.output(then.op("Relu", s, name="then/relu"), dtype=np.float32, shape=[2, 8])
    other = b.subgraph("else")
    other.output(other.op("Neg", s, name="else/neg"), dtype=np.float32, shape=[2, 8])
    branch = b.op("If", cond, name="if", then_branch=then.graph(), else_branch=other.graph())
    b.output(b.op("MatMul", branch, b.weight("w2", [8, 4]), name="mm2"))
    for node in b.nodes:
        node.doc_string = f"doc of {node.name}"
    b.doc_string = "graph doc"
    b.metadata = {"author": "tests", "license": "none", "empty": ""}
    model = b.build(check=False)
    model.doc_string = "model doc"
    model.producer_version = "9.9"
    model.domain = "org.tests"
    model.model_version = 3
    model.graph.initializer[0].doc_string = "weight doc"
    model.functions[0].doc_string = "function doc"
    check(model)
    return model


def test_roundtrip_keeps_metadata_docs_functions_and_value_info():
    model = rich_model()
    emitted = roundtrip(model)
    assert_equivalent(model, emitted)
    assert emitted.SerializeToString() == model.SerializeToString()
    assert {p.key: p.value for p in emitted.metadata_props} == {
        "author": "tests", "license": "none", "empty": ""}
    assert emitted.functions[0].doc_string == "function doc"


def test_conversion_keeps_metadata_docs_functions_and_value_info():
    model = rich_model()
    converted, _ = amp_rewriter.convert(model)
    check(converted)
    assert list(converted.metadata_props) == list(model.metadata_props)
    assert list(converted.functions) == list(model.functions)
    assert list(converted.opset_import) == list(model.opset_import)
    assert (converted.doc_string, converted.graph.doc_string) == ("model doc", "graph doc")
    assert (converted.producer_version, converted.domain, converted.model_version) == \
        ("9.9", "org.tests", 3)
    docs = {n.name: n.doc_string for n in converted.graph.node if n.op_type != "Cast"}
    assert docs == {n.name: n.doc_string for n in model.graph.node}
    # value_info entries survive, with the dtype of the converted value.
    infos = {v.name: v.type.tensor_type.elem_type for v in converted.graph.value_info}
    assert set(infos) == {"mm1", "swish"}
    assert infos["mm1"] == TensorProto.FLOAT16 and infos["swish"] == TensorProto.FLOAT
    for flag in (True, False):
        assert_close(model, converted, feeds_for(model, c=np.array(flag)))


def test_loaded_graphs_lint_clean():
    models = [BUILDERS[name]() for name in sorted(BUILDERS)] + [rich_model()]
    models += [onnx.load(str(p)) for p in EXAMPLES]
    for model in models:
        ir = load_onnx(model)
        assert lint(ir.graph) == []
        nested = [g for g in ir.graph.walk_graphs() if g.parent is not None]
        for graph in nested:
            assert graph.owner is not None and graph.owner.graph is graph.parent


# -- external data -------------------------------------------------------------------------------
def save_external(model: onnx.ModelProto, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # save_model rewrites the tensors it externalises in place
    path = folder / "model.onnx"
    onnx.save_model(copy, str(path), save_as_external_data=True, location="w.data",
                    size_threshold=0)
    return path


def all_float_weights_model() -> onnx.ModelProto:
    b = GraphBuilder()
    x = b.input("x", [4, 32])
    h = b.op("MatMul", x, b.weight("w1", [32, 32]), name="mm1")
    r = b.op("Relu", b.op("Add", h, b.weight("b1", [32]), name="add"), name="relu")
    b.output(b.op("MatMul", r, b.weight("w2", [32, 32]), name="mm2"))
    return b.build()


def external_tensors(model: onnx.ModelProto) -> list[str]:
    return [t.name for t in model.graph.initializer
            if t.data_location == TensorProto.EXTERNAL]


def test_external_data_model_converts_runs_and_leaves_the_input_alone(tmp_path):
    model = all_float_weights_model()
    source = save_external(model, tmp_path / "in")
    before = {p.name: p.read_bytes() for p in source.parent.iterdir()}
    output = tmp_path / "out" / "model_fp16.onnx"
    output.parent.mkdir()
    converted, report = amp_rewriter.convert_file(source, output)
    assert {p.name: p.read_bytes() for p in source.parent.iterdir()} == before
    assert report.node("mm1")["precision"] == "fp16"
    onnx.checker.check_model(str(output), full_check=True)
    import onnxruntime as ort
    session = ort.InferenceSession(str(output), providers=["CPUExecutionProvider"])
    feeds = feeds_for(model)
    expected = run(model, feeds)[0]
    actual = session.run(None, feeds)[0]
    assert np.max(np.abs(actual - expected)) <= 2e-2 * np.max(np.abs(expected))


def test_external_data_stays_external_after_conversion(tmp_path):
    source = save_external(all_float_weights_model(), tmp_path / "in")
    output = tmp_path / "out" / "model_fp16.onnx"
    output.parent.mkdir()
    amp_rewriter.convert_file(source, output)
    assert (output.parent / "model_fp16.onnx.data").is_file()
    assert external_tensors(onnx.load(str(output), load_external_data=False))


def test_external_data_model_with_tensors_left_external_converts(tmp_path):
    b = GraphBuilder()
    x = b.input("x", [4, 32])
    h = b.op("MatMul", x, b.weight("w", [32, 32]), name="mm")
    b.output(b.op("Reshape", h, b.const("shape", np.array([8, 16], np.int64)), name="reshape"))
    y = b.input("y", [32, 32])
    b.output(b.op("Exp", b.op("Mul", y, b.weight("table", [32, 32]), name="mul"), name="exp"))
    model = b.build()
    source = save_external(model, tmp_path / "in")
    output = tmp_path / "out" / "model_fp16.onnx"
    output.parent.mkdir()
    _, report = amp_rewriter.convert_file(source, output)
    assert report.node("mul")["precision"] == "fp32"
    # The fp32 table (2 KiB) is still external, next to the output.
    assert "table" in external_tensors(onnx.load(str(output), load_external_data=False))
    assert (output.parent / "model_fp16.onnx.data").is_file()
    import onnxruntime as ort
    session = ort.InferenceSession(str(output), providers=["CPUExecutionProvider"])
    feeds = feeds_for(model)
    for got, want in zip(session.run(None, feeds), run(model, feeds)):
        assert np.allclose(got, want, rtol=2e-2, atol=2e-2 * np.max(np.abs(want)))


# -- networkx as an oracle -----------------------------------------------------------------------
UNARY = ("Relu", "Tanh", "Neg", "Sigmoid", "Transpose")
BINARY = ("Add", "Mul", "Sub", "MatMul")


def random_dag_model(seed: int, n_nodes: int = 40) -> onnx.ModelProto:
    """A random DAG of [4, 4] float ops over two inputs and a few weights, in a random
    topological order of the proto nodes."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder(seed=seed)
    values = [b.input("x0", [4, 4]), b.input("x1", [4, 4])]
    values += [b.weight(f"w{i}", [4, 4], scale=0.5) for i in range(3)]
    consumed: set[str] = set()
    for i in range(n_nodes):
        if rng.random() < 0.4:
            op, args = UNARY[rng.integers(len(UNARY))], [values[rng.integers(len(values))]]
        else:
            op = BINARY[rng.integers(len(BINARY))]
            args = [values[rng.integers(len(values))] for _ in range(2)]
        out = b.op(op, *args, name=f"n{i}")
        if op in ("Add", "Mul", "Sub", "MatMul"):
            out = b.op("Tanh", out, name=f"n{i}_squash")  # keep values bounded
        consumed.update(args)
        values.append(out)
    outputs = [v for v in values[5:] if v not in consumed]
    b.output(*outputs)
    # Shuffle the proto into another valid topological order.
    graph = nx.DiGraph()
    producer = {o: n.name for n in b.nodes for o in n.output}
    for n in b.nodes:
        graph.add_node(n.name)
        for i in n.input:
            if i in producer:
                graph.add_edge(producer[i], n.name)
    by_name = {n.name: n for n in b.nodes}
    order: list[str] = []
    ready = sorted(n for n in graph if graph.in_degree(n) == 0)
    indegree = dict(graph.in_degree())
    while ready:
        pick = ready.pop(int(rng.integers(len(ready))))
        order.append(pick)
        for s in graph.successors(pick):
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.append(s)
    b.nodes[:] = [by_name[n] for n in order]
    return b.build()


def proto_dag(model: onnx.ModelProto) -> nx.DiGraph:
    graph = nx.DiGraph()
    producer = {o: n.name for n in model.graph.node for o in n.output}
    for node in model.graph.node:
        graph.add_node(node.name)
        for name in node.input:
            if name in producer:
                graph.add_edge(producer[name], node.name)
    return graph


def ir_successors(ir_graph) -> dict[str, set[str]]:
    succ: dict[str, set[str]] = {n.name: set() for n in ir_graph.nodes}
    for node in ir_graph.nodes:
        for value in node.outputs:
            if value is not None:
                succ[node.name].update(consumer.name for consumer, _ in value.uses)
    return succ


@pytest.mark.parametrize("seed", range(5))
def test_ir_order_and_reachability_match_networkx(seed):
    model = random_dag_model(seed)
    oracle = proto_dag(model)
    assert nx.is_directed_acyclic_graph(oracle)
    ir = load_onnx(model)
    assert lint(ir.graph) == []
    order = [n.name for n in ir.graph.nodes]
    assert order == [n.name for n in model.graph.node]  # the loader keeps the file's order
    position = {name: i for i, name in enumerate(order)}
    assert all(position[u] < position[v] for u, v in oracle.edges)  # a topological order
    # networkx's own sort, breaking ties by file position, reproduces the file's order exactly.
    assert list(nx.lexicographical_topological_sort(oracle, key=position.__getitem__)) == order

    succ = ir_successors(ir.graph)
    assert {(u, v) for u, vs in succ.items() for v in vs} == set(oracle.edges)
    for name in order:  # reachability through the IR's use lists == networkx descendants
        seen, stack = set(), list(succ[name])
        while stack:
            current = stack.pop()
            if current not in seen:
                seen.add(current)
                stack.extend(succ[current])
        assert seen == nx.descendants(oracle, name), name

    # Every node here has one fp32 type group, so the propagation graph is the node graph.
    groups = GroupGraph(ir.graph)
    group_edges = {(g.node.name, s.node.name) for g in groups.vertices for s in groups.succ[g]}
    assert group_edges == set(oracle.edges)
    pred_edges = {(p.node.name, g.node.name) for g in groups.vertices for p in groups.pred[g]}
    assert pred_edges == set(oracle.edges)

    assert_equivalent(model, roundtrip(model))


@pytest.mark.parametrize("seed", range(5))
def test_random_dag_converts_and_matches_fp32(seed):
    model = random_dag_model(seed)
    converted, report = amp_rewriter.convert(model)
    check(converted)
    assert any(n["precision"] == "fp16" for n in report.nodes)
    assert [o.name for o in converted.graph.output] == [o.name for o in model.graph.output]
    assert_close(model, converted, feeds_for(model), tol=3e-2)


def test_a_report_written_in_pieces_is_its_json(tmp_path, monkeypatch):
    """convert --report writes the report as it makes it, a batch of pieces at a time: the file
    is the report's JSON, whatever the batch size, names that are not UTF-8 included."""
    from amp_rewriter import fileio

    model = BUILDERS[sorted(BUILDERS)[0]]()
    _, report = amp_rewriter.convert(model, keep_io_types=True)
    report.nodes.update(0, name=b"caf\xe9")
    expected = report.to_json()
    assert "caf\\\\xe9" in expected
    for batch in (1, 3, 1 << 16):
        monkeypatch.setattr(fileio, "_PIECES_PER_WRITE", batch)
        path = tmp_path / f"report{batch}.json"
        fileio.write_atomically(path, report.json_pieces())
        assert path.read_bytes() == expected.encode()



def test_report_entries_across_packed_blocks_read_as_given(monkeypatch):
    """The report keeps its node entries in compressed blocks: every entry reads back as it was
    given, in order and by index, across block boundaries and after a partly filled block, and
    each read hands out a fresh dict (changing one changes nothing stored)."""
    from amp_rewriter import report as report_module

    monkeypatch.setattr(report_module, "_ENTRIES_PER_BLOCK", 3)
    model = BUILDERS[sorted(BUILDERS)[0]]()
    _, converted = amp_rewriter.convert(model, keep_io_types=True)
    expected = list(converted.nodes)
    assert len(expected) >= 4
    records = [(e["name"], e["op"], e["precision"], e["class"], e["kind"], e["reason"],
                e.get("graph"), e.get("class_reason"),
                tuple((g["group"], g["precision"], g["kind"], g["reason"],
                       g["via"]["node"] if "via" in g else None,
                       g["via"]["group"] if "via" in g else None) for g in e.get("groups", [])))
               for e in expected]
    entries = report_module.NodeEntries(records)
    assert len(entries) == len(expected) and list(entries) == expected
    assert [entries[i] for i in reversed(range(len(expected)))] == expected[::-1]
    assert entries[-1] == expected[-1]
    entries.append({"name": "added", "op": "Relu", "groups": [{"group": "T"}]})
    entries.append({"name": "added2", "op": "Relu", "groups": [{"group": "T"}]})
    entries[len(expected)]["groups"].append("changed")
    entries[-2]["groups"][0]["group"] = "changed"
    assert entries[len(expected)] == {"name": "added", "op": "Relu", "groups": [{"group": "T"}]}
    assert entries[-1]["name"] == "added2"
    for _ in range(2):  # sealed in a block now
        entries.append({"name": "more", "op": "Relu", "groups": [{"group": "T"}]})
    entries[len(expected)]["groups"].append("changed")
    assert entries[len(expected)]["groups"] == [{"group": "T"}]
    entries.update(1, reason="updated")
    assert entries[1] == dict(expected[1], reason="updated")
    assert entries[2] == expected[2]
