"""The TF emitter writes any node a pass adds (op, attributes, data and control inputs) into a
GraphDef or a function body, and a function's control outputs from the IR."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from amp_rewriter.formats.tf.emit import emit_function, emit_graphdef  # noqa: E402
from amp_rewriter.formats.tf.load import load_function, load_graphdef  # noqa: E402
from amp_rewriter.ir import Graph, IRError, Model, Node, Value, lint, present  # noqa: E402
from amp_rewriter.passes.rewrite.building import array_constant  # noqa: E402

v1 = tf.compat.v1


def add(model: Model, op: str, inputs: list[Value], outputs: list[str],
        waits: list[Node] = (), **attrs) -> Node:
    """A node appended to the main graph as a pass would add it (IR mutators only)."""
    graph: Graph = model.graph
    node = Node(model.unique_name(op.lower()), op, graph=graph)
    for value in inputs:
        node.add_input(value)
    for index, dtype in enumerate(outputs):
        node.add_output(graph.add_value(Value(model.unique_name(f"{node.name}_{index}"), graph,
                                              dtype)))
    for name, value in attrs.items():
        node.set_attr(name, value)
    node.add_control_inputs(waits)
    graph.append_node(node)
    return node


def out(node: Node, slot: int = 0) -> Value:
    return present(node.outputs[slot])


def _gate_on_finite(model: Model, x: Value) -> Value:
    """merge(x * 2 if all(isfinite(x)) else x), written with a pivot per branch: the nodes of a
    branch wait for their pivot (control edges), as a TF1 cond does."""
    finite = add(model, "IsFinite", [x], ["bool"])
    axis = array_constant(model, model.graph, "axis", np.asarray([0], np.int32))
    flag = add(model, "All", [out(finite), axis], ["bool"])
    switch = add(model, "Switch", [out(flag), out(flag)], ["bool", "bool"])
    when_false = add(model, "Identity", [out(switch, 0)], ["bool"])
    when_true = add(model, "Identity", [out(switch, 1)], ["bool"])
    two = array_constant(model, model.graph, "two", np.asarray(2.0, np.float32))
    doubled = add(model, "Mul", [x, two], ["float32"], waits=[when_true])
    kept = add(model, "Identity", [x], ["float32"], waits=[when_false])
    merged = add(model, "Merge", [out(doubled), out(kept)], ["float32", "int32"])
    return out(merged)


def _identity_model() -> Model:
    """The IR of `y = identity(x)`, x a float32 [3] placeholder."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [3], name="x")
        tf.identity(x, name="y")
    return load_graphdef(graph.as_graph_def(), ["y"])


def test_added_nodes_with_control_inputs_run_in_a_graphdef():
    model = _identity_model()
    x_value = model.graph.values["x"]
    merged = _gate_on_finite(model, x_value)
    add(model, "Identity", [merged], ["float32"])  # a fetchable copy
    assert lint(model.graph) == []
    emitted = emit_graphdef(model)
    nodes = {nd.name: nd for nd in emitted.node}
    merge = next(nd for nd in emitted.node if nd.op == "Merge")
    assert merge.attr["N"].i == 2 and merge.attr["T"].type == tf.float32.as_datatype_enum
    mul = next(nd for nd in emitted.node if nd.op == "Mul")
    assert [ref for ref in mul.input if ref.startswith("^")] == ["^identity_1"]
    assert nodes["all"].attr["Tidx"].type == tf.int32.as_datatype_enum
    assert nodes["all"].attr["keep_dims"].b is False  # the OpDef's default, written out
    with tf.Graph().as_default() as imported:
        v1.import_graph_def(emitted, name="")
    fetch = next(nd.name for nd in emitted.node if nd.op == "Identity"
                 and nd.input == [f"{merge.name}"])
    with v1.Session(graph=imported) as session:
        finite = np.array([1.0, 2.0, 3.0], np.float32)
        np.testing.assert_array_equal(session.run(f"{fetch}:0", {"x:0": finite}), 2 * finite)
        bad = np.array([1.0, np.inf, 3.0], np.float32)
        np.testing.assert_array_equal(session.run(f"{fetch}:0", {"x:0": bad}), bad)


def test_added_nodes_and_control_outputs_in_a_function_body():
    @tf.function(input_signature=[tf.TensorSpec([3], tf.float32)])
    def double(x):
        return x * 2.0

    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [3], name="x")
        tf.identity(double(x), name="y")
    graph_def = graph.as_graph_def()
    index, fdef = next((i, f) for i, f in enumerate(graph_def.library.function)
                       if "double" in f.signature.name)
    model = load_function(fdef, graph_def.library)
    result = model.graph.outputs[0]
    three = array_constant(model, model.graph, "three", np.asarray(3.0, np.float32))
    tripled = add(model, "Mul", [result, three], ["float32"])
    done = add(model, "NoOp", [], [], waits=[tripled])
    model.graph.set_output(0, out(tripled))
    model.graph.set_control_output("tripled_done", done)
    assert lint(model.graph) == []
    emitted = emit_function(model)
    assert emitted.ret[fdef.signature.output_arg[0].name] == f"{tripled.name}:z:0"
    assert emitted.control_ret["tripled_done"] == done.name
    assert "tripled_done" in emitted.signature.control_output
    assert any(nd.op == "Const" and nd.name == "three" for nd in emitted.node_def)
    graph_def.library.function[index].CopyFrom(emitted)
    with tf.Graph().as_default() as imported:
        v1.import_graph_def(graph_def, name="")
    with v1.Session(graph=imported) as session:
        np.testing.assert_array_equal(
            session.run("y:0", {"x:0": np.array([1, 2, 3], np.float32)}), [6, 12, 18])


def test_an_added_node_the_opdef_cannot_write_is_an_ir_error():
    model = _identity_model()
    add(model, "Identity", [model.graph.values["x"]], ["float32"], colour="red")
    with pytest.raises(IRError, match="no attribute 'colour'"):
        emit_graphdef(model)
