"""Run an fp32 ONNX model and its converted version in onnxruntime (CPU) on the same inputs."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx

from ...errors import AmpError
from ...validation import OutputComparison, compare_outputs
from .load import (
    PROTOBUF_LIMIT,
    load_external_data,
    load_onnx,
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
    """For integer inputs that index an embedding table (Gather on an initializer): its rows."""
    inits = {t.name: t for t in model.graph.initializer}
    rows: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[0] in inits:
            table = inits[node.input[0]]
            if table.dims:
                name = node.input[1]
                rows[name] = min(rows.get(name, table.dims[0]), table.dims[0])
    return rows


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
        shape = []
        for index, dim in enumerate(tt.shape.dim):
            if dim.HasField("dim_value") and dim.dim_value > 0:
                shape.append(dim.dim_value)
            else:
                shape.append(SYMBOLIC_DIM_SIZE if index == 0 else SEQUENCE_DIM_SIZE)
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


def _session(model: onnx.ModelProto | str | bytes, label: str):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
        return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AmpError(f"onnxruntime cannot load the {label} model: {message}") from None


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


class ConvertedModelFailed(AmpError):
    """The converted model (not the fp32 one, not the inputs) cannot be loaded or run."""


def compare_models(reference: onnx.ModelProto | str | bytes,
                   candidate: onnx.ModelProto | str | bytes, feeds: dict[str, np.ndarray],
                   inputs_given: bool = False) -> list[OutputComparison]:
    """Run both models on `feeds`; per-output max-abs and relative (max-abs / max|ref|) errors.

    `inputs_given`: the feeds are the user's (--inputs), checked against the model's inputs
    (every key an input, every input a key, each of its dtype), and errors do not suggest
    --inputs. A failure of the converted model raises `ConvertedModelFailed`.
    """
    ref_session = _session(reference, "fp32")
    if inputs_given:
        _check_given_inputs(ref_session, feeds)
    names = [o.name for o in ref_session.get_outputs()]
    wanted = {i.name for i in ref_session.get_inputs()}
    ref_outputs = _run(ref_session, names, {k: v for k, v in feeds.items() if k in wanted},
                       "the fp32 model", inputs_given, AmpError)
    try:
        new_session = _session(candidate, "converted")
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
    new_outputs = _run(new_session, names, new_feeds, "the converted model", inputs_given,
                       ConvertedModelFailed)
    return [compare_outputs(name, ref, new)
            for name, ref, new in zip(names, ref_outputs, new_outputs)]


def _run(session, names: list[str], feeds: dict[str, np.ndarray], label: str,
         inputs_given: bool, error: type[AmpError]) -> list:
    try:
        return session.run(names, feeds)
    except Exception as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        source = "the --inputs data" if inputs_given else "seeded random inputs"
        hint = "" if inputs_given else " (give real inputs with --inputs x.npz)"
        raise error(f"onnxruntime failed to run {label} on {source}: {message}{hint}") from None


EMULATION_NOTE = ("onnxruntime's CPU provider lacks bf16 kernels; running the bf16 model "
                  "emulated (fp32 compute, every bf16 tensor rounded to bf16)")


@contextlib.contextmanager
def runnable_on_cpu(path: Path, scratch: Path | None = None,
                    model: onnx.ModelProto | None = None
                    ) -> Iterator[tuple[str | bytes, list[str]]]:
    """What onnxruntime's CPU provider can run for the converted model at `path`, and notes.

    Without bf16 that is the path itself. A bf16 model is emulated (`emulate_bfloat16`), its
    external data read from the model's folder; the emulated model goes to onnxruntime as bytes,
    or, when over protobuf's 2 GiB, as a file with external data in a temporary folder inside
    `scratch` (the system's temporary folder when None), removed afterwards. `model`: the
    model at `path` already parsed (it is modified when emulated).
    """
    model = read_model_file(path) if model is None else model
    if not has_bfloat16(model):
        del model
        yield str(path), []
        return
    load_external_data(model, path.resolve().parent)
    _emulate_in_place(model)
    if model.ByteSize() <= PROTOBUF_LIMIT:
        yield model.SerializeToString(), [EMULATION_NOTE]
        return
    with tempfile.TemporaryDirectory(dir=scratch, prefix=".amp-rewriter-bf16-") as folder:
        emulated = Path(folder) / "emulated.onnx"
        onnx.save_model(model, str(emulated), save_as_external_data=True,
                        all_tensors_to_one_file=True, location="emulated.onnx.data")
        del model
        yield str(emulated), [EMULATION_NOTE]


def emulate_bfloat16(model: onnx.ModelProto) -> onnx.ModelProto:
    """An fp32 model that rounds every bf16 tensor of `model` to bf16 where it is produced.

    onnxruntime's CPU provider has almost no bf16 kernels, so a bf16 model cannot run there. This
    copy computes each op in fp32 and rounds its bf16 outputs (Cast to bf16 and back), which is
    what a bf16 kernel with fp32 accumulation does; validation runs it in place of the bf16 model.
    `model` must hold its tensors' data (`runnable_on_cpu` loads external data first).
    """
    emulated = onnx.ModelProto()
    emulated.CopyFrom(model)
    _emulate_in_place(emulated)
    return emulated


def _emulate_in_place(emulated: onnx.ModelProto) -> None:
    """`emulate_bfloat16` on the model itself (no copy: the caller owns it)."""
    ir_model = load_onnx(emulated)
    bf16, f32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    # Inner graphs first: re-adding an outer node copies its body, so bodies must be final by then.
    for graph in reversed(list(ir_model.graph.walk_graphs())):
        proto = graph.handle
        nodes = []
        for node in graph.nodes:
            nodes.append(node.handle)
            for slot, value in enumerate(node.outputs):
                if value is None or value.dtype != "bfloat16":
                    continue
                raw = f"{value.name}__bf16_emulation"
                node.handle.output[slot] = raw
                if node.op_type == "Cast":
                    nodes.append(onnx.helper.make_node("Cast", [raw], [value.name], to=f32))
                else:
                    rounded = f"{raw}_rounded"
                    nodes.append(onnx.helper.make_node("Cast", [raw], [rounded], to=bf16))
                    nodes.append(onnx.helper.make_node("Cast", [rounded], [value.name], to=f32))
        del proto.node[:]
        proto.node.extend(nodes)
        for index, tensor in enumerate(proto.initializer):
            if tensor.data_type == bf16:
                array = onnx.numpy_helper.to_array(tensor).astype(np.float32)
                proto.initializer[index].CopyFrom(onnx.numpy_helper.from_array(array, tensor.name))
        for info in list(proto.input) + list(proto.output):
            if info.type.tensor_type.elem_type == bf16:
                info.type.tensor_type.elem_type = f32
        del proto.value_info[:]


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
