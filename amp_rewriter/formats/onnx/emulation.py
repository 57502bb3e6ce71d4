"""How onnxruntime's CPU provider is made to run a low-precision model the way the target would:
one entry point, `emulate_low_precision(model, policy=...)`, for validation, `check`, `--auto`,
`diagnose` and the tests.

Policies:

- `MISSING_KERNELS` (validation's): only the nodes the CPU provider has no low-precision kernel
  for compute in fp32, their low-precision outputs rounded where they are produced; the rest run
  as they are, and each output says how it was computed.
- `EVERY_NODE`: the same for every node with fp16/bf16 tensors: every rounding and overflow of the
  target happens (a plain CPU run computes an fp16 op without a CPU kernel in fp32 and drops the
  casts around it, so a cast of -3.4e38 to fp16 is not -inf there).
- `WHOLE_MODEL` (`--auto`'s and `diagnose`'s, `execution.Execution`): the whole model becomes
  fp32 with each low-precision tensor rounded where it is produced; initializers stay in their
  dtype (half the memory) and are widened right before their first reader; graph inputs become
  fp32 (feed them values already rounded: `execution.round_feeds`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from ...ir import Graph, Node, TypeGroup, Value
from ...validation import EMULATED
from . import ort_registry
from .load import (
    all_tensors,
    load_external_data,
    load_onnx,
    model_opsets,
    schema_since_version,
)
from .rules import CONTROL_FLOW_OPS

#: The policies of `emulate_low_precision`.
MISSING_KERNELS = "missing-kernels"
EVERY_NODE = "every-node"
WHOLE_MODEL = "whole-model"
POLICIES = (MISSING_KERNELS, EVERY_NODE, WHOLE_MODEL)
_LOW = {onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16"}


def emulate_low_precision(model: onnx.ModelProto, base_dir: str | os.PathLike | None = None,
                          policy: str = MISSING_KERNELS, copy: bool = True) -> Emulation:
    """A model onnxruntime's CPU provider runs like the target would, by `policy` (see the
    module's docstring), and what was emulated. External data is read from `base_dir`;
    `copy=False` rewrites `model` itself (a caller that owns it saves the memory)."""
    if policy == WHOLE_MODEL:
        return Emulation(_emulate_whole_model(model, base_dir, in_place=not copy))
    if policy not in POLICIES:
        raise ValueError(f"unknown emulation policy {policy!r} (expected one of "
                         f"{', '.join(POLICIES)})")
    return _emulate_nodes(model, base_dir, policy == EVERY_NODE, copy)


#: How an output was computed in a validation run (OutputComparison.computed, with EMULATED).
COMPUTED_FP32 = "fp32"
COMPUTED_REAL = "low-precision kernels"


@dataclass
class Emulation:
    """A converted model prepared for onnxruntime's CPU provider, and what was emulated.

    model: the model to run; `emulated`: "name (op)" of the nodes computed in fp32 with their
    low-precision outputs rounded; `outputs`: output name -> (how it was computed, the emulated
    ops on its path).
    """

    model: onnx.ModelProto
    emulated: list[str] = field(default_factory=list)
    outputs: dict[str, tuple[str, list[str]]] = field(default_factory=dict)


_LOW_ELEM_TYPES = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}


def _cpu_runs_in_low_precision(node: Node, opsets: dict[str, int]) -> bool:
    """Whether onnxruntime's CPU provider has a kernel for the node with its dtypes (nodes we
    know nothing about, control flow and casts count as runnable: they are left to onnxruntime)."""
    if node.op_type in CONTROL_FLOW_OPS or node.op_type == "Cast" or not node.has_schema:
        return True
    domain = node.domain or ""
    since = schema_since_version(node.op_type, domain, opsets.get(domain, 0))
    if since is None:
        return True
    dtypes = []
    for group in node.type_groups:
        values = [node.inputs[s] for s in group.input_slots] + \
                 [node.outputs[s] for s in group.output_slots]
        dtype = next((v.dtype for v in values if v is not None and v.dtype), None)
        if dtype is not None:
            dtypes.append((group.name.split("[")[0], dtype))
    return ort_registry.cpu_kernel_for(node.op_type, domain, since, dtypes) is not False


def _low_values(node: Node) -> tuple[list[int], list[int]]:
    """The node's input and output slots that carry fp16/bf16 tensors (a value of unknown dtype
    takes its type group's)."""
    def low(value: Value | None, group: TypeGroup | None) -> bool:
        if value is None:
            return False
        dtype = value.dtype or (group.current_dtype if group is not None else None)
        return dtype in _LOW_ELEM_TYPES

    ins = [i for i, v in enumerate(node.inputs)
           if low(v, node.input_group[i] if i < len(node.input_group) else None)]
    outs = [i for i, v in enumerate(node.outputs)
            if low(v, node.output_group[i] if i < len(node.output_group) else None)]
    return ins, outs


def _fill_body_dtypes(graph: Graph) -> None:
    """Body inputs a model leaves untyped (loop-carried values) take their group's dtype."""
    for node in graph.walk_nodes():
        for group in node.type_groups:
            dtype = group.current_dtype
            for value in group.inner_defs:
                if value.dtype is None:
                    value.dtype = dtype


