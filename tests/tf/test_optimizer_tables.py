"""The optimizer argument tables (formats/tf/optimizers.py) against TensorFlow's own OpDefs, and
`check` reading them: low-precision optimizer updates and constants that do not survive them."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tensorflow.core.framework import op_def_pb2  # noqa: E402
from tensorflow.python.client import pywrap_tf_session  # noqa: E402

from amp_rewriter.formats.tf.check import check_tf_graph  # noqa: E402
from amp_rewriter.formats.tf.optimizers import (  # noqa: E402
    EPSILON,
    GRADIENT,
    LEARNING_RATE,
    VARIABLE,
    WRITE_ARGS,
    write_args,
)

v1 = tf.compat.v1


def _registered_ops() -> dict[str, op_def_pb2.OpDef]:
    ops = op_def_pb2.OpList()
    ops.ParseFromString(pywrap_tf_session.TF_GetBuffer(pywrap_tf_session.TF_GetAllOpList()))
    return {op.name: op for op in ops.op}


def test_every_entry_names_the_opdefs_inputs_and_no_writing_kernel_is_missing():
    registered = _registered_ops()
    for op, args in WRITE_ARGS.items():
        assert op in registered, op
        assert [name for name, _ in args.args] == [a.name for a in registered[op].input_arg], op
        assert args.slot(VARIABLE) == 0, op
        assert registered[op].input_arg[0].is_ref or registered[op].input_arg[0].type == \
            tf.resource.as_datatype_enum, op
    # what TensorFlow registers under the writing prefixes, less three ops that make a new
    # tensor instead of writing a variable
    prefixes = ("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply", "Scatter",
                "ResourceScatter", "Assign")
    not_writes = {"ScatterNd", "ScatterNdNonAliasingAdd", "AssignVariableXlaConcatND"}
    assert {op for op in registered if op.startswith(prefixes)} - not_writes == set(WRITE_ARGS)
    adam = write_args("ResourceApplyAdam")
    assert adam is not None and adam.is_optimizer_update
    assert (adam.slot(LEARNING_RATE), adam.slot(EPSILON), adam.slot(GRADIENT)) == (5, 8, 9)
    sparse = write_args("ResourceSparseApplyProximalGradientDescent")
    assert sparse is not None and [name for name, _ in sparse.args][-2:] == ["grad", "indices"]


def _export(graph: tf.Graph, path) -> str:
    with graph.as_default():
        v1.train.export_meta_graph(str(path))
    return str(path)


def test_check_flags_a_keras_style_fused_update_in_fp16(tmp_path):
    # what tf.keras (Keras 2) optimizers run: ResourceApplyKerasMomentum on an fp16 variable
    graph = tf.Graph()
    with graph.as_default():
        weight = v1.get_variable("w", [4], tf.float16, use_resource=True)
        accum = v1.get_variable("w_momentum", [4], tf.float16, use_resource=True)
        grad = v1.placeholder(tf.float16, [4], name="grad")
        tf.raw_ops.ResourceApplyKerasMomentum(
            var=weight.handle, accum=accum.handle, grad=grad, name="update",
            lr=tf.cast(tf.constant(1e-8, tf.float32), tf.float16),
            momentum=tf.constant(0.9, tf.float16))
    result = check_tf_graph(_export(graph, tmp_path / "keras.meta"))
    kinds = [(p["kind"], p.get("node")) for p in result.problems]
    assert ("low_precision_update", "update") in kinds
    # an fp32 learning rate cast to fp16 on its way: 1e-8 is 0 there
    assert ("optimizer_constant_underflow", "update") in kinds


def test_check_notes_constants_that_would_underflow_in_an_fp32_graph(tmp_path):
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 8], name="x")
        w = v1.get_variable("w", [8, 1])
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)), name="loss")
        v1.train.AdamOptimizer(1e-3, epsilon=1e-9).minimize(loss, name="train")
    result = check_tf_graph(_export(graph, tmp_path / "fp32.meta"), target="fp16")
    assert not result.problems
    assert any("'epsilon'" in note and "would underflow in fp16" in note
               for note in result.notes), result.notes
    assert np.float16(1e-9) == 0
