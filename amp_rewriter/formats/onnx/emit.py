"""IR -> ONNX: patch the loaded ModelProto in place and write it (model and external data).

Nodes the passes did not touch keep their original NodeProto (attributes, doc strings, metadata);
only renamed inputs/outputs, retargeted casts and converted fill values are patched. Initializers
keep their original TensorProto unless converted. Nodes a pass created (casts, the Clip that
saturates a masked attention sum) get fresh NodeProtos.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...errors import AmpError
from ...fileio import Companions, default_file_mode, open_input, pread_exact
from ...ir import (
    Graph,
    IRError,
    IRInvariantError,
    LazyTensor,
    Model,
    Node,
    Value,
    lint_enabled,
    present,
    tensors,
)
from ...ir.dtypes import FINITE_MAX, NUMPY_DTYPES
from ...options import EXTERNAL_LAYOUTS
from . import ort_registry
from .encoding import (
    GRAPH_NODE,
    MODEL_GRAPH,
    EncodedModel,
    EncodedNodes,
    append_field,
    field_key,
    varint,
)
from .load import (
    PROTOBUF_LIMIT,
    all_tensors,
    attribute_tensors,
    elem_type_code,
    external_range,
    inline_external_data,
    walk_graph_protos,
)

#: The location a deferred tensor's proto carries until `save_onnx` writes its data: no input
#: location can be one (the loader refuses NUL in a location), and the token after it finds
#: the tensor in `deferred`.
_DEFERRED = "\0amp-rewriter-deferred:"


def _tensor_proto(name: str, tensor: LazyTensor,
                  deferred: dict[str, LazyTensor] | None = None) -> onnx.TensorProto:
    """The TensorProto of a constant. With `deferred`, a streaming tensor (a file's weight,
    converted as it is read) gets a proto without data, marked for `save_onnx` to fill."""
    proto = onnx.TensorProto()
    _write_tensor(proto, name, tensor, deferred)
    return proto


#: numpy dtypes whose values a TensorProto holds as their bytes in raw_data (little-endian),
#: by the element type they are stored as.
_RAW_ELEMENTS = {np.dtype(np.float32): onnx.TensorProto.FLOAT,
                 np.dtype(np.float16): onnx.TensorProto.FLOAT16}


def _write_tensor(target: onnx.TensorProto, name: str, tensor: LazyTensor,
                  deferred: dict[str, LazyTensor] | None = None) -> None:
    """Make `target` the TensorProto of a constant (see `_tensor_proto`), in place: written
    into the proto that holds it, a few hundred thousand small converted weights are not each
    built as a message first and then copied in."""
    if deferred is not None and tensor.streams:
        token = str(len(deferred))
        deferred[token] = tensor
        target.CopyFrom(_header(name, tensor))
        target.data_location = onnx.TensorProto.EXTERNAL
        entry = target.external_data.add()
        entry.key, entry.value = "location", _DEFERRED + token
        return
    array = np.asarray(tensor.numpy())
    if array.dtype != NUMPY_DTYPES.get(tensor.dtype, array.dtype):
        array = array.astype(NUMPY_DTYPES[tensor.dtype])
    if tensor.dtype == "bfloat16":
        target.CopyFrom(helper.make_tensor(name, onnx.TensorProto.BFLOAT16, array.shape,
                                           array.view(np.uint16).tobytes(), raw=True))
        return
    element = _RAW_ELEMENTS.get(array.dtype)
    if element is None or sys.byteorder != "little":
        target.CopyFrom(numpy_helper.from_array(array, name))
        return
    # What numpy_helper.from_array writes for these, without its general dispatch.
    target.Clear()
    target.dims.extend(array.shape)
    target.data_type = element
    if name:  # as from_array: an empty name is left unset, not set empty
        target.name = name
    target.raw_data = array.tobytes()


def _header(name: str, tensor: LazyTensor) -> onnx.TensorProto:
    """A tensor's proto without its data: the fields `_tensor_proto` sets but `raw_data`."""
    return onnx.TensorProto(name=name, data_type=elem_type_code(tensor.dtype),
                            dims=list(tensor.shape))


def _emit_tensor(target: onnx.TensorProto, name: str, tensor: LazyTensor,
                 deferred: dict[str, LazyTensor] | None) -> None:
    """Write a pass's constant into `target`; the IR then lets go of its values (the proto
    holds them, or the writer streams them), so the model's weights are not held twice."""
    _write_tensor(target, name, tensor, deferred)
    tensor.release()


