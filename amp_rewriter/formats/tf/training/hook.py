"""The TF2 training hook: a `tf.function` train step (or Keras's train, test and predict steps)
run in mixed precision, rewritten by the training core's second front end (`step.py`).

    step = mixed_precision(train_step, target="fp16")   # train_step: a tf.function or a function
    loss = step(x, y)                                    # traces, rewrites once, runs the rewrite
    step.loss_scale, step.good_steps, step.report        # the scaler's variables, the last report

`MixedPrecisionStep` is a `tf.Module`: its variables (`loss_scale`, `good_steps`, `bad_steps`
with hysteresis, `skipped_steps`) are checkpointed with it, and it is called like the step.

A call runs a `tf.function` of ours. Tracing it traces the user's step (the user's own
`tf.function`, so TensorFlow's retracing rules apply: a new input signature is traced and
rewritten once, and later calls do no Python work beyond the call), rewrites the body and calls
the rewritten body with the scaler's handles. After the call it counts a skipped step and, when
a default summary writer with a step is active while tracing (a TensorBoard callback with an
`update_freq` in batches does that), writes `amp/loss_scale` and `amp/skipped_steps`.

Distribution strategies. Called around a whole step (a function that calls `strategy.run`), the
trace holds every replica's forward and backward pass, the strategy's all-reduce and every
replica's update: the flag is taken after the all-reduce (`find_step_plan`'s aggregations), so
every replica, and every worker of MultiWorkerMirroredStrategy, takes the same decision. Called
per replica (`strategy.run(step, ...)`), each replica's call makes one `merge_call` that gathers
the replicas' arguments and runs the whole step the same way (`strategy.run` of the user's
function, inside our `tf.function`): a replica cannot trace its own function body, because an
optimizer's `merge_call` must run in the graph `strategy.run` was called in (TensorFlow refuses a
synchronization point inside a nested function), and this way the decision is the same one
all-reduced decision. Each replica gets its own outputs back.

The scaler's variables are plain resource variables, one copy per process (made outside any
strategy's variable creator): the rewritten step reads and writes them once per call, whatever
the number of replicas, and the workers' copies stay equal because every worker takes the same
decision. A checkpoint without them (fp32 training) restores into the wrapper; they keep their
initial values.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import summary_pb2
from tensorflow.python.eager import backprop
from tensorflow.python.ops import resource_variable_ops, summary_ops_v2

from ....errors import AmpError
from ....ir.dtypes import SHORT_NAMES as _SHORT
from ....options import TfOptions, TrainingOptions, format_options
from ....report import Report
from ....training import LossScaleRule
from ....training.update import UpdateOptions
from .step import RewrittenStep, rewrite_inference_function, rewrite_step_function
from .storage import SIXTEEN_BITS

#: What marks a summary as a scalar for TensorBoard (its scalars plugin).
_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))


def _error(message: str) -> AmpError:
    """An AmpError that autograph passes through unchanged (it would prefix the user's code)."""
    error = AmpError(message)
    error.ag_pass_through = True  # type: ignore[attr-defined]
    return error


def _last_line(exc: BaseException) -> str:
    """The line of a TensorFlow error that says what went wrong (autograph puts the user's code
    first and the message last)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


@contextlib.contextmanager
def _float_losses_only() -> Iterator[None]:
    """While a step is traced, `tape.gradient` of a loss that is not float is an AmpError
    (TensorFlow would give None gradients, and the error would come later, from elsewhere)."""
    original = backprop.GradientTape.gradient

    def gradient(tape: Any, target: Any, sources: Any, *args: Any, **kwargs: Any) -> Any:
        for tensor in tf.nest.flatten(target):
            dtype = getattr(tensor, "dtype", None)
            if isinstance(dtype, tf.DType) and not (dtype.is_floating or dtype.is_complex):
                raise _error(f"the loss given to tape.gradient is {dtype.name}, not a float "
                             f"tensor: no gradient can be taken of it")
        return original(tape, target, sources, *args, **kwargs)

    backprop.GradientTape.gradient = gradient
    try:
        yield
    finally:
        backprop.GradientTape.gradient = original


def trace(function: Any, args: tuple, kwargs: dict) -> Any:
    """The ConcreteFunction of `function` (a tf.function) for these arguments; what goes wrong
    while tracing is one AmpError line."""
    try:
        with _float_losses_only():
            return function.get_concrete_function(*args, **kwargs)
    except AmpError as exc:
        raise _error(_last_line(exc)) from None
    except Exception as exc:  # the user's code or TensorFlow refused the trace
        raise _error(f"tracing the step failed: {type(exc).__name__}: {_last_line(exc)}") \
            from None


def _create_at_top_level(next_creator: Callable, **kwargs: Any) -> Any:
    """A variable creator that makes the variable outside any function being traced (its
    initial value computed eagerly), as a first call would; a variable whose initial value is
    a tensor of the traced graph is made there, as TensorFlow makes it."""
    initial = kwargs.get("initial_value")
    if not callable(initial) and tf.is_symbolic_tensor(initial):
        return next_creator(**kwargs)
    with tf.init_scope():
        return next_creator(**kwargs)


def as_tf_function(step: Any) -> Any:
    """`step` as a tf.function of ours (a plain function, a method or the Python function of
    a tf.function, with its input signature), in which a variable the step makes (an optimizer
    builds its slots on its first call) is made at the top level. Our trace calls the step's
    trace, and TensorFlow cannot lift the initializers of a nested trace's variables (a
    MirroredStrategy replica's copy reads the first replica's), nor can a ConcreteFunction be
    had without a trace."""
    if not callable(step):
        raise AmpError(f"expected a tf.function or a Python function, got "
                       f"{type(step).__name__}")
    function = python_function(step)

    def step_making_variables_at_top_level(*args: Any, **kwargs: Any) -> Any:
        with tf.variable_creator_scope(_create_at_top_level):
            return function(*args, **kwargs)

    return tf.function(step_making_variables_at_top_level,
                       input_signature=getattr(step, "input_signature", None))


def python_function(step: Any) -> Callable:
    """The Python function a tf.function wraps (`strategy.run` traces it in its own graph)."""
    return getattr(step, "python_function", step)


class _Traced:
    """One step function (a tf.function) with its rewrites, run by a tf.function of ours: a new
    input signature traces it, and the body is rewritten once per ConcreteFunction."""

    def __init__(self, owner: _RewrittenFunction, step: Any):
        self.owner, self.step = owner, step
        #: ConcreteFunction -> its rewrite.
        self.rewrites: dict[Any, RewrittenStep] = {}
        self.function = tf.function(self.run, autograph=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        concrete = trace(self.step, args, kwargs)
        rewritten = self.rewrites.get(concrete)
        if rewritten is None:
            rewritten = self.rewrites[concrete] = self.owner.rewrite(concrete)
        outputs, extra = rewritten(args, kwargs, self.owner.state_handles())
        self.owner.after_step(extra)
        return outputs


@dataclass
class _Calls:
    """What a wrapper calls, kept out of TensorFlow's tracking (so a checkpoint holds only
    the variables): the user's step and our traced functions."""

    step: Any
    direct: _Traced | None = None
    #: strategy -> the whole-step function run by a merge_call from replicas.
    hoisted: dict[Any, _Traced] = field(default_factory=dict)


