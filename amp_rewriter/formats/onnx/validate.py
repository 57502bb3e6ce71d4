"""Run an fp32 ONNX model and its converted version in onnxruntime on the same inputs.

On the CPU provider, the low-precision ops it has no kernel for (fused contrib ops in fp16,
nearly everything in bf16) are emulated (`emulate_low_precision`), and each output says how it
was computed; an `Execution` that does not emulate (the backend profile's providers, or
`--device cuda`) runs the converted model on its providers as it is instead.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx

from ... import progress
from ...errors import AmpError, ConvertedModelFailed, first_line
from ...fileio import scratch_dir
from ...validation import OutputComparison, check_random_shape, compare_outputs
from . import ort_registry
from .emulation import Emulation, emulate_low_precision
from .execution import CPU_PROVIDER, DEVICE_PROVIDERS, Execution, ProviderMissing
from .load import (
    PROTOBUF_LIMIT,
    read_model_file,
    walk_graph_protos,
)

_NUMPY_OF_ELEM = {
    onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.DOUBLE: np.float64, onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32, onnx.TensorProto.INT8: np.int8,
    onnx.TensorProto.UINT8: np.uint8, onnx.TensorProto.BOOL: np.bool_,
}
#: Symbolic dims are resolved to this size (small, so validation is quick).
SYMBOLIC_DIM_SIZE = 2
SEQUENCE_DIM_SIZE = 8


def _embedding_rows(model: onnx.ModelProto) -> dict[str, int]:
    """For integer inputs that index an embedding table (Gather on an initializer, or
    onnxruntime's fused EmbedLayerNormalization, through a Cast): its rows."""
    inits = {t.name: t for t in model.graph.initializer}
    cast_source = {node.output[0]: node.input[0] for node in model.graph.node
                   if node.op_type == "Cast" and node.input and node.output}
    rows: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) > 1:
            ids, table_name = node.input[1], node.input[0]
        elif node.op_type == "EmbedLayerNormalization" and len(node.input) > 2:
            ids, table_name = node.input[0], node.input[2]
        else:
            continue
        table = inits.get(table_name)
        if table is not None and table.dims:
            name = cast_source.get(ids, ids)
            rows[name] = min(rows.get(name, table.dims[0]), table.dims[0])
    return rows


def validation_shape(info: onnx.ValueInfoProto) -> list[int]:
    """The shape validation feeds a graph input: its fixed dims, and small sizes for symbolic
    ones (the batch, then sequence-like dims)."""
    shape = []
    for position, dim in enumerate(info.type.tensor_type.shape.dim):
        if dim.HasField("dim_value") and dim.dim_value > 0:
            shape.append(dim.dim_value)
        else:
            shape.append(SYMBOLIC_DIM_SIZE if position == 0 else SEQUENCE_DIM_SIZE)
    return shape


def random_inputs(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs of the right dtype and shape; symbolic dims get small sizes."""
    rng = np.random.default_rng(seed)
    initializer_names = {t.name for t in model.graph.initializer}
    rows = _embedding_rows(model)
    feeds: dict[str, np.ndarray] = {}
    for info in model.graph.input:
        if info.name in initializer_names:
            continue
        tt = info.type.tensor_type
        dtype = _NUMPY_OF_ELEM.get(tt.elem_type)
        if dtype is None:
            raise AmpError(f"input {info.name!r}: cannot make random data of elem_type "
                           f"{tt.elem_type}; pass --inputs")
        shape = validation_shape(info)
        check_random_shape(info.name, shape)
        lower = info.name.lower()
        if dtype == np.bool_:
            data = rng.random(shape) > 0.5
        elif np.issubdtype(dtype, np.integer):
            if "mask" in lower:
                data = np.ones(shape, dtype)
                if data.ndim >= 2 and data.shape[-1] > 1:
                    data[..., -1, data.shape[-1] // 2:] = 0  # some padding in the last row
            else:
                high = rows.get(info.name, 2)
                data = rng.integers(0, high, size=shape).astype(dtype)
        else:
            data = rng.standard_normal(shape).astype(dtype)
        feeds[info.name] = np.asarray(data, dtype=dtype)
    return feeds


def _session(model: onnx.ModelProto | str | bytes, label: str,
             execution: Execution | None = None):
    """An onnxruntime session on `execution`'s providers (None: the CPU provider)."""
    options = ort_registry.session_options()
    ort = ort_registry.required()
    providers = execution.providers if execution is not None else (CPU_PROVIDER,)
    chosen_by = execution.chosen_by if execution is not None else "--device cpu"
    provider = providers[0]
    if provider not in ort.get_available_providers():
        hint = (" (install onnxruntime-gpu instead of onnxruntime: pip install "
                "'amp-rewriter[gpu]')" if provider == DEVICE_PROVIDERS["cuda"] else "")
        raise ProviderMissing(f"{chosen_by}: this onnxruntime has no {provider}{hint}")
    try:
        with _model_source(model) as source:
            session = ort.InferenceSession(
                source, options, providers=list(providers),
                provider_options=list(execution.provider_options)
                if execution is not None and execution.provider_options else None)
    except Exception as exc:
        message = first_line(exc)
        raise AmpError(f"onnxruntime cannot load the {label} model: {message}") from None
    if provider not in session.get_providers():
        raise ProviderMissing(f"{chosen_by}: onnxruntime could not start its {provider} (no "
                              f"GPU visible, or its CUDA libraries are missing)")
    return session


@contextlib.contextmanager
def _model_source(model: onnx.ModelProto | str | bytes) -> Iterator[str | bytes]:
    """What an InferenceSession opens: a path or bytes as they are, a model as bytes, or (past
    protobuf's 2 GB) as a temporary file with external data."""
    if isinstance(model, (str, bytes)):
        yield model
        return
    try:
        data = model.SerializeToString() if model.ByteSize() <= PROTOBUF_LIMIT else None
    except Exception:  # protobuf refuses to size or write messages past its limit
        data = None
    if data is not None:
        yield data
        return
    with scratch_dir("validate") as tmp:
        path = Path(tmp) / "model.onnx"
        onnx.save_model(model, str(path), save_as_external_data=True,
                        all_tensors_to_one_file=True, location="model.onnx.data")
        yield str(path)


#: onnxruntime's input type strings -> numpy dtypes (what --inputs arrays must be).
_NUMPY_OF_ORT_TYPE = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16,
    "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32, "tensor(uint64)": np.uint64, "tensor(bool)": np.bool_,
}


