"""TensorFlow GraphDef / FunctionDef -> IR.

A node's type groups come from its OpDef: one group per `type` attribute (`T`, `U`, `SrcT`), one
per element of a `list(type)` attribute (`T[0]`, `T[1]`, ... for IdentityN), with every port bound
to that attribute in the group (a `number_attr` input such as AddN's N inputs shares one group).
Ports of a fixed dtype (Shape's `out_type` is an attr, but `bool` predicates, `resource` handles
are not) have no group. Ops with no OpDef are fp32 barriers. Data edges and control edges
(`^name` inputs) both become IR edges, and a function's control outputs (`control_ret`) the
graph's `control_outputs`; the emitter writes them back from the IR.

TF1 graphs are not sorted and their while loops are cycles (NextIteration -> Merge): nodes are
ordered topologically with those back edges left out.

Grappler's TF-specific rules that are plain data live here as marks the passes read:
- FusedBatchNorm / FusedBatchNormGrad (V1, where scale/offset/mean/var share `T`) become their V2
  form with `U = float`, as Grappler does, so `T` may go low precision while `U` stays fp32;
- an Identity that reads a ref variable (VariableV2), and an Enter fed by such a read, stay fp32
  (`Node.pin_reason`), as Grappler's NodeImplicitlyReadsNonResourceVariable keeps them;
- fetch nodes of a GraphDef are preserved (never changed), as Grappler preserves fetch nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from tensorflow.core.framework import function_pb2, graph_pb2, node_def_pb2, op_def_pb2
from tensorflow.python.framework import dtypes, op_def_registry, tensor_util

from ...errors import AmpError
from ...ir import FLOAT32, Graph, LazyTensor, Model, Node, TypeGroup, Value, decisions, present
from ...ir.core import first_unplaced, stable_topological_order
from .rules import BACK_EDGE_OPS, BATCH_NORM_V2, FIXED_TYPE_ATTRS, REF_VARIABLE_OPS


def dtype_name(enum: int) -> str:
    """Our dtype name ("float32", "bfloat16", "int32", ...) for a DataType enum (refs: base)."""
    return dtypes.as_dtype(enum).base_dtype.name


def known_dtype(enum: int) -> bool:
    """Whether `enum` is a DataType TensorFlow knows (0, DT_INVALID, is not)."""
    try:
        dtypes.as_dtype(enum)
    except TypeError:
        return False
    return enum != 0


#: Most outputs one node may declare through a number or list attribute (Split's num_split,
#: Unpack's num, ...). Each costs memory the file never paid for, and no real graph comes near.
MAX_DECLARED_OUTPUTS = 1 << 16

#: TensorProto value fields of the numeric dtypes, and how many entries one element takes.
_VALUE_FIELDS = {
    dtypes.float32: ("float_val", 1), dtypes.float64: ("double_val", 1),
    dtypes.float16: ("half_val", 1), dtypes.bfloat16: ("half_val", 1),
    dtypes.int32: ("int_val", 1), dtypes.int16: ("int_val", 1), dtypes.int8: ("int_val", 1),
    dtypes.uint8: ("int_val", 1), dtypes.uint16: ("int_val", 1), dtypes.int64: ("int64_val", 1),
    dtypes.uint32: ("uint32_val", 1), dtypes.uint64: ("uint64_val", 1),
    dtypes.bool: ("bool_val", 1), dtypes.complex64: ("scomplex_val", 2),
    dtypes.complex128: ("dcomplex_val", 2),
}


def const_tensor(nd: node_def_pb2.NodeDef, label: str) -> LazyTensor:
    """A Const node's value, checked against what its TensorProto really holds.

    The declared shape must be non-negative, `tensor_content` exactly as long as the shape
    needs, and value fields no longer than it; fewer values than elements is TensorFlow's compact
    form (the last value repeats), which stays compact (LazyTensor.repeating_last) instead of
    being expanded: a 40000x30000 fill costs the few bytes the file holds.
    """
    tensor = nd.attr["value"].tensor
    where = f"{label}: Const {nd.name!r}"
    if not known_dtype(tensor.dtype):
        raise AmpError(f"{where}: its tensor has an unknown dtype ({tensor.dtype})")
    dtype = dtypes.as_dtype(tensor.dtype)
    declared = nd.attr["dtype"].type if "dtype" in nd.attr else tensor.dtype
    if declared != tensor.dtype:
        shown = dtype_name(declared) if known_dtype(declared) else declared
        raise AmpError(f"{where}: its dtype attr is {shown} but its tensor holds {dtype.name}")
    if tensor.tensor_shape.unknown_rank:
        raise AmpError(f"{where}: its tensor has an unknown rank")
    shape = tuple(d.size for d in tensor.tensor_shape.dim)
    if any(d < 0 for d in shape):
        raise AmpError(f"{where}: its tensor has a negative dimension {list(shape)}")
    elements = math.prod(shape)
    handle = tensor
    field_info = _VALUE_FIELDS.get(dtype)
    if field_info is None:  # strings, resources, variants: never converted, read by TF only
        return LazyTensor(dtype_name(tensor.dtype), shape,
                          lambda: tensor_util.MakeNdarray(tensor), handle=handle)
    if tensor.tensor_content:
        needed = elements * dtype.size
        if len(tensor.tensor_content) != needed:
            raise AmpError(f"{where}: tensor_content holds {len(tensor.tensor_content)} bytes, "
                           f"its shape {list(shape)} of {dtype.name} needs {needed}")
        return LazyTensor(dtype_name(tensor.dtype), shape,
                          lambda: tensor_util.MakeNdarray(tensor), handle=handle)
    field, per_element = field_info
    count = len(getattr(tensor, field))
    if count % per_element or count // per_element > elements:
        raise AmpError(f"{where}: its tensor holds {count // per_element} value(s), more than its "
                       f"shape {list(shape)} has elements ({elements})")
    stored = count // per_element
    if stored == elements or not dtype.is_floating:
        # Whole, or not a float (never range checked or converted, so never expanded here).
        return LazyTensor(dtype_name(tensor.dtype), shape,
                          lambda: tensor_util.MakeNdarray(tensor), handle=handle)
    first = _stored_float_values(tensor, dtype, field, stored)
    return LazyTensor.repeating_last(dtype_name(tensor.dtype), shape, first, handle=handle)


def _stored_float_values(tensor, dtype: dtypes.DType, field: str, stored: int) -> np.ndarray:
    """A compact float tensor's stored values (a zero when it holds none: TF's zero fill)."""
    numpy_dtype = dtype.as_numpy_dtype
    if not stored:
        return np.zeros(1, numpy_dtype)
    values = getattr(tensor, field)
    if field == "half_val":
        return np.asarray(values, np.int64).astype(np.uint16).view(numpy_dtype)
    return np.asarray(values, numpy_dtype)


def dtype_enum(name: str) -> int:
    """The DataType enum for one of our dtype names."""
    return dtypes.as_dtype(name).as_datatype_enum


@dataclass
class Port:
    """One expanded input or output port of a node: which OpDef arg it is and its type binding."""

    arg: str
    index: int  # position within the arg (number_attr / type_list_attr expansion)
    dtype: int  # DataType enum (0 when unknown)
    group: str | None  # "T", "T[1]"; None for a fixed dtype
    attr: str | None  # the type attr ("T" for "T[1]")
    list_index: int | None
    is_ref: bool = False


@dataclass
class TfNodeInfo:
    """What the emitter needs about one loaded node beyond its NodeDef: its expanded ports."""

    inputs: list[Port]
    outputs: list[Port]


@dataclass
class TfGraphSource:
    """The IR Model's handle: the proto a graph came from and per-node port information."""

    kind: str  # "graphdef" or "function"
    proto: graph_pb2.GraphDef | function_pb2.FunctionDef
    nodes: dict[str, TfNodeInfo] = field(default_factory=dict)
    #: Function bodies: input arg name -> Value; output arg names in signature order.
    arg_values: dict[str, Value] = field(default_factory=dict)
    ret_names: list[str] = field(default_factory=list)
    #: Ops with no OpDef anywhere (custom ops): left untouched, fp32 barriers.
    unknown_ops: set[str] = field(default_factory=set)


