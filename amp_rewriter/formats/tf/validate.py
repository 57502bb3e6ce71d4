"""Run an fp32 TensorFlow graph or SavedModel and its converted version on the CPU on the same
inputs (seeded random feeds unless given) and compare the outputs."""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from ...errors import AmpError, ConvertedModelFailed
from ...validation import OutputComparison, check_random_shape, compare_outputs
from ._tensorflow import imported_graph

SYMBOLIC_DIM_SIZE = 2


class ConvertedGraphFailed(ConvertedModelFailed):
    """The converted graph or SavedModel (not the fp32 one, not the inputs) cannot load or run."""


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


def _check_graph_feeds(graph_def: graph_pb2.GraphDef, feeds: dict[str, np.ndarray]) -> None:
    """--inputs data a graph cannot take: one line naming the key or placeholder."""
    placeholders = {nd.name: nd for nd in graph_def.node
                    if nd.op in ("Placeholder", "PlaceholderV2", "PlaceholderWithDefault")}
    unknown = sorted(k for k in feeds if k.split(":")[0] not in placeholders)
    if unknown:
        raise AmpError(f"--inputs: {', '.join(map(repr, unknown))} "
                       f"{'matches' if len(unknown) == 1 else 'match'} no placeholder of the "
                       f"graph (its placeholders: {', '.join(placeholders) or 'none'})")
    given = {k.split(":")[0] for k in feeds}
    missing = [name for name, nd in placeholders.items()
               if name not in given and nd.op != "PlaceholderWithDefault"]
    if missing:
        raise AmpError(f"--inputs has no array for placeholder(s) "
                       f"{', '.join(map(repr, missing))} (it holds: "
                       f"{', '.join(sorted(feeds)) or 'nothing'})")
    for key, array in feeds.items():
        wanted = tf.as_dtype(placeholders[key.split(":")[0]].attr["dtype"].type)
        if np.asarray(array).dtype != wanted.as_numpy_dtype:
            raise AmpError(f"--inputs: {key!r} is {np.asarray(array).dtype}, the placeholder "
                           f"takes {wanted.name}")


def run_graphdef(graph_def: graph_pb2.GraphDef, fetches: list[str],
                 feeds: dict[str, np.ndarray], error: type[AmpError] = AmpError
                 ) -> list[np.ndarray]:
    """Run a GraphDef in a tf.compat.v1 Session on the CPU (variables are initialized by running
    their initializers, `<variable>/Assign`, first; a Saver's restore assigns are left alone).
    Failures raise `error`."""
    graph = imported_graph(graph_def, "the graph", error)
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
        raise error(f"TensorFlow failed to run a graph: {detail}") from None


def compare_graphdefs(reference: graph_pb2.GraphDef, candidate: graph_pb2.GraphDef,
                      fetches: list[str], feeds: dict[str, np.ndarray] | None = None
                      ) -> list[OutputComparison]:
    """Run both GraphDefs on the same feeds (the user's, checked against the placeholders, or
    seeded random ones); per-output errors of `candidate`. A failure of the candidate raises
    `ConvertedGraphFailed`."""
    if feeds is None:
        feeds = graphdef_feeds(reference)
    else:
        _check_graph_feeds(reference, feeds)
    ref = run_graphdef(reference, fetches, feeds)
    new = run_graphdef(candidate, fetches, feeds, ConvertedGraphFailed)
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
    ref_model = _load_saved_model(reference, AmpError)
    new_model = _load_saved_model(candidate, ConvertedGraphFailed)
    if feeds is not None:
        _check_signature_feeds(ref_model.signatures, feeds)
    results = []
    for name, ref_fn in sorted(ref_model.signatures.items()):
        new_fn = new_model.signatures.get(name)
        if new_fn is None:
            raise ConvertedGraphFailed(f"the converted SavedModel has no signature {name!r}")
        inputs = feeds if feeds is not None else signature_feeds(ref_fn, seed)
        inputs = {k: v for k, v in inputs.items()
                  if k in ref_fn.structured_input_signature[1]}
        ref_out = _call(ref_fn, inputs, AmpError)
        new_out = _call(new_fn, inputs, ConvertedGraphFailed)
        for key in sorted(ref_out):
            label = f"{name}/{key}"
            if ref_out[key].dtype == tf.string and new_out[key].dtype == tf.string:
                continue
            if new_out[key].dtype != ref_out[key].dtype:
                results.append(OutputComparison(label, float("inf"), float("inf"), False))
                continue
            results.append(compare_outputs(label, ref_out[key].numpy(), new_out[key].numpy()))
    return results


def _load_saved_model(path: str | os.PathLike, error: type[AmpError]):
    try:
        return tf.saved_model.load(str(path))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise error(f"{path}: the SavedModel does not load: {first}") from None


def _call(function, inputs: dict[str, np.ndarray], error: type[AmpError]) -> dict:
    try:
        return function(**{k: tf.constant(v) for k, v in inputs.items()})
    except Exception as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = " ".join(lines[:2]) if lines else type(exc).__name__
        raise error(f"TensorFlow failed to run a signature: {detail}") from None


def _check_signature_feeds(signatures, feeds: dict[str, np.ndarray]) -> None:
    """--inputs data the signatures cannot take: one line naming the key or input."""
    specs = {name: fn.structured_input_signature[1] for name, fn in signatures.items()}
    known = {key for spec in specs.values() for key in spec}
    unknown = sorted(set(feeds) - known)
    if unknown:
        raise AmpError(f"--inputs: {', '.join(map(repr, unknown))} "
                       f"{'matches' if len(unknown) == 1 else 'match'} no input of the "
                       f"SavedModel's signatures (their inputs: {', '.join(sorted(known))})")
    for signature, spec in sorted(specs.items()):
        missing = sorted(set(spec) - set(feeds))
        if missing:
            raise AmpError(f"--inputs has no array for {', '.join(map(repr, missing))} of "
                           f"signature {signature!r} (it holds: {', '.join(sorted(feeds))})")
        for key, tensor_spec in spec.items():
            dtype = np.asarray(feeds[key]).dtype
            if dtype != tensor_spec.dtype.as_numpy_dtype:
                raise AmpError(f"--inputs: {key!r} is {dtype}, signature {signature!r} takes "
                               f"{tensor_spec.dtype.name}")
