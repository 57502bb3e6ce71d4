"""TF2 train steps: the rewrite of a traced step's function body, and the function that runs it.

`rewrite_step_function` takes the FunctionDef of a traced `tf.function` (a ConcreteFunction's
body, unoptimized: what TensorFlow's tracing wrote) through the training core's second front
end: `load_function` gives the IR, `find_step_plan` the `TrainingPlan`, the `tf-training`
pipeline the passes (the scaler built by `FunctionTrainingOps`), `emit_function` the body back.
The scaler's state variables become resource arguments after the body's own (its inputs, then
its captures), and the all-finite flag an extra return value after the body's own.

`RewrittenStep` runs it. The FunctionDef is imported into a FuncGraph (TensorFlow's own import
checks every op, input and attribute of the rewritten body, as `check` does for a GraphDef) and
registered with the function runtime as an AtomicFunction; a call flattens its arguments as the
original ConcreteFunction does, passes the original's captured inputs (the variables' handles)
and the scaler's handles, and packs the outputs as the original's. These are TensorFlow's
internal function APIs (function_def_to_graph, atomic_function, function_type_utils): the one
place this package uses them, since no public API calls a FunctionDef from a traced graph.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tensorflow.core.framework import function_pb2
from tensorflow.python.eager.polymorphic_function import atomic_function, function_type_utils
from tensorflow.python.framework import function_def_to_graph

from ....errors import AmpError, first_line
from ....ir import Model
from ....options import TfOptions
from ....report import Report
from ....training import LossScaleRule
from ....training.passes import TrainingContext
from ....training.update import UpdateOptions
from .. import convert as tf_convert
from ..emit import emit_function
from .ops import FunctionTrainingOps
from .rewrite import training_summary
from .step_plan import find_step_plan
from .storage import read_as_fp32

#: Names of the rewritten functions (registered with the runtime: each must be new).
_FUNCTION_NUMBERS = itertools.count()


@dataclass
class StepRewrite:
    """A rewritten step body: the FunctionDef, the report, the scaler's state variables in the
    order of their arguments ("scale", "good_steps", "bad_steps"), and whether the body returns
    the all-finite flag after its own return values."""

    function_def: function_pb2.FunctionDef
    report: Report
    states: list[str]
    returns_flag: bool
    #: Each state variable's initial value, by name (the caller makes the variables).
    initials: dict[str, np.ndarray] = field(default_factory=dict)


def rewrite_step_function(fdef: function_pb2.FunctionDef,
                          library: function_pb2.FunctionDefLibrary, options: TfOptions,
                          rule: LossScaleRule, update: UpdateOptions | None = None,
                          variable_names: dict[str, str] | None = None,
                          trainable: frozenset[str] | None = None,
                          resource_prefix: str = "",
                          stored_dtypes: dict[str, str] | None = None) -> StepRewrite:
    """The mixed-precision rewrite of a train step's body (see the module docstring);
    `update`: how it updates its variables (16-bit weights, unscaling, accumulation);
    `variable_names`: the captured variables' names by argument name (the random keys of
    16-bit weights); `trainable`: the arguments of the trainable ones (None: every variable an
    update writes from the gradients); `resource_prefix`: what the body's own resources are
    named under; `stored_dtypes`: the captured variables the caller built in 16 bits (their
    dtype by argument name), with 16-bit `update.weights`: the body is read as fp32 first
    (`storage.read_as_fp32`) and their writes rounded back into them."""
    contexts: list[TrainingContext] = []
    upcast = 0
    if stored_dtypes and update is not None and update.weight_dtype is not None:
        fdef, upcast = read_as_fp32(fdef, library, stored_dtypes)
    else:
        stored_dtypes = None
    called = frozenset(f.signature.name for f in library.function)

    def plan_training(model: Model) -> TrainingContext:
        ops = FunctionTrainingOps(model, resource_prefix=resource_prefix,
                                  variable_names=variable_names, stored_dtypes=stored_dtypes)
        plan = find_step_plan(model, ops, called, trainable)
        problems = plan.problems()
        if problems:
            raise AmpError(f"internal: the training plan is unsound: {problems[0]}")
        contexts.append(TrainingContext(plan, rule, ops, update or UpdateOptions()))
        return contexts[-1]

    model, report = tf_convert.rewrite_function_ir(fdef, library, options, "tf-training",
                                                   plan_training)
    context = contexts[0]
    ops = context.ops
    assert isinstance(ops, FunctionTrainingOps)
    if report.summary["low_precision_nodes"] == 0:
        raise AmpError(f"nothing in the step's forward or backward pass can run in "
                       f"{options.target}: it has no float32 compute ops (MatMul, Conv2D, ...) "
                       f"to convert")
    flag = context.all_finite
    if flag is not None and context.window is not None:
        # the caller counts skipped steps: accumulating, only a window's end applies or skips
        within = ops.negate(context.window.boundary, "report/within_window")
        flag = ops.either(flag, within, "report/applied_or_within_window")
        ops.commit()
        model.graph.sort_nodes()
    if flag is not None:
        model.graph.add_output(flag)
    out = emit_function(model)
    plan = context.plan
    report.training = {
        "loss": plan.loss.name,
        "losses": [node.name for node in plan.differentiated],
        "step": plan.step.name,
        "state_arguments": [value.name for value in ops.arguments],
        "results_released": sorted(context.released),
        **training_summary(context, report),
    }
    if stored_dtypes:
        report.training["variables_built_16bit"] = {
            "variables": sorted(ops.variable_names.get(a, a) for a in stored_dtypes),
            "values_read_as_fp32": upcast}
    return StepRewrite(out, report, [state.name for state in ops.variables], flag is not None,
                       {state.name: np.asarray(state.initial) for state in ops.variables})


def rewrite_inference_function(fdef: function_pb2.FunctionDef,
                               library: function_pb2.FunctionDefLibrary,
                               options: TfOptions) -> tuple[function_pb2.FunctionDef, Report]:
    """The mixed-precision rewrite of an inference function's body (Keras's test and predict
    steps): the `tf` pipeline, arguments and return values keeping their dtypes."""
    model, report = tf_convert.rewrite_function_ir(fdef, library, options)
    return emit_function(model), report


class RewrittenStep:
    """A rewritten body of a ConcreteFunction, callable where the original was (eagerly or while
    tracing another function), with the extra arguments and return values of the rewrite."""

    def __init__(self, fdef: function_pb2.FunctionDef, original: Any):
        fdef = function_pb2.FunctionDef.FromString(fdef.SerializeToString())
        number = next(_FUNCTION_NUMBERS)
        fdef.signature.name = f"{original.function_def.signature.name}_amp_{number}"
        self.original = original
        self.user_outputs = len(original.function_def.signature.output_arg)
        try:
            graph = function_def_to_graph.function_def_to_graph(
                fdef, propagate_device_spec=True, include_library_functions=False)
        except Exception as exc:  # TF refuses the body: a bug of the rewrite, said in one line
            raise AmpError(f"internal: the rewritten step does not import into TensorFlow: "
                           f"{first_line(exc)}") from None
        for child in original.graph._functions.values():  # functions the body calls
            graph._add_function_recursive(child)
        graph.collective_manager_ids_used = list(
            getattr(original.graph, "collective_manager_ids_used", []))
        self.function = atomic_function.from_func_graph(fdef.signature.name, graph, {})

    def __call__(self, args: Sequence[Any], kwargs: dict[str, Any],
                 extra: Sequence[Any]) -> tuple[Any, list[Any]]:
        """Run the body on the original's arguments and the `extra` arguments (the scaler's
        handles): the original's structured outputs, and the extra return values."""
        function_type = self.original.function_type
        bound = function_type_utils.canonicalize_function_inputs(args, kwargs, function_type)
        inputs = [*function_type.unpack_inputs(bound), *self.original.captured_inputs, *extra]
        outputs = list(self.function.call_flat(*inputs))
        mine, theirs = outputs[:self.user_outputs], outputs[self.user_outputs:]
        return function_type.pack_output(mine), theirs

