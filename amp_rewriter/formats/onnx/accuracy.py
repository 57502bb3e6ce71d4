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

Low precision runs where `execution.select_execution` says for the backend profile (its
providers, or the CPU emulated); so does
the probe's shadows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from ...accuracy.calibration import Batch, InputSpec
from ...accuracy.ir_nodes import Ref, constant_as_read, node_info, resolve
from ...accuracy.runner import (
    Conversion,
    ModelRunner,
    NodeInfo,
    PreparedProbe,
    Probe,
    ProbeBatch,
    ProbePlan,
)
from ...errors import AmpError, first_line
from ...fileio import scratch_dir
from ...ir import FLOAT_DTYPES, LOW_PRECISION_DTYPES, TARGET_DTYPES, Graph, Node, Value
from ...op_lists import default_backend, find_profile
from ...options import OnnxOptions
from ...passes.base import Pin
from ...report import Report
from .convert import ConvertedIR, convert_model_file, convert_model_ir
from .emit import _tensor_proto, has_external_data
from .execution import (
    Execution,
    low_precision_inputs,
    native_feeds,
    round_feeds,
    select_execution,
)
from .load import all_tensors, elem_type_code, load_onnx, read_model_file
from .rules import CONTROL_FLOW_OPS, ONNX_RULES
from .validate import _NUMPY_OF_ELEM, random_inputs

#: Reductions for `--max-reduction`: each output value sums input size / output size elements.
REDUCE_OPS = frozenset({"ReduceSum", "ReduceSumSquare", "ReduceMean", "ReduceL1", "ReduceL2",
                        "ReduceLogSum", "ReduceLogSumExp", "ReduceProd", "CumSum"})