def _data(initializer: Value) -> LazyTensor:
    if initializer.const is None:
        raise IRError(f"initializer {initializer.name!r} has no data")
    return initializer.const


def _new_node(node: Node, opset: int) -> onnx.NodeProto:
    """The NodeProto of a node a pass created: a cast, the saturation of a masked sum, the
    rescaled mean square of an RMS norm."""
    if node.op_type == "Cast":
        return helper.make_node("Cast", [present(node.inputs[0]).name],
                                [present(node.outputs[0]).name], name=node.name,
                                to=_cast_to(node.attrs["to"], opset))
    if node.op_type == "Clip" and opset < 11:
        # Clip before opset 11 takes its bounds as attributes; the pass gives them as constants.
        low, high = (float(np.asarray(_data(present(v)).numpy()).reshape(-1)[0])
                     for v in node.inputs[1:3])
        return helper.make_node("Clip", [present(node.inputs[0]).name],
                                [present(node.outputs[0]).name], name=node.name, min=low,
                                max=high)
    # A pass's other nodes carry plain attributes only (a reduction's axes and keepdims).
    attrs: dict[str, Any] = {k: list(v) if isinstance(v, tuple) else v
                             for k, v in node.attrs.items() if isinstance(v, (int, float, tuple))}
    return helper.make_node(node.op_type, [v.name if v is not None else "" for v in node.inputs],
                            [v.name if v is not None else "" for v in node.outputs],
                            name=node.name, domain=node.domain or None, **attrs)


def _cast_to(dtype: str, opset: int) -> int | str:
    """A Cast's `to` attribute for `dtype`: a type code, or before opset 6 a type name."""
    code = elem_type_code(dtype)
    return onnx.TensorProto.DataType.Name(code) if opset < 6 else code


def _patch_node(node: Node, opset: int, borrowed: bool = False, verify_edges: bool = False
                ) -> onnx.NodeProto:
    """The node's proto with what the passes changed written in: its own proto patched in
    place, or with `borrowed` (the proto is the caller's) a patched copy; a node a pass made
    gets a new one."""
    proto = node.handle
    if proto is None:  # a node a pass created
        return _new_node(node, opset)
    changes = _node_changes(node, proto, opset, verify_edges)
    if not changes:
        return proto
    if borrowed:
        copy = onnx.NodeProto()
        copy.CopyFrom(proto)
        proto = copy
    for field, slot, value in changes:
        if field == "input":
            proto.input[slot] = value
        elif field == "output":
            proto.output[slot] = value
        else:  # an attribute: its new value, in its place (appended if it had none)
            attr = next((a for a in proto.attribute if a.name == field), None)
            if attr is None:
                proto.attribute.append(value)
            else:
                attr.CopyFrom(value)
    return proto


def _node_changes(node: Node, proto: onnx.NodeProto, opset: int, verify_edges: bool = False
                  ) -> list[tuple[str, int, Any]]:
    """What differs between a loaded node and its proto: ("input" or "output", slot, name)
    and (attribute name, 0, new AttributeProto). `verify_edges`: compare the names of every
    node, not only of those whose `edges_changed` is set, and raise IRInvariantError where the
    flag missed a change."""
    changes: list[tuple[str, int, Any]] = []
    # Reading a proto's names costs about a microsecond a node: only the nodes whose edges
    # changed are compared.
    if node.edges_changed or verify_edges:
        for field, values, names in (("input", node.inputs, proto.input),
                                     ("output", node.outputs, proto.output)):
            for slot, value in enumerate(values):
                name = value.name if value is not None else ""
                if names[slot] != name:
                    if not node.edges_changed:
                        raise IRInvariantError(
                            f"node {node.name!r}: {field} {slot} became {name!r} without "
                            f"edges_changed set (an edit that bypassed the IR's mutators)")
                    changes.append((field, slot, name))
    if node.op_type == "Cast" and node.outputs[0] is not None:
        out = node.outputs[0]
        if out.dtype != out.original_dtype and out.dtype is not None:
            if any(attr.name == "to" for attr in proto.attribute):
                changes.append(("to", 0, helper.make_attribute("to", _cast_to(out.dtype, opset))))
    if node.op_type == "ConstantOfShape":
        fill = node.attrs.get("value")
        if fill is not None and fill.handle is None:
            changes.append(("value", 0, helper.make_attribute("value", _tensor_proto("", fill))))
    return changes


