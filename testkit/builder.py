"""A tiny ONNX graph builder for the pass tests, plus helpers to run and inspect conversions.

    b = GraphBuilder(opset=17)
    x = b.input("x", [2, 8])                       # float32 input
    h = b.op("MatMul", x, b.weight("w", [8, 8]), name="mm1")
    r = b.op("Relu", h, name="relu")
    b.output(b.op("Exp", r, name="exp"))
    model = b.build()                              # checked with onnx.checker full_check

Values are plain strings (their ONNX names). `op` returns one name, or a tuple when `outputs > 1`.
Attributes are keyword arguments (`b.op("Softmax", h, axis=-1)`); a `GraphProto` attribute (If,
Loop) comes from `b.subgraph(...)`, a nested builder sharing this one's name counter and weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

#: numpy dtype -> ONNX elem type, for inputs, outputs and value_info.
_ELEM = {
    np.dtype(np.float32): onnx.TensorProto.FLOAT,
    np.dtype(np.float16): onnx.TensorProto.FLOAT16,
    np.dtype(np.float64): onnx.TensorProto.DOUBLE,
    np.dtype(np.int64): onnx.TensorProto.INT64,
    np.dtype(np.int32): onnx.TensorProto.INT32,
    np.dtype(np.bool_): onnx.TensorProto.BOOL,
}

#: onnxruntime's type strings -> numpy dtype (to feed a model whose inputs were lowered).
_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
}


def elem_type(dtype: Any) -> int:
    """ONNX elem type code for a numpy dtype (or an ONNX code passed through)."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        return dtype
    return _ELEM[np.dtype(dtype)]


