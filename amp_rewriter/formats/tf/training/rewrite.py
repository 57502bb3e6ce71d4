"""TF1 training graphs: mixed-precision forward and backward passes, fp32 master weights, and a
dynamic loss-scaling subgraph inside the graph.

    result = rewrite_training_graph(graph, loss="loss", train_op="train", target="fp16")
    with tf.compat.v1.Session(graph=result.graph) as session: ...

TF1 is the training core's first front end (`amp_rewriter/training`):

1. the MetaGraph's GraphDef is loaded into the IR (control edges included);
2. `find_training_plan` (plan.py) reads the TF1 graph into a `TrainingPlan` over IR values:
   the train op's variable writes, tf.gradients' seeds, the frontier where gradients leave the
   backward pass, their aggregation, the optimizer path;
3. the `tf-training` pipeline runs the training passes (the loss scaler, built by
   `TfTrainingOps`, ops.py) and then the inference passes on the forward and backward passes;
4. the IR is emitted back into the MetaGraph, whose collections, saver and signatures stay as
   they were; the scaler's variables join its `local_variables` collection.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import graph_pb2, variable_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow.python.framework import meta_graph as tf_meta_graph

from ....errors import AmpError
from ....ir import Model, Value
from ....options import TfOptions, TrainingOptions, format_options
from ....report import Report
from ....training.passes import TrainingContext
from .. import convert as tf_convert
from .. import files
from .._tensorflow import imported_graph
from .ops import TfTrainingOps, TfVariableNodes
from .plan import find_training_plan, node_name


@dataclass
class TrainingRewrite:
    """What `rewrite_training_graph` returns.

    `loss` is the loss tensor's name ("loss:0") and `train_op` the train op's node name, ready
    for `session.run`. `loss_scale` and `good_steps` are tensors to fetch for the current scale
    and counter (they read the variables, or give the initial values before the first step); the
    variables themselves are `loss_scale_variable` and `good_steps_variable` (local variables,
    so a default Saver neither saves nor needs them and fp32 checkpoints restore into the graph).
    """

    graph: tf.Graph
    meta_graph_def: meta_graph_pb2.MetaGraphDef
    loss: str
    train_op: str
    loss_scale: str | None
    good_steps: str | None
    report: Report
    loss_scale_variable: str | None = None
    good_steps_variable: str | None = None
    bad_steps: str | None = None
    all_finite: str | None = None
    init_op: str | None = None
    micro_step: str | None = None


def as_meta_graph(source) -> meta_graph_pb2.MetaGraphDef:
    """A copy of the training graph as a MetaGraphDef, from a tf.Graph, GraphDef, MetaGraphDef or
    a file (.meta, .pb, .pbtxt)."""
    meta = meta_graph_pb2.MetaGraphDef()
    if isinstance(source, meta_graph_pb2.MetaGraphDef):
        meta.CopyFrom(source)
    elif isinstance(source, graph_pb2.GraphDef):
        meta.graph_def.CopyFrom(source)
    elif isinstance(source, tf.Graph):
        with source.as_default():
            meta.CopyFrom(tf.compat.v1.train.export_meta_graph(graph=source))
    elif isinstance(source, (str, os.PathLike)):
        if Path(source).suffix == ".meta":
            meta.CopyFrom(files.read_meta_graph(source))
        else:
            meta.graph_def.CopyFrom(files.read_graphdef(source))
    else:
        raise AmpError(f"expected a tf.Graph, GraphDef, MetaGraphDef or file path, got "
                       f"{type(source).__name__}")
    return meta


def _collection_train_op(meta: meta_graph_pb2.MetaGraphDef) -> str:
    entries = meta.collection_def["train_op"].node_list.value \
        if "train_op" in meta.collection_def else []
    names = list(dict.fromkeys(node_name(e) for e in entries))
    if len(names) != 1:
        raise AmpError("name the train op (--train-op NAME): the graph has "
                       + ("no 'train_op' collection" if not names
                          else f"{len(names)} train ops in its 'train_op' collection"))
    return names[0]


def _trainable_variables(meta: meta_graph_pb2.MetaGraphDef) -> frozenset[str] | None:
    """The node names of the MetaGraph's trainable variables (None when it lists none: a bare
    GraphDef)."""
    key = tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES
    if key not in meta.collection_def:
        return None
    names = set()
    for entry in meta.collection_def[key].bytes_list.value:
        try:
            definition = variable_pb2.VariableDef.FromString(entry)
        except Exception:  # a damaged entry: it names no variable
            continue
        if definition.variable_name:
            names.add(node_name(definition.variable_name))
    return frozenset(names)


def _loss_port(loss) -> int:
    """The output index the caller named ("loss:1" -> 1; a node name or None -> 0)."""
    name = getattr(loss, "name", loss)
    if isinstance(name, str) and ":" in name:
        port = name.rpartition(":")[2]
        return int(port) if port.isdigit() else 0
    return 0


def _tensor_name(value: Value) -> str:
    """The TF tensor name of a value the training passes made (`node:port`)."""
    producer = value.producer
    return f"{producer.name}:{value.producer_slot}" if producer is not None else f"{value.name}:0"


def _add_local_variables(meta: meta_graph_pb2.MetaGraphDef, ops: TfTrainingOps) -> None:
    """List the scaler's variables in `local_variables`, as tf.compat.v1 lists a local resource
    variable: a default Saver neither saves nor needs them, local_variables_initializer() runs
    their initializers, import_meta_graph makes them variables again."""
    names = {nd.name for nd in meta.graph_def.node}
    for state in ops.variables:
        nodes: TfVariableNodes = state.handle
        # the scaler's state variables all have these (only an accumulator has none, and it
        # is not listed: it reads as zeros until written)
        assert nodes.initializer and nodes.snapshot and nodes.initial_value
        listed = (nodes.handle.name, nodes.initializer.name, nodes.snapshot.name,
                  nodes.initial_value.name)
        missing = [name for name in listed if name not in names]
        if missing:
            raise AmpError(f"internal: the scaler's node {missing[0]!r} was written under "
                           f"another name")
        definition = variable_pb2.VariableDef(
            variable_name=f"{nodes.handle.name}:0", initializer_name=nodes.initializer.name,
            snapshot_name=f"{nodes.snapshot.name}:0",
            initial_value_name=f"{nodes.initial_value.name}:0", is_resource=True,
            trainable=False)
        meta.collection_def[tf.compat.v1.GraphKeys.LOCAL_VARIABLES].bytes_list.value.append(
            definition.SerializeToString())


def rewrite_training_meta_graph(source: Any, options: TfOptions, training: TrainingOptions
                                ) -> tuple[meta_graph_pb2.MetaGraphDef, dict, Report]:
    """The rewrite as protos: (MetaGraphDef, names, report). See `rewrite_training_graph`."""
    if options.outputs:
        raise AmpError("--outputs does not apply with --training: name --loss and --train-op")
    if not options.keep_io_types:
        raise AmpError("--no-keep-io-types does not apply with --training: the loss and "
                       "placeholders keep their dtypes")
    rule = training.loss_scale_rule(options.target)
    meta = as_meta_graph(source)
    # A graph TensorFlow itself refuses (a bad device, a dangling input, a dtype mismatch) is
    # said to be the input's fault, before it is planned and converted.
    imported_graph(meta, "the training graph")
    loss, train_op = training.loss, training.train_op
    train_op_name = node_name(train_op) if train_op is not None else _collection_train_op(meta)
    loss_name = node_name(loss) if loss is not None else None
    names_in_graph = {nd.name for nd in meta.graph_def.node}
    for what, name in (("train op", train_op_name), ("loss", loss_name)):
        if name is not None and name not in names_in_graph:
            raise AmpError(f"{what} {name!r}: no such node in the graph")
    contexts: list[TrainingContext] = []

    update = training.update_options()
    trainable = _trainable_variables(meta)

    def plan_training(model: Model) -> TrainingContext:
        plan = find_training_plan(model, loss_name, train_op_name, trainable)
        if not any(value is plan.loss for value in model.graph.outputs):
            model.graph.add_output(plan.loss)  # a loss found in the graph is fetched too
        problems = plan.problems()
        if problems:
            raise AmpError(f"internal: the training plan is unsound: {problems[0]}")
        contexts.append(TrainingContext(plan, rule, TfTrainingOps(model), update))
        return contexts[-1]

    fetches = list(dict.fromkeys(([loss_name] if loss_name else []) + [train_op_name]
                                 + tf_convert.meta_graph_fetches(meta)))
    converted, report, _ = tf_convert.rewrite_graphdef_ir(
        meta.graph_def, dataclasses.replace(options, outputs=fetches), "tf-training",
        plan_training=plan_training)
    context = contexts[0]
    plan, ops = context.plan, context.ops
    assert isinstance(ops, TfTrainingOps)
    if report.summary["low_precision_nodes"] == 0:
        raise AmpError(f"nothing in the forward or backward pass can run in {options.target}: "
                       f"the graph has no float32 compute ops (MatMul, Conv2D, ...) to convert")
    out = meta_graph_pb2.MetaGraphDef()
    out.CopyFrom(meta)
    out.graph_def.CopyFrom(converted)
    if out.HasField("meta_info_def"):
        out.meta_info_def.stripped_op_list.CopyFrom(
            tf_meta_graph.stripped_op_list_for_graph(converted))
    _add_local_variables(out, ops)
    loss_node = plan.loss.producer.name if plan.loss.producer is not None else plan.loss.name
    if plan.loss_unrelated:
        report.warnings.append(
            f"loss {loss_node!r} is neither the tensor the gradients are taken of "
            f"({', '.join(n.name for n in plan.differentiated)}) nor computed from it")
    names = _names(context, loss_node, _loss_port(training.loss))
    report.training = {**names, **training_summary(context, report)}
    return out, names, report


def _names(context: TrainingContext, loss_node: str, loss_port: int) -> dict[str, str | None]:
    """What a training script fetches: the loss, the train op, the scaler's tensors and
    variables (None where the rule has none)."""
    names: dict[str, str | None] = {"loss": f"{loss_node}:{loss_port}",
                                    "train_op": context.plan.step.name}
    if context.window is not None:
        names["micro_step"] = _tensor_name(context.window.state[0].value)
    if not context.rule.scales:
        return names

    def variable(state) -> str | None:
        return state.handle.handle.name if state is not None else None

    assert context.scale is not None and context.all_finite is not None
    names.update(
        loss_scale=_tensor_name(context.scale),
        loss_scale_variable=variable(context.scale_state),
        good_steps=_tensor_name(context.good_steps.value) if context.good_steps else None,
        good_steps_variable=variable(context.good_steps),
        bad_steps_variable=variable(context.bad_steps),
        all_finite=_tensor_name(context.all_finite))
    return names


def training_summary(context: TrainingContext, report: Report) -> dict[str, Any]:
    """The report's account of the training rewrite: the rule and what each pass touched."""
    plan, scales = context.plan, context.rule.scales
    optimizer_path = {node.name for node in plan.optimizer_path}
    kinds: dict[str, int] = {}
    for write in plan.writes:
        kinds[write.kind] = kinds.get(write.kind, 0) + 1
    return {
        "loss_scale_rule": context.rule.as_dict(),
        "gradient_seeds_scaled": [seed.node.name for seed in plan.seeds] if scales else [],
        "gradients_unscaled": len(context.unscaled),
        "update_ops_gated": [write.node.name for write in plan.writes] if scales else [],
        "variable_writes": dict(sorted(kinds.items())),
        "updates_moved_after_backward_pass": sorted({w.name for w, _ in plan.deferred}),
        "finite_checks": len(context.unscaled) + len(plan.aggregations) if scales else 0,
        "nodes_pinned_fp32": sum(1 for n in report.nodes
                                 if n.get("class") == "fp32" and n["name"] in optimizer_path),
        "update": context.update_options.as_dict(),
        "variables_stored_16bit": {v.name: v.dtype for v in context.stored},
        "unscale": {"where": context.unscale, "reason": context.unscale_reason,
                    "folded": [{"update": write, "input": what, "multiplier": multiplier}
                               for write, what, multiplier in context.folded]},
        "accumulators": [_tensor_name(e.value) for e in context.gradients or []],
    }