def _set_elem_type(info: onnx.ValueInfoProto, dtype: str | None) -> None:
    if dtype is None or not info.type.HasField("tensor_type"):
        return
    code = elem_type_code(dtype)
    if info.type.tensor_type.elem_type != code:
        info.type.tensor_type.elem_type = code


def _emit_graph(graph: Graph, opset: int, deferred: dict[str, LazyTensor] | None,
                target: onnx.GraphProto | None = None, release: bool = False) -> None:
    """Write `graph` back into its proto, or with `target` into that one (the graph's own proto
    is the caller's and is only read: see `Model.borrowed`). `release`: the IR is released
    next, so its tensors' protos may be rewritten."""
    _emit_tables(graph, deferred, target, release)
    _write_nodes(graph, target if target is not None else graph.handle, opset,
                 borrowed=target is not None)


def _node_proto(node: Node, opset: int, borrowed: bool, verify_edges: bool) -> onnx.NodeProto:
    """`_patch_node` for a node of a graph whose protos are the caller's when `borrowed`: a
    node that holds a body is the loader's copy even there."""
    return _patch_node(node, opset, borrowed and not node.subgraphs, verify_edges)


def _write_nodes(graph: Graph, proto: onnx.GraphProto, opset: int, borrowed: bool) -> None:
    verify_edges = lint_enabled()
    patched = [_node_proto(node, opset, borrowed, verify_edges) for node in graph.nodes]
    del proto.node[:]
    proto.node.extend(patched)


def _emit_tables(graph: Graph, deferred: dict[str, LazyTensor] | None,
                 target: onnx.GraphProto | None, release: bool) -> None:
    """All of `graph` but its nodes (see `_emit_graph`)."""
    source: onnx.GraphProto = graph.handle
    proto = target if target is not None else source
    _emit_signature(graph, proto)
    _emit_initializers(graph, source, proto, deferred, overwrite=release)


def _encode_nodes(graph: Graph, opset: int, encoded_nodes: bytearray, borrowed: bool,
                  release: bool) -> EncodedNodes:
    """Append `graph`'s nodes to `encoded_nodes` as GraphProto fields (and say where each is,
    with its names); with `release`, each is let go as soon as it is written, so that the
    encoding grows into the memory they leave."""
    index_of_nodes = EncodedNodes()
    nodes = graph.take_nodes() if release else graph.nodes
    verify_edges = lint_enabled()
    for index, node in enumerate(nodes):
        append_field(encoded_nodes, GRAPH_NODE,
                     _node_proto(node, opset, borrowed, verify_edges).SerializeToString())
        index_of_nodes.add(len(encoded_nodes), node.op_type,
                           tuple([v.name if v is not None else "" for v in node.inputs]),
                           tuple([v.name if v is not None else "" for v in node.outputs]))
        if release:
            nodes[index] = None  # type: ignore[call-overload]
            node.release()
    # Packed now, while the IR lives: the last block's records refer to the IR's name strings,
    # scattered through its memory, and would keep most of that memory from going back to the
    # system when the IR is freed.
    index_of_nodes.pack()
    return index_of_nodes


def _emit_signature(graph: Graph, proto: onnx.GraphProto) -> None:
    """The graph's inputs, outputs and value_info with the dtypes the passes gave them."""
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
        described = graph.values.get(info.name)
        if described is None:
            continue
        _set_elem_type(info, described.dtype)
        kept_info.append(info)
    if len(kept_info) != len(proto.value_info):
        del proto.value_info[:]
        proto.value_info.extend(kept_info)