class GraphBuilder:
    """Build one ONNX graph (and, via `build`, a model) in a few lines."""

    def __init__(self, opset: int = 17, *, ir_version: int = 8, seed: int = 0,
                 name: str = "main", _parent: GraphBuilder | None = None):
        self.opset = opset
        self.ir_version = ir_version
        self.name = name
        self._parent = _parent
        self._rng: np.random.Generator | None = (np.random.default_rng(seed) if _parent is None
                                                  else None)
        self._counter: list[int] = [0] if _parent is None else _parent._counter
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self.functions: list[onnx.FunctionProto] = []
        self.extra_opsets: dict[str, int] = {}
        self.metadata: dict[str, str] = {}
        self.doc_string = ""
        self._infer_outputs: set[str] = set()

    # -- values ---------------------------------------------------------------------------------
    def _root(self) -> GraphBuilder:
        return self if self._parent is None else self._parent._root()

    def fresh(self, base: str) -> str:
        """A new unique name (shared across nested builders)."""
        self._counter[0] += 1
        return f"{base}_{self._counter[0]}"

    def input(self, name: str, shape: Sequence[int | str | None] | None,
              dtype: Any = np.float32) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type(dtype), shape))
        return name

    def const(self, name: str, array: Any, dtype: Any = None) -> str:
        """An initializer holding `array` (float arrays default to float32)."""
        array = np.asarray(array)
        if dtype is not None:
            array = array.astype(dtype)
        elif array.dtype == np.float64:
            array = array.astype(np.float32)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def weight(self, name: str, shape: Sequence[int], scale: float = 0.1) -> str:
        """A float32 initializer drawn from N(0, scale^2) with the builder's seeded generator."""
        rng = self._root()._rng
        assert rng is not None  # the root builder owns the generator
        return self.const(name, (rng.standard_normal(tuple(shape)) * scale).astype(np.float32))

    def value_info_for(self, name: str, shape: Sequence[int | str | None] | None,
                       dtype: Any = np.float32) -> None:
        self.value_info.append(helper.make_tensor_value_info(name, elem_type(dtype), shape))

    # -- nodes ----------------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: str | None, name: str | None = None, outputs: int = 1,
           output_names: Sequence[str] | None = None, domain: str = "", **attrs: Any):
        """Add a node; returns its output name (a tuple of names when `outputs` > 1)."""
        name = name or self.fresh(op_type.lower())
        if output_names is None:
            output_names = [name] if outputs == 1 else [f"{name}:{i}" for i in range(outputs)]
        node = helper.make_node(op_type, ["" if i is None else i for i in inputs],
                                list(output_names), name=name, domain=domain or None, **attrs)
        self.nodes.append(node)
        return output_names[0] if len(output_names) == 1 else tuple(output_names)

    def output(self, *names: str, dtype: Any = None,
               shape: Sequence[int | str | None] | None = None) -> None:
        """Declare graph outputs. Without dtype/shape, `build` fills them by ONNX shape inference
        (falling back to float32 of unknown shape)."""
        for name in names:
            info = helper.make_tensor_value_info(
                name, elem_type(np.float32 if dtype is None else dtype), shape)
            self.outputs.append(info)
            if dtype is None and shape is None:
                self._infer_outputs.add(name)

    def subgraph(self, name: str) -> GraphBuilder:
        """A nested builder for an If branch or Loop/Scan body; call `.graph()` on it."""
        return GraphBuilder(self.opset, name=name, _parent=self)

    def function(self, domain: str, name: str, inputs: Sequence[str], outputs: Sequence[str],
                 nodes: Sequence[onnx.NodeProto], opset: int | None = None) -> None:
        """Add a model-local function `domain.name` (its body uses the default opset)."""
        func = helper.make_function(domain, name, list(inputs), list(outputs), list(nodes),
                                    [helper.make_opsetid("", opset or self.opset)])
        root = self._root()
        root.functions.append(func)
        root.extra_opsets.setdefault(domain, 1)

    # -- results --------------------------------------------------------------------------------
    def graph(self) -> onnx.GraphProto:
        return helper.make_graph(self.nodes, self.name, self.inputs, self.outputs,
                                 initializer=self.initializers, value_info=self.value_info,
                                 doc_string=self.doc_string or None)

    def build(self, check: bool = True) -> onnx.ModelProto:
        opsets = [helper.make_opsetid("", self.opset)]
        opsets += [helper.make_opsetid(d, v) for d, v in sorted(self.extra_opsets.items())]
        model = helper.make_model(self.graph(), opset_imports=opsets, functions=self.functions,
                                  producer_name="amp-rewriter-tests")
        model.ir_version = self.ir_version
        if self.metadata:
            helper.set_model_props(model, self.metadata)
        if self._infer_outputs:
            known: dict[str, onnx.TypeProto] = {i.name: i.type for i in model.graph.input}
            for tensor in model.graph.initializer:
                known.setdefault(tensor.name, helper.make_tensor_type_proto(
                    tensor.data_type, list(tensor.dims)))
            # Infer on a copy without outputs: every node output then lands in value_info
            # (declared outputs that are also inputs make ONNX skip the other outputs).
            probe = onnx.ModelProto()
            probe.CopyFrom(model)
            del probe.graph.output[:]
            try:
                inferred = onnx.shape_inference.infer_shapes(probe)
            except Exception:  # leave the float32 default; the checker will say what is wrong
                inferred = None
            if inferred is not None:
                for info in inferred.graph.value_info:
                    if info.type.tensor_type.HasField("shape"):
                        known[info.name] = info.type
            for info in model.graph.output:
                if info.name in self._infer_outputs and info.name in known:
                    info.type.CopyFrom(known[info.name])
        if check:
            onnx.checker.check_model(model, full_check=True)
        return model


# -- inspecting conversions -------------------------------------------------------------------
def precisions(report) -> dict[str, str]:
    """{node name: 'fp16' | 'bf16' | 'fp32' | ...} from a conversion report."""
    return {entry["name"]: entry["precision"] for entry in report.nodes}