def _emulate_nodes(model: onnx.ModelProto, base_dir: str | os.PathLike | None,
                   emulate_all: bool, copy: bool) -> Emulation:
    """The MISSING_KERNELS and EVERY_NODE policies (see `emulate_low_precision`).

    Every node with fp16/bf16 tensors that the CPU provider has no kernel for in those dtypes
    (fused contrib ops in fp16, nearly every op in bf16; `emulate_all` takes every such node)
    computes in fp32 instead: its low-precision inputs are cast to fp32 and each low-precision
    output is rounded to its dtype right where it is produced (Cast to fp16/bf16), which is what a
    low-precision kernel with fp32 accumulation gives. Nodes with a real kernel run as they are.
    bf16 graph inputs and outputs are fed and read as fp32 (numpy has no bf16), rounded at the
    boundary. External data is read into the copy (from `base_dir`, with the loader's checks on
    where it lies). `copy=False` rewrites `model` itself (a caller that owns it saves the memory).
    """
    if copy:
        emulated = onnx.ModelProto()
        emulated.CopyFrom(model)
    else:
        emulated = model
    if base_dir is not None and _has_external(emulated):
        load_external_data(emulated, Path(base_dir))
    ir_model = load_onnx(emulated)
    _fill_body_dtypes(ir_model.graph)
    opsets = model_opsets(emulated)
    f32 = onnx.TensorProto.FLOAT
    result = Emulation(emulated)
    emulated_nodes: set[Node] = set()
    # Inner graphs first: re-adding an outer node copies its body, so bodies must be final by then.
    for graph in reversed(list(ir_model.graph.walk_graphs())):
        proto = graph.handle
        widened: dict[str, str] = {}  # a low-precision value -> its fp32 copy in this graph
        nodes: list[onnx.NodeProto] = []
        for node in graph.nodes:
            low_in, low_out = _low_values(node)
            if not (low_in or low_out) or (
                    not emulate_all and _cpu_runs_in_low_precision(node, opsets)) \
                    or node.op_type in CONTROL_FLOW_OPS or node.op_type == "Cast":
                nodes.append(node.handle)
                continue
            emulated_nodes.add(node)
            result.emulated.append(f"{node.name} ({node.qualified_op})")
            for slot in low_in:
                value = node.inputs[slot]
                assert value is not None
                if value.name not in widened:  # names are unique model-wide (bodies included)
                    widened[value.name] = ir_model.unique_name(f"{value.name}__fp32_emulation")
                    nodes.append(onnx.helper.make_node("Cast", [value.name],
                                                       [widened[value.name]], to=f32))
                node.handle.input[slot] = widened[value.name]
            _widen_tensor_attributes(node.handle)
            nodes.append(node.handle)
            for slot in low_out:
                value = node.outputs[slot]
                group = node.output_group[slot] if slot < len(node.output_group) else None
                assert value is not None
                dtype = value.dtype or (group.current_dtype if group is not None else None)
                raw = ir_model.unique_name(f"{value.name}__fp32_emulated")
                node.handle.output[slot] = raw
                nodes.append(onnx.helper.make_node("Cast", [raw], [value.name],
                                                   to=_LOW_ELEM_TYPES[dtype or ""]))
        del proto.node[:]
        proto.node.extend(nodes)
        del proto.value_info[:]  # the emulated values' types changed; onnxruntime infers them
        if graph.parent is None:
            _fp32_boundary(proto, ir_model.unique_name)
    result.outputs = _how_outputs_were_computed(ir_model.graph, emulated_nodes)
    return result


def _has_external(model: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in all_tensors(model.graph))


def _widen_tensor_attributes(node: onnx.NodeProto) -> None:
    """Low-precision tensor attributes (ConstantOfShape's value) of an emulated node as fp32."""
    for attr in node.attribute:
        if attr.HasField("t") and attr.t.data_type in _LOW_ELEM_TYPES.values():
            array = onnx.numpy_helper.to_array(attr.t).astype(np.float32)
            attr.t.CopyFrom(onnx.numpy_helper.from_array(array, attr.t.name))


def _fp32_boundary(graph: onnx.GraphProto, fresh: Callable[[str], str]) -> None:
    """bf16 graph inputs and outputs become fp32 ones, rounded to bf16 where they cross."""
    bf16, f32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    initializers = {t.name for t in graph.initializer}
    head = []
    for info in graph.input:
        if info.type.tensor_type.elem_type == bf16 and info.name not in initializers:
            outer = fresh(f"{info.name}__fp32_input")
            head.append(onnx.helper.make_node("Cast", [outer], [info.name], to=bf16))
            info.name = outer
            info.type.tensor_type.elem_type = f32
    tail = []
    for info in graph.output:
        if info.type.tensor_type.elem_type == bf16:
            inner = fresh(f"{info.name}__bf16_output")
            for node in graph.node:
                for i, name in enumerate(node.output):
                    if name == info.name:
                        node.output[i] = inner
                for i, name in enumerate(node.input):
                    if name == info.name:
                        node.input[i] = inner
            tail.append(onnx.helper.make_node("Cast", [inner], [info.name], to=f32))
            info.type.tensor_type.elem_type = f32
    if head or tail:
        nodes = head + list(graph.node) + tail
        del graph.node[:]
        graph.node.extend(nodes)


