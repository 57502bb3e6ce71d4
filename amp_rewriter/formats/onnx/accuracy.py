"""ONNX models for `convert --auto` and `diagnose`: the runner of `accuracy.runner`'s contract.

The probe is one model, run in one onnxruntime session per batch: the fp32 model itself, every
float tensor exposed as an output, and beside each node that runs in low precision in the
conversion two shadow copies reading the fp32 reference activations directly:

- ``lp``: the converted node, its activations cast to the dtype it reads (its constants as the
  conversion made them): its local output;
- ``rd``: the fp32 node, its low-precision activations rounded (cast down and back up).

Nodes inside If/Loop bodies get their shadows inside the same body, next to the reference
activations they read; a body's tensors leave it as extra If outputs (the other branch gives an
empty tensor) or extra Loop scan outputs (stacked per iteration). When onnxruntime cannot run
that (a body tensor whose shape changes between iterations), the probe falls back to the main
graph and says so. Scan bodies are not measured inside.

Low precision runs where `execution.select_execution` says (CUDA, or the CPU emulated); so does
the probe's shadows.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from ...accuracy.calibration import Batch, InputSpec
from ...accuracy.ir_nodes import Ref, constant_as_read, node_info, resolve
from ...accuracy.runner import Conversion, ModelRunner, NodeInfo, Probe, ProbeBatch, ProbePlan
from ...errors import AmpError
from ...ir import FLOAT_DTYPES, LOW_PRECISION_DTYPES, TARGET_DTYPES, Graph, Node, Value
from ...options import Options
from ...passes.base import Pin
from ...report import Report
from .convert import DEFAULT_BACKEND, ConvertedIR, convert_model_file, convert_model_ir
from .emit import _tensor_proto, has_external_data
from .execution import Execution, native_feeds, round_feeds, select_execution
from .load import PROTOBUF_LIMIT, elem_type_code, load_onnx, read_model_file
from .rules import CONTROL_FLOW_OPS, ONNX_RULES
from .validate import _NUMPY_OF_ELEM, random_inputs

#: Reductions for `--max-reduction`: each output value sums input size / output size elements.
REDUCE_OPS = frozenset({"ReduceSum", "ReduceSumSquare", "ReduceMean", "ReduceL1", "ReduceL2",
                        "ReduceLogSum", "ReduceLogSumExp", "ReduceProd", "CumSum"})
#: Prefix of every name the probe adds.
PREFIX = "amp_probe/"

Path_ = tuple[str, ...]


class OnnxConversion(Conversion):
    """A conversion in memory: the ModelProto, its report and the IR the passes left."""

    def __init__(self, model: onnx.ModelProto, report: Report, ir: ConvertedIR,
                 pins: Mapping[str, Pin]):
        self.model = model
        self.report = report
        self.ir = ir
        self.pins = pins


# -- graph paths: the same body in the fp32 model, the probe and a converted model -------------

def ir_graph_path(graph: Graph, name_of: Any = None) -> Path_:
    """A body's path: for each level, its owner's first output name and the attribute
    (`name_of(value)` gives the name to use; original names for a conversion's IR)."""
    parts: list[str] = []
    while graph.parent is not None and graph.owner is not None:
        owner = graph.owner
        attr = next(key for key, sub in owner.subgraphs.items() if sub is graph)
        anchor = next(((name_of(v) if name_of else v.name) for v in owner.outputs
                       if v is not None), owner.name)
        parts.append(f"{anchor}/{attr}")
        graph = graph.parent
    return tuple(reversed(parts))


def proto_graphs(model: onnx.ModelProto
                 ) -> dict[Path_, tuple[onnx.GraphProto, onnx.NodeProto | None, str, Path_]]:
    """path -> (graph, owner node, attribute name, parent path) for a model and its bodies."""
    found: dict[Path_, tuple[onnx.GraphProto, onnx.NodeProto | None, str, Path_]] = {
        (): (model.graph, None, "", ())}
    stack: list[tuple[Path_, onnx.GraphProto]] = [((), model.graph)]
    while stack:
        path, graph = stack.pop()
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    anchor = next((o for o in node.output if o), node.name)
                    sub = (*path, f"{anchor}/{attr.name}")
                    found[sub] = (attr.g, node, attr.name, path)
                    stack.append((sub, attr.g))
    return found


def _label(path: Path_) -> str:
    return "main" if not path else " > ".join(path)


# -- exposing tensors ------------------------------------------------------------------------

@dataclasses.dataclass
class _Wanted:
    path: Path_
    name: str
    label: str
    elem: int


def expose(model: onnx.ModelProto, wanted: list[_Wanted], bodies: bool = True
           ) -> tuple[dict[str, str], list[str]]:
    """Make every wanted tensor a main-graph output (in place). Body tensors leave through extra
    If outputs (the other branch gives an empty tensor) or Loop scan outputs (stacked per
    iteration). Returns label -> output name, and notes on what could not be exposed."""
    graphs = proto_graphs(model)
    pending: dict[Path_, list[_Wanted]] = {}
    for item in wanted:
        if item.path and not bodies:
            continue
        pending.setdefault(item.path, []).append(item)
    result: dict[str, str] = {}
    notes: list[str] = []
    counter = [0]

    def fresh(kind: str) -> str:
        counter[0] += 1
        return f"{PREFIX}{kind}/{counter[0]}"

    done: set[Path_] = set()
    for path in sorted(pending, key=lambda p: (-len(p), p)):
        if path in done:
            continue
        done.add(path)
        graph, owner, _attr, parent = graphs[path]
        items = pending.get(path, [])
        if not path:
            outputs = {o.name for o in graph.output}
            for item in items:
                if item.name not in outputs:
                    graph.output.append(helper.make_tensor_value_info(item.name, item.elem, None))
                    outputs.add(item.name)
                result[item.label] = item.name
            continue
        assert owner is not None
        if owner.op_type == "Loop":
            for item in items:
                body_out = _body_output(graph, item, fresh)
                graph.output.append(helper.make_tensor_value_info(body_out, item.elem, None))
                outer = fresh("out")
                owner.output.append(outer)
                pending.setdefault(parent, []).append(_Wanted(parent, outer, item.label,
                                                              item.elem))
        elif owner.op_type == "If":
            branches = {a.name: a.g for a in owner.attribute if a.name in ("then_branch",
                                                                             "else_branch")}
            anchor = next((o for o in owner.output if o), owner.name)
            paths = {name: (*parent, f"{anchor}/{name}") for name in branches}
            for other in paths.values():
                done.add(other)
            per_branch = {name: pending.get(p, []) for name, p in paths.items()}
            for name, items_here in per_branch.items():
                for item in items_here:
                    outer = fresh("out")
                    owner.output.append(outer)
                    for branch_name, branch in branches.items():
                        if branch_name == name:
                            body_out = _body_output(branch, item, fresh)
                        else:
                            body_out = fresh("empty")
                            branch.node.append(helper.make_node(
                                "Constant", [], [body_out],
                                value=helper.make_tensor("", item.elem, [0], [])))
                        branch.output.append(helper.make_tensor_value_info(body_out, item.elem,
                                                                           None))
                    pending.setdefault(parent, []).append(_Wanted(parent, outer, item.label,
                                                                  item.elem))
        elif items:
            notes.append(f"{owner.op_type} {_label(path)}: its body is measured as a whole, "
                         f"not node by node")
    return result, notes


def _body_output(graph: onnx.GraphProto, item: _Wanted, fresh: Any) -> str:
    """A name under which `item` can be added as a body output (an Identity when the tensor is
    already one of the body's outputs or inputs)."""
    taken = {o.name for o in graph.output} | {i.name for i in graph.input}
    if item.name not in taken:
        return item.name
    alias = fresh("alias")
    graph.node.append(helper.make_node("Identity", [item.name], [alias]))
    return alias


# -- the runner ----------------------------------------------------------------------------------

class OnnxRunner(ModelRunner):
    """An ONNX model file, converted and run for `convert --auto` and `diagnose`."""

    format = "onnx"

    def __init__(self, path: Path, options: Options):
        if options.outputs:
            raise AmpError("--outputs is for TensorFlow GraphDefs: an ONNX model names its "
                           "outputs")
        self.path = path
        self.options = options.with_backend(DEFAULT_BACKEND)
        assert self.options.backend is not None
        self.model = read_model_file(path)
        self.base_dir = path.resolve().parent
        self.target_dtype = TARGET_DTYPES[self.options.target]
        self.execution: Execution = select_execution(self.options.backend, self.options.target)
        self.execution_note = self.execution.description
        self._initializers = {t.name for t in self.model.graph.initializer}

    # -- inputs and outputs ------------------------------------------------------------------
    def input_specs(self) -> list[InputSpec]:
        specs = []
        for info in self.model.graph.input:
            if info.name in self._initializers:
                continue
            tensor_type = info.type.tensor_type
            dtype = _NUMPY_OF_ELEM.get(tensor_type.elem_type)
            if dtype is None:
                raise AmpError(f"input {info.name!r}: elem_type {tensor_type.elem_type} is not "
                               f"supported by the accuracy tools")
            shape: tuple[int | None, ...] | None = None
            if tensor_type.HasField("shape"):
                shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0
                              else None for d in tensor_type.shape.dim)
            specs.append(InputSpec(info.name, np.dtype(dtype).name, shape))
        return specs

    def output_names(self) -> list[str]:
        return [o.name for o in self.model.graph.output]

    def random_batch(self, seed: int) -> Batch:
        return random_inputs(self.model, seed)

    # -- conversions -------------------------------------------------------------------------
    def convert(self, pins: Mapping[str, Pin]) -> OnnxConversion:
        options = dataclasses.replace(self.options, check=False)
        model, report, ir = convert_model_ir(self.model, options, self.base_dir, dict(pins))
        return OnnxConversion(model, report, ir, pins)

    def write(self, output_path: Path, pins: Mapping[str, Pin]) -> Report:
        return convert_model_file(self.path, output_path, self.options, dict(pins))[1]

    # -- nodes -------------------------------------------------------------------------------
    def _node_refs(self, conversion: OnnxConversion, node: Node) -> list[Ref | None]:
        name_of = conversion.ir.original_name
        return [None if v is None else resolve(v, name_of) for v in node.inputs]

    def nodes(self, conversion: Conversion) -> list[NodeInfo]:
        assert isinstance(conversion, OnnxConversion)
        ir = conversion.ir
        infos: list[NodeInfo] = []

        def visit(graph: Graph) -> None:
            for node in graph.nodes:
                if node.handle is None:
                    continue  # a cast the conversion inserted
                for sub in node.subgraphs.values():
                    visit(sub)
                infos.append(self._info(conversion, node, graph, len(infos)))

        visit(ir.model.graph)
        return infos

    def _info(self, conversion: OnnxConversion, node: Node, graph: Graph, order: int
              ) -> NodeInfo:
        name_of = conversion.ir.original_name
        measurable = (not node.subgraphs and node.has_schema
                      and node.op_type not in CONTROL_FLOW_OPS)
        return node_info(node, _label(ir_graph_path(graph, name_of)), order, name_of,
                         ONNX_RULES.divisor_slots, REDUCE_OPS, ("MatMul",), measurable)

    # -- sessions ------------------------------------------------------------------------------
    def _session(self, model: onnx.ModelProto, label: str) -> Any:
        """A session for a model that may be bigger than one protobuf or hold external data."""
        if has_external_data(model) or model.ByteSize() > PROTOBUF_LIMIT:
            with tempfile.TemporaryDirectory(prefix="amp-rewriter-probe-") as tmp:
                path = Path(tmp) / "model.onnx"
                from onnx import external_data_helper

                external_data_helper.load_external_data_for_model(model, str(self.base_dir))
                onnx.save_model(model, str(path), save_as_external_data=True,
                                all_tensors_to_one_file=True, location="model.onnx.data",
                                size_threshold=1024)
                return self.execution.session(str(path), label)
        return self.execution.session(model, label)

    def _feeds(self, converted: onnx.ModelProto, session: Any, batch: Batch) -> Batch:
        if self.execution.emulate:
            return round_feeds(converted, batch)
        return native_feeds(session, batch)

    def open_candidate(self, conversion: Conversion) -> Any:
        assert isinstance(conversion, OnnxConversion)
        session = self._session(self.execution.prepare(conversion.model), "converted model")
        return (session, conversion.model)

    def run_candidate(self, session: Any, batch: Batch) -> dict[str, np.ndarray]:
        sess, converted = session
        names = self.output_names()
        try:
            values = sess.run(names, self._feeds(converted, sess, batch))
        except Exception as exc:
            raise AmpError(f"onnxruntime failed to run the converted model: "
                           f"{_first_line(exc)}") from None
        return dict(zip(names, values))

    def open_probe(self, conversion: Conversion, plan: ProbePlan) -> Probe:
        assert isinstance(conversion, OnnxConversion)
        try:
            return _OnnxProbe(self, conversion, plan, bodies=True)
        except AmpError as first:
            if not any(g.parent is not None for g in conversion.ir.model.graph.walk_graphs()):
                raise
            probe = _OnnxProbe(self, conversion, plan, bodies=False)
            probe.notes.append(f"If/Loop bodies measured as a whole: the probe of their "
                               f"insides failed ({first})")
            return probe