#: Prefix of every name the probe adds.
PREFIX = "amp_probe/"
#: Layer normalisations, standard and onnxruntime's fused ones (as `Node.qualified_op`).
NORMALIZATION_OPS = frozenset({
    "LayerNormalization", "RMSNormalization", "com.microsoft.SkipLayerNormalization",
    "com.microsoft.SkipSimplifiedLayerNormalization", "com.microsoft.EmbedLayerNormalization",
    "SimplifiedLayerNormalization", "com.microsoft.SimplifiedLayerNormalization"})

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
    normalization_ops = NORMALIZATION_OPS
    _written = 0

    def __init__(self, path: Path, options: OnnxOptions):
        self.path = path
        self.options = options.with_backend(default_backend("onnx", options.target))
        self.profile = find_profile("onnx", self.options.backend or "", self.options.overrides)
        self.model = read_model_file(path)
        self.base_dir = path.resolve().parent
        #: Where the models handed to onnxruntime are written (deleted with the runner).
        self._workdir = scratch_dir("auto")
        self.workdir = Path(self._workdir.name)
        #: Big models go to onnxruntime as files, their new tensors spilled to disk as made.
        self.on_disk = has_external_data(self.model) or self.model.ByteSize() >= SMALL_MODEL
        self.weight_bytes = sum(_tensor_bytes(t) for t in all_tensors(self.model.graph))
        self._keep_weights_on_disk()
        self.target_dtype = TARGET_DTYPES[self.options.target]
        self.execution: Execution = select_execution(self.profile, self.options.target)
        self.execution_note = self.execution.description
        self._initializers = {t.name for t in self.model.graph.initializer}

    def close(self) -> None:
        self._workdir.cleanup()

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

    def shadow_bytes(self, conversion: Conversion) -> dict[str, int]:
        """Each low-precision node's constants, as the emulated probe holds them (fp32)."""
        assert isinstance(conversion, OnnxConversion)
        costs: dict[str, int] = {}
        for node in conversion.ir.model.graph.walk_nodes():
            if node.handle is None or not any(g.precision in LOW_PRECISION_DTYPES
                                              for g in node.type_groups):
                continue
            costs[node.name] = sum(4 * v.const.size for v in node.inputs
                                   if v is not None and v.const is not None)
        return costs

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
    def _keep_weights_on_disk(self) -> None:
        """Memory stays near the model's size only if no Python object holds the weights while
        onnxruntime does: external data files are copied into the work folder (the models
        written there refer to them), inline weights are moved out to a file there."""
        from onnx import external_data_helper

        if has_external_data(self.model):
            locations = {entry.value for tensor in all_tensors(self.model.graph)
                         for entry in tensor.external_data if entry.key == "location"}
            for location in locations:
                source = (self.base_dir / location).resolve()
                try:
                    source.relative_to(self.base_dir.resolve())
                except ValueError:
                    raise AmpError(f"external data location {location!r} points outside the "
                                   f"model's folder") from None
                if not source.is_file():
                    raise AmpError(f"external data file {location!r} not found")
                target = self.workdir / location
                target.parent.mkdir(parents=True, exist_ok=True)
                _link(source, target)
            return
        if self.model.ByteSize() < SMALL_MODEL:
            return
        external_data_helper.convert_model_to_external_data(
            self.model, all_tensors_to_one_file=True, location="amp_weights.data",
            size_threshold=1024)
        external_data_helper.write_external_data_tensors(self.model, str(self.workdir))
        self.base_dir = self.workdir

    def _write(self, model: onnx.ModelProto) -> onnx.ModelProto | Path:
        """`model` as onnxruntime will read it: small models stay in memory; others are written
        to the work folder (new tensors in a file of their own, external data linked there) so
        that no Python object holds their weights while onnxruntime loads them."""
        if model.ByteSize() < SMALL_MODEL and not has_external_data(model):
            return model
        self._written += 1
        path = self.workdir / f"session_{self._written}.onnx"
        onnx.save_model(model, str(path), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=f"{path.name}.data",
                        size_threshold=1024)
        return path

    def _open(self, written: onnx.ModelProto | Path, label: str,
              spilled: Path | None = None) -> Any:
        """The session of a `_write` result (whose files go once onnxruntime has read them)."""
        if not isinstance(written, Path):
            return self.execution.session(written, label, lean=self.on_disk)
        try:
            return self.execution.session(str(written), label, lean=self.on_disk)
        finally:
            written.unlink(missing_ok=True)
            written.with_name(written.name + ".data").unlink(missing_ok=True)
            if spilled is not None:
                spilled.unlink(missing_ok=True)

    def spill_file(self) -> Path | None:
        """A new file in the work folder for tensors written out as they are made (None when
        the model is small enough to stay in memory)."""
        if not self.on_disk:
            return None
        self._written += 1
        return self.workdir / f"spill_{self._written}.bin"

    def _feeds(self, low_inputs: dict[str, str], session: Any, batch: Batch) -> Batch:
        if self.execution.emulate:
            return round_feeds(low_inputs, batch)
        return native_feeds(session, batch)

    @property
    def _data_dir(self) -> Path:
        """Where the external data of the models handed to onnxruntime is found."""
        return self.workdir if self.on_disk else self.base_dir

    def _prepared_write(self, model: onnx.ModelProto) -> onnx.ModelProto | Path:
        """`_write` of a model built for the purpose (emulated in place)."""
        return self._write(self.execution.prepare(model, self._data_dir, in_place=True))

    def open_candidate(self, conversion: Conversion) -> Any:
        assert isinstance(conversion, OnnxConversion)
        low_inputs = low_precision_inputs(conversion.model)
        # Emulated in place: a copy would hold the converted weights twice (see the contract).
        session = self._open(self._prepared_write(conversion.model), "converted model")
        return (session, low_inputs)

    def run_candidate(self, session: Any, batch: Batch) -> dict[str, np.ndarray]:
        sess, converted = session
        names = self.output_names()
        try:
            values = sess.run(names, self._feeds(converted, sess, batch))
        except Exception as exc:
            raise AmpError(f"onnxruntime failed to run the converted model: "
                           f"{first_line(exc)}") from None
        return dict(zip(names, values))

    def prepare_probe(self, conversion: Conversion, plan: ProbePlan) -> PreparedProbe:
        assert isinstance(conversion, OnnxConversion)
        return _OnnxProbe(self, conversion, plan)


