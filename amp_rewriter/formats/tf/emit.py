"""IR -> TensorFlow GraphDef / FunctionDef.

Every loaded node keeps its NodeDef; only its data inputs (rewired to casts or converted
constants) and its type attributes change. A type attribute is written from the dtype the IR now
gives the values bound to it, so retargeted casts (`DstT`), casts whose source changed (`SrcT`)
and painted groups all follow one rule. Control inputs are written back as they were. New nodes:
Cast (`SrcT`, `DstT`, `Truncate=false`, on the producer's device) and Const (converted constants,
on the device of the constant they replace).
"""

from __future__ import annotations

import re

import numpy as np
from tensorflow.core.framework import (
    function_pb2,
    graph_pb2,
    node_def_pb2,
    tensor_pb2,
    tensor_shape_pb2,
)

from ...ir import Graph, IRError, LazyTensor, Model, Node, Value, present, unique_name
from ...ir.dtypes import NUMPY_DTYPES
from .load import TfGraphSource, dtype_enum

_INVALID = re.compile(r"[^A-Za-z0-9_./>-]")


#: TensorProto value fields that can hold a compact tensor (its last value repeating) per dtype;
#: half_val holds float16 and bfloat16 as their 16 bits.
_COMPACT_FIELDS = {"float32": "float_val", "float16": "half_val", "bfloat16": "half_val"}


def tensor_proto(tensor: LazyTensor) -> tensor_pb2.TensorProto:
    """A TensorProto holding `tensor` in its dtype (bfloat16 and float16 as raw content; a
    compact tensor stays compact, as TensorFlow itself stores fills)."""
    proto = tensor_pb2.TensorProto(dtype=dtype_enum(tensor.dtype))
    field = _COMPACT_FIELDS.get(tensor.dtype)
    if tensor.compact and field is not None:
        values = np.asarray(tensor.stored()).astype(NUMPY_DTYPES[tensor.dtype])
        proto.tensor_shape.CopyFrom(_shape_proto(tensor.shape))
        if field == "half_val":
            getattr(proto, field).extend(values.view(np.uint16).astype(np.int32).tolist())
        else:
            getattr(proto, field).extend(values.tolist())
        return proto
    array = np.asarray(tensor.numpy())
    wanted = NUMPY_DTYPES.get(tensor.dtype, array.dtype)
    if array.dtype != wanted:
        array = array.astype(wanted)
    proto.tensor_shape.CopyFrom(_shape_proto(array.shape))
    proto.tensor_content = np.ascontiguousarray(array).tobytes()
    return proto


def _shape_proto(shape: tuple[int, ...]) -> tensor_shape_pb2.TensorShapeProto:
    return tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=int(d)) for d in shape])


def _dtype(value: Value) -> str:
    if value.dtype is None:
        raise IRError(f"{value.name}: no dtype to write")
    return value.dtype


class _Namer:
    """Valid, unique TF node names for the nodes a pass created."""

    def __init__(self, taken: set[str]):
        self.taken = set(taken)

    def name(self, wanted: str) -> str:
        base = _INVALID.sub("_", wanted) or "node"
        if not re.match(r"[A-Za-z0-9.]", base[0]):
            base = "n" + base
        return unique_name(base, self.taken)


