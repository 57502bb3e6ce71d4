"""The training rewrite's gating form holds inside a TF2 function body: a write that waits for
`TfTrainingOps.gate` runs on a finite step and is skipped on a non-finite one, with no error and
no Switch on the variable's handle (the function gets it as a resource argument)."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tensorflow.python.eager import context  # noqa: E402

from amp_rewriter.formats.tf.emit import emit_function  # noqa: E402
from amp_rewriter.formats.tf.load import load_function  # noqa: E402
from amp_rewriter.formats.tf.training.ops import TfTrainingOps  # noqa: E402
from amp_rewriter.ir import lint  # noqa: E402


def test_a_gated_write_in_a_function_body_is_skipped_on_a_bad_step():
    variable = tf.Variable(np.zeros(3, np.float32))

    @tf.function(input_signature=[tf.TensorSpec([3], tf.float32)])
    def step(x):
        variable.assign_add(x)
        return tf.constant(1.0)

    concrete = step.get_concrete_function()
    model = load_function(concrete.function_def, concrete.graph.as_graph_def().library)
    ops = TfTrainingOps(model)
    gate = ops.gate(ops.all_finite([model.graph.inputs[0]], "check/all_finite"), "gate/apply")
    write = next(n for n in model.graph.nodes if n.op_type == "AssignAddVariableOp")
    write.add_control_input(gate)
    ops.commit()
    assert lint(model.graph) == [] and list(model.graph.control_outputs.values()) == [write]
    gated = emit_function(model)
    switched = [nd.input[0] for nd in gated.node_def if nd.op == "Switch"]
    assert switched and all(ref.startswith("amp_loss_scale/check/") for ref in switched)
    gated.signature.name = "gated_step"
    context.context().add_function_def(gated)

    def run(values):
        # the rewritten body run by TF2's function runtime, with the variable's handle
        tf.raw_ops.StatefulPartitionedCall(args=[tf.constant(values, tf.float32),
                                                 variable.handle], Tout=[tf.float32],
                                           f="gated_step")
        return variable.numpy().tolist()

    assert run([1, 2, 3]) == [1, 2, 3]
    assert run([1, np.inf, 3]) == [1, 2, 3]  # skipped: no write, no error
    assert run([1, 1, np.nan]) == [1, 2, 3]
    assert run([1, 1, 1]) == [2, 3, 4]
