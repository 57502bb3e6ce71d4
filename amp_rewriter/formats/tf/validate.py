"""Run an fp32 TensorFlow graph or SavedModel and its converted version on the CPU on the same
inputs (seeded random feeds unless given) and compare the outputs."""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from ...errors import AmpError
from ...validation import OutputComparison, check_random_shape, compare_outputs

SYMBOLIC_DIM_SIZE = 2


def _random_array(rng: np.random.Generator, dtype: tf.DType, dims: list[int | None], name: str
                  ) -> np.ndarray:
    shape = [SYMBOLIC_DIM_SIZE if d is None or d < 0 else d for d in dims]
    check_random_shape(name, shape)
    if dtype.is_floating:
        return rng.standard_normal(shape).astype(np.float32).astype(dtype.as_numpy_dtype)
    if dtype.is_integer:
        return rng.integers(0, 4, size=shape).astype(dtype.as_numpy_dtype)
    if dtype.is_bool:
        return rng.integers(0, 2, size=shape).astype(bool)
    raise AmpError(f"cannot make random data of dtype {dtype.name} for {name!r}: give --inputs")


def graphdef_feeds(graph_def: graph_pb2.GraphDef, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random data for every Placeholder (unknown dims get size 2)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for nd in graph_def.node:
        if nd.op not in ("Placeholder", "PlaceholderV2"):
            continue
        shape = nd.attr["shape"].shape
        if shape.unknown_rank:
            raise AmpError(f"placeholder {nd.name!r} has an unknown rank: give --inputs")
        feeds[nd.name] = _random_array(rng, tf.as_dtype(nd.attr["dtype"].type),
                                       [d.size for d in shape.dim], nd.name)
    return feeds


def run_graphdef(graph_def: graph_pb2.GraphDef, fetches: list[str],
                 feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run a GraphDef in a tf.compat.v1 Session on the CPU (variables are initialized by running
    their initializers, `<variable>/Assign`, first; a Saver's restore assigns are left alone)."""
    graph = tf.Graph()
    try:
        with graph.as_default():
            tf.compat.v1.import_graph_def(graph_def, name="")
    except Exception as exc:  # TF raises ValueError / InvalidArgumentError
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AmpError(f"TensorFlow cannot import a graph to run it: {detail}") from None
    names = [f if ":" in f else f"{f}:0" for f in fetches]
    feed = {f"{k}:0" if ":" not in k else k: v for k, v in feeds.items()}
    assigns = [nd.name for nd in graph_def.node
               if nd.op in ("Assign", "AssignVariableOp") and nd.name.endswith("/Assign")]
    config = tf.compat.v1.ConfigProto(device_count={"GPU": 0})
    try:
        with tf.compat.v1.Session(graph=graph, config=config) as session:
            if assigns:
                session.run(assigns)
            return session.run(names, feed_dict=feed)
    except Exception as exc:
        # TF's first line is often just "Graph execution error:"; the cause follows it.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = " ".join(lines[:2]) if lines else type(exc).__name__
        raise AmpError(f"TensorFlow failed to run a graph: {detail}") from None


def compare_graphdefs(reference: graph_pb2.GraphDef, candidate: graph_pb2.GraphDef,
                      fetches: list[str], feeds: dict[str, np.ndarray] | None = None
                      ) -> list[OutputComparison]:
    """Run both GraphDefs on the same feeds; per-output errors of `candidate`."""
    feeds = graphdef_feeds(reference) if feeds is None else feeds
    ref = run_graphdef(reference, fetches, feeds)
    new = run_graphdef(candidate, fetches, feeds)
    return [compare_outputs(name, r, n)
            for name, r, n in zip(fetches, ref, new)]


def signature_feeds(function, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random data for a concrete function's keyword inputs (unknown dims get size 2)."""
    rng = np.random.default_rng(seed)
    specs = function.structured_input_signature[1]
    return {name: _random_array(rng, spec.dtype, spec.shape.as_list()
                                if spec.shape.rank is not None else [], name)
            for name, spec in sorted(specs.items())}


def compare_saved_models(reference: str | os.PathLike, candidate: str | os.PathLike,
                         feeds: dict[str, np.ndarray] | None = None, seed: int = 0
                         ) -> list[OutputComparison]:
    """Serve every signature of both SavedModels on the same inputs; per-output errors.

    An output whose dtype differs from the reference's counts as failed (infinite error). String
    outputs are not compared: no precision decision touches them, and asset paths differ between
    the two directories by design.
    """
    ref_model = tf.saved_model.load(str(reference))
    new_model = tf.saved_model.load(str(candidate))
    results = []
    for name, ref_fn in sorted(ref_model.signatures.items()):
        new_fn = new_model.signatures[name]
        inputs = feeds if feeds is not None else signature_feeds(ref_fn, seed)
        ref_out = ref_fn(**{k: tf.constant(v) for k, v in inputs.items()})
        new_out = new_fn(**{k: tf.constant(v) for k, v in inputs.items()})
        for key in sorted(ref_out):
            label = f"{name}/{key}"
            if ref_out[key].dtype == tf.string and new_out[key].dtype == tf.string:
                continue
            if new_out[key].dtype != ref_out[key].dtype:
                results.append(OutputComparison(label, float("inf"), float("inf"), False))
                continue
            results.append(compare_outputs(label, ref_out[key].numpy(), new_out[key].numpy()))
    return results