def _emit_initializers(graph: Graph, source: onnx.GraphProto, proto: onnx.GraphProto,
                       deferred: dict[str, LazyTensor] | None, overwrite: bool) -> None:
    """The graph's initializers into `proto`: those of `source` that are left, in their order
    (converted ones in their place), then the ones the passes added. Each converted one is
    written in as it is made where it can be, rather than all made first and copied in (a
    million-node graph has 100k or more small constants, each its own message until copied).
    `overwrite`: `proto` may be rewritten in place, the IR read by nothing afterwards."""
    emitted: set[str] = set()
    if source is not proto:  # a new proto: the source is the caller's
        _copy_remaining_initializers(graph, source, proto, deferred, emitted)
    elif overwrite and all(tensor.name in graph.initializers
                           and tensor.data_location != onnx.TensorProto.EXTERNAL
                           for tensor in proto.initializer):
        for tensor in proto.initializer:
            const = _data(graph.initializers[tensor.name])
            if const.handle is not tensor:
                _emit_tensor(tensor, tensor.name, const, deferred)
            emitted.add(tensor.name)
    else:  # the originals must stay readable (the IR is kept, a converted weight streams
        # from the original's file), or some are dropped
        kept = []
        for tensor, value in _remaining_initializers(graph, source, emitted):
            const = _data(value)
            if const.handle is tensor:
                kept.append(tensor)
            else:
                kept.append(_tensor_proto(value.name, const, deferred))
                const.release()
        del proto.initializer[:]
        proto.initializer.extend(kept)
    for name, value in graph.initializers.items():
        if name not in emitted:
            const = _data(value)
            if const.handle is not None:
                proto.initializer.add().CopyFrom(const.handle)
            else:
                _emit_tensor(proto.initializer.add(), name, const, deferred)


def _copy_remaining_initializers(graph: Graph, source: onnx.GraphProto,
                                 target: onnx.GraphProto, deferred: dict[str, LazyTensor] | None,
                                 emitted: set[str]) -> None:
    """Append to `target` what `_remaining_initializers` finds: each original proto copied,
    each converted one written in as it is made."""
    for tensor, value in _remaining_initializers(graph, source, emitted):
        const = _data(value)
        if const.handle is tensor:
            target.initializer.add().CopyFrom(tensor)
        else:
            _emit_tensor(target.initializer.add(), value.name, const, deferred)


def _remaining_initializers(graph: Graph, source: onnx.GraphProto, emitted: set[str]
                            ) -> Iterator[tuple[onnx.TensorProto, Value]]:
    """The initializers of `source` the graph still has, in order, with the graph's value
    (its original proto, or converted); their names go into `emitted`."""
    for tensor in source.initializer:
        value = graph.initializers.get(tensor.name)
        if value is not None:
            emitted.add(tensor.name)
            yield tensor, value


class EmittedModel:
    """An emitted model in two parts: the ModelProto without its main graph's nodes, and those
    nodes encoded. Re-adding a million nodes to the loaded proto would copy each into it
    (protobuf keeps the replaced ones until the whole message goes) while the IR is still
    alive; encoded, they take a quarter of that, and `assemble` parses the whole model once,
    when the caller has let the IR go. (`split` False: `head` is the whole model.)"""

    def __init__(self, head: onnx.ModelProto, encoded_nodes: bytearray, split: bool = True,
                 nodes: EncodedNodes | None = None):
        self.head = head
        self.encoded_nodes = encoded_nodes
        self.split = split
        #: Where the main graph's nodes are in the assembled model's encoding, once `assemble`
        #: parsed it from one (None otherwise).
        self.nodes = nodes

    def size_bound(self) -> int:
        """At most the size of the assembled model's encoding (the graph's length prefix
        grows by up to 5 bytes)."""
        return _size_bound(self.head, self.encoded_nodes)

    def assemble(self) -> onnx.ModelProto:
        """The whole ModelProto. The parts go into it: this object is empty afterwards."""
        encoded = self.encode()
        if encoded is not None:
            return encoded.parse()
        head = self.head
        self.head, self.encoded_nodes = onnx.ModelProto(), bytearray()
        return head

    def encode(self) -> EncodedModel | None:
        """The whole model's encoding (the parts go into it: this object is empty afterwards),
        or None where `assemble` builds the model otherwise (not split, or beyond what one
        message may be parsed from)."""
        head, nodes = self.head, self.encoded_nodes
        if not self.split:
            return None
        if _size_bound(head, nodes) > PROTOBUF_LIMIT:
            # beyond what one message may be parsed from: the nodes go into the head
            head.graph.MergeFromString(nodes)
            self.encoded_nodes = bytearray()
            self.nodes = None
            return None
        self.head, self.encoded_nodes = onnx.ModelProto(), bytearray()
        graph = head.graph.SerializeToString()
        head.ClearField("graph")
        encoded = bytearray(head.SerializeToString())
        del head  # the last reference: the loaded model's memory goes before the parse
        head_length = len(encoded)
        encoded += field_key(MODEL_GRAPH)
        encoded += varint(len(nodes) + len(graph))
        if self.nodes is not None:
            self.nodes.place(encoded, len(encoded))
        encoded += nodes
        del nodes
        encoded += graph
        return EncodedModel(encoded, head_length, len(graph), self.nodes)