class _OnnxProbe(Probe):
    """The probe model's session (and, for diagnose, the instrumented converted model's)."""

    def __init__(self, runner: OnnxRunner, conversion: OnnxConversion, plan: ProbePlan,
                 bodies: bool):
        self.runner = runner
        self.notes: list[str] = []
        probe, self.labels, self.shadows = self._build(conversion, plan, bodies)
        self.session = runner._session(runner.execution.prepare(probe), "probe model")
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.candidate_session = None
        self.candidate_labels: dict[str, str] = {}
        if plan.candidate_tensors:
            instrumented = onnx.ModelProto()
            instrumented.CopyFrom(conversion.model)
            wanted = []
            ir = conversion.ir
            for graph in ir.model.graph.walk_graphs():
                path = ir_graph_path(graph)
                for node in graph.nodes:
                    if node.handle is None:
                        continue
                    for value in node.outputs:
                        original = ir.original_name(value) if value is not None else None
                        if value is None or original is None or value.dtype not in FLOAT_DTYPES:
                            continue
                        wanted.append(_Wanted(path, value.name, original,
                                              elem_type_code(value.dtype)))
            self.candidate_labels, notes = expose(instrumented, wanted, bodies)
            self.notes.extend(n for n in notes if n not in self.notes)
            self.candidate_session = runner._session(runner.execution.prepare(instrumented),
                                                     "instrumented converted model")
            self.candidate_model = conversion.model
        # A first run checks that onnxruntime can run the probe (bodies included) at all.
        self._checked = False

    def _build(self, conversion: OnnxConversion, plan: ProbePlan, bodies: bool
               ) -> tuple[onnx.ModelProto, dict[str, str], dict[str, tuple[str, str, str, int]]]:
        runner = self.runner
        ir = conversion.ir
        probe = onnx.ModelProto()
        probe.CopyFrom(runner.model)
        graphs = proto_graphs(probe)
        wanted: list[_Wanted] = []
        #: output label -> (kind, node name, rounded input, index in NodeInfo.outputs)
        shadows: dict[str, tuple[str, str, str, int]] = {}
        reference_ir = load_onnx(runner.model, runner.base_dir)
        for graph in reference_ir.graph.walk_graphs():
            path = ir_graph_path(graph)
            for node in graph.nodes:
                for value in node.outputs:
                    if value is not None and value.dtype in FLOAT_DTYPES:
                        wanted.append(_Wanted(path, value.name, value.name,
                                              elem_type_code(value.dtype)))
        for name in runner.output_names():
            wanted.append(_Wanted((), name, name, 0))
        builder = _ShadowBuilder(runner, conversion, graphs)
        for graph in ir.model.graph.walk_graphs():
            path = ir_graph_path(graph, ir.original_name)
            if path and not bodies:
                continue
            if path not in graphs:
                continue
            for node in graph.nodes:
                if node.handle is None or node.subgraphs or not node.has_schema:
                    continue
                if not any(g.precision in LOW_PRECISION_DTYPES for g in node.type_groups):
                    continue
                shadows_of = builder.add(node, path, plan.local, plan.rounds(node.name))
                for kind, rounded, index, name, elem in shadows_of:
                    label = f"{kind}:{node.name}:{rounded}:{index}"
                    shadows[label] = (kind, node.name, rounded, index)
                    wanted.append(_Wanted(path, name, label, elem))
        labels, notes = expose(probe, wanted, bodies)
        self.notes.extend(notes)
        return probe, labels, shadows

    def run(self, batch: Batch) -> ProbeBatch:
        runner = self.runner
        try:
            values = self.session.run(self.output_names, batch)
        except Exception as exc:
            raise AmpError(f"onnxruntime failed to run the probe model: {_first_line(exc)} "
                           f"(check the calibration inputs)") from None
        by_name = dict(zip(self.output_names, values))
        reference: dict[str, np.ndarray] = {}
        local: dict[str, list[np.ndarray | None]] = {}
        rounded: dict[str, dict[str, list[np.ndarray | None]]] = {}
        for label, name in self.labels.items():
            array = by_name.get(name)
            if array is None:
                continue
            shadow = self.shadows.get(label)
            if shadow is None:
                reference[label] = array
                continue
            kind, node_name, rounded_input, index = shadow
            slots = (local.setdefault(node_name, []) if kind == "lp"
                     else rounded.setdefault(node_name, {}).setdefault(rounded_input, []))
            while len(slots) <= index:
                slots.append(None)
            slots[index] = array
        candidate: dict[str, np.ndarray] = {}
        if self.candidate_session is not None:
            session = self.candidate_session
            names = [o.name for o in session.get_outputs()]
            try:
                outs = session.run(names, runner._feeds(self.candidate_model, session, batch))
            except Exception as exc:
                raise AmpError(f"onnxruntime failed to run the converted model: "
                               f"{_first_line(exc)}") from None
            produced = dict(zip(names, outs))
            for label, name in self.candidate_labels.items():
                if name in produced:
                    candidate[label] = produced[name]
        return ProbeBatch(reference, local, rounded, candidate)


