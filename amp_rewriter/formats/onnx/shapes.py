"""Concrete tensor shapes of a model at given input sizes, for the report's cost summary.

Shape inference runs on a skeleton of the model: its nodes and small (shape-like) initializers,
with every large or external initializer replaced by a graph input of the same type and shape,
so models with external data or over 2 GB cost no more than their node count. onnx's shape
inference (with data propagation, for Shape -> Gather -> Reshape chains) serves standard
models; onnxruntime's symbolic shape inference, which knows its contrib ops, serves models with
com.microsoft ops. A failure of either only means fewer known shapes.

A big graph is inferred a slice of nodes at a time, and within a slice each node's output types
are looked up by what decides them (`_NodeMemo`) where an earlier node was alike: in a graph of
repeated layers onnx's inference then runs once per distinct node, not once per node.
"""

from __future__ import annotations

import importlib.util
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import cache
from itertools import chain, compress
from operator import add, attrgetter, itemgetter, methodcaller
from pathlib import Path
from typing import Any, NamedTuple, cast

import onnx

from ...cost import bytes_moved
from ...ir import FLOAT_DTYPES
from . import ort_registry
from .encoding import (
    GRAPH_NODE,
    GRAPH_VALUE_INFO,
    MODEL_GRAPH,
    NODE_NAME,
    NODE_OP_TYPE,
    EncodedModel,
    EncodedNodes,
    NodeNames,
    append_field,
    encoded_fields,
    field_key,
    read_varint,
    varint,
)
from .load import dtype_name, elem_type_code, model_opsets, walk_graph_protos
from .validate import validation_shape

#: Initializers up to this many elements stay in the skeleton (Reshape targets, axes, ...).
SMALL_INITIALIZER = 64

_STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")


def skeleton(model: onnx.ModelProto, input_shapes: Mapping[str, tuple[int, ...]]
             ) -> onnx.ModelProto:
    """The model's graph with concrete input shapes and without its large tensors' data."""
    sk = _skeleton_without_nodes(model, input_shapes)
    sk.graph.node.extend(model.graph.node)
    return sk


def skeleton_bytes(model: onnx.ModelProto, input_shapes: Mapping[str, tuple[int, ...]],
                   value_info: bool = False) -> bytes:
    """`skeleton`, serialized (with the model's value_info if asked), without building it:
    each node is serialized on its own and appended to the serialized rest (a message's
    encoding concatenated with another's reads as the two merged). A skeleton message would hold
    a copy of every node, four times the size of their encoding."""
    head = _skeleton_without_nodes(model, input_shapes)
    graph = encoded_fields(GRAPH_NODE, model.graph.node)
    if value_info:
        graph += encoded_fields(GRAPH_VALUE_INFO, model.graph.value_info)
    graph += head.graph.SerializeToString()
    head.ClearField("graph")
    encoded = bytearray(head.SerializeToString())
    append_field(encoded, MODEL_GRAPH, graph)
    del graph
    return bytes(encoded)


class _SkeletonParts(NamedTuple):
    """A skeleton (see `skeleton`) before its graph's initializers and inputs are added."""

    #: The model's header and the graph's name and outputs.
    head: onnx.ModelProto
    #: The small initializers that stay: the model's own messages, not copies.
    small_initializers: list[onnx.TensorProto]
    #: The large initializers (or held in external files), which become inputs: the model's
    #: own messages, declared as inputs only where a skeleton is built (a million-node graph
    #: may have hundreds of thousands, which the cost summary reads the types of only).
    large_initializers: list[onnx.TensorProto]
    #: The graph's inputs at concrete sizes.
    inputs: list[onnx.ValueInfoProto]


def _skeleton_parts(model: onnx.ModelProto, input_shapes: Mapping[str, tuple[int, ...]]
                    ) -> _SkeletonParts:
    sk = onnx.ModelProto()
    sk.ir_version = max(model.ir_version, 4)  # initializers need not be listed as inputs
    sk.opset_import.extend(model.opset_import)
    sk.functions.extend(model.functions)
    source, graph = model.graph, sk.graph
    graph.name = source.name
    graph.output.extend(source.output)
    initializer_names = set()
    small: list[onnx.TensorProto] = []
    large: list[onnx.TensorProto] = []
    inputs: list[onnx.ValueInfoProto] = []
    for tensor in source.initializer:
        initializer_names.add(tensor.name)
        if tensor.data_location != onnx.TensorProto.EXTERNAL \
                and math.prod(tensor.dims) <= SMALL_INITIALIZER:
            small.append(tensor)
        else:
            large.append(tensor)
    for info in source.input:
        if info.name in initializer_names:
            continue
        copy = onnx.ValueInfoProto()
        copy.CopyFrom(info)
        shape = input_shapes.get(info.name)
        if shape is not None and info.type.HasField("tensor_type"):
            dims = copy.type.tensor_type.shape.dim
            del dims[:]
            for size in shape:
                dims.add().dim_value = size
        inputs.append(copy)
    return _SkeletonParts(sk, small, large, inputs)