# -- OpDefs and ports ------------------------------------------------------------------------

class OpDefs:
    """OpDef lookup: the global registry, then the graph's function library."""

    def __init__(self, library: function_pb2.FunctionDefLibrary | None):
        self.library: dict[str, op_def_pb2.OpDef] = {}
        if library is not None:
            for fdef in library.function:
                self.library[fdef.signature.name] = fdef.signature

    def get(self, op: str) -> op_def_pb2.OpDef | None:
        return op_def_registry.get(op) or self.library.get(op)


def _attr(node: node_def_pb2.NodeDef, op_def: op_def_pb2.OpDef, name: str):
    """The node's attr value, or the OpDef's default when the NodeDef leaves it out."""
    if name in node.attr:
        return node.attr[name]
    for attr in op_def.attr:
        if attr.name == name and attr.HasField("default_value"):
            return attr.default_value
    return None


def _number(node: node_def_pb2.NodeDef, op_def: op_def_pb2.OpDef, arg) -> int:
    """How many ports a `number_attr` arg has (AddN's N); a negative count raises AmpError."""
    value = _attr(node, op_def, arg.number_attr)
    count = value.i if value is not None else 0
    if count < 0:
        raise AmpError(f"node {node.name!r} ({node.op}): attr {arg.number_attr} is {count}")
    return count