class _RewrittenFunction(tf.Module):
    """A step function run in mixed precision (see the module docstring): the calls, per
    replica or not; the subclasses say how a traced body is rewritten."""

    def __init__(self, step: Any, options: TfOptions, name: str):
        super().__init__(name=name)
        self._calls = _Calls(as_tf_function(step))
        self._options = options
        #: The last trace's Report (None before the first call).
        self.report: Report | None = None
        #: How many traced bodies were rewritten.
        self.rewrites = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        replica = tf.distribute.get_replica_context()
        if replica is not None and tf.distribute.has_strategy():
            return replica.merge_call(self._whole_step, args=args, kwargs=kwargs)
        if self._calls.direct is None:
            self._calls.direct = _Traced(self, self._calls.step)
        return self._calls.direct(*args, **kwargs)

    def _whole_step(self, strategy: Any, *args: Any, **kwargs: Any) -> Any:
        """Every replica's call at once (in a merge_call): `strategy.run` of the step."""
        whole_step = self._calls.hoisted.get(strategy)
        if whole_step is None:
            per_replica = python_function(self._calls.step)

            def whole(*args: Any, **kwargs: Any) -> Any:
                return strategy.run(per_replica, args=args, kwargs=kwargs)

            whole_step = self._calls.hoisted[strategy] = _Traced(self, as_tf_function(whole))
        return whole_step(*args, **kwargs)

    def rewrite(self, concrete: Any) -> RewrittenStep:
        """The rewritten body of a traced step (records its report)."""
        raise NotImplementedError

    def state_handles(self) -> list[Any]:
        """The handles a rewritten body takes after its own arguments."""
        return []

    def after_step(self, extra: list[Any]) -> None:
        """Graph work after the rewritten body ran, given its extra return values."""

    def _recorded(self, report: Report) -> None:
        self.report = report
        self.rewrites += 1


