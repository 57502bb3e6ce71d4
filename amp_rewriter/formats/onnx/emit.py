"""IR -> ONNX: patch the loaded ModelProto in place and write it (model and external data).

Nodes the passes did not touch keep their original NodeProto (attributes, doc strings, metadata);
only renamed inputs/outputs, retargeted casts and converted fill values are patched. Initializers
keep their original TensorProto unless converted. Nodes a pass created (casts, the Clip that
saturates a masked attention sum) get fresh NodeProtos.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper

from ...fileio import default_file_mode
from ...ir import Graph, IRError, LazyTensor, Model, Node, Value, present
from ...ir.dtypes import NUMPY_DTYPES
from .load import PROTOBUF_LIMIT, all_tensors, elem_type_code, walk_graph_protos


def _tensor_proto(name: str, tensor: LazyTensor) -> onnx.TensorProto:
    array = np.asarray(tensor.numpy())
    if array.dtype != NUMPY_DTYPES.get(tensor.dtype, array.dtype):
        array = array.astype(NUMPY_DTYPES[tensor.dtype])
    if tensor.dtype == "bfloat16":
        proto = helper.make_tensor(name, onnx.TensorProto.BFLOAT16, array.shape,
                                   array.view(np.uint16).tobytes(), raw=True)
        return proto
    return numpy_helper.from_array(array, name)


def _data(initializer: Value) -> LazyTensor:
    if initializer.const is None:
        raise IRError(f"initializer {initializer.name!r} has no data")
    return initializer.const


def _new_node(node: Node, opset: int) -> onnx.NodeProto:
    """The NodeProto of a node a pass created: a cast, or the saturation of a masked sum."""
    if node.op_type == "Cast":
        code = elem_type_code(node.attrs["to"])
        to = onnx.TensorProto.DataType.Name(code) if opset < 6 else code  # Cast-1: a type name
        return helper.make_node("Cast", [present(node.inputs[0]).name],
                                [present(node.outputs[0]).name], name=node.name, to=to)
    if node.op_type == "Clip" and opset < 11:
        # Clip before opset 11 takes its bounds as attributes; the pass gives them as constants.
        low, high = (float(np.asarray(_data(present(v)).numpy()).reshape(-1)[0])
                     for v in node.inputs[1:3])
        return helper.make_node("Clip", [present(node.inputs[0]).name],
                                [present(node.outputs[0]).name], name=node.name, min=low,
                                max=high)
    return helper.make_node(node.op_type, [v.name if v is not None else "" for v in node.inputs],
                            [v.name if v is not None else "" for v in node.outputs],
                            name=node.name, domain=node.domain or None)


def _patch_node(node: Node, opset: int) -> onnx.NodeProto:
    proto = node.handle
    if proto is None:  # a node a pass created
        return _new_node(node, opset)
    for slot, value in enumerate(node.inputs):
        name = value.name if value is not None else ""
        if proto.input[slot] != name:
            proto.input[slot] = name
    for slot, value in enumerate(node.outputs):
        name = value.name if value is not None else ""
        if proto.output[slot] != name:
            proto.output[slot] = name
    if node.op_type == "Cast" and node.outputs[0] is not None:
        out = node.outputs[0]
        if out.dtype != out.original_dtype and out.dtype is not None:
            for attr in proto.attribute:
                if attr.name == "to":
                    attr.i = elem_type_code(out.dtype)
    if node.op_type == "ConstantOfShape":
        fill = node.attrs.get("value")
        if fill is not None and fill.handle is None:
            for attr in list(proto.attribute):
                if attr.name == "value":
                    proto.attribute.remove(attr)
            proto.attribute.append(helper.make_attribute("value", _tensor_proto("", fill)))
    return proto


def _set_elem_type(info: onnx.ValueInfoProto, dtype: str | None) -> None:
    if dtype is None or not info.type.HasField("tensor_type"):
        return
    code = elem_type_code(dtype)
    if info.type.tensor_type.elem_type != code:
        info.type.tensor_type.elem_type = code


def _emit_graph(graph: Graph, opset: int) -> None:
    proto: onnx.GraphProto = graph.handle
    nodes = [_patch_node(node, opset) for node in graph.nodes]
    del proto.node[:]
    proto.node.extend(nodes)

    kept: list[onnx.TensorProto] = []
    emitted: set[str] = set()
    for tensor in proto.initializer:
        value = graph.initializers.get(tensor.name)
        if value is None:
            continue
        const = _data(value)
        kept.append(tensor if const.handle is tensor else _tensor_proto(value.name, const))
        emitted.add(tensor.name)
    for name, value in graph.initializers.items():
        if name not in emitted:
            const = _data(value)
            kept.append(const.handle if const.handle is not None else _tensor_proto(name, const))
    del proto.initializer[:]
    proto.initializer.extend(kept)

    declared = {info.name: info for info in proto.input}
    inputs = []
    for value in graph.inputs:
        info = declared.get(value.name)
        if info is None:  # a converted initializer that IR < 4 must list as an input too
            info = helper.make_tensor_value_info(value.name, elem_type_code(_data(value).dtype),
                                                 list(_data(value).shape))
        _set_elem_type(info, value.dtype)
        inputs.append(info)
    if [i.name for i in inputs] != [i.name for i in proto.input]:
        del proto.input[:]
        proto.input.extend(inputs)
    for info, value in zip(proto.output, graph.outputs):
        if info.name != value.name:
            info.name = value.name
        _set_elem_type(info, value.dtype)
    kept_info = []
    for info in proto.value_info:
        value = graph.values.get(info.name)
        if value is None:
            continue
        _set_elem_type(info, value.dtype)
        kept_info.append(info)
    if len(kept_info) != len(proto.value_info):
        del proto.value_info[:]
        proto.value_info.extend(kept_info)


def emit_onnx(model: Model) -> onnx.ModelProto:
    """Write the IR back into its ModelProto (inner graphs first, so copies see final bodies)."""
    opset = next((imp.version for imp in model.handle.opset_import
                  if imp.domain in ("", "ai.onnx")), 0)
    for graph in reversed(list(model.graph.walk_graphs())):
        _emit_graph(graph, opset)
    return model.handle


def has_external_data(model: onnx.ModelProto) -> bool:
    """Whether any tensor of the model (subgraphs included) lives in an external file."""
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in all_tensors(model.graph))


#: Initializers of this size or more go to the external data file: onnx's own default, measured
#: as onnx measures it (`sys.getsizeof` of the raw bytes), so outputs match `onnx.save_model`'s.
EXTERNAL_DATA_THRESHOLD = 1024


def save_onnx(model: onnx.ModelProto, path: str | os.PathLike,
              source_dir: str | os.PathLike | None = None, external: bool | None = None) -> None:
    """Write `model` to `path`, and with external data its tensors to `<name>.data` beside it.

    Tensors stored externally in the input (relative to `source_dir`) are read first; then every
    initializer of 1 KiB or more goes to the data file (none when every tensor is smaller: the model
    is then self-contained). `path` is written in place: callers write into the private folder
    of an `OutputTransaction`, which moves the model and its data file into place together.
    """
    path = Path(path)
    if external is None:
        external = has_external_data(model) or model.ByteSize() > PROTOBUF_LIMIT
    if external:
        if source_dir is not None:
            external_data_helper.load_external_data_for_model(model, str(source_dir))
        data_name = path.name + ".data"
        data_path = path.parent / data_name
        data_path.unlink(missing_ok=True)  # the helpers append; start from an empty file
        initializers = (t for g in walk_graph_protos(model.graph) for t in g.initializer)
        for tensor in initializers:
            if (tensor.HasField("raw_data")
                    and sys.getsizeof(tensor.raw_data) >= EXTERNAL_DATA_THRESHOLD):
                external_data_helper.set_external_data(tensor, data_name)
        external_data_helper.write_external_data_tensors(model, str(path.parent))
        if data_path.exists():
            os.chmod(data_path, default_file_mode())  # onnx creates it 0600
    data = model.SerializeToString(deterministic=True)
    with open(path, "wb") as handle:
        handle.write(data)
    os.chmod(path, default_file_mode())