def _size_bound(head: onnx.ModelProto, encoded_nodes: bytearray) -> int:
    return head.ByteSize() + len(encoded_nodes) + 5


def emit_onnx_parts(model: Model, deferred: dict[str, LazyTensor] | None = None, *,
                    split: bool = True, release: bool = False) -> EmittedModel:
    """Write the IR back into its ModelProto (inner graphs first, so copies see final bodies);
    the main graph's nodes are encoded beside it (`EmittedModel`), or with `split` False
    written into it as well (the IR's node handles then stay valid, and are the model's).
    `release` (with `split`): nothing reads the IR afterwards but `Model.release`; its nodes
    are let go as they are encoded, and its tensors' protos may be rewritten.

    With `deferred` (a dict to fill), initializers that stream from the input's external data
    (weights converted as they are read) are left without data for `save_onnx` to write a
    chunk at a time; without it, every initializer holds its data.
    """
    return Emission(model, deferred, split=split, release=release).finish()


class Emission:
    """`emit_onnx_parts` in two steps: made, it has written all but the main graph's nodes
    (and with `release` the IR's name tables are let go: no value is looked up by name
    afterwards), so that what still reads the nodes can run before `finish` writes them."""

    def __init__(self, model: Model, deferred: dict[str, LazyTensor] | None = None, *,
                 split: bool = True, release: bool = False):
        self.model = model
        self.split = split
        self.release = release and split
        self.opset = next((imp.version for imp in model.handle.opset_import
                           if imp.domain in ("", "ai.onnx")), 0)
        self.head = _without_main_nodes(model.handle) if model.borrowed else model.handle
        self.target = self.head.graph if model.borrowed else None
        for graph in reversed(list(model.graph.walk_graphs())[1:]):
            _emit_graph(graph, self.opset, deferred, release=self.release)
        main = model.graph
        proto = self.target if self.target is not None else main.handle
        _emit_signature(main, proto)  # the last lookup of a value by name
        if self.release:
            # Before the initializers are written: their converted data takes the tables'
            # memory (at a million nodes ~150 MB) rather than adding to it.
            model.forget_names()
        _emit_initializers(main, main.handle, proto, deferred, overwrite=self.release)

    def finish(self) -> EmittedModel:
        """Write the main graph's nodes; the model in its parts."""
        graph, borrowed = self.model.graph, self.model.borrowed
        proto = self.target if self.target is not None else graph.handle
        encoded_nodes = bytearray()
        if not self.split:
            _write_nodes(graph, proto, self.opset, borrowed)
            return EmittedModel(self.head, encoded_nodes, self.split)
        nodes = _encode_nodes(graph, self.opset, encoded_nodes, borrowed, self.release)
        del proto.node[:]
        return EmittedModel(self.head, encoded_nodes, self.split, nodes)