class _ShadowBuilder:
    """Adds the lp and rd shadows of converted nodes to the probe (a copy of the fp32 model)."""

    def __init__(self, runner: OnnxRunner, conversion: OnnxConversion,
                 graphs: dict[Path_, tuple[onnx.GraphProto, onnx.NodeProto | None, str, Path_]]):
        self.runner = runner
        self.conversion = conversion
        self.graphs = graphs
        self.casts: dict[tuple[Path_, str, str, bool], str] = {}
        self.constants: dict[tuple[Path_, int, str], str] = {}
        self.count = 0

    def fresh(self, kind: str) -> str:
        self.count += 1
        return f"{PREFIX}{kind}/{self.count}"

    def _cast(self, path: Path_, reference: str, dtype: str, back_to: str | None) -> str:
        """`reference` cast to `dtype` (and back to `back_to`: rounding), in the graph at
        `path`, made once."""
        key = (path, reference, dtype, back_to is not None)
        name = self.casts.get(key)
        if name is not None:
            return name
        graph = self.graphs[path][0]
        low = self.fresh("cast")
        graph.node.append(helper.make_node("Cast", [reference], [low],
                                           to=elem_type_code(dtype), name=low))
        name = low
        if back_to is not None:
            name = self.fresh("round")
            graph.node.append(helper.make_node("Cast", [low], [name],
                                               to=elem_type_code(back_to), name=name))
        self.casts[key] = name
        return name

    def _constant(self, path: Path_, ref: Ref) -> str:
        """The converted node's constant as it reads it, as an initializer of the probe."""
        value: Value = ref.value
        key = (path, id(value), ref.dtype or "")
        name = self.constants.get(key)
        if name is not None:
            return name
        name = self.fresh("const")
        tensor = _tensor_proto(name, constant_as_read(ref))
        self.graphs[path][0].initializer.append(tensor)
        self.constants[key] = name
        return name

    def add(self, node: Node, path: Path_, local: bool, rounds: bool
            ) -> list[tuple[str, str, int, str, int]]:
        """Add `node`'s shadows; returns (kind, rounded input, output index, name, elem type) to
        expose: kind "lp" (rounded input "", when `local`) and, when `rounds`, one "rd" per
        low-precision input."""
        runner = self.runner
        graph = self.graphs[path][0]
        refs = runner._node_refs(self.conversion, node)
        lp_inputs: list[str] = []
        exact: list[str] = []
        rounding: list[tuple[int, str, str]] = []  # (slot, reference name, rounded name)
        for slot, ref in enumerate(refs):
            if ref is None:
                lp_inputs.append("")
                exact.append("")
                continue
            if ref.reference is None:
                return []  # a value the fp32 model does not have: nothing to compare with
            if ref.kind == "constant":
                lp_inputs.append(self._constant(path, ref))
                exact.append(ref.reference)
                continue
            exact.append(ref.reference)
            if ref.dtype == ref.reference_dtype or ref.dtype is None:
                lp_inputs.append(ref.reference)
                continue
            lp_inputs.append(self._cast(path, ref.reference, ref.dtype, None))
            if ref.dtype in LOW_PRECISION_DTYPES and ref.reference_dtype is not None and \
                    ref.reference not in (r for _, r, _ in rounding):
                rounding.append((slot, ref.reference,
                                 self._cast(path, ref.reference, ref.dtype, ref.reference_dtype)))
        float_slots = [slot for slot, v in enumerate(node.outputs)
                       if v is not None and v.original_dtype in FLOAT_DTYPES]
        exposed: list[tuple[str, str, int, str, int]] = []
        if local:
            outputs = self._copy(graph, node, "lp", lp_inputs, fp32=False)
            for index, slot in enumerate(float_slots):
                value = node.outputs[slot]
                assert value is not None
                exposed.append(("lp", "", index, outputs[slot],
                                elem_type_code(value.dtype or "float32")))
        for _slot, reference, rounded in (rounding if rounds else []):
            inputs = [rounded if name == reference else name for name in exact]
            outputs = self._copy(graph, node, "rd", inputs, fp32=True)
            for index, slot in enumerate(float_slots):
                value = node.outputs[slot]
                assert value is not None
                exposed.append(("rd", reference, index, outputs[slot],
                                elem_type_code(value.original_dtype or "float32")))
        return exposed

    def _copy(self, graph: onnx.GraphProto, node: Node, kind: str, inputs: list[str],
              fp32: bool) -> list[str]:
        """A copy of the converted node reading `inputs` (with its fp32 output dtype restored
        when `fp32`: a Cast's target); returns its output names."""
        copy = onnx.NodeProto()
        copy.CopyFrom(node.handle)
        copy.name = self.fresh(kind)
        del copy.input[:]
        copy.input.extend(inputs)
        if fp32 and node.op_type == "Cast" and node.outputs[0] is not None:
            original = node.outputs[0].original_dtype
            for attr in copy.attribute:
                if attr.name == "to" and original:
                    attr.i = elem_type_code(original)
        outputs = [self.fresh(f"{kind}_out") if v is not None else "" for v in node.outputs]
        del copy.output[:]
        copy.output.extend(outputs)
        graph.node.append(copy)
        return outputs


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
