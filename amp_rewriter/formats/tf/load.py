"""TensorFlow GraphDef / FunctionDef -> IR.

A node's type groups come from its OpDef: one group per `type` attribute (`T`, `U`, `SrcT`), one
per element of a `list(type)` attribute (`T[0]`, `T[1]`, ... for IdentityN), with every port bound
to that attribute in the group (a `number_attr` input such as AddN's N inputs shares one group).
Ports of a fixed dtype (Shape's `out_type` is an attr, but `bool` predicates, `resource` handles
are not) have no group. Ops with no OpDef are fp32 barriers. Only data edges become IR edges;
control edges stay on the NodeDef (the IR node's handle) and the emitter writes them back.

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

import heapq
from dataclasses import dataclass, field

from tensorflow.core.framework import function_pb2, graph_pb2, node_def_pb2, op_def_pb2
from tensorflow.python.framework import dtypes, op_def_registry, tensor_util

from ...errors import AmpError
from ...ir import FLOAT32, Graph, LazyTensor, Model, Node, TypeGroup, Value, decisions, present
from .rules import BACK_EDGE_OPS, BATCH_NORM_V2, FIXED_TYPE_ATTRS, REF_VARIABLE_OPS


def dtype_name(enum: int) -> str:
    """Our dtype name ("float32", "bfloat16", "int32", ...) for a DataType enum (refs: base)."""
    return dtypes.as_dtype(enum).base_dtype.name


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
    """What the emitter needs about one loaded node beyond its NodeDef."""

    inputs: list[Port]
    outputs: list[Port]
    controls: list[str]  # control-input node names, in the original order


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


def expand_ports(node: node_def_pb2.NodeDef, op_def: op_def_pb2.OpDef,
                 args) -> list[Port]:
    """One Port per actual input/output of `node` for the OpDef `args` (input_arg/output_arg)."""
    ports: list[Port] = []
    for arg in args:
        if arg.number_attr:
            value = _attr(node, op_def, arg.number_attr)
            count = value.i if value is not None else 0
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
            if not producer.has_schema:  # an op we know nothing about: outputs grow on demand
                while len(producer.outputs) <= index:
                    self._add_output(producer, Port("output", len(producer.outputs), 0, None,
                                                    None, None))
            else:
                raise AmpError(f"{self.label}: node {consumer!r}: input {ref!r}: {name} "
                               f"({producer.op_type}) has {len(producer.outputs)} output(s)")
        return present(producer.outputs[index])

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
        ready = [i for i, d in enumerate(indegree) if d == 0]
        heapq.heapify(ready)
        order: list[node_def_pb2.NodeDef] = []
        while ready:
            i = heapq.heappop(ready)
            order.append(self.node_defs[i])
            for j in consumers[i]:
                indegree[j] -= 1
                if indegree[j] == 0:
                    heapq.heappush(ready, j)
        if len(order) != len(self.node_defs):
            stuck = next(nd.name for i, nd in enumerate(self.node_defs) if indegree[i] > 0)
            raise AmpError(f"{self.label}: the graph has a cycle that is not a while loop's "
                           f"NextIteration -> Merge edge (at node {stuck!r})")
        return order

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

    def _create_node(self, nd: node_def_pb2.NodeDef, order: int) -> Node:
        graph = self.model.graph
        node = Node(nd.name, nd.op, "", graph)
        node.handle = nd
        node.order = order
        self.model.used_names.add(nd.name)
        op_def = self.opdefs.get(nd.op)
        data, controls = self._split_inputs(nd)
        info = TfNodeInfo([], [], controls)
        self.source.nodes[nd.name] = info
        if op_def is None:
            node.has_schema = False
            self.source.unknown_ops.add(nd.op)
            info.inputs = [Port("input", i, 0, None, None, None) for i in range(len(data))]
            for i in range(len(nd.attr["_output_shapes"].list.shape) if "_output_shapes" in
                           nd.attr else 0):
                self._add_output(node, Port("output", i, 0, None, None, None))
            return node
        info.inputs = expand_ports(nd, op_def, op_def.input_arg)
        if len(info.inputs) != len(data):
            raise AmpError(f"{self.label}: node {nd.name!r} ({nd.op}) has {len(data)} data "
                           f"input(s), its OpDef expects {len(info.inputs)}")
        for port in expand_ports(nd, op_def, op_def.output_arg):
            self._add_output(node, port)
        if nd.op == "Const" and node.outputs:
            tensor = nd.attr["value"].tensor
            present(node.outputs[0]).const = LazyTensor(
                dtype_name(tensor.dtype), tuple(d.size for d in tensor.tensor_shape.dim),
                lambda: tensor_util.MakeNdarray(tensor), handle=tensor)
        return node

    def _wire_and_group(self, node: Node) -> None:
        nd: node_def_pb2.NodeDef = node.handle
        info = self.source.nodes[node.name]
        data, _ = self._split_inputs(nd)
        for ref in data:
            node.add_input(self._resolve(ref, nd.name))
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

        for slot, port in enumerate(info.inputs):
            if port.group is not None:
                group = group_for(port)
                group.input_slots.append(slot)
                node.input_group[slot] = group
        for slot, port in enumerate(info.outputs):
            if port.group is not None:
                group = group_for(port)
                group.output_slots.append(slot)
                node.output_group[slot] = group
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
    return model