def rewrite_training_graph(
        graph_or_graph_def_or_meta_graph: Any, loss: Any = None, train_op: Any = None,
        target: str = "fp16", backend: str | None = None,
        loss_scale: str | float | None = None, **options: Any) -> TrainingRewrite:
    """Rewrite a TF1 training graph to mixed precision with fp32 master weights and loss scaling.

    Args:
        graph_or_graph_def_or_meta_graph: a tf.Graph (its collections come along), a GraphDef,
            a MetaGraphDef or a path to one (.meta, .pb, .pbtxt). It is not modified.
        loss: the loss tensor, op or name (default: the one tensor the gradients are taken of).
        train_op: the train op or its name (default: the `train_op` collection's only entry).
        target: "fp16" or "bf16".
        backend: "tf-gpu" or "tf-cpu" (default: tf-gpu for fp16, tf-cpu for bf16).
        loss_scale: "dynamic" (fp16 default), "none" (bf16 default) or a number (fixed scale).
        **options: the loss scaler's rule (`TrainingOptions`: initial_scale (2**15),
            growth_interval (2000), growth_factor (2), backoff_factor (0.5), min_scale (1),
            hysteresis (1)) and the conversion options of `amp_rewriter.TfOptions` (allow, infer,
            deny, clear, keep_nodes, config, clamp).

    Returns:
        A TrainingRewrite: a new tf.Graph ready for a tf.compat.v1 Session (collections and
        saver of the input restored), the names of the loss, train op, scale and counter, and
        the conversion report (with a `training` section).
    """
    training, rest = TrainingOptions.from_kwargs({**options, "loss": loss, "train_op": train_op,
                                                  "loss_scale": loss_scale})
    meta, names, report = rewrite_training_meta_graph(
        graph_or_graph_def_or_meta_graph,
        format_options(TfOptions, {"target": target, "backend": backend, **rest}),
        training)
    graph = imported_graph(meta, "the rewritten training graph")
    return TrainingRewrite(graph=graph, meta_graph_def=meta, report=report,
                           loss=names["loss"], train_op=names["train_op"],
                           loss_scale=names.get("loss_scale"), good_steps=names.get("good_steps"),
                           loss_scale_variable=names.get("loss_scale_variable"),
                           good_steps_variable=names.get("good_steps_variable"),
                           bad_steps=names.get("bad_steps_variable"),
                           all_finite=names.get("all_finite"),
                           micro_step=names.get("micro_step"))


def convert_training_file(input_path: Path, output_path: Path, options: TfOptions,
                          training: TrainingOptions) -> Report:
    """`convert --training`: a .meta (or a .pb/.pbtxt with --loss and --train-op) in, the
    rewritten graph out in the output's format (.meta keeps collections, signatures, saver)."""
    if output_path.exists() and input_path.exists() and os.path.samefile(input_path, output_path):
        raise AmpError("the output path is the input: refusing to overwrite the input")
    if files.is_saved_model_dir(input_path):
        raise AmpError("--training takes a TF1 training graph (.meta, or .pb/.pbtxt with --loss "
                       "and --train-op), not a SavedModel")
    meta, _names, report = rewrite_training_meta_graph(input_path, options, training)
    if output_path.suffix == ".meta":
        files.write_graphdef(meta, output_path)
    else:
        files.write_graphdef(meta.graph_def, output_path)
    return report