#: The loss scaler's state variables, which a MixedPrecisionStep makes up front.
_SCALER_STATES = ("scale", "good_steps", "bad_steps")
#: What a distribution strategy appends to a replica's copy of a variable's name.
_REPLICA_SUFFIX = re.compile(r"/replica_\d+$")


def captured_variable_names(concrete: Any
                            ) -> tuple[dict[str, str], frozenset[str], dict[str, str]]:
    """The names of the variables a traced step captures, by the argument of the body that
    takes their handle: a name without the replica suffix, numbered by its occurrence among
    the variables of one replica, so that every replica's copy of a variable gets the same name
    (16-bit weights' random bits are keyed by it) and no two variables of a replica share one;
    and the arguments of the trainable ones (the weights, not an optimizer's slots); and the
    IR dtype of those the caller built in 16 bits (float16, bfloat16), by argument."""
    arguments = [arg.name for arg in concrete.function_def.signature.input_arg]
    captured = list(concrete.captured_inputs)
    # handles are tensors, which do not hash: their refs do, by identity
    by_handle = {v.handle.ref(): v for v in concrete.graph.variables}
    names: dict[str, str] = {}
    trainable: set[str] = set()
    sixteen: dict[str, str] = {}
    seen: dict[tuple[str, str], int] = {}
    first = len(arguments) - len(captured)
    for argument, handle in zip(arguments[first:], captured, strict=True):
        variable = by_handle.get(handle.ref())
        if variable is None:
            continue
        full = variable.name.partition(":")[0]
        base = _REPLICA_SUFFIX.sub("", full)
        replica = full[len(base):]
        occurrence = seen.get((base, replica), 0)
        seen[(base, replica)] = occurrence + 1
        clean = re.sub(r"[^A-Za-z0-9_./-]", "_", base).lstrip("./-_") or "variable"
        names[argument] = clean if occurrence == 0 else f"{clean}_{occurrence}"
        if variable.trainable:
            trainable.add(argument)
        if variable.dtype.as_datatype_enum in SIXTEEN_BITS:
            sixteen[argument] = variable.dtype.name  # TF's name is the IR's
    return names, frozenset(trainable), sixteen


def _state_variable(initial: Any, dtype: tf.DType, name: str) -> tf.Variable:
    """A plain resource variable, whatever strategy scope is active (ResourceVariable's own
    constructor does not go through the variable creators that make distributed variables)."""
    with tf.init_scope():
        return resource_variable_ops.ResourceVariable(
            np.asarray(initial, dtype.as_numpy_dtype), trainable=False, name=name, dtype=dtype)


#: Where frames are not the user's: this package, TensorFlow's and Keras's tracing, the stdlib.
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(module.__file__ or "")) + os.sep
                      for module in (sys.modules["amp_rewriter"], tf, contextlib))


def _first_user_frame() -> int:
    """The `stacklevel` that makes a warning raised by this function's caller point at the
    user's line: a step's first call traces it deep inside TensorFlow, so a fixed level would
    name a line of TensorFlow's or ours."""
    not_the_users = (*_LIBRARY_DIRS, *_keras_dirs(), "<")  # "<": frozen and generated code
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(not_the_users):
        frame, level = frame.f_back, level + 1
    return level


def _keras_dirs() -> tuple[str, ...]:
    keras = sys.modules.get("keras")
    return (os.path.dirname(os.path.abspath(keras.__file__)) + os.sep,) \
        if keras is not None and keras.__file__ else ()


