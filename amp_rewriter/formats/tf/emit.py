"""IR -> TensorFlow GraphDef / FunctionDef.

Every loaded node keeps its NodeDef; its data and control inputs are written from the IR's edges
and its type attributes from the dtypes the IR now gives the values bound to them, so
retargeted casts (`DstT`), casts whose source changed (`SrcT`) and painted groups all follow one
rule; an attribute a pass set on it (`Node.attrs`: a variable's `dtype`) replaces the
NodeDef's. A function's control outputs (`control_ret`) come from the graph's
`control_outputs`.

A node a pass added is written from its OpDef: its op, data and control inputs, the type
attributes its inputs' and outputs' dtypes bind (`T`, `dtype`, `N`, list(type) attributes),
the other attributes from `Node.attrs` converted by the OpDef's attribute types (int, float,
bool, string, shape, tensor, type, func and their lists), the OpDef's defaults for the rest; a
cast goes on its producer's device. New constants (initializers a pass made) become Const
nodes, a converted one on the device and behind the control inputs of the Const it replaces.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tensorflow.core.framework import (
    attr_value_pb2,
    function_pb2,
    graph_pb2,
    node_def_pb2,
    op_def_pb2,
    tensor_pb2,
    tensor_shape_pb2,
)

from ...ir import Graph, IRError, LazyTensor, Model, Node, Value, present, unique_name
from ...ir.dtypes import NUMPY_DTYPES
from ...ir.rounding import NEAREST, ROUNDING_ATTR, rounding_of
from .load import OpDefs, Port, TfGraphSource, dtype_enum, expand_ports

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


def _shape_attr(shape: Sequence[int | None] | None) -> tensor_shape_pb2.TensorShapeProto:
    """A shape attribute: None is an unknown rank, a None dimension an unknown size."""
    if shape is None:
        return tensor_shape_pb2.TensorShapeProto(unknown_rank=True)
    return tensor_shape_pb2.TensorShapeProto(dim=[
        tensor_shape_pb2.TensorShapeProto.Dim(size=-1 if d is None else int(d)) for d in shape])


def _tensor_attr(value: Any) -> tensor_pb2.TensorProto:
    if isinstance(value, LazyTensor):
        return tensor_proto(value)
    array = np.asarray(value)
    return tensor_proto(LazyTensor(array.dtype.name, tuple(array.shape), lambda: array))


#: OpDef attribute type -> how a Python value of `Node.attrs` is written into an AttrValue.
_ATTR_WRITERS: dict[str, Callable[[attr_value_pb2.AttrValue, Any], None]] = {
    "int": lambda a, v: setattr(a, "i", int(v)),
    "float": lambda a, v: setattr(a, "f", float(v)),
    "bool": lambda a, v: setattr(a, "b", bool(v)),
    "string": lambda a, v: setattr(a, "s", v if isinstance(v, bytes) else str(v).encode()),
    "type": lambda a, v: setattr(a, "type", dtype_enum(v)),
    "shape": lambda a, v: a.shape.CopyFrom(_shape_attr(v)),
    "tensor": lambda a, v: a.tensor.CopyFrom(_tensor_attr(v)),
    "func": lambda a, v: setattr(a.func, "name", str(v)),
    "list(int)": lambda a, v: a.list.i.extend(int(x) for x in v),
    "list(float)": lambda a, v: a.list.f.extend(float(x) for x in v),
    "list(bool)": lambda a, v: a.list.b.extend(bool(x) for x in v),
    "list(string)": lambda a, v: a.list.s.extend(
        x if isinstance(x, bytes) else str(x).encode() for x in v),
    "list(type)": lambda a, v: a.list.type.extend(dtype_enum(x) for x in v),
    "list(shape)": lambda a, v: a.list.shape.extend(_shape_attr(x) for x in v),
}

#: The IR's own attributes of its cast op: the target dtype (TF writes it as `DstT`, the dtype
#: of the cast's output) and the rounding mode (a stochastic cast is lowered before it is
#: written: formats/tf/rounding.py).
_IR_CAST_ATTRS = frozenset({"to", ROUNDING_ATTR})


def _arg_counts(node: Node, op_def: op_def_pb2.OpDef, args, total: int) -> list[int]:
    """How many of `total` slots each OpDef arg takes: one for a plain arg, the length of a
    list(type) attribute given in `Node.attrs`, and the rest for the one variadic arg left."""
    counts: list[int | None] = []
    for arg in args:
        if arg.number_attr and arg.number_attr in node.attrs:
            counts.append(int(node.attrs[arg.number_attr]))
        elif arg.type_list_attr and arg.type_list_attr in node.attrs:
            counts.append(len(node.attrs[arg.type_list_attr]))
        elif arg.number_attr or arg.type_list_attr:
            counts.append(None)
        else:
            counts.append(1)
    open_args = [i for i, c in enumerate(counts) if c is None]
    if len(open_args) > 1:
        raise IRError(f"{node.name} ({node.op_type}): give the counts of its variadic args as "
                      f"attributes")
    if open_args:
        counts[open_args[0]] = total - sum(c for c in counts if c is not None)
    if sum(c or 0 for c in counts) != total or any((c or 0) < 0 for c in counts):
        raise IRError(f"{node.name} ({node.op_type}): {total} slot(s) do not fit its OpDef")
    return [c or 0 for c in counts]


def _bind_types(node: Node, op_def: op_def_pb2.OpDef, args, values: Sequence[Value | None],
                types: dict[str, Any], numbers: dict[str, int]) -> None:
    """Record the type and number attributes that `args` bind, from the IR dtypes of `values`
    (a node's inputs or outputs in slot order)."""
    slot = 0
    for arg, count in zip(args, _arg_counts(node, op_def, args, len(values))):
        dtypes_here = [_dtype(present(v)) for v in values[slot:slot + count]]
        slot += count
        if arg.number_attr:
            numbers.setdefault(arg.number_attr, count)
        if arg.type_list_attr:
            types.setdefault(arg.type_list_attr, dtypes_here)
        elif arg.type_attr and dtypes_here:
            types.setdefault(arg.type_attr, dtypes_here[0])


class _Emitter:
    def __init__(self, model: Model):
        self.model = model
        self.source: TfGraphSource = model.handle
        self.graph: Graph = model.graph
        self.function = self.source.kind == "function"
        proto = self.source.proto
        self.opdefs = OpDefs(None if self.function else proto.library)
        self.live: set[Node] = set(self.graph.nodes)
        kept = {node.name for node in self.graph.nodes if node.handle is not None}
        self.namer = _Namer(kept | set(self.source.arg_values)
                            | {value.name for value in self.graph.inputs})
        self.node_names: dict[Node, str] = {}
        self.const_names: dict[Value, str] = {}
        self.devices: dict[str, str] = {}  # original constant name -> its device
        #: Output ports of the nodes a pass added (how a function body names their outputs).
        self.added_ports: dict[Node, list[Port]] = {}

    def node_name(self, node: Node) -> str:
        name = self.node_names.get(node)
        if name is None:
            name = node.name if node.handle is not None else self.namer.name(node.name)
            self.node_names[node] = name
        return name

    def ref(self, value: Value) -> str:
        """How a consumer names `value` in an input list."""
        producer = value.producer
        if producer is None:
            if value.is_graph_input and self.function:
                return value.name
            name = self.const_names[value]
            return f"{name}:output:0" if self.function else name
        name = self.node_name(producer)
        slot = value.producer_slot
        if self.function:
            if producer.handle is None:
                port = self.added_ports[producer][slot]
            else:
                port = self.source.nodes[producer.name].outputs[slot]
            return f"{name}:{port.arg}:{port.index}"
        return name if slot == 0 else f"{name}:{slot}"

    def waits(self, nodes: Sequence[Node]) -> list[str]:
        """Control inputs (`^name`) for `nodes`: a removed node (only a replaced constant's
        own list can still name one) stands for what it waited for."""
        refs: list[str] = []
        seen: set[Node] = set()
        stack = list(reversed(nodes))
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in self.live:
                refs.append(f"^{self.node_name(node)}")
            else:
                stack.extend(reversed(node.predecessors()))
        return refs

    # -- nodes --------------------------------------------------------------------------------
    def patch(self, node: Node) -> node_def_pb2.NodeDef:
        original: node_def_pb2.NodeDef = node.handle
        nd = node_def_pb2.NodeDef()
        nd.CopyFrom(original)
        del nd.input[:]
        nd.input.extend(self.ref(present(v)) for v in node.inputs)
        nd.input.extend(self.waits(node.control_inputs))
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
        if node.attrs:
            self._set_attrs(node, nd)
        return nd

    def _set_attrs(self, node: Node, nd: node_def_pb2.NodeDef) -> None:
        """Attributes a pass set on a loaded node (a variable stored in another dtype) replace
        the NodeDef's."""
        op_def = self.opdefs.get(node.op_type)
        kinds = {attr.name: attr.type for attr in op_def.attr} if op_def is not None else {}
        for name, value in node.attrs.items():
            if name not in kinds:
                raise IRError(f"{node.name} ({node.op_type}): no attribute {name!r} in its OpDef")
            nd.attr[name].Clear()
            _ATTR_WRITERS[kinds[name]](nd.attr[name], value)

    def added(self, node: Node) -> node_def_pb2.NodeDef:
        """The NodeDef of a node a pass added, written from its OpDef (see the module doc)."""
        op_def = self.opdefs.get(node.op_type)
        if op_def is None:
            raise IRError(f"{node.name}: TensorFlow has no op {node.op_type!r}")
        if node.op_type == "Cast" and rounding_of(node.attrs) != NEAREST:
            raise IRError(f"{node.name}: a {rounding_of(node.attrs)} rounding Cast is written "
                          f"only once lowered (formats/tf/rounding.py)")
        nd = node_def_pb2.NodeDef(name=self.node_name(node), op=node.op_type)
        nd.input.extend(self.ref(present(v)) for v in node.inputs)
        nd.input.extend(self.waits(node.control_inputs))
        types: dict[str, Any] = {}
        numbers: dict[str, int] = {}
        _bind_types(node, op_def, op_def.input_arg, node.inputs, types, numbers)
        _bind_types(node, op_def, op_def.output_arg, node.outputs, types, numbers)
        known = {attr.name for attr in op_def.attr}
        unknown = set(node.attrs) - known - (_IR_CAST_ATTRS if node.op_type == "Cast" else set())
        if unknown:
            raise IRError(f"{node.name} ({node.op_type}): no attribute {sorted(unknown)[0]!r} "
                          f"in its OpDef")
        for attr in op_def.attr:
            value = nd.attr[attr.name]
            if attr.name in node.attrs:
                _ATTR_WRITERS[attr.type](value, node.attrs[attr.name])
            elif attr.name in types:
                _ATTR_WRITERS[attr.type](value, types[attr.name])
            elif attr.name in numbers:
                value.i = numbers[attr.name]
            elif attr.HasField("default_value"):
                value.CopyFrom(attr.default_value)
            else:
                raise IRError(f"{node.name} ({node.op_type}): attribute {attr.name!r} is "
                              f"neither given nor bound by a dtype")
        if node.op_type == "Cast":
            source = present(node.inputs[0])
            if source.producer is not None and source.producer.handle is not None:
                nd.device = source.producer.handle.device
        self.added_ports[node] = expand_ports(nd, op_def, op_def.output_arg)
        return nd

    def constant(self, value: Value) -> node_def_pb2.NodeDef:
        nd = node_def_pb2.NodeDef(name=self.const_names[value], op="Const")
        assert value.const is not None
        nd.attr["dtype"].type = dtype_enum(_dtype(value))
        nd.attr["value"].tensor.CopyFrom(tensor_proto(value.const))
        nd.device = self.devices.get(value.name, "")
        origin = value.origin
        if origin is not None and origin.producer is not None:
            # The original Const's control inputs place it (e.g. inside a while-loop frame, or
            # after an Assert): the converted copy needs the same ones.
            nd.input.extend(self.waits(origin.producer.control_inputs))
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
                self.const_names[value] = self.namer.name(name)
        out = [self.constant(v) for v in self.graph.initializers.values()
               if v in self.const_names]
        for node in self.graph.nodes:
            out.append(self.patch(node) if node.handle is not None else self.added(node))
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
    """The converted FunctionDef: same signature (plus the arguments a pass added, after the
    others), rewritten body, returns rewired."""
    source: TfGraphSource = model.handle
    original: function_pb2.FunctionDef = source.proto
    emitter = _Emitter(model)
    out = function_pb2.FunctionDef()
    out.CopyFrom(original)
    known: set[Value] = set(source.arg_values.values())
    for value in model.graph.inputs:
        if value not in known:
            out.signature.input_arg.add(name=value.name, type=dtype_enum(_dtype(value)))
    del out.node_def[:]
    out.node_def.extend(emitter.nodes())
    for name, value in zip(source.ret_names, model.graph.outputs):
        out.ret[name] = emitter.ref(value)
    for index, value in enumerate(model.graph.outputs[len(source.ret_names):]):
        # a return value a pass added, after the function's own
        name = f"amp_output_{index}"
        out.signature.output_arg.add(name=name, type=dtype_enum(_dtype(value)))
        out.ret[name] = emitter.ref(value)
    control_outputs = {key: emitter.node_name(node)
                       for key, node in model.graph.control_outputs.items()}
    for key in [key for key in out.control_ret if key not in control_outputs]:
        del out.control_ret[key]
    kept_keys = [key for key in out.signature.control_output if key in control_outputs]
    if len(kept_keys) != len(out.signature.control_output):
        del out.signature.control_output[:]
        out.signature.control_output.extend(kept_keys)
    for key, name in control_outputs.items():
        if out.control_ret.get(key) != name:
            out.control_ret[key] = name
        if key not in out.signature.control_output:
            out.signature.control_output.append(key)
    return out