def _skeleton_without_nodes(model: onnx.ModelProto, input_shapes: Mapping[str, tuple[int, ...]]
                            ) -> onnx.ModelProto:
    head, small_initializers, large_initializers, inputs = _skeleton_parts(model, input_shapes)
    head.graph.initializer.extend(small_initializers)
    head.graph.input.extend(onnx.helper.make_tensor_value_info(
        tensor.name, tensor.data_type, list(tensor.dims)) for tensor in large_initializers)
    head.graph.input.extend(inputs)
    return head


@cache
def _symbolic_shape_inference() -> Any:
    """onnxruntime's SymbolicShapeInference class. Its module is loaded from its file: importing
    it as `onnxruntime.tools.symbolic_shape_infer` runs that package's __init__, which imports
    torch when it is installed (seconds, for a helper this does not use)."""
    spec = importlib.util.find_spec("onnxruntime")
    assert spec is not None and spec.submodule_search_locations
    path = Path(list(spec.submodule_search_locations)[0]) / "tools" / "symbolic_shape_infer.py"
    module_spec = importlib.util.spec_from_file_location("_amp_rewriter_symbolic_shape_infer", path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.SymbolicShapeInference


#: Reductions that take their axes as an input from opset 18 on.
_AXES_INPUT_REDUCTIONS = ("ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                          "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")


def _symbolic_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxruntime's symbolic shape inference, keeping what it inferred when it cannot infer
    everything (its `infer_shapes` then raises, after writing a debug model into the working
    directory: these are the steps of that method without the raise and the file)."""
    inference = _symbolic_shape_inference()(2**31 - 1, True, False, 0)
    if model_opsets(model).get("", 0) >= 18:
        # From opset 18 every reduction takes its axes as an input, as ReduceSum does since 13;
        # the inference has that rule for ReduceSum and ReduceMean only (a ReduceMax, which the
        # RMS norm's rescale writes, would leave every later shape unknown).
        for op in _AXES_INPUT_REDUCTIONS:
            inference.dispatcher_.setdefault(op, inference._infer_ReduceSum)
    inference._preprocess(model)
    while inference.run_:
        inference._infer_impl()
    inference._update_output_from_vi()
    result: onnx.ModelProto = inference.out_mp_
    return result


def _inferred(model: onnx.ModelProto, input_shapes: Mapping[str, tuple[int, ...]],
              op_kinds: set[tuple[str, str]], type_check: bool = False
              ) -> tuple[onnx.ModelProto | None, bool]:
    """The skeleton with its inferred value_info (None when inference failed), and whether the
    inference also passed the type and shape check that onnx.checker's full check runs.

    `op_kinds`: the model's (domain, op type) pairs, nested graphs included. `type_check`:
    run onnx's inference in its strict, type-checking mode on the skeleton with the model's
    declared value_info (the full check's inference, at concrete input sizes): one inference
    serves the cost summary and the check. Where that raises (or the model has onnxruntime's
    ops, whose shapes come from onnxruntime), the result says so and shapes come from the
    lenient inference as without `type_check`.
    """
    ort_ops = any((domain not in _STANDARD_DOMAINS or not onnx.defs.has(op))
                  and ort_registry.has_op(op, domain) for domain, op in op_kinds)
    with ort_registry.quiet():
        if ort_ops:
            try:
                return _symbolic_shapes(skeleton(model, input_shapes)), False
            except Exception:  # any failure only costs us shapes
                pass
        if type_check and not ort_ops:
            try:
                return onnx.shape_inference.infer_shapes(
                    skeleton_bytes(model, input_shapes, value_info=True), check_type=True,
                    strict_mode=True, data_prop=True), True
            except Exception:  # the caller runs the checker's own full check
                pass
        try:
            return onnx.shape_inference.infer_shapes(skeleton_bytes(model, input_shapes),
                                                     strict_mode=False, data_prop=True), False
        except Exception:  # as above
            return None, False


#: Graphs with more top-level nodes than this have their shapes inferred a slice of this many
#: nodes at a time: onnx's inference takes about 2.4 KB per node while it runs (2.4 GB at a
#: million nodes, on top of the model), a slice a bounded amount.
SLICE_NODES = 100_000

#: Ops whose bodies may read values of the graph around them: a graph with them is inferred
#: whole (a slice's inputs are what its nodes read, bodies not searched).
_BODY_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})

Types = dict[str, tuple[str | None, tuple[int, ...] | None]]


def _sliceable(node_count: int, op_kinds: set[tuple[str, str]]) -> bool:
    """Whether a graph of `node_count` top-level nodes and these (domain, op type) pairs is
    inferred a slice at a time."""
    return node_count > SLICE_NODES and not any(
        op in _BODY_OPS or domain not in _STANDARD_DOMAINS for domain, op in op_kinds)


def _traffic_in_slices(model: onnx.ModelProto, input_shapes: Mapping[str, tuple[int, ...]],
                     type_check: bool, encoded: EncodedNodes | None = None
                     ) -> _ActivationTraffic | None:
    """The activation traffic, with the types inferred `SLICE_NODES` nodes at a time (None when
    an inference fails: the caller infers the whole graph then; with `type_check` that means
    that the type check did not pass in some slice).

    A slice is a graph of its nodes whose inputs are the values they read from earlier slices,
    declared with the types inferred there (concrete shapes at these input sizes, or the partly
    known shape). Shape-like values read from earlier slices (shapes, sizes, indices) come with
    the nodes that compute them, back to the values that are not, so that data propagation
    still knows their contents (a Reshape's target computed by Shape -> Gather -> Concat).
    With `type_check`, each slice is inferred in the strict, type-checking mode with the
    declared value_info of what it computes, as the whole graph would be.

    `encoded`: the main graph's nodes as they lie in the model's encoding, with their names
    (an emitter's `EncodedNodes`), read from there rather than through protobuf; `model`'s
    own node list may then be empty."""
    nodes = model.graph.node
    count = len(encoded) if encoded is not None else len(nodes)
    slicer = _Slicer(model, input_shapes, type_check, encoded)
    traffic = _ActivationTraffic(model.graph)
    for start in range(0, count, SLICE_NODES):
        stop = min(start + SLICE_NODES, count)
        if encoded is not None:
            records = encoded.names_between(start, stop)
        else:
            records = _node_names(nodes[start:stop])
        found = slicer.infer(start, records)
        if found is None:
            return None
        traffic.add(records, found)
    return traffic


class _Slicer:
    """The state of `_traffic_in_slices`: what the slices inferred so far."""

    def __init__(self, model: onnx.ModelProto, input_shapes: Mapping[str, tuple[int, ...]],
                 type_check: bool, encoded: EncodedNodes | None):
        self.nodes = model.graph.node
        self.encoded = encoded
        self.type_check = type_check
        head, small_initializers, large_initializers, inputs = _skeleton_parts(model,
                                                                               input_shapes)
        self.graph_name = model.graph.name
        #: The graph's own inputs (the large initializers, which a slice declares as inputs
        #: too, are typed in `types` only).
        self.graph_inputs = {info.name: info for info in inputs}
        self.small_initializers = {tensor.name: tensor for tensor in small_initializers}
        head.ClearField("graph")
        self.head = head.SerializeToString()
        self.declared = ({info.name: info for info in model.graph.value_info} if type_check
                         else {})
        self.outputs = {info.name: info for info in model.graph.output}
        self.types: Types = {}
        #: The encoded TypeProto of values whose shape is partly known.
        self.partial: dict[str, bytes] = {}
        #: Shape-like values' producers, and (inputs, outputs) of each such node by index.
        self.producer: dict[str, int] = {}
        self.shape_like_nodes: dict[int, tuple[Sequence[str], Sequence[str]]] = {}
        self.memo = _NodeMemo()
        self._type_constants(large_initializers)

    def _fields(self, first: int, last: int) -> bytes | bytearray:
        """Nodes `first` to `last` - 1 encoded as GraphProto fields."""
        if self.encoded is not None:
            return self.encoded.fields(first, last)
        return encoded_fields(GRAPH_NODE, self.nodes[first:last])

    def infer(self, start: int, records: Sequence[NodeNames]) -> Types | None:
        """Infer one slice: the nodes from `start` on, as (op type, input names, output names)
        each. Returns the types found (of what the slice reads and computes); None when that
        fails.

        The nodes are looked up a node at a time (`_infer_by_node`) up to the first that
        computes a graph output or a value with a declared type (onnx's check compares the
        two), and from there, or where the lookup cannot serve, inferred as one graph."""
        member_reads, produced = _slice_reads(records)
        if self.memo.enabled and self.producer.keys().isdisjoint(member_reads):
            checked = self.outputs.keys() | self.declared.keys()
            first = len(records)
            if not produced.isdisjoint(checked):
                first = next(index for index, (_, _, outputs) in enumerate(records)
                             if not checked.isdisjoint(outputs))
            looked_up = self._infer_by_node(start, records[:first], member_reads) \
                if first else None
            if looked_up is not None:
                if first == len(records):
                    return looked_up
                rest = self._infer_whole(start + first, records[first:])
                return None if rest is None else looked_up | rest
        return self._infer_whole(start, records, member_reads, produced)

    def _infer_whole(self, start: int, records: Sequence[NodeNames],
                     member_reads: list[str] | None = None,
                     produced: set[str] | None = None) -> Types | None:
        """`infer` by one inference of the slice's nodes (with the earlier nodes that compute
        the shape-like values they read)."""
        if member_reads is None or produced is None:
            member_reads, produced = _slice_reads(records)
        prefix = [(index, *self.shape_like_nodes[index])
                  for index in self._shape_like_sources(member_reads)]
        reads = member_reads
        if prefix:
            prefix_reads, prefix_produced = _slice_reads(prefix)
            seen = prefix_produced.union(prefix_reads)
            reads = prefix_reads + [name for name in member_reads if name not in seen]
            produced |= prefix_produced
        sliced = onnx.GraphProto(name=self.graph_name)
        if not self._declare_inputs(sliced, reads):
            return None
        if self.declared:
            declared = self.declared
            computed = chain(_outputs(prefix), _outputs(records))
            sliced.value_info.extend([declared[name] for name in computed if name in declared])
        sliced.output.extend(info for name, info in self.outputs.items() if name in produced)
        graph = bytearray()
        for index, _, _ in prefix:
            graph += self._fields(index, index + 1)
        graph += self._fields(start, start + len(records))
        graph += sliced.SerializeToString()
        inferred = self._run_inference(graph)
        del graph
        if inferred is None:
            return None
        found = _types(inferred, inferred, self.partial)
        del inferred
        self.types.update(found)
        # The types of values found share a handful of tuples: each is judged once.
        like = {known for known in set(found.values()) if _shape_like(*known)}
        shape_like = {name for name, known in found.items() if known in like} if like else None
        if shape_like:
            for offset, outs in enumerate(map(itemgetter(2), records)):
                if not shape_like.isdisjoint(outs):
                    index = start + offset
                    self.shape_like_nodes[index] = (records[offset][1], outs)
                    for name in outs:
                        self.producer[name] = index
        return found

    def _infer_by_node(self, start: int, records: Sequence[NodeNames],
                       reads: list[str]) -> Types | None:
        """The slice's types found a node at a time, each node's output types looked up by
        what decides them (`_NodeMemo`) and inferred only for a node unlike those before it;
        None where the slice must be inferred whole: a node computes an integer shape-like
        value (data propagation carries its contents to later nodes), a node reads a value
        without a type, or too many nodes are unlike those before (no repeated structure).
        `reads`: what the slice reads from before it."""
        fields = self._fields(start, start + len(records))
        tails = _op_tails(fields, records)
        if tails is None:
            return None
        memo, types, partial = self.memo, self.types, self.partial
        # Before any node: the graph's inputs it reads (initializers are no activations).
        found: Types = {name: types[name] for name in self.graph_inputs.keys() & set(reads)
                        if name in types}
        type_of = types.get
        typed: dict[str, Any] = types  # plain answers' types are all there
        small_initializers = self.small_initializers.keys()
        offset = 0
        seen = 0
        for (op_type, inputs, outputs), (end, tail) in zip(records, tails):
            # Most inputs are keyed by their type: one lookup each, in C.
            keys = tuple(map(type_of, inputs))
            if None in keys or (partial and not partial.keys().isdisjoint(inputs)) \
                    or (op_type not in _TYPE_ONLY_OPS
                        and not small_initializers.isdisjoint(inputs)):
                exact = self._input_keys(inputs, op_type)
                if exact is None:
                    return None
                keys = exact
            # The empty names among the outputs (optional outputs not asked for) and their
            # count are part of what decides the node's types.
            produced = len(outputs) if "" not in outputs else tuple(map(bool, outputs))
            key = (tail, keys, produced)
            answer = memo.get(key)
            if answer is None:
                memo.misses += 1
                if memo.misses > _MEMO_TRIAL \
                        and memo.misses * _MEMO_MISS_RATIO > memo.seen + seen:
                    memo.give_up()
                    return None
                answer = self._infer_node(fields[offset:end], inputs, outputs)
                if answer is None:
                    return None
                memo[key] = answer
            seen += 1
            offset = end
            plain, knowns, encodings = answer
            if plain:  # the usual case: every output typed, in full, no shape-like integer
                if len(outputs) == 1:
                    typed[outputs[0]] = knowns[0]
                else:
                    typed.update(zip(outputs, knowns))
                continue
            for name, known, encoding in zip(outputs, knowns, encodings):
                if not name:
                    continue
                if known is None or (known[0] not in FLOAT_DTYPES and _shape_like(*known)):
                    return None
                if encoding is not None:
                    partial[name] = encoding
                types[name] = known
        memo.seen += seen
        computed = list(filter(None, _outputs(records)))
        found.update(zip(computed, map(types.__getitem__, computed)))
        return found

    def _input_keys(self, inputs: Sequence[str], op_type: str) -> tuple[Any, ...] | None:
        """What a node's inputs contribute to what decides its output types: each one's type
        (a partly known shape by its encoding), or, for a small initializer read by an op
        whose inference may read its contents, the tensor itself; None for an omitted input.
        None where an input has no type."""
        keys: list[Any] = []
        for name in inputs:
            if not name:
                keys.append(None)
                continue
            encoding = self.partial.get(name)
            tensor = self.small_initializers.get(name)
            if encoding is not None:
                keys.append(("partly known", encoding))
            elif tensor is not None and op_type not in _TYPE_ONLY_OPS:
                keys.append(self.memo.tensor_contents(tensor))
            else:
                known = self.types.get(name)
                if known is None:
                    return None
                keys.append(known)
        return tuple(keys)

    def _type_constants(self, large_initializers: list[onnx.TensorProto]) -> None:
        """Enter the initializers and the graph's inputs in `types`, so that `_infer_by_node`
        finds what a node reads in one table (and a slice declares a large initializer it
        reads as an input of that type): each (dtype, shape) made once and shared."""
        shared: dict[Any, Any] = {}
        named = chain(self.small_initializers.items(),
                      ((tensor.name, tensor) for tensor in large_initializers))
        for name, tensor in named:
            constant: Any = (dtype_name(tensor.data_type), tuple(tensor.dims))
            self.types[name] = shared.setdefault(constant, constant)
        for name, info in self.graph_inputs.items():
            declared = _dtype_and_shape(info.type)
            if declared is None:
                continue
            self.types[name] = shared.setdefault(declared, declared)
            if declared[1] is None and info.type.tensor_type.HasField("shape"):
                self.partial[name] = info.type.SerializeToString()

    def _infer_node(self, field: bytes | bytearray, inputs: Sequence[str],
                    outputs: Sequence[str]) -> _NodeTypes | None:
        """One node's output types, inferred as a graph of that node alone (its inputs declared
        as the slices declare them). None where the inference fails."""
        sliced = onnx.GraphProto(name=self.graph_name)
        if not self._declare_inputs(sliced, list(dict.fromkeys(n for n in inputs if n))):
            return None
        graph = bytearray(field)
        graph += sliced.SerializeToString()
        inferred = self._run_inference(graph)
        if inferred is None:
            return None
        partly: dict[str, bytes] = {}
        found = _types(inferred, inferred, partly)
        knowns = tuple(found.get(name) for name in outputs)
        encodings = tuple(partly.get(name) for name in outputs)
        plain = all(outputs) and not partly.keys() & set(outputs) and all(
            known is not None and (known[0] in FLOAT_DTYPES or not _shape_like(*known))
            for known in knowns)
        return _NodeTypes(plain, knowns, encodings)

    def _run_inference(self, graph: bytes | bytearray) -> onnx.ModelProto | None:
        """onnx's inference of the model with `graph` (a GraphProto's encoding) as its graph,
        in the strict, type-checking mode where the check asks for it; None where it raises
        (as in `_inferred`: the whole graph's inference decides then)."""
        encoded = bytearray(self.head)
        append_field(encoded, MODEL_GRAPH, graph)
        try:
            with ort_registry.quiet():
                return onnx.shape_inference.infer_shapes(
                    bytes(encoded), check_type=self.type_check, strict_mode=self.type_check,
                    data_prop=True)
        except Exception:  # onnx raises several exception types
            return None

    def _shape_like_sources(self, reads: list[str]) -> list[int]:
        """The earlier nodes that compute the shape-like values among `reads`, and those that
        compute the shape-like values they read in turn, in graph order."""
        chosen: set[int] = set()
        stack = [name for name in reads if name in self.producer]
        while stack:
            index = self.producer[stack.pop()]
            if index not in chosen:
                chosen.add(index)
                stack.extend(name for name in self.shape_like_nodes[index][0]
                             if name in self.producer)
        return sorted(chosen)

    def _declare_inputs(self, sliced: onnx.GraphProto, reads: list[str]) -> bool:
        """Give the slice what it reads: the model's inputs and small initializers as they are,
        earlier slices' values with their inferred types. False when one has none."""
        for name in reads:
            if name in self.small_initializers:
                sliced.initializer.append(self.small_initializers[name])
            elif name in self.graph_inputs:
                sliced.input.append(self.graph_inputs[name])
            elif name in self.partial:
                info = sliced.input.add(name=name)
                info.type.MergeFromString(self.partial[name])
            else:
                dtype, shape = self.types.get(name, (None, None))
                if dtype is None:
                    return False  # read before it is typed: the whole graph is inferred
                sliced.input.append(onnx.helper.make_tensor_value_info(
                    name, elem_type_code(dtype), list(shape) if shape is not None else None))
        return True


#: Ops whose output types and shapes follow from their inputs' types alone, never from the
#: contents of an input (as a Reshape's follow from its target's): a small initializer one of
#: them reads counts for `_NodeMemo` by its type, so that the biases of a hundred layers do not
#: make a hundred different nodes.
_TYPE_ONLY_OPS = frozenset({
    "Abs", "Add", "And", "BatchNormalization", "Cast", "Conv", "Div", "Equal", "Erf", "Exp",
    "Gelu", "Gemm", "Greater", "GreaterOrEqual", "Identity", "InstanceNormalization",
    "LayerNormalization", "LeakyRelu", "Less", "LessOrEqual", "Log", "LogSoftmax", "MatMul",
    "Max", "Min", "Mod", "Mul", "Neg", "Not", "Or", "Pow", "PRelu", "Reciprocal", "Relu",
    "Sigmoid", "Sign", "Softmax", "Sqrt", "Sub", "Tanh", "Transpose", "Where", "Xor"})

#: `_Slicer._infer_by_node` infers this many nodes of a slice before it judges whether the
#: graph repeats itself, and gives up once more than one node in `_MEMO_MISS_RATIO` had to be
#: inferred alone (a graph without repeated structure is inferred faster a slice at a time).
_MEMO_TRIAL = 256
_MEMO_MISS_RATIO = 20


class _NodeTypes(NamedTuple):
    """A node's output types as `_NodeMemo` keeps them."""

    #: Every output is there, typed in full, and none is a shape-like integer: the types go
    #: in as they are.
    plain: bool
    #: Per output: (dtype, concrete shape or None), None where inference found no type.
    knowns: tuple[tuple[str | None, tuple[int, ...] | None] | None, ...]
    #: Per output: the encoded type where its shape is partly known, else None.
    encodings: tuple[bytes | None, ...]


class _NodeMemo(dict[tuple[bytes, tuple[Any, ...], Any], _NodeTypes]):
    """A node's output types by what decides them: its encoding without its value names and
    node name (op, domain, attributes) and what it reads (each input's type, or a small
    constant's contents). In a graph of repeated layers nearly every node is like one before
    it, so that onnx's inference runs once per distinct node rather than once per node."""

    def __init__(self) -> None:
        super().__init__()
        self.enabled = True
        #: Nodes looked up, and those inferred alone since no node before was like them.
        self.seen = 0
        self.misses = 0
        self._tensor_keys: dict[str, Any] = {}

    def give_up(self) -> None:
        """Stop memoizing: the graph has too little repeated structure to gain from it."""
        self.enabled = False
        self.clear()

    def tensor_contents(self, tensor: onnx.TensorProto) -> Any:
        """A small initializer's type and contents (its encoding without its name)."""
        key = self._tensor_keys.get(tensor.name)
        if key is None:
            copy = onnx.TensorProto()
            copy.CopyFrom(tensor)
            copy.ClearField("name")
            key = self._tensor_keys[tensor.name] = ("contents", copy.SerializeToString())
        return key


def _op_tails(fields: bytes | bytearray, records: Sequence[NodeNames]
              ) -> list[tuple[int, bytes]] | None:
    """For each node of a run of GraphProto node fields: where its field ends in `fields`,
    and its encoding from its op type on (op, domain, attributes: everything but its value
    names and node name, which protobuf writes first). None unless every name is ASCII and
    shorter than 128 bytes, so that the names' lengths give where each op type starts (and
    a node whose op type is not found there: an encoding in another field order)."""
    inputs = list(map(itemgetter(1), records))
    outputs = list(map(itemgetter(2), records))
    names = list(chain(chain.from_iterable(inputs), chain.from_iterable(outputs)))
    if names and (max(map(len, names)) >= 128 or not "".join(names).isascii()):
        return None
    # Each name takes its key, a one-byte length and its bytes: two bytes more than its length.
    name_bytes = list(map(add, map(len, map("".join, inputs)), map(len, map("".join, outputs))))
    name_count = list(map(add, map(len, inputs), map(len, outputs)))
    tails = []
    offset = 0
    size = len(fields)
    for op_type, names_length, count in zip(map(itemgetter(0), records), name_bytes,
                                            name_count):
        if fields[offset] != _NODE_KEY:
            return None
        at = offset + 2
        length = fields[at - 1]
        if length >= 0x80:  # most nodes take 128 bytes or more: a two-byte length, read here
            second = fields[at]
            at += 1
            length = (length & 0x7F) | (second << 7)
            if second >= 0x80:
                length, at = read_varint(fields, offset + 1)
        end = at + length
        at += names_length + 2 * count
        if at < end and fields[at] == _NAME_KEY:
            length = fields[at + 1]
            at += 2 + length
            if length >= 0x80:
                length, at = read_varint(fields, at - length - 1)
                at += length
        field = _op_type_field(op_type)
        if end > size or fields[at:at + len(field)] != field:
            return None
        tails.append((end, bytes(fields[at:end])))
        offset = end
    return tails


#: The one-byte keys of GraphProto.node and NodeProto.name.
_NODE_KEY = field_key(GRAPH_NODE)[0]
_NAME_KEY = field_key(NODE_NAME)[0]


@cache
def _op_type_field(op_type: str) -> bytes:
    """NodeProto's op_type field holding `op_type`, encoded."""
    encoded = op_type.encode()
    return field_key(NODE_OP_TYPE) + varint(len(encoded)) + encoded


def _shape_like(dtype: str | None, shape: tuple[int, ...] | None) -> bool:
    """Whether a value may carry what data propagation tracks (a shape, a size, an index): a
    scalar or short vector, or a non-float value of unknown shape."""
    if shape is None:
        return dtype is not None and dtype not in FLOAT_DTYPES
    return len(shape) <= 1 and math.prod(shape) <= SMALL_INITIALIZER


def _slice_reads(nodes: Sequence[tuple[Any, Sequence[str], Sequence[str]]]
                 ) -> tuple[list[str], set[str]]:
    """The values a run of nodes in graph order reads from before it (in order of first read),
    and the values it produces. Each node is (anything, input names, output names)."""
    produced = set(_outputs(nodes))
    # In graph order a value read and produced by the run is produced before it is read.
    first_reads = dict.fromkeys(chain.from_iterable(map(itemgetter(1), nodes)))
    return [name for name in first_reads if name and name not in produced], produced


def _node_names(nodes: Iterable[onnx.NodeProto]) -> list[NodeNames]:
    """The `NodeNames` of parsed nodes, as an emitter's `EncodedNodes` records them."""
    return [(node.op_type, tuple(node.input), tuple(node.output)) for node in nodes]


def _outputs(nodes: Sequence[tuple[Any, Sequence[str], Sequence[str]]]) -> Iterator[str]:
    """The output names of (anything, input names, output names) nodes, in order."""
    return chain.from_iterable(map(itemgetter(2), nodes))


def _types(inferred: onnx.ModelProto | None, model: onnx.ModelProto,
           partial: dict[str, bytes] | None = None) -> Types:
    """Value name -> (dtype, concrete shape or None) as inferred (or, failing that, declared).
    `partial`: a dict to fill with the encoded TypeProto of each value whose shape is only
    partly known (a symbolic or missing dimension)."""
    graph = inferred.graph if inferred is not None else model.graph
    # list() first: iterating upb's repeated fields directly costs ~5x more per element.
    infos = list(graph.input) + list(graph.value_info) + list(graph.output)
    # Maps and compresses run in C: no Python per value (a million of them).
    names = list(map(attrgetter("name"), infos))
    # Most values share a handful of types: each distinct TypeProto (by its bytes, one protobuf
    # call) is read once, not field by field per value (~10 calls each, seconds at 1M values).
    keys = list(map(methodcaller("SerializeToString"), map(attrgetter("type"), infos)))
    by_type = _TypesByEncoding()
    known = list(map(by_type.__getitem__, keys))
    # A value without a tensor type (None, left out) does not hide one declared elsewhere.
    result = cast(Types, dict(compress(zip(names, known), known)))
    if partial is not None and by_type.partly:
        partial.update(compress(zip(names, keys), map(by_type.partly.__contains__, keys)))
    return result


class _TypesByEncoding(dict[bytes, tuple[str | None, tuple[int, ...] | None] | None]):
    """An encoded TypeProto -> (dtype, concrete shape or None), None for no tensor element
    type; each read once. `partly`: the encodings whose shape is there but partly known."""

    def __init__(self) -> None:
        super().__init__()
        self.partly: set[bytes] = set()

    def __missing__(self, key: bytes) -> tuple[str | None, tuple[int, ...] | None] | None:
        type_proto = onnx.TypeProto.FromString(key)
        known = self[key] = _dtype_and_shape(type_proto)
        if known is not None and known[1] is None and type_proto.tensor_type.HasField("shape"):
            self.partly.add(key)
        return known


def _dtype_and_shape(type_proto: onnx.TypeProto
                     ) -> tuple[str | None, tuple[int, ...] | None] | None:
    """(dtype, concrete shape or None) of a tensor type; None for no tensor element type."""
    tensor_type = type_proto.tensor_type
    elem_type = tensor_type.elem_type
    if not elem_type:
        return None
    dims = list(tensor_type.shape.dim)
    shape = None
    if tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
        shape = tuple(d.dim_value for d in dims)
    return dtype_name(elem_type), shape


def validation_input_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """The shapes validation feeds the graph inputs when no inputs are given."""
    initializers = {t.name for t in model.graph.initializer}
    return {info.name: tuple(validation_shape(info)) for info in model.graph.input
            if info.name not in initializers and info.type.HasField("tensor_type")}


class _ActivationTraffic:
    """The bytes the top-level graph's activations move, summed per type as nodes are counted
    (`add`): each is written once by its producer and read once per consumer and per graph
    output it is; constants (initializers, Constant outputs) are not activations, and reads by
    nodes of nested graphs (captures) are the subgraph's traffic, not counted."""

    def __init__(self, graph: onnx.GraphProto):
        self.constants = {tensor.name for tensor in graph.initializer}
        self.inputs = [info.name for info in graph.input]
        self.outputs = [info.name for info in graph.output]
        #: Each distinct type found, by its number.
        self.numbers = _Numbering()
        #: The activations found so far -> their type's number.
        self.type_numbers: dict[str, int] = {}
        #: Per type number: accesses, and activations of that type.
        self.accesses: Counter[int | None] = Counter()
        self.values: Counter[int | None] = Counter()

    def add(self, nodes: Sequence[NodeNames], types: Types) -> None:
        """Count nodes given as (op type, input names, output names), with the types of what
        they read and write (`types`; found before for what they read from earlier nodes)."""
        self.constants.update([outputs[0] for op_type, _, outputs in nodes
                               if op_type == "Constant" and outputs])
        # Types by number: counting hashes an int, not a (dtype, shape) tuple, per access.
        self.type_numbers.update(zip(types, map(self.numbers.__getitem__, types.values())))
        for name in self.constants.intersection(types):
            del self.type_numbers[name]
        # Type lookups and counts in C (maps of dict.get, Counter.update): no Python per name.
        number_of = self.type_numbers.get
        written = list(map(number_of, _outputs(nodes)))
        self.values.update(written)
        self.accesses.update(written)
        self.accesses.update(map(number_of, chain.from_iterable(map(itemgetter(1), nodes))))

    def bytes_moved(self, input_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        """`cost.bytes_moved` of what was counted, graph inputs and outputs added."""
        number_of = self.type_numbers.get
        values = self.values + Counter(number_of(name) for name in self.inputs
                                       if name not in self.constants)
        accesses = self.accesses + Counter(map(number_of, self.outputs))
        types = self.numbers.types
        traffic = bytes_moved((*types[number], accesses[number], values[number])
                              for number in {**values, **accesses} if number is not None)
        traffic["input_shapes"] = {name: list(shape) for name, shape in input_shapes.items()}
        return traffic


class _Numbering(dict[tuple[str | None, tuple[int, ...] | None], int]):
    """A number for each distinct (dtype, shape), given when first looked up; `types[n]` is
    the type numbered n."""

    def __init__(self) -> None:
        super().__init__()
        self.types: list[tuple[str | None, tuple[int, ...] | None]] = []

    def __missing__(self, known: tuple[str | None, tuple[int, ...] | None]) -> int:
        number = self[known] = len(self.types)
        self.types.append(known)
        return number


def activation_traffic(model: onnx.ModelProto, input_shapes: Mapping[str, tuple[int, ...]]
                       ) -> dict[str, Any]:
    """`cost.bytes_moved` for the top-level graph's float activations at `input_shapes`, each
    counted once written and once per read (`_ActivationTraffic`)."""
    return checked_activation_traffic(model, input_shapes)[0]


def checked_activation_traffic(model: onnx.ModelProto,
                               input_shapes: Mapping[str, tuple[int, ...]],
                               op_kinds: set[tuple[str, str]] | None = None,
                               type_check: bool = False) -> tuple[dict[str, Any], bool]:
    """`activation_traffic`, and whether its shape inference passed the type and shape check of
    onnx.checker's full check (asked for with `type_check`; see `_inferred`). `op_kinds`: the
    nodes' (domain, op type) pairs, nested graphs included, when known (else read off the
    model)."""
    if op_kinds is None:
        op_kinds = {(node.domain, node.op_type) for g in walk_graph_protos(model.graph)
                    for node in g.node}
    traffic = _traffic_in_slices(model, input_shapes, type_check) \
        if _sliceable(len(model.graph.node), op_kinds) else None
    checked = type_check  # every slice passed the type check it was asked for
    if traffic is None:
        inferred, checked = _inferred(model, input_shapes, op_kinds, type_check)
        types = _types(inferred, model)
        del inferred
        traffic = _ActivationTraffic(model.graph)
        traffic.add(_node_names(list(model.graph.node)), types)
    return traffic.bytes_moved(input_shapes), checked


def encoded_activation_traffic(model: EncodedModel, op_kinds: set[tuple[str, str]],
                               type_check: bool = False) -> tuple[dict[str, Any], bool] | None:
    """`checked_activation_traffic` of a model still in its encoding, at the validation input
    shapes, where its graph is inferred in slices read from the encoding (the model is never
    parsed whole); None where it is not (`SLICE_NODES` nodes or fewer, ops with bodies or from
    other domains) or a slice fails: the caller infers the parsed model then. `op_kinds`: the
    nodes' (domain, op type) pairs, nested graphs included."""
    if model.nodes is None or not _sliceable(len(model.nodes), op_kinds):
        return None
    shell = model.shell()
    input_shapes = validation_input_shapes(shell)
    traffic = _traffic_in_slices(shell, input_shapes, type_check, model.nodes)
    if traffic is None:
        return None
    return traffic.bytes_moved(input_shapes), type_check