def _all_graphs(graph: onnx.GraphProto) -> Iterable[onnx.GraphProto]:
    stack = [graph]
    while stack:
        g = stack.pop()
        yield g
        for node in g.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    stack.append(attr.g)
                stack.extend(attr.graphs)


def all_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Every node of the model's graph and its subgraphs (functions excluded)."""
    return [n for g in _all_graphs(model.graph) for n in g.node]


def count_casts(model: onnx.ModelProto) -> int:
    """Cast nodes in all graphs of the model (subgraphs included, function bodies not)."""
    return sum(1 for n in all_nodes(model) if n.op_type == "Cast" and n.domain in ("", "ai.onnx"))


def casts(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Every standard-domain Cast node of the model, subgraphs included."""
    return [n for n in all_nodes(model) if n.op_type == "Cast" and n.domain in ("", "ai.onnx")]


def node_by_name(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    """The node called `name`, in the main graph or a subgraph."""
    for node in all_nodes(model):
        if node.name == name:
            return node
    raise KeyError(name)


def initializer(model: onnx.ModelProto, name: str) -> onnx.TensorProto:
    """The initializer called `name`, in the main graph or a subgraph."""
    for g in _all_graphs(model.graph):
        for tensor in g.initializer:
            if tensor.name == name:
                return tensor
    raise KeyError(name)


def producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """Tensor name -> the node that produces it, over every graph of the model."""
    return {out: n for n in all_nodes(model) for out in n.output if out}


def check(model: onnx.ModelProto) -> None:
    """onnx's full checker (with shape inference): raises on an invalid model."""
    onnx.checker.check_model(model, full_check=True)


# -- running ------------------------------------------------------------------------------------
def run_as_fp16(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Run an fp16 model with real fp16 rounding and overflow: every fp16 tensor is rounded
    where it is produced (fp32 compute, as GPU kernels do), since ORT's CPU provider would run
    fp16 ops without a CPU kernel in fp32 and drop the casts around them."""
    from amp_rewriter.formats.onnx.emulation import EVERY_NODE, emulate_low_precision

    return run(emulate_low_precision(model, policy=EVERY_NODE).model, feeds)


def run(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Run with onnxruntime's CPU provider; feeds are cast to the model's input dtypes."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    prepared = {}
    for info in session.get_inputs():
        value = np.asarray(feeds[info.name])
        wanted = _ORT_TYPES.get(info.type)
        prepared[info.name] = value.astype(wanted) if wanted is not None else value
    return session.run(None, prepared)


def assert_close(fp32_model: onnx.ModelProto, converted: onnx.ModelProto,
                 feeds: Mapping[str, np.ndarray], tol: float = 2e-2) -> None:
    """Every output of `converted` within `tol` of fp32, relative to the output's largest value."""
    expected = run(fp32_model, feeds)
    actual = run(converted, feeds)
    assert len(expected) == len(actual)
    for index, (e, a) in enumerate(zip(expected, actual)):
        assert e.shape == a.shape, f"output {index}: shape {a.shape} != {e.shape}"
        e64, a64 = np.asarray(e, np.float64), np.asarray(a, np.float64)
        assert np.all(np.isfinite(a64) == np.isfinite(e64)), f"output {index}: non-finite values"
        finite = np.isfinite(e64)
        scale = max(float(np.max(np.abs(e64[finite]), initial=0.0)), 1e-6)
        err = float(np.max(np.abs(a64[finite] - e64[finite]), initial=0.0))
        assert err <= tol * scale, f"output {index}: max error {err:g} > {tol} * {scale:g}"


def feeds_for(model: onnx.ModelProto, seed: int = 0, **fixed: np.ndarray) -> dict[str, np.ndarray]:
    """Random float32 feeds (N(0,1)) for the model's float inputs with static shapes."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for info in model.graph.input:
        if info.name in fixed:
            feeds[info.name] = fixed[info.name]
            continue
        dims = [d.dim_value for d in info.type.tensor_type.shape.dim]
        feeds[info.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds
