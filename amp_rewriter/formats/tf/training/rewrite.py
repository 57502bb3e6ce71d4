"""TF1 training graphs: mixed-precision forward and backward passes, fp32 master weights, and a
dynamic loss-scaling subgraph inside the graph.

    result = rewrite_training_graph(graph, loss="loss", train_op="train", target="fp16")
    with tf.compat.v1.Session(graph=result.graph) as session: ...

What the rewrite does, in order:

1. Finds the parts of the graph: the train op's ancestors, the variable writes among them (the
   update ops), the gradient seeds tf.gradients made (`Fill(shape, 1)` under a `gradients/`
   scope), the gradient tensors that leave those scopes (the *frontier*), and the optimizer path
   between them and the updates (aggregation over towers, clipping, learning rates, slots).
2. Builds the loss-scaling subgraph (`amp_loss_scale/`): a scale variable and a good-step
   counter (local variables, read through an "initialized yet?" switch so any initializer
   works), the seeds multiplied by the scale, every frontier gradient multiplied by 1/scale in
   fp32, one all-finite flag over the unscaled gradients and every aggregation of them, each
   update op's inputs passed through Switch(flag) so that a bad step writes nothing, and the
   scale/counter update attached to the train op.
3. Converts the forward and backward passes with the inference op lists and passes; everything
   else (optimizer path, initializers, saver, the loss-scaling subgraph) is pinned to fp32 with
   its reason, so weights, slots, optimizer constants and the update stay fp32."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from ....errors import AmpError
from ....options import Options, TrainingOptions, split_kwargs
from ....passes import Pin
from ....report import Report
from .. import convert as tf_convert
from .. import files
from .._tensorflow import imported_graph
from .loss_scale import LossScaleConfig, Rewires, build_loss_scaling
from .plan import TrainingPlan, node_name, plan_training_graph


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


def _pins(plan: TrainingPlan, original: set[str], graph_def: graph_pb2.GraphDef
          ) -> dict[str, str]:
    pins = {}
    for nd in graph_def.node:
        name = nd.name
        if name == plan.loss or name in plan.losses_differentiated:
            pins[name] = "the loss stays fp32"
        elif name not in original:
            pins[name] = "loss-scaling subgraph: fp32 by design"
        elif name in plan.gradient_aggregations:
            pins[name] = ("adds up the gradients of a variable used more than once: gradients "
                          "return to fp32 before aggregation")
        elif name in plan.optimizer_path:
            pins[name] = ("optimizer and update path: fp32 master weights, optimizer slots and "
                          "constants, gradients after they leave the backward pass")
        elif name not in plan.converted_region:
            pins[name] = ("outside the forward and backward passes (initializers, saver, "
                          "summaries): left in fp32")
    return pins


def _loss_port(loss) -> int:
    """The output index the caller named ("loss:1" -> 1; a node name or None -> 0)."""
    name = getattr(loss, "name", loss)
    if isinstance(name, str) and ":" in name:
        port = name.rpartition(":")[2]
        return int(port) if port.isdigit() else 0
    return 0


def rewrite_training_meta_graph(source: Any, options: Options, training: TrainingOptions
                                ) -> tuple[meta_graph_pb2.MetaGraphDef, dict, Report]:
    """The rewrite as protos: (MetaGraphDef, names, report). See `rewrite_training_graph`."""
    if options.outputs:
        raise AmpError("--outputs does not apply with --training: name --loss and --train-op")
    if not options.keep_io_types:
        raise AmpError("--no-keep-io-types does not apply with --training: the loss and "
                       "placeholders keep their dtypes")
    scaler = LossScaleConfig.parse(training.loss_scale, options.target,
                                   initial=training.initial_scale,
                                   growth_interval=training.growth_interval,
                                   growth_factor=training.growth_factor,
                                   backoff_factor=training.backoff_factor,
                                   min_scale=training.min_scale, hysteresis=training.hysteresis)
    meta = as_meta_graph(source)
    loss, train_op = training.loss, training.train_op
    train_op_name = node_name(train_op) if train_op is not None else _collection_train_op(meta)
    plan = plan_training_graph(meta.graph_def, node_name(loss) if loss is not None else None,
                               train_op_name)
    original = {nd.name for nd in meta.graph_def.node}

    graph = imported_graph(meta, "the training graph")
    rewires = Rewires()
    for writer, waiting in plan.deferred.items():
        for name in waiting:
            rewires.drop_control(name, writer)
        rewires.add_control(plan.train_op, writer)
    scaler_names = None
    if scaler.mode != "none":
        scaler_names = build_loss_scaling(graph, plan, scaler, rewires)
        for group in plan.initializer_groups:
            for initializer in scaler_names.initializers:
                rewires.add_control(group, initializer)
    with graph.as_default():
        exported = tf.compat.v1.train.export_meta_graph(
            graph=graph, saver_def=meta.saver_def if meta.HasField("saver_def") else None)
    for key, signature in meta.signature_def.items():
        exported.signature_def[key].CopyFrom(signature)
    rewires.apply(exported.graph_def)

    fetches = [plan.loss, plan.train_op] + tf_convert.meta_graph_fetches(exported)
    if scaler_names is not None:
        fetches += [scaler_names.scale_value, scaler_names.all_finite]
        fetches += [scaler_names.good_steps_value] if scaler_names.good_steps_value else []
    fetches = list(dict.fromkeys(fetches))
    converted, report = tf_convert.convert_graph_def(
        exported.graph_def, dataclasses.replace(options, outputs=fetches),
        pipeline="tf-training",
        pins={name: Pin(reason) for name, reason in _pins(plan, original,
                                                          exported.graph_def).items()})
    if report.summary["low_precision_nodes"] == 0:
        raise AmpError(f"nothing in the forward or backward pass can run in {options.target}: "
                       f"the graph has no float32 compute ops (MatMul, Conv2D, ...) to convert")
    exported.graph_def.CopyFrom(converted)
    if plan.loss_unrelated:
        report.warnings.append(f"loss {plan.loss!r} is neither the tensor the gradients are taken "
                               f"of ({', '.join(plan.losses_differentiated)}) nor computed from it")

    loss_port = _loss_port(training.loss)
    names: dict[str, str | None] = {"loss": f"{plan.loss}:{loss_port}",
                                    "train_op": plan.train_op}
    if scaler_names is not None:
        names.update(loss_scale=scaler_names.scale_value,
                     loss_scale_variable=scaler_names.scale_variable,
                     good_steps=scaler_names.good_steps_value,
                     good_steps_variable=scaler_names.good_steps_variable,
                     bad_steps_variable=scaler_names.bad_steps_variable,
                     all_finite=scaler_names.all_finite)
    report.training = {
        **names,
        "loss_scale_rule": asdict(scaler),
        "gradient_seeds_scaled": plan.seeds if scaler_names else [],
        "gradients_unscaled": sum(1 for _ in plan.frontier) if scaler_names else 0,
        "update_ops_gated": plan.update_ops if scaler_names else [],
        "updates_moved_after_backward_pass": sorted(plan.deferred),
        "finite_checks": (len(plan.frontier) + len(plan.aggregations)) if scaler_names else 0,
        "nodes_pinned_fp32": sum(1 for n in report.nodes
                                 if n.get("class") == "fp32" and n["name"] in plan.optimizer_path),
    }
    return exported, names, report


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
            hysteresis (1)) and the conversion options of `amp_rewriter.Options` (allow, infer,
            deny, clear, keep_nodes, config, clamp).

    Returns:
        A TrainingRewrite: a new tf.Graph ready for a tf.compat.v1 Session (collections and
        saver of the input restored), the names of the loss, train op, scale and counter, and
        the conversion report (with a `training` section).
    """
    training, rest = split_kwargs(TrainingOptions, {**options, "loss": loss,
                                                    "train_op": train_op,
                                                    "loss_scale": loss_scale})
    meta, names, report = rewrite_training_meta_graph(
        graph_or_graph_def_or_meta_graph, Options(target=target, backend=backend, **rest),
        training)
    graph = imported_graph(meta, "the rewritten training graph")
    return TrainingRewrite(graph=graph, meta_graph_def=meta, report=report,
                           loss=names["loss"], train_op=names["train_op"],
                           loss_scale=names.get("loss_scale"), good_steps=names.get("good_steps"),
                           loss_scale_variable=names.get("loss_scale_variable"),
                           good_steps_variable=names.get("good_steps_variable"),
                           bad_steps=names.get("bad_steps_variable"),
                           all_finite=names.get("all_finite"))


def convert_training_file(input_path: Path, output_path: Path, options: Options,
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