class _OnnxProbe(Probe, PreparedProbe):
    """The probe model (and, for diagnose, the instrumented converted model): built and written
    by the constructor, run by sessions `open` creates."""

    def __init__(self, runner: OnnxRunner, conversion: OnnxConversion, plan: ProbePlan):
        self.runner = runner
        self.notes: list[str] = []
        bodies = plan.bodies
        self.has_bodies = bodies and any(g.parent is not None
                                         for g in conversion.ir.model.graph.walk_graphs())
        self.spilled = runner.spill_file()
        probe, self.labels, self.shadows = self._build(conversion, plan, bodies)
        self.written = runner._prepared_write(probe)
        del probe
        self.candidate_written: onnx.ModelProto | Path | None = None
        self.candidate_labels: dict[str, str] = {}
        self.candidate_session: Any = None
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
            self.candidate_written = runner._prepared_write(instrumented)
            del instrumented
            self.candidate_inputs = low_precision_inputs(conversion.model)

    def open(self) -> Probe:
        self.session = self.runner._open(self.written, "probe model", self.spilled)
        self.output_names = [o.name for o in self.session.get_outputs()]
        if self.candidate_written is not None:
            self.candidate_session = self.runner._open(self.candidate_written,
                                                       "instrumented converted model")
        return self

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
        builder = _ShadowBuilder(runner, conversion, graphs, self.spilled)
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
                shadows_of = builder.add(node, path, plan.shadows(node.name),
                                         plan.rounds(node.name))
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
            raise AmpError(f"onnxruntime failed to run the probe model: {first_line(exc)} "
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
                outs = session.run(names, runner._feeds(self.candidate_inputs, session, batch))
            except Exception as exc:
                raise AmpError(f"onnxruntime failed to run the converted model: "
                               f"{first_line(exc)}") from None
            produced = dict(zip(names, outs))
            for label, name in self.candidate_labels.items():
                if name in produced:
                    candidate[label] = produced[name]
        return ProbeBatch(reference, local, rounded, candidate)


class _ShadowBuilder:
    """Adds the lp and rd shadows of converted nodes to the probe (a copy of the fp32 model)."""

    def __init__(self, runner: OnnxRunner, conversion: OnnxConversion,
                 graphs: dict[Path_, tuple[onnx.GraphProto, onnx.NodeProto | None, str, Path_]],
                 spill: Path | None):
        self.runner = runner
        self.conversion = conversion
        self.graphs = graphs
        #: Where constants go as they are made (so the probe never holds them), if anywhere.
        self.spill = spill
        self.casts: dict[tuple[Path_, str, str, bool], str] = {}
        self.constants: dict[tuple[Path_, Value, str], str] = {}
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
        key = (path, value, ref.dtype or "")
        name = self.constants.get(key)
        if name is not None:
            return name
        name = self.fresh("const")
        data = constant_as_read(ref)
        tensor = _tensor_proto(name, data)
        data.release()  # the probe's proto (or the spill file) holds it now
        if self.spill is not None and len(tensor.raw_data) >= 1024:
            from onnx import external_data_helper

            with open(self.spill, "ab") as handle:
                offset = handle.tell()
                handle.write(tensor.raw_data)
            external_data_helper.set_external_data(tensor, self.spill.name, offset,
                                                   len(tensor.raw_data))
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
        self.graphs[path][0].initializer.append(tensor)
        self.constants[key] = name
        return name

    def add(self, node: Node, path: Path_, local: bool, rounds: bool
            ) -> list[tuple[str, str, int, str, int]]:
        """Add `node`'s shadows; returns (kind, rounded input, output index, name, elem type) to
        expose: kind "lp" (rounded input "", when `local`) and, when `rounds`, one "rd" per
        low-precision input."""
        if not local and not rounds:
            return []
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
            # Constants and casts only for the shadows this probe has: a node measured in
            # another pass must not put its low-precision weights in this one.
            if ref.kind == "constant":
                lp_inputs.append(self._constant(path, ref) if local else "")
                exact.append(ref.reference)
                continue
            exact.append(ref.reference)
            if ref.dtype == ref.reference_dtype or ref.dtype is None:
                lp_inputs.append(ref.reference)
                continue
            lp_inputs.append(self._cast(path, ref.reference, ref.dtype, None) if local else "")
            if rounds and ref.dtype in LOW_PRECISION_DTYPES and ref.reference_dtype is not None \
                    and ref.reference not in (r for _, r, _ in rounding):
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


def _tensor_bytes(tensor: onnx.TensorProto) -> int:
    """A tensor's size in bytes, from its dims and dtype (its data is not read)."""
    elements = 1
    for dim in tensor.dims:
        elements *= dim
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize \
        if tensor.data_type not in (0, onnx.TensorProto.STRING) else 0
    return elements * itemsize


#: Below this size a model is handed to onnxruntime in memory, in sessions as onnxruntime makes
#: them by default; above it, in files and lean sessions (weights held once).
SMALL_MODEL = 256 * 2**20


def _link(source: Path, target: Path) -> None:
    """`target` holds `source`'s content: a copy. Not a symbolic link (onnxruntime refuses
    external data that resolves outside the model's folder) nor a hard link (onnx then refuses
    to read the original: "multiple hard links")."""
    import shutil

    shutil.copyfile(source, target)