def count_ports(node: node_def_pb2.NodeDef, op_def: op_def_pb2.OpDef, args) -> int:
    """How many ports `expand_ports` would make, without making them: attributes may declare
    any count (AddN with N = 1e9), so callers check it against what the node really has."""
    total = 0
    for arg in args:
        if arg.number_attr:
            total += _number(node, op_def, arg)
        elif arg.type_list_attr:
            value = _attr(node, op_def, arg.type_list_attr)
            total += len(value.list.type) if value is not None else 0
        else:
            total += 1
    return total


def check_declared_outputs(node: node_def_pb2.NodeDef, op_def: op_def_pb2.OpDef,
                           label: str) -> None:
    """Refuse a node whose attributes declare an absurd number of outputs."""
    outputs = count_ports(node, op_def, op_def.output_arg)
    if outputs > MAX_DECLARED_OUTPUTS:
        raise AmpError(f"{label}: node {node.name!r} ({node.op}) declares {outputs} outputs "
                       f"through its attributes (at most {MAX_DECLARED_OUTPUTS} are accepted)")


def expand_ports(node: node_def_pb2.NodeDef, op_def: op_def_pb2.OpDef,
                 args) -> list[Port]:
    """One Port per actual input/output of `node` for the OpDef `args` (input_arg/output_arg).
    Check the count first (`count_ports`): attributes may declare any number."""
    ports: list[Port] = []
    for arg in args:
        if arg.number_attr:
            count = _number(node, op_def, arg)
            type_value = _attr(node, op_def, arg.type_attr) if arg.type_attr else None
            dtype = arg.type or (type_value.type if type_value is not None else 0)
            group = arg.type_attr or None
            for i in range(count):
                ports.append(Port(arg.name, i, dtype, group, group, None, arg.is_ref))
        elif arg.type_list_attr:
            value = _attr(node, op_def, arg.type_list_attr)
            types = list(value.list.type) if value is not None else []
            for i, dtype in enumerate(types):
                ports.append(Port(arg.name, i, dtype, f"{arg.type_list_attr}[{i}]",
                                  arg.type_list_attr, i, arg.is_ref))
        elif arg.type_attr:
            value = _attr(node, op_def, arg.type_attr)
            ports.append(Port(arg.name, 0, value.type if value is not None else 0, arg.type_attr,
                              arg.type_attr, None, arg.is_ref))
        else:
            ports.append(Port(arg.name, 0, arg.type, None, None, None, arg.is_ref))
    return ports


def _allowed(op_def: op_def_pb2.OpDef, attr_name: str) -> frozenset[str] | None:
    for attr in op_def.attr:
        if attr.name == attr_name:
            types = attr.allowed_values.list.type
            return frozenset(dtype_name(t) for t in types) if types else None
    return None


def parse_graph_input(ref: str) -> tuple[str, int]:
    """GraphDef input "node" / "node:2" -> (node, port)."""
    name, sep, port = ref.rpartition(":")
    if sep and port.isdigit():
        return name, int(port)
    return ref, 0


def value_name(node_name: str, port: int) -> str:
    """The IR value name of a node output: TF's tensor name without the ":0"."""
    return node_name if port == 0 else f"{node_name}:{port}"


# -- the loader ------------------------------------------------------------------------------