def _how_outputs_were_computed(graph: Graph, emulated_nodes: set[Node]
                               ) -> dict[str, tuple[str, list[str]]]:
    """Output name -> (fp32, low-precision kernels or emulated; the emulated ops on its path)."""
    result = {}
    for output in graph.outputs:
        seen: set[Node] = set()
        emulated_ops: set[str] = set()
        low = output.dtype in _LOW_ELEM_TYPES
        stack = [output.producer] if output.producer is not None else []
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            members = [node, *(inner for sub in node.subgraphs.values()
                               for inner in sub.walk_nodes())]
            for member in members:
                if member in emulated_nodes:
                    emulated_ops.add(member.qualified_op)
                ins, outs = _low_values(member)
                low = low or bool(ins or outs)
                for value in member.inputs:
                    if value is not None and value.producer is not None \
                            and value.producer not in seen:
                        stack.append(value.producer)
        if emulated_ops:
            result[output.name] = (EMULATED, sorted(emulated_ops))
        else:
            result[output.name] = (COMPUTED_REAL if low else COMPUTED_FP32, [])
    return result


def _emulate_whole_model(model: onnx.ModelProto, base_dir: str | os.PathLike | None,
                         in_place: bool) -> onnx.ModelProto:
    """The WHOLE_MODEL policy: an fp32 copy of `model` that rounds every fp16/bf16 tensor to its
    dtype where it is produced: op outputs are rounded with a cast to the low dtype and back;
    initializers stay in their dtype (half the memory) and are read through a cast to fp32.
    Graph inputs become fp32: feed them values already rounded (see `execution.round_feeds`)."""
    if in_place:
        emulated = model
    else:
        emulated = onnx.ModelProto()
        emulated.CopyFrom(model)
    ir_model = load_onnx(emulated, base_dir)
    f32 = onnx.TensorProto.FLOAT
    codes = {name: code for code, name in _LOW.items()}
    # Inner graphs first: re-adding an outer node copies its body, so bodies must be final by then.
    for graph in reversed(list(ir_model.graph.walk_graphs())):
        proto: onnx.GraphProto = graph.handle
        position: dict[Node, int] = {node: index for index, node in enumerate(graph.nodes)}
        nodes: list[onnx.NodeProto] = []
        declared_inputs = {info.name: info for info in proto.input}
        #: node -> the casts of low-precision initializers it reads first: each cast runs right
        #: before its first reader, so that the fp32 copies are not all alive at once.
        widen_before: dict[int, list[onnx.NodeProto]] = {}
        for tensor in proto.initializer:
            if tensor.data_type in _LOW:
                raw = f"{tensor.name}__amp_emulated"
                cast = onnx.helper.make_node("Cast", [raw], [tensor.name], to=f32)
                value = graph.values.get(tensor.name)
                first = min((position[consumer] for consumer, _ in value.uses
                             if consumer in position), default=None) \
                    if value is not None else None
                if first is not None:
                    widen_before.setdefault(first, []).append(cast)
                else:  # read by a body, or by nothing: at the start
                    nodes.append(cast)
                if tensor.name in declared_inputs:  # IR < 4 lists initializers as inputs
                    declared_inputs[tensor.name].name = raw
                tensor.name = raw
        for index, node in enumerate(graph.nodes):
            nodes.extend(widen_before.get(index, ()))
            nodes.append(node.handle)
            for slot, value in enumerate(node.outputs):
                if value is None or value.dtype not in codes:
                    continue
                raw = f"{value.name}__amp_emulated"
                node.handle.output[slot] = raw
                code = codes[value.dtype]
                if node.op_type == "Cast":  # the cast itself rounds; widen its result
                    nodes.append(onnx.helper.make_node("Cast", [raw], [value.name], to=f32))
                else:
                    nodes.extend(_round_pair(raw, value.name, code))
        del proto.node[:]
        proto.node.extend(nodes)
        for node in proto.node:
            for attr in node.attribute:
                if attr.HasField("t") and attr.t.data_type in _LOW:
                    array = onnx.numpy_helper.to_array(attr.t).astype(np.float32)
                    attr.t.CopyFrom(onnx.numpy_helper.from_array(array, attr.t.name))
        for info in list(proto.input) + list(proto.output):
            if info.type.tensor_type.elem_type in _LOW and not info.name.endswith(
                    "__amp_emulated"):
                info.type.tensor_type.elem_type = f32
        del proto.value_info[:]
    return emulated


def _round_pair(raw: str, name: str, code: int) -> list[onnx.NodeProto]:
    rounded = f"{raw}_rounded"
    return [onnx.helper.make_node("Cast", [raw], [rounded], to=code),
            onnx.helper.make_node("Cast", [rounded], [name], to=onnx.TensorProto.FLOAT)]