def _check_given_inputs(session, feeds: dict[str, np.ndarray]) -> None:
    """--inputs data that cannot be what the model takes: one line naming the key or input."""
    inputs = {i.name: i for i in session.get_inputs()}
    unknown = sorted(set(feeds) - set(inputs))
    if unknown:
        raise AmpError(f"--inputs: {', '.join(repr(k) for k in unknown)} "
                       f"{'matches' if len(unknown) == 1 else 'match'} no input of the model "
                       f"(its inputs: {', '.join(inputs) or 'none'})")
    missing = [name for name in inputs if name not in feeds]
    if missing:
        raise AmpError(f"--inputs has no array for input(s) {', '.join(map(repr, missing))} "
                       f"(it holds: {', '.join(sorted(feeds)) or 'nothing'})")
    for name, info in inputs.items():
        wanted = _NUMPY_OF_ORT_TYPE.get(info.type)
        if wanted is not None and feeds[name].dtype != wanted:
            raise AmpError(f"--inputs: {name!r} is {feeds[name].dtype}, the model takes "
                           f"{np.dtype(wanted).name} ({info.type})")


def compare_models(reference: onnx.ModelProto | str | bytes,
                   candidate: onnx.ModelProto | str | bytes, feeds: dict[str, np.ndarray],
                   execution: Execution | None = None,
                   computed: dict[str, tuple[str, list[str]]] | None = None,
                   inputs_given: bool = False) -> list[OutputComparison]:
    """Run both models on `feeds`; per-output max-abs and relative (max-abs / max|ref|) errors.

    The fp32 reference always runs on the CPU; the candidate on `execution`'s providers (None:
    the CPU provider, the candidate as given). `computed` says, per
    output, how the candidate computed it (kept in each comparison). `inputs_given`: the feeds
    are the user's (--inputs), checked against the model's inputs (every key an input, every
    input a key, each of its dtype), and errors do not suggest --inputs. A failure of the
    converted model raises `ConvertedModelFailed`.
    """
    with progress.bar("validating", 4, "step") as drawn:
        steps = progress.Steps(drawn)
        steps.start("loading the fp32 model")
        ref_session = _session(reference, "fp32")
        if inputs_given:
            _check_given_inputs(ref_session, feeds)
        names = [o.name for o in ref_session.get_outputs()]
        wanted = {i.name for i in ref_session.get_inputs()}
        steps.start("running the fp32 model")
        ref_outputs = _run(ref_session, names, {k: v for k, v in feeds.items() if k in wanted},
                           "the fp32 model", inputs_given, AmpError)
        del ref_session
        steps.start("loading the converted model")
        comparisons = _compare_with(candidate, names, ref_outputs, feeds, execution,
                                    inputs_given, steps)
        steps.finish()
    for c in comparisons:
        c.computed, c.emulated_ops = (computed or {}).get(c.name, ("", []))
    return comparisons


def _compare_with(candidate: onnx.ModelProto | str | bytes, names: list[str],
                  ref_outputs: list, feeds: dict[str, np.ndarray],
                  execution: Execution | None, inputs_given: bool, steps: progress.Steps
                  ) -> list[OutputComparison]:
    """Run the converted model and compare its outputs with the fp32 model's."""
    try:
        new_session = _session(candidate, "converted", execution)
    except ProviderMissing:
        raise  # the provider is missing, not the model at fault
    except AmpError as exc:
        raise ConvertedModelFailed(str(exc)) from None
    candidate_names = {o.name for o in new_session.get_outputs()}
    missing = [n for n in names if n not in candidate_names]
    if missing:
        raise ConvertedModelFailed(f"the models have different outputs: {', '.join(missing)} "
                                   f"missing from the converted model")
    new_feeds = {}
    for info in new_session.get_inputs():
        if info.name not in feeds:
            raise ConvertedModelFailed(f"the converted model has an input the fp32 model does "
                                       f"not: {info.name!r}")
        value = feeds[info.name]
        if info.type == "tensor(float16)" and value.dtype == np.float32:
            value = value.astype(np.float16)
        new_feeds[info.name] = value
    steps.start("running the converted model")
    new_outputs = _run(new_session, names, new_feeds, "the converted model", inputs_given,
                       ConvertedModelFailed)
    return [compare_outputs(name, ref, new)
            for name, ref, new in zip(names, ref_outputs, new_outputs)]