class TfLoader:
    """Builds the IR of one GraphDef or one FunctionDef body (see load_graphdef, load_function)."""

    def __init__(self, kind: str, proto, node_defs, library, label: str):
        self.label = label
        self.opdefs = OpDefs(library)
        self.source = TfGraphSource(kind, proto)
        self.model = Model(graph=Graph(label), format="tf", handle=self.source)
        self.node_defs = list(node_defs)
        self.by_name: dict[str, node_def_pb2.NodeDef] = {}
        for nd in self.node_defs:
            if nd.name in self.by_name:
                raise AmpError(f"{label}: two nodes are named {nd.name!r}")
            self.by_name[nd.name] = nd
        self.nodes: dict[str, Node] = {}

    # -- input references ---------------------------------------------------------------
    def _split_inputs(self, nd: node_def_pb2.NodeDef) -> tuple[list[str], list[str]]:
        data: list[str] = []
        controls: list[str] = []
        for ref in nd.input:
            (controls if ref.startswith("^") else data).append(ref)
        return data, [c[1:] for c in controls]

    def _resolve(self, ref: str, consumer: str) -> Value:
        """The Value a data input reference names (GraphDef or function-body syntax)."""
        if self.source.kind == "function":
            if ref in self.source.arg_values:
                return self.source.arg_values[ref]
            parts = ref.split(":")
            if len(parts) == 3 and parts[0] in self.nodes:
                node = self.nodes[parts[0]]
                info = self.source.nodes[parts[0]]
                for slot, out_port in enumerate(info.outputs):
                    if out_port.arg == parts[1] and str(out_port.index) == parts[2]:
                        return present(node.outputs[slot])
            raise AmpError(f"{self.label}: node {consumer!r}: input {ref!r} names no function "
                           f"argument or node output")
        name, index = parse_graph_input(ref)
        producer = self.nodes.get(name)
        if producer is None:
            raise AmpError(f"{self.label}: node {consumer!r}: input {ref!r} refers to no node")
        if index >= len(producer.outputs):
            if not producer.has_schema and index < MAX_DECLARED_OUTPUTS:
                # an op we know nothing about: outputs grow on demand
                while len(producer.outputs) <= index:
                    self._add_output(producer, Port("output", len(producer.outputs), 0, None,
                                                    None, None))
            else:
                raise AmpError(f"{self.label}: node {consumer!r}: input {ref!r}: {name} "
                               f"({producer.op_type}) has {len(producer.outputs)} output(s)")
        return present(producer.outputs[index])

    def _control_node(self, name: str, consumer: str) -> Node:
        """The node a control input `^name` (or a control output) names."""
        node = self.nodes.get(name)
        if node is None:
            raise AmpError(f"{self.label}: {consumer}: control input {name!r} names no node")
        return node

    def _producer_name(self, ref: str) -> str:
        if self.source.kind == "function":
            return ref.split(":")[0]
        return parse_graph_input(ref)[0]

    # -- ordering -------------------------------------------------------------------------
    def _topological_order(self) -> list[node_def_pb2.NodeDef]:
        """Kahn's algorithm in original order, without NextIteration -> Merge back edges."""
        index = {nd.name: i for i, nd in enumerate(self.node_defs)}
        indegree = [0] * len(self.node_defs)
        consumers: list[list[int]] = [[] for _ in self.node_defs]
        for i, nd in enumerate(self.node_defs):
            for ref in nd.input:
                source = ref[1:] if ref.startswith("^") else self._producer_name(ref)
                j = index.get(source)
                if j is None:
                    if source in self.source.arg_values:
                        continue
                    raise AmpError(f"{self.label}: node {nd.name!r}: input {ref!r} refers to no "
                                   f"node")
                if self.node_defs[j].op in BACK_EDGE_OPS:
                    continue  # a loop's back edge
                indegree[i] += 1
                consumers[j].append(i)
        order = stable_topological_order(consumers, indegree)
        if len(order) != len(self.node_defs):
            stuck = self.node_defs[first_unplaced(order, len(self.node_defs))].name
            raise AmpError(f"{self.label}: the graph has a cycle that is not a while loop's "
                           f"NextIteration -> Merge edge (at node {stuck!r})")
        return [self.node_defs[i] for i in order]

    # -- nodes ----------------------------------------------------------------------------
    def _add_output(self, node: Node, port: Port) -> None:
        slot = len(node.outputs)
        value = Value(value_name(node.name, slot), self.model.graph,
                      dtype_name(port.dtype) if port.dtype else None)
        value.loop_back = node.op_type in BACK_EDGE_OPS
        self.model.graph.add_value(value)
        self.model.used_names.add(value.name)
        node.add_output(value)
        node.output_group.append(None)
        self.source.nodes[node.name].outputs.append(port)

    def _check_attrs(self, nd: node_def_pb2.NodeDef, op_def: op_def_pb2.OpDef) -> None:
        """Refuse a node that lacks an attribute its OpDef needs or whose type attribute holds no
        dtype TensorFlow knows (TF's importer would refuse it too, after the conversion)."""
        where = f"{self.label}: node {nd.name!r} ({nd.op})"
        for attr in op_def.attr:
            value = _attr(nd, op_def, attr.name)
            if value is None:
                raise AmpError(f"{where}: attr {attr.name} is missing")
            if attr.type == "type" and not known_dtype(value.type):
                raise AmpError(f"{where}: attr {attr.name} holds no valid dtype ({value.type})")
            if attr.type == "list(type)" and not all(known_dtype(t) for t in value.list.type):
                raise AmpError(f"{where}: attr {attr.name} holds an invalid dtype")

    def _create_node(self, nd: node_def_pb2.NodeDef, order: int) -> Node:
        graph = self.model.graph
        node = Node(nd.name, nd.op, "", graph)
        node.handle = nd
        node.order = order
        self.model.used_names.add(nd.name)
        op_def = self.opdefs.get(nd.op)
        data, _controls = self._split_inputs(nd)
        info = TfNodeInfo([], [])
        self.source.nodes[nd.name] = info
        if op_def is None:
            node.has_schema = False
            self.source.unknown_ops.add(nd.op)
            info.inputs = [Port("input", i, 0, None, None, None) for i in range(len(data))]
            for i in range(len(nd.attr["_output_shapes"].list.shape) if "_output_shapes" in
                           nd.attr else 0):
                self._add_output(node, Port("output", i, 0, None, None, None))
            return node
        expected = count_ports(nd, op_def, op_def.input_arg)
        if expected != len(data):
            raise AmpError(f"{self.label}: node {nd.name!r} ({nd.op}) has {len(data)} data "
                           f"input(s), its OpDef expects {expected}")
        check_declared_outputs(nd, op_def, self.label)
        self._check_attrs(nd, op_def)
        info.inputs = expand_ports(nd, op_def, op_def.input_arg)
        for port in expand_ports(nd, op_def, op_def.output_arg):
            self._add_output(node, port)
        if nd.op == "Const" and node.outputs:
            present(node.outputs[0]).const = const_tensor(nd, self.label)
        return node

    def _wire_and_group(self, node: Node) -> None:
        nd: node_def_pb2.NodeDef = node.handle
        info = self.source.nodes[node.name]
        data, controls = self._split_inputs(nd)
        for ref in data:
            node.add_input(self._resolve(ref, nd.name))
        if controls:
            node.add_control_inputs(self._control_node(name, f"node {nd.name!r}")
                                    for name in controls)
        node.input_group = [None] * len(node.inputs)
        if not node.has_schema:
            return
        op_def = self.opdefs.get(nd.op)
        assert op_def is not None  # has_schema
        groups: dict[str, TypeGroup] = {}

        def group_for(port: Port) -> TypeGroup:
            assert port.group is not None and port.attr is not None
            group = groups.get(port.group)
            if group is None:
                fixed = FIXED_TYPE_ATTRS.get((node.op_type, port.attr))
                group = TypeGroup(node, port.group, allowed=_allowed(op_def, port.attr),
                                  fixed=fixed is not None, reason=fixed or "")
                groups[port.group] = group
                node.type_groups.append(group)
            if port.is_ref and not group.fixed:
                group.fixed = True
                group.reason = "reads or writes a ref variable: the variable's dtype"
            return group

        # Slots are gathered in lists and stored as tuples once: an AddN or ConcatV2 may have
        # thousands of inputs, and growing a tuple a slot at a time is quadratic.
        slots: dict[tuple[TypeGroup, bool], list[int]] = {}
        for slot, port in enumerate(info.inputs):
            if port.group is not None:
                group = group_for(port)
                slots.setdefault((group, True), []).append(slot)
                node.input_group[slot] = group
        for slot, port in enumerate(info.outputs):
            if port.group is not None:
                group = group_for(port)
                slots.setdefault((group, False), []).append(slot)
                node.output_group[slot] = group
        for group in groups.values():
            group.input_slots = tuple(slots.get((group, True), ()))
            group.output_slots = tuple(slots.get((group, False), ()))
        for value in node.outputs:
            present(value).original_dtype = present(value).dtype

    def _mark_ref_reads(self, node: Node) -> None:
        """Grappler's NodeImplicitlyReadsNonResourceVariable: such reads stay fp32."""
        if node.op_type not in ("Identity", "Enter") or not node.inputs or node.inputs[0] is None:
            return
        producer = node.inputs[0].producer
        if producer is None:
            return
        if node.op_type == "Identity" and producer.op_type in REF_VARIABLE_OPS:
            node.pin_reason = (
                f"reads ref variable {producer.name} ({producer.op_type}): stays fp32 and the "
                f"cast goes after it, as Grappler keeps implicit ref-variable reads")
            node.pin_kind = decisions.PIN
        elif node.op_type == "Enter" and producer.pin_reason \
                and producer.op_type in ("Identity", "Enter"):
            node.pin_reason = (
                f"carries ref-variable read {producer.name} into a loop: stays fp32, as Grappler "
                f"keeps implicit ref-variable reads")
            node.pin_kind = decisions.PIN

    def build(self) -> Model:
        for nd in self.node_defs:
            if nd.op in BATCH_NORM_V2 and nd.attr["T"].type == dtype_enum(FLOAT32):
                nd.op = BATCH_NORM_V2[nd.op]  # same semantics; U = float keeps statistics fp32
                nd.attr["U"].type = dtype_enum(FLOAT32)
        for order, nd in enumerate(self._topological_order()):
            node = self._create_node(nd, order)
            self.nodes[nd.name] = node
            self.model.graph.append_node(node)
        for node in self.model.graph.nodes:
            self._wire_and_group(node)
            self._mark_ref_reads(node)
        return self.model