class MixedPrecisionStep(_RewrittenFunction):
    """A train step run in mixed precision with in-graph loss scaling (see the module
    docstring). `loss_scale` (float32), `good_steps` (int32) and `bad_steps` (int32, with
    hysteresis) are the scaler's variables (None where the rule has none; a fixed scale is a
    constant tensor, bf16's default has no scale); `skipped_steps` (int64) counts the steps
    skipped for a non-finite gradient; `report` is the last trace's Report (`explain` reads
    it)."""

    def __init__(self, step: Any, options: TfOptions, rule: LossScaleRule,
                 update: UpdateOptions | None = None):
        super().__init__(step, options, "mixed_precision_step")
        self.rule = rule
        self.update = update or UpdateOptions()
        #: The other state variables a rewrite asked for (16-bit weights' step counter, the
        #: accumulation window's micro-step and flag), made at the first rewrite that does.
        self.update_state: dict[str, tf.Variable] = {}
        self.loss_scale: tf.Variable | tf.Tensor | None = None
        self.good_steps: tf.Variable | None = None
        self.bad_steps: tf.Variable | None = None
        self.skipped_steps: tf.Variable | None = None
        if rule.dynamic:
            self.loss_scale = _state_variable(rule.initial_scale, tf.float32, "loss_scale")
            self.good_steps = _state_variable(0, tf.int32, "good_steps")
            if rule.counts_bad_steps:
                self.bad_steps = _state_variable(0, tf.int32, "bad_steps")
        elif rule.scales:
            self.loss_scale = tf.constant(rule.initial_scale, tf.float32)  # a fixed scale
        if rule.scales:
            self.skipped_steps = _state_variable(0, tf.int64, "skipped_steps")
        self._states: list[str] = []

    def rewrite(self, concrete: Any) -> RewrittenStep:
        library = concrete.graph.as_graph_def().library
        names, trainable, sixteen = captured_variable_names(concrete)
        self._check_storage(names, trainable, sixteen)
        rewritten = rewrite_step_function(
            concrete.function_def, library, self._options, self.rule, self.update,
            variable_names=names, trainable=trainable,
            resource_prefix=f"{concrete.function_def.signature.name}_{id(self):x}",
            stored_dtypes=sixteen)
        for name in rewritten.states:
            if name not in _SCALER_STATES and name not in self.update_state:
                initial = rewritten.initials[name]
                self.update_state[name] = _state_variable(
                    initial, tf.as_dtype(initial.dtype), name)
        self._states = rewritten.states
        self._recorded(rewritten.report)
        return RewrittenStep(rewritten.function_def, concrete)

    def _check_storage(self, names: dict[str, str], trainable: frozenset[str],
                       sixteen: dict[str, str]) -> None:
        """With 16-bit `weights`: the weights built in another 16-bit dtype are an AmpError;
        weights all built float32 keep float32 storage, said in one warning line. With 16-bit
        `slots`: other variables (a Keras optimizer makes its slots in the weights' dtype)
        built in another 16-bit dtype are an AmpError, not a setting silently ignored."""
        slots = self.update.slot_dtype
        for argument in sorted(set(sixteen) - trainable):
            if slots is not None and sixteen[argument] != slots:
                raise _error(f"slots={self.update.slots!r} but variable "
                             f"{names.get(argument, argument)} is built in {sixteen[argument]} "
                             f"(Keras makes an optimizer's slots in its weights' dtype): pass "
                             f"slots={_SHORT[sixteen[argument]]!r} or leave slots unset")
        wanted = self.update.weight_dtype
        if wanted is None:
            return
        for argument in sorted(trainable & set(sixteen)):
            if sixteen[argument] != wanted:
                raise _error(f"weights={self.update.weights!r} but variable "
                             f"{names.get(argument, argument)} is built in "
                             f"{sixteen[argument]}: build the model in {wanted} or pass "
                             f"weights={_SHORT[sixteen[argument]]!r}")
        if trainable and not trainable & set(sixteen):
            warnings.warn(
                f"weights={self.update.weights!r}: the step's trainable variables are float32, "
                f"so they hold {self.update.weights} values but keep float32 storage (memory "
                f"and checkpoints unchanged); build them in {wanted} (Keras: "
                f"dtype={wanted!r}) for 16-bit storage", UserWarning,
                stacklevel=_first_user_frame())

    def state_handles(self) -> list[Any]:
        variables = {"scale": self.loss_scale, "good_steps": self.good_steps,
                     "bad_steps": self.bad_steps, **self.update_state}
        handles = []
        for name in self._states:
            variable = variables[name]
            if variable is None:
                raise AmpError(f"internal: the rewritten step reads a {name} variable the "
                               f"wrapper does not have")
            handles.append(variable.handle)
        return handles

    def after_step(self, extra: list[Any]) -> None:
        if not extra or self.skipped_steps is None:
            return
        skipped = tf.cast(tf.logical_not(extra[0]), tf.int64)
        total = self.skipped_steps.assign_add(skipped)
        step = tf.summary.experimental.get_step()
        if summary_ops_v2.has_default_writer() and step is not None:
            scale = self.loss_scale
            with tf.control_dependencies([total]):
                for tag, value in (("amp/loss_scale", tf.identity(scale)),
                                   ("amp/skipped_steps", total)):
                    # tf.summary.scalar's own form, which needs TensorBoard installed
                    tf.summary.write(tag, tf.cast(value, tf.float32), step=step,
                                     metadata=_SCALAR_METADATA)