def _without_main_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` without its main graph's nodes and initializers (what emitting a
    borrowed model writes anew), made field by field so that those are never copied."""
    head = onnx.ModelProto()
    _copy_fields(model, head, skip=("graph",))
    _copy_fields(model.graph, head.graph, skip=("node", "initializer"))
    return head


def _copy_fields(source: Any, target: Any, skip: tuple[str, ...]) -> None:
    for descriptor, value in source.ListFields():
        if descriptor.name in skip:
            continue
        if hasattr(value, "ListFields"):  # a message
            getattr(target, descriptor.name).CopyFrom(value)
        elif isinstance(value, (str, bytes, int, float)):
            setattr(target, descriptor.name, value)
        else:  # a repeated field
            getattr(target, descriptor.name).extend(value)


def emit_onnx(model: Model, deferred: dict[str, LazyTensor] | None = None) -> onnx.ModelProto:
    """Write the IR back into its ModelProto (patched in place and returned)."""
    return emit_onnx_parts(model, deferred, split=False).assemble()


def has_external_data(model: onnx.ModelProto) -> bool:
    """Whether any tensor of the model (subgraphs included) lives in an external file."""
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in all_tensors(model.graph))


#: Initializers of this size or more go to the external data file: onnx's own default, measured
#: as onnx measures it (`sys.getsizeof` of the raw bytes), so outputs match `onnx.save_model`'s.
EXTERNAL_DATA_THRESHOLD = 1024


def deferred_bytes(deferred: dict[str, LazyTensor] | None) -> int:
    """Bytes the deferred tensors will write."""
    return sum(tensor.nbytes for tensor in (deferred or {}).values())


def data_file_name(model_name: str, layout: str, index: int = 0) -> str:
    """The name of an output's data file beside the model `model_name`: `<name>.data` for the
    `single` layout, `<name>.<index>.data` for the `index`-th tensor with `per-tensor`."""
    return f"{model_name}.data" if layout == "single" else f"{model_name}.{index}.data"


def data_files(model_name: str, layout: str | None) -> Companions | None:
    """The data files `save_onnx` may write beside the model `model_name` with `layout` (None,
    the default, may write `single`'s), named for the output transaction, which checks them
    before anything is written; None for `inline`."""
    if layout == "inline":
        return None
    index = r"\.\d+" if layout == "per-tensor" else ""
    return Companions(re.compile(re.escape(model_name) + index + r"\.data"), "external data")


def save_onnx(model: onnx.ModelProto, path: str | os.PathLike,
              source_dir: str | os.PathLike | None = None, external: bool | None = None, *,
              layout: str | None = None, threshold: int = EXTERNAL_DATA_THRESHOLD,
              deferred: dict[str, LazyTensor] | None = None,
              progress: Callable[[int], None] | None = None,
              has_external: bool | None = None) -> None:
    """Write `model` to `path`, and with external data its tensors beside it.

    `layout` (`EXTERNAL_LAYOUTS`; by default `single` when `external` is true: the model has
    external data or is over 2 GiB, else `inline`): with `single` every initializer of
    `threshold` bytes or more (as onnx counts them) goes to `<name>.data`, with `per-tensor` each
    to its own `<name>.<n>.data`; the others (and tensors in attributes) stay in the model. Data
    the input keeps in external files (relative to `source_dir`) is copied a byte range at a
    time, and the `deferred` tensors (`emit_onnx`) are converted and written a chunk at a time,
    so no more than a chunk of the weights is ever in memory. `inline` puts everything in the
    model, which protobuf limits to 2 GiB. `progress` is told the bytes of each data write.
    `has_external`: whether some tensor of `model` refers to external data (or is deferred),
    when the caller knows (else it is found out: a walk over every node's attributes).

    `path` is written in place: callers write into the private folder of an
    `OutputTransaction`, which moves the model and its data files into place together.
    """
    path = Path(path)
    base = Path(source_dir) if source_dir is not None else None
    deferred = deferred or {}
    if has_external is None:
        has_external = bool(deferred) or has_external_data(model)
    if layout is None:
        if external is None:
            external = (has_external
                        or model.ByteSize() + deferred_bytes(deferred) > PROTOBUF_LIMIT)
        layout = "single" if external else "inline"
    if layout not in EXTERNAL_LAYOUTS:
        raise AmpError(f"unknown external-data layout {layout!r} (expected "
                       f"{', '.join(EXTERNAL_LAYOUTS)})")
    try:
        if has_external:
            for tensor in _attribute_tensors(model):  # onnx keeps these in the model
                if tensor.data_location == onnx.TensorProto.EXTERNAL:
                    _load_inline(tensor, base, deferred)
        if layout == "inline":
            if has_external:
                for tensor in _initializers(model.graph):
                    if tensor.data_location == onnx.TensorProto.EXTERNAL:
                        _load_inline(tensor, base, deferred)
            size = model.ByteSize()
            if size > PROTOBUF_LIMIT:
                raise AmpError(f"--external-data inline: the model would be {size} bytes, over "
                               f"protobuf's 2 GiB limit; use single or per-tensor")
        else:
            with _DataFiles(path, layout, progress) as files:
                for tensor in _initializers(model.graph):
                    _place(tensor, files, base, threshold, deferred)
        data = model.SerializeToString(deterministic=True)
        with open(path, "wb") as handle:
            handle.write(data)
    except OSError as exc:
        raise AmpError(f"cannot write the output {path.name} ({exc.strerror or exc})") from None
    os.chmod(path, default_file_mode())


def _initializers(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every initializer, in the order onnx's external-data helpers write them: a graph's own,
    then its nodes' subgraphs' depth first."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _initializers(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from _initializers(sub)


def _attribute_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """The tensors in node attributes (Constant values, ...), local functions' included."""
    bodies = [g for g in walk_graph_protos(model.graph)]
    for nodes in [g.node for g in bodies] + [f.node for f in model.functions]:
        for node in nodes:
            for attr in node.attribute:
                yield from attribute_tensors(attr)


def _deferred_tensor(tensor: onnx.TensorProto, deferred: dict[str, LazyTensor]
                     ) -> LazyTensor | None:
    location = next((e.value for e in tensor.external_data if e.key == "location"), "")
    if not location.startswith(_DEFERRED):
        return None
    return deferred[location[len(_DEFERRED):]]


def _load_inline(tensor: onnx.TensorProto, base: Path | None,
                 deferred: dict[str, LazyTensor]) -> None:
    """Put an external (or deferred) tensor's data into the proto, as onnx's loader does."""
    lazy = _deferred_tensor(tensor, deferred)
    if lazy is not None:
        tensor.CopyFrom(_tensor_proto(tensor.name, lazy))
        return
    if base is None:
        raise AmpError(f"tensor {tensor.name!r} has external data, but the model was not given "
                       f"as a file path")
    inline_external_data(tensor, base)


def _goes_external(nbytes: int, threshold: int) -> bool:
    """Whether a tensor of `nbytes` bytes goes to the data file (onnx counts `sys.getsizeof`
    of the bytes object: the bytes and Python's object header)."""
    return sys.getsizeof(b"") + nbytes >= threshold


def _place(tensor: onnx.TensorProto, files: _DataFiles, base: Path | None, threshold: int,
           deferred: dict[str, LazyTensor]) -> None:
    """Write one initializer's data to its data file (or keep it in the model when small)."""
    lazy = _deferred_tensor(tensor, deferred)
    if lazy is not None:
        if not _goes_external(lazy.nbytes, threshold):
            tensor.CopyFrom(_tensor_proto(tensor.name, lazy))
            return
        tensor.CopyFrom(_header(tensor.name, lazy))
        location, offset = files.open_for(tensor)
        files.reserve(lazy.nbytes)
        if lazy.conversion is not None:
            _write_behind(files, _converted_chunks(lazy))
        else:  # a stored tensor's chunks may share one buffer: each is written before the next
            for chunk in lazy.chunks():
                files.write(np.ascontiguousarray(chunk).view(np.uint8).data)
        _set_location(tensor, location, offset, files.end() - offset)
    elif tensor.data_location == onnx.TensorProto.EXTERNAL:
        assert base is not None  # the loader refused external data without a folder
        source, source_offset, length = external_range(tensor, base)
        if not _goes_external(length, threshold):
            _load_inline(tensor, base, deferred)
            return
        location, offset = files.open_for(tensor)
        files.reserve(length)
        files.copy_range(source, source_offset, length)
        _set_location(tensor, location, offset, length)
    elif tensor.HasField("raw_data") and _goes_external(len(tensor.raw_data), threshold):
        location, offset = files.open_for(tensor)
        files.write(memoryview(tensor.raw_data))
        length = len(tensor.raw_data)
        tensor.ClearField("raw_data")
        _set_location(tensor, location, offset, length)


def _write_behind(files: _DataFiles, chunks: Iterator[np.ndarray]) -> None:
    """Write each chunk (a fresh array: a conversion's result) on a writer thread while the
    next one is read and converted, which overlaps the disk with the CPU; at most two chunks
    are in memory."""
    with ThreadPoolExecutor(max_workers=1) as writer:
        pending: Future[None] | None = None
        for chunk in chunks:
            data = np.ascontiguousarray(chunk).view(np.uint8).data
            if pending is not None:
                pending.result()
            pending = writer.submit(files.write, data)
        if pending is not None:
            pending.result()


def _converted_chunks(lazy: LazyTensor) -> Iterator[np.ndarray]:
    """A deferred tensor's values a chunk at a time; an fp16 conversion goes through
    onnxruntime's Cast (a vectorized cast, many times numpy's scalar one), with the same bits as
    numpy's (`_fp16_chunk`)."""
    cast = _ort_fp16_cast() if lazy.conversion is not None and lazy.dtype == "float16" else None
    if cast is None or lazy.conversion is None:
        yield from lazy.chunks()
        return
    source, clamp = lazy.conversion
    for chunk in source.chunks():
        yield _fp16_chunk(np.asarray(chunk, np.float32), clamp, cast)


def _fp16_chunk(chunk: np.ndarray, clamp: bool,
                cast: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """`convert_array(chunk, "float16", clamp)` through `cast`. Finite values and infinities
    round the same in both (IEEE round to nearest even); NaNs, whose payload bits a hardware
    cast may change, are converted by numpy."""
    if clamp:
        limit = FINITE_MAX["float16"]
        chunk = np.where(np.isfinite(chunk), np.clip(chunk, -limit, limit), chunk)
    result = cast(chunk)
    nans = np.isnan(chunk)
    if nans.any():
        result[nans] = chunk[nans].astype(np.float16)
    return result


@cache
def _ort_fp16_cast() -> Callable[[np.ndarray], np.ndarray] | None:
    """onnxruntime's Cast to float16 on one thread, as a function of a flat float32 array;
    None without onnxruntime."""
    ort = ort_registry.onnxruntime()
    if ort is None:
        return None
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["y"], to=onnx.TensorProto.FLOAT16)], "cast",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT16, ["n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 7
    options = ort_registry.session_options()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])

    def cast(values: np.ndarray) -> np.ndarray:
        return session.run(None, {"x": values.reshape(-1)})[0]
    return cast


def _set_location(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """The entries onnx's `set_external_data` writes, in its order."""
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


class _DataFiles:
    """The data file(s) beside an output model, written sequentially (no alignment padding,
    as onnx's helpers write them)."""

    def __init__(self, model_path: Path, layout: str,
                 progress: Callable[[int], None] | None):
        self.folder = os.fspath(model_path.parent)
        self.name = model_path.name
        self.mode = default_file_mode()
        self.layout = layout
        self.progress = progress
        self.count = 0
        self.fd: int | None = None
        self.location = ""
        self.offset = 0

    def __enter__(self) -> _DataFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def open_for(self, tensor: onnx.TensorProto) -> tuple[str, int]:
        """(location, offset) where `tensor`'s data starts."""
        if self.fd is None or self.layout == "per-tensor":
            self._close()
            self.location = data_file_name(self.name, self.layout, self.count)
            self.fd = os.open(os.path.join(self.folder, self.location),
                              os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, self.mode)
            self.offset = 0
        self.count += 1
        return self.location, self.offset

    def end(self) -> int:
        """The offset the next write goes to."""
        return self.offset

    def reserve(self, length: int) -> None:
        """Allocate the next `length` bytes on disk before writing them: on ext4 and the like
        the writes then go to allocated blocks (measured several times faster for gigabytes);
        a full disk fails here, before the data is written. Ignored where the file system
        cannot allocate ahead."""
        assert self.fd is not None
        if length <= 0 or not hasattr(os, "posix_fallocate"):
            return
        try:
            os.posix_fallocate(self.fd, self.offset, length)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise

    def write(self, data: memoryview) -> None:
        assert self.fd is not None
        view = data.cast("B")
        while view:
            written = os.write(self.fd, view)
            view = view[written:]
            self.offset += written
            if self.progress is not None:
                self.progress(written)

    def copy_range(self, source: Path, offset: int, length: int) -> None:
        """Append `length` bytes of `source` from `offset`, in the kernel where it can
        (`os.copy_file_range`), else through a buffer a chunk at a time."""
        assert self.fd is not None
        label = f"external data file {source.name!r}"
        fd, _ = open_input(source, label)
        in_kernel = getattr(os, "copy_file_range", None)  # Linux only
        try:
            left = length
            while left > 0:
                step = min(left, tensors.CHUNK_BYTES)
                copied = -1
                try:
                    if in_kernel is not None:
                        copied = in_kernel(fd, self.fd, step, offset)
                except OSError as exc:
                    if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL,
                                         errno.EOPNOTSUPP):
                        raise
                    in_kernel = None
                if copied < 0:  # no in-kernel copy here: read and write
                    data = pread_exact(fd, step, offset, label)
                    self.write(memoryview(data))
                    copied = len(data)
                elif copied == 0:
                    raise AmpError(f"{label}: ends before offset {offset + left} (was it changed "
                                   f"during the run?)")
                else:
                    self.offset += copied
                    if self.progress is not None:
                        self.progress(copied)
                offset += copied
                left -= copied
        finally:
            os.close(fd)