def default_fetches(graph_def: graph_pb2.GraphDef) -> list[str]:
    """Nodes nothing reads (by data or control edge) that make a float tensor: likely fetches."""
    read: set[str] = set()
    for nd in graph_def.node:
        for ref in nd.input:
            read.add(ref[1:] if ref.startswith("^") else parse_graph_input(ref)[0])
    opdefs = OpDefs(graph_def.library)
    fetches = []
    for nd in graph_def.node:
        if nd.name in read or nd.op in ("Const", "NoOp", "Placeholder", "Assert", "SaveV2"):
            continue
        op_def = opdefs.get(nd.op)
        if op_def is None or not op_def.output_arg:
            continue
        check_declared_outputs(nd, op_def, "graph")
        ports = expand_ports(nd, op_def, op_def.output_arg)
        if any(p.dtype in (1, 2, 14, 19) for p in ports):  # float, double, bfloat16, half
            fetches.append(nd.name)
    return fetches


def load_graphdef(graph_def: graph_pb2.GraphDef, fetches: list[str],
                  keep_fetch_nodes: bool = True, label: str = "graph") -> Model:
    """IR of a GraphDef (modified in place: FusedBatchNorm V1 -> V2). `fetches` are output
    tensors ("y" or "y:1"); with `keep_fetch_nodes` their nodes are preserved as Grappler does."""
    loader = TfLoader("graphdef", graph_def, graph_def.node, graph_def.library, label)
    model = loader.build()
    graph = model.graph
    for fetch in fetches:
        name, port = parse_graph_input(fetch)
        node = loader.nodes.get(name)
        if node is None:
            raise AmpError(f"output {fetch!r} is not a node of the graph")
        if not node.outputs and ":" not in fetch:  # a target op (train op, NoOp group)
            continue
        if port >= len(node.outputs):
            raise AmpError(f"output {fetch!r}: {name} ({node.op_type}) has {len(node.outputs)} "
                           f"output(s)")
        graph.add_output(present(node.outputs[port]))
        if keep_fetch_nodes:
            node.pin_reason = (
                "fetch node (--outputs): preserved with its dtype, as Grappler preserves fetch "
                "nodes; casts go in front of it")
            node.pin_kind = decisions.PIN
    return model


def load_function(fdef: function_pb2.FunctionDef,
                  library: function_pb2.FunctionDefLibrary) -> Model:
    """IR of a FunctionDef body: arguments are graph inputs, return values graph outputs."""
    label = fdef.signature.name
    loader = TfLoader("function", fdef, fdef.node_def, library, label)
    graph = loader.model.graph
    for arg in fdef.signature.input_arg:
        if arg.number_attr or arg.type_list_attr or not arg.type:
            raise AmpError(f"{label}: polymorphic function argument {arg.name!r} not supported")
        value = graph.add_value(Value(arg.name, graph, dtype_name(arg.type)))
        graph.add_input(value)
        loader.model.used_names.add(arg.name)
        loader.source.arg_values[arg.name] = value
    model = loader.build()
    for arg in fdef.signature.output_arg:
        ref = fdef.ret[arg.name]
        graph.add_output(loader._resolve(ref, f"return value {arg.name}"))
        loader.source.ret_names.append(arg.name)
    for key, name in fdef.control_ret.items():
        graph.set_control_output(key, loader._control_node(name, f"control output {key!r}"))
    return model