class MixedPrecisionFunction(_RewrittenFunction):
    """An inference function (Keras's test or predict step) run in mixed precision: the `tf`
    pipeline on its traced body, no loss scaling. `report` is the last trace's Report."""

    def __init__(self, step: Any, options: TfOptions):
        super().__init__(step, options, "mixed_precision_function")

    def rewrite(self, concrete: Any) -> RewrittenStep:
        library = concrete.graph.as_graph_def().library
        fdef, report = rewrite_inference_function(concrete.function_def, library,
                                                  self._options)
        self._recorded(report)
        return RewrittenStep(fdef, concrete)


#: The conversion options a step takes (the rest describe files: outputs, external data, ...).
STEP_OPTIONS = ("backend", "allow", "infer", "deny", "clear", "keep_nodes", "config", "clamp")


def step_options(target: str, options: dict[str, Any]
                 ) -> tuple[TfOptions, LossScaleRule, UpdateOptions]:
    """The conversion options, the loss-scale rule and the update options of a
    `mixed_precision` call's keyword arguments; AmpError names an unknown or misplaced one, or a
    bad value."""
    training, rest = TrainingOptions.from_kwargs(options)
    if training.loss is not None or training.train_op is not None:
        raise AmpError("loss and train_op name the parts of a TF1 graph: a TF2 step's loss is "
                       "what its tape differentiates")
    unknown = sorted(set(rest) - set(STEP_OPTIONS))
    if unknown:
        raise AmpError(f"no option {unknown[0]!r} for a train step (options: "
                       f"{', '.join(STEP_OPTIONS)}, loss_scale, "
                       f"{', '.join(LossScaleRule.knobs())}, "
                       f"{', '.join(UpdateOptions.knobs())})")
    converted = format_options(TfOptions, {"target": target, **rest})
    return converted, training.loss_scale_rule(converted.target), training.update_options()


def mixed_precision(step: Any, target: str = "fp16", **options: Any) -> MixedPrecisionStep:
    """A train step run in mixed precision, with the loss scaled in the graph.

    Args:
        step: a `tf.function` (or a Python function, wrapped in one) that computes a loss, takes
            its gradients with `tf.GradientTape` and applies them (a Keras 3 or tf.compat.v1
            optimizer, or `assign`/`assign_sub`); it may call `strategy.run`, or be called by it.
        target: "fp16" or "bf16".
        **options: the conversion options (backend: tf-gpu, the fp16 default, or tf-cpu, the
            bf16 default; allow, infer, deny, clear, keep_nodes, config, clamp) and the
            loss-scale rule: loss_scale ("dynamic", the fp16 default; "none", the bf16 default;
            or a fixed number), initial_scale (2**15), growth_interval (2000), growth_factor
            (2), backoff_factor (0.5), min_scale (1), hysteresis (1); and the update: weights
            ("fp32", or "fp16"/"bf16": each update computed in fp32 and rounded to 16 bits;
            variables built in that type, e.g. Keras layers with dtype="float16", stay stored
            in it, the step run as its fp32 equivalent; float32 ones hold 16-bit values and
            keep their storage, with a warning), rounding ("stochastic", the 16-bit
            default, or "nearest"), slots, rounding_seed, unscale ("auto", "gradients",
            "optimizer") and accumulate (N micro-steps per applied step).

    Returns:
        A `MixedPrecisionStep`: call it as the step; `loss_scale`, `good_steps`,
        `skipped_steps` are its variables, `report` the last trace's Report.
    """
    converted, rule, update = step_options(target, options)
    return MixedPrecisionStep(step, converted, rule, update)