class _Emitter:
    def __init__(self, model: Model):
        self.model = model
        self.source: TfGraphSource = model.handle
        self.graph: Graph = model.graph
        self.function = self.source.kind == "function"
        kept = {node.name for node in self.graph.nodes if node.handle is not None}
        self.namer = _Namer(kept | set(self.source.arg_values))
        self.node_names: dict[int, str] = {}
        self.const_names: dict[int, str] = {}
        self.devices: dict[str, str] = {}  # original constant name -> its device
        self.removed = self._removed_nodes()

    def _removed_nodes(self) -> dict[str, list[str]]:
        """Original nodes a pass removed (folded casts, replaced constants) -> the nodes a control
        edge on them now waits for instead: the nodes they themselves read."""
        kept = {node.name for node in self.graph.nodes if node.handle is not None}
        proto = self.source.proto
        originals = {nd.name: nd for nd in (proto.node_def if self.function else proto.node)}
        removed: dict[str, list[str]] = {}
        for name in self.source.nodes:
            if name in kept:
                continue
            nd = originals.get(name)
            readers = [ref[1:] if ref.startswith("^") else ref.split(":")[0]
                       for ref in (nd.input if nd is not None else ())]
            removed[name] = [r for r in readers if r not in self.source.arg_values]
        return removed

    def control_inputs(self, names: list[str]) -> list[str]:
        """Control inputs with removed nodes replaced by what they waited for (deduplicated)."""
        result: list[str] = []
        stack = list(reversed(names))
        seen: set[str] = set()
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in self.removed:
                if name in self.const_names_by_name:
                    result.append(name)  # a converted constant took the name over
                else:
                    stack.extend(reversed(self.removed[name]))
            else:
                result.append(name)
        return result

    def node_name(self, node: Node) -> str:
        name = self.node_names.get(id(node))
        if name is None:
            name = node.name if node.handle is not None else self.namer.name(node.name)
            self.node_names[id(node)] = name
        return name

    def ref(self, value: Value) -> str:
        """How a consumer names `value` in an input list."""
        producer = value.producer
        if producer is None:
            if value.is_graph_input and self.function:
                return value.name
            name = self.const_names[id(value)]
            return f"{name}:output:0" if self.function else name
        name = self.node_name(producer)
        slot = value.producer_slot
        if self.function:
            if producer.handle is None:  # a Cast of ours
                return f"{name}:y:0"
            port = self.source.nodes[producer.name].outputs[slot]
            return f"{name}:{port.arg}:{port.index}"
        return name if slot == 0 else f"{name}:{slot}"

    # -- nodes --------------------------------------------------------------------------------
    def patch(self, node: Node) -> node_def_pb2.NodeDef:
        original: node_def_pb2.NodeDef = node.handle
        nd = node_def_pb2.NodeDef()
        nd.CopyFrom(original)
        del nd.input[:]
        nd.input.extend(self.ref(present(v)) for v in node.inputs)
        info = self.source.nodes[node.name]
        nd.input.extend(f"^{c}" for c in self.control_inputs(info.controls))
        for group in node.type_groups:
            if group.fixed:
                continue
            dtype = group.current_dtype
            if dtype is None:
                continue
            enum = dtype_enum(dtype)
            attr, _, index = group.name.partition("[")
            if index:
                types = nd.attr[attr].list.type
                i = int(index[:-1])
                if types[i] != enum:
                    types[i] = enum
            elif nd.attr[attr].type != enum:
                nd.attr[attr].type = enum
        return nd

    def cast(self, node: Node) -> node_def_pb2.NodeDef:
        source = present(node.inputs[0])
        nd = node_def_pb2.NodeDef(name=self.node_name(node), op="Cast", input=[self.ref(source)])
        nd.attr["SrcT"].type = dtype_enum(_dtype(source))
        nd.attr["DstT"].type = dtype_enum(node.attrs["to"])
        nd.attr["Truncate"].b = False
        if source.producer is not None and source.producer.handle is not None:
            nd.device = source.producer.handle.device
        return nd

    def constant(self, value: Value) -> node_def_pb2.NodeDef:
        nd = node_def_pb2.NodeDef(name=self.const_names[id(value)], op="Const")
        assert value.const is not None
        nd.attr["dtype"].type = dtype_enum(_dtype(value))
        nd.attr["value"].tensor.CopyFrom(tensor_proto(value.const))
        nd.device = self.devices.get(value.name, "")
        origin = value.origin
        if origin is not None and origin.producer is not None:
            # The original Const's control inputs place it (e.g. inside a while-loop frame, or
            # after an Assert): the converted copy needs the same ones.
            info = self.source.nodes.get(origin.producer.name)
            if info is not None:
                nd.input.extend(f"^{c}" for c in self.control_inputs(info.controls))
            nd.device = origin.producer.handle.device if origin.producer.handle else nd.device
        return nd

    def nodes(self) -> list[node_def_pb2.NodeDef]:
        proto = self.source.proto
        for nd in (proto.node_def if self.function else proto.node):
            if nd.op == "Const":
                self.devices[nd.name] = nd.device
        # A converted constant that replaced its only reader's original takes the original's name
        # (that node is gone from the graph, so the name is free).
        for name, value in self.graph.initializers.items():
            if value.const is not None and value.const.handle is None:
                self.const_names[id(value)] = self.namer.name(name)
        self.const_names_by_name = set(self.const_names.values())
        out = [self.constant(v) for v in self.graph.initializers.values()
               if id(v) in self.const_names]
        for node in self.graph.nodes:
            out.append(self.patch(node) if node.handle is not None else self.cast(node))
        return out


def emit_graphdef(model: Model) -> graph_pb2.GraphDef:
    """The converted GraphDef (a new proto; the loaded one is not modified)."""
    source: TfGraphSource = model.handle
    original: graph_pb2.GraphDef = source.proto
    emitter = _Emitter(model)
    out = graph_pb2.GraphDef()
    out.versions.CopyFrom(original.versions)
    if original.HasField("library"):
        out.library.CopyFrom(original.library)
    out.node.extend(emitter.nodes())
    return out


def emit_function(model: Model) -> function_pb2.FunctionDef:
    """The converted FunctionDef: same signature, rewritten body, returns rewired."""
    source: TfGraphSource = model.handle
    original: function_pb2.FunctionDef = source.proto
    emitter = _Emitter(model)
    out = function_pb2.FunctionDef()
    out.CopyFrom(original)
    del out.node_def[:]
    out.node_def.extend(emitter.nodes())
    for name, value in zip(source.ret_names, model.graph.outputs):
        out.ret[name] = emitter.ref(value)
    for key, node_name in list(out.control_ret.items()):
        if node_name in emitter.removed:
            replacement = emitter.control_inputs([node_name])
            if replacement:
                out.control_ret[key] = replacement[0]
            else:
                del out.control_ret[key]
    return out