def _run(session, names: list[str], feeds: dict[str, np.ndarray], label: str,
         inputs_given: bool, error: type[AmpError]) -> list:
    try:
        return session.run(names, feeds)
    except Exception as exc:
        message = first_line(exc)
        source = "the --inputs data" if inputs_given else "seeded random inputs"
        hint = "" if inputs_given else " (give real inputs with --inputs x.npz)"
        raise error(f"onnxruntime failed to run {label} on {source}: {message}{hint}") from None


def _emulation_note(emulation: Emulation) -> str:
    ops = Counter(entry.rsplit(" (", 1)[1].rstrip(")") for entry in emulation.emulated)
    listed = ", ".join(f"{op} x{count}" for op, count in sorted(ops.items()))
    return (f"{len(emulation.emulated)} node(s) have no low-precision kernel on onnxruntime's "
            f"CPU provider and ran emulated (fp32 compute, each low-precision output rounded "
            f"where it is produced): {listed}")


@contextlib.contextmanager
def runnable_on_cpu(path: Path, scratch: Path | None = None,
                    model: onnx.ModelProto | None = None
                    ) -> Iterator[tuple[str | bytes, list[str], dict[str, tuple[str, list[str]]]]]:
    """What onnxruntime's CPU provider can run for the converted model at `path`: (the model, as
    a path or bytes; notes; output name -> how it was computed).

    Ops without a low-precision CPU kernel run emulated (`emulate_low_precision`, its external
    data read from the model's folder); the emulated model goes to onnxruntime as bytes, or,
    when over protobuf's 2 GiB, as a file with external data in a temporary folder inside
    `scratch` (the system's temporary folder when None), removed afterwards. `model`: the model
    at `path` already parsed (it is modified when emulated).
    """
    model = read_model_file(path) if model is None else model
    emulation = emulate_low_precision(model, path.resolve().parent, copy=False)
    if not emulation.emulated:
        outputs = emulation.outputs
        del model, emulation
        yield str(path), [], outputs
        return
    notes, outputs, emulated = [_emulation_note(emulation)], emulation.outputs, emulation.model
    del model, emulation
    if emulated.ByteSize() <= PROTOBUF_LIMIT:
        yield emulated.SerializeToString(), notes, outputs
        return
    with scratch_dir("emulated", scratch) as folder:
        target = Path(folder) / "emulated.onnx"
        onnx.save_model(emulated, str(target), save_as_external_data=True,
                        all_tensors_to_one_file=True, location="emulated.onnx.data")
        del emulated
        yield str(target), notes, outputs


def validate_conversion(reference: str | os.PathLike, converted: str | os.PathLike,
                        feeds: dict[str, np.ndarray], execution: Execution | None = None,
                        scratch: Path | None = None, inputs_given: bool = False,
                        model: onnx.ModelProto | None = None
                        ) -> tuple[list[OutputComparison], list[str]]:
    """Compare a converted model file with its fp32 reference; (comparisons, notes).

    With an emulating `execution` (or None) the converted model runs on the CPU and the ops
    without a low-precision CPU kernel run emulated (`runnable_on_cpu`, a model over 2 GiB
    staged in `scratch`; `model`: the file already parsed, rewritten in place) and every
    comparison says how its output was computed; else it runs on the execution's providers as
    it is.
    """
    converted_path = Path(converted)
    if execution is not None and not execution.emulate:
        computed: dict[str, tuple[str, list[str]]] = {
            o.name: (execution.providers[0], [])
            for o in (model or read_model_file(converted_path)).graph.output}
        return compare_models(os.fspath(reference), str(converted_path), feeds, execution,
                              computed, inputs_given), []
    with runnable_on_cpu(converted_path, scratch, model) as (candidate, notes, computed):
        return compare_models(os.fspath(reference), candidate, feeds, None, computed,
                              inputs_given), notes


def has_bfloat16(model: onnx.ModelProto) -> bool:
    """Whether any graph of the model (bodies included) has a bf16 initializer, cast or IO."""
    bf16 = onnx.TensorProto.BFLOAT16
    for graph in walk_graph_protos(model.graph):
        if any(t.data_type == bf16 for t in graph.initializer):
            return True
        if any(i.type.tensor_type.elem_type == bf16
               for i in list(graph.input) + list(graph.output)):
            return True
        if any(node.op_type == "Cast" and attr.name == "to" and attr.i == bf16
               for node in graph.node for attr in node.attribute):
            return True
    return False
