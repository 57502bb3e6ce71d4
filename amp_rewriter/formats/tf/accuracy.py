"""TensorFlow GraphDefs for `convert --auto` and `diagnose`: the runner of
`accuracy.runner`'s contract.

A tf.compat.v1 Session fetches any tensor by name, so the probe needs no extra outputs: it is the
fp32 GraphDef plus, for each node that runs in low precision in the conversion, shadow copies
reading the fp32 reference tensors directly (``lp``: the converted node, its activations cast to
what it reads; ``rd``: the fp32 node with one low-precision input rounded). Nodes inside a TF1
while loop's frame cannot be fetched from outside it: they are measured as part of the loop's
results only. Low precision runs on TensorFlow's own CPU kernels (no emulation needed: unlike
onnxruntime's CPU provider, TensorFlow runs fp16/bf16 ops in those types).

GraphDefs (.pb, .pbtxt), the graph of a MetaGraphDef (.meta) and SavedModels are measured. A
SavedModel is measured through its serving signature frozen into one GraphDef (variables as
constants, function calls inlined: a node inside a called function gets the call node's name as
a prefix); `--auto`'s pins then apply, by the node's name inside its function, to the whole
SavedModel, written as `convert` writes one (low-precision weights included).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2
from tensorflow.python.framework import op_def_registry

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
from ...ir import FLOAT_DTYPES, LOW_PRECISION_DTYPES, TARGET_DTYPES, Model, Node, Value, ValueNames
from ...options import TfOptions
from ...passes.base import Pin
from ...report import Report
from ._tensorflow import imported_graph
from .convert import (
    convert_saved_model_dir,
    meta_graph_fetches,
    refuse_outputs_for_saved_models,
    rewrite_graphdef,
    rewrite_graphdef_ir,
)
from .emit import tensor_proto
from .files import is_saved_model_dir, read_graphdef, read_meta_graph, write_graphdef
from .lists import default_backend
from .load import default_fetches, dtype_enum, parse_graph_input
from .rules import TF_RULES
from .validate import graphdef_feeds

REDUCE_OPS = frozenset({"Sum", "Mean", "Prod", "EuclideanNorm", "Cumsum"})
MATMUL_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})
PREFIX = "amp_probe/"


class TfConversion(Conversion):
    """A converted GraphDef in memory, its report and the IR the passes left."""

    def __init__(self, graph_def: graph_pb2.GraphDef, report: Report, ir: Model,
                 names: ValueNames, pins: Mapping[str, Pin]):
        self.graph_def = graph_def
        self.report = report
        self.ir = ir
        self.original_name = names.original_name
        self.pins = pins


def _tensor(name: str) -> str:
    """A value name ("y", "y:1") as a fetchable tensor name."""
    return name if ":" in name else f"{name}:0"


def frame_nodes(graph_def: graph_pb2.GraphDef) -> set[str]:
    """Nodes inside a TF1 while loop's frame (from an Enter to an Exit): not fetchable."""
    consumers: dict[str, list[str]] = {}
    for nd in graph_def.node:
        for ref in nd.input:
            source = ref[1:] if ref.startswith("^") else parse_graph_input(ref)[0]
            consumers.setdefault(source, []).append(nd.name)
    ops = {nd.name: nd.op for nd in graph_def.node}
    inside: set[str] = set()
    stack = [nd.name for nd in graph_def.node if nd.op in ("Enter", "RefEnter")]
    while stack:
        name = stack.pop()
        if name in inside:
            continue
        inside.add(name)
        if ops.get(name) in ("Exit", "RefExit"):
            continue
        stack.extend(consumers.get(name, ()))
    return inside


SERVING_SIGNATURE = "serving_default"


def frozen_signature(path: Path) -> tuple[graph_pb2.GraphDef, list[str], dict[str, str]]:
    """A SavedModel's serving signature as one GraphDef: (graph, fetch tensor names, each
    node's name -> its name inside the function that holds it)."""
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2,
    )

    try:
        loaded = tf.saved_model.load(str(path))
    except Exception as exc:
        raise AmpError(f"{path}: TensorFlow cannot load the SavedModel: {first_line(exc)}"
                       ) from None
    signatures = dict(loaded.signatures)
    if not signatures:
        raise AmpError(f"{path}: the SavedModel has no signature to measure")
    name = SERVING_SIGNATURE if SERVING_SIGNATURE in signatures else sorted(signatures)[0]
    function = signatures[name]
    try:
        frozen = convert_variables_to_constants_v2(function)
    except Exception as exc:
        raise AmpError(f"{path}: signature {name!r} cannot be frozen for measuring: "
                       f"{first_line(exc)}") from None
    graph_def = frozen.graph.as_graph_def()
    return graph_def, [t.name for t in frozen.outputs], _names_inside_functions(
        function.graph.as_graph_def())


def _names_inside_functions(graph_def: graph_pb2.GraphDef) -> dict[str, str]:
    """Inlined node name ("call/inner/MatMul") -> the name inside its function ("inner/MatMul"),
    following the signature's function calls down."""
    library = {f.signature.name: f for f in graph_def.library.function}
    names: dict[str, str] = {}
    stack = [(list(graph_def.node), "")]
    while stack:
        nodes, prefix = stack.pop()
        for nd in nodes:
            names[prefix + nd.name] = nd.name
            callee = library.get(nd.attr["f"].func.name) if "f" in nd.attr else None
            if callee is not None:
                stack.append((list(callee.node_def), f"{prefix}{nd.name}/"))
    return names


class TfRunner(ModelRunner):
    """A TensorFlow GraphDef or SavedModel, converted and run for `convert --auto` and
    `diagnose`."""

    format = "tf"

    def __init__(self, path: Path, options: TfOptions):
        self.path = path
        self.meta = read_meta_graph(path) if path.suffix == ".meta" else None
        self.user_options = options
        #: For a SavedModel: frozen node name -> its name inside its function.
        self.local_names: dict[str, str] | None = None
        if is_saved_model_dir(path):
            refuse_outputs_for_saved_models(options)
            self.graph_def, outputs, self.local_names = frozen_signature(path)
            options = dataclasses.replace(options, outputs=outputs)
        else:
            self.graph_def = self.meta.graph_def if self.meta is not None \
                else read_graphdef(path)
        if self.meta is not None and not options.outputs:
            options = dataclasses.replace(options,
                                          outputs=meta_graph_fetches(self.meta) or None)
        self.options = options.with_backend(default_backend(options.target))
        self.fetches = list(self.options.outputs or default_fetches(self.graph_def))
        if not self.fetches:
            raise AmpError("no output found: name the fetch nodes with --outputs")
        self.target_dtype = TARGET_DTYPES[self.options.target]
        self.execution_note = (f"TensorFlow CPU kernels in {self.options.target} (native, no "
                               f"emulation)")
        self.unfetchable = frame_nodes(self.graph_def)

    # -- inputs and outputs --------------------------------------------------------------------
    def input_specs(self) -> list[InputSpec]:
        specs = []
        for nd in self.graph_def.node:
            if nd.op not in ("Placeholder", "PlaceholderV2"):
                continue
            dtype = tf.as_dtype(nd.attr["dtype"].type).as_numpy_dtype
            shape_proto = nd.attr["shape"].shape
            shape = None if shape_proto.unknown_rank else tuple(
                d.size if d.size >= 0 else None for d in shape_proto.dim)
            specs.append(InputSpec(nd.name, np.dtype(dtype).name, shape))
        return specs

    def output_names(self) -> list[str]:
        return list(self.fetches)

    def random_batch(self, seed: int) -> Batch:
        return graphdef_feeds(self.graph_def, seed)

    # -- conversions ---------------------------------------------------------------------------
    def convert(self, pins: Mapping[str, Pin]) -> TfConversion:
        options = dataclasses.replace(self.options, check=False, outputs=self.fetches)
        graph_def, report, (ir, names) = rewrite_graphdef_ir(self.graph_def, options,
                                                              pins=pins)
        return TfConversion(graph_def, report, ir, names, pins)

    def write(self, output_path: Path, pins: Mapping[str, Pin]) -> Report:
        """As plain `convert` writes a GraphDef, a .meta file or a SavedModel, with `pins`."""
        options = self.user_options
        if self.local_names is not None:
            local = {self.local_names.get(name, name): pin for name, pin in pins.items()}
            return convert_saved_model_dir(self.path, output_path, options, local)
        if self.meta is not None:
            from tensorflow.core.protobuf import meta_graph_pb2

            converted, report = rewrite_graphdef(self.meta.graph_def, self.options, pins=pins)
            out = meta_graph_pb2.MetaGraphDef()
            out.CopyFrom(self.meta)
            out.graph_def.CopyFrom(converted)
            write_graphdef(out, output_path)
            return report
        converted, report = rewrite_graphdef(self.graph_def, options, pins=pins)
        write_graphdef(converted, output_path)
        return report

    # -- nodes ---------------------------------------------------------------------------------
    def _measurable(self, node: Node) -> bool:
        op_def = op_def_registry.get(node.op_type)
        return (op_def is not None and not op_def.is_stateful and node.has_schema
                and node.name not in self.unfetchable)

    def nodes(self, conversion: Conversion) -> list[NodeInfo]:
        assert isinstance(conversion, TfConversion)
        infos: list[NodeInfo] = []
        for node in conversion.ir.graph.nodes:
            if node.handle is None:
                continue
            info = node_info(node, "main", len(infos), conversion.original_name,
                             TF_RULES.divisor_slots, REDUCE_OPS, MATMUL_OPS,
                             self._measurable(node))
            info.outputs = [name for name in info.outputs
                            if name.partition(":")[0] not in self.unfetchable]
            infos.append(info)
        return infos

    # -- sessions ------------------------------------------------------------------------------
    def _session(self, graph_def: graph_pb2.GraphDef, label: str) -> tf.compat.v1.Session:
        graph = imported_graph(graph_def, f"the {label}")
        config = tf.compat.v1.ConfigProto(device_count={"GPU": 0})
        session = tf.compat.v1.Session(graph=graph, config=config)
        assigns = [nd.name for nd in graph_def.node
                   if nd.op in ("Assign", "AssignVariableOp") and nd.name.endswith("/Assign")]
        if assigns:
            session.run(assigns)
        return session

    def _run(self, session: tf.compat.v1.Session, fetches: list[str], batch: Batch,
             label: str) -> list[np.ndarray]:
        feeds = {_tensor(name): value for name, value in batch.items()}
        try:
            return session.run(fetches, feed_dict=feeds)
        except Exception as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            detail = " ".join(lines[:2]) if lines else type(exc).__name__
            raise AmpError(f"TensorFlow failed to run the {label}: {detail}") from None

    def open_candidate(self, conversion: Conversion) -> Any:
        assert isinstance(conversion, TfConversion)
        return self._session(conversion.graph_def, "converted graph")

    def run_candidate(self, session: Any, batch: Batch) -> dict[str, np.ndarray]:
        values = self._run(session, [_tensor(n) for n in self.fetches], batch, "converted graph")
        return dict(zip(self.fetches, values))

    def prepare_probe(self, conversion: Conversion, plan: ProbePlan) -> PreparedProbe:
        assert isinstance(conversion, TfConversion)
        return _TfProbe(self, conversion, plan)


class _TfProbe(Probe, PreparedProbe):
    """The probe GraphDef (and, for diagnose, the converted one), sessions started by `open`."""

    def __init__(self, runner: TfRunner, conversion: TfConversion, plan: ProbePlan):
        self.runner = runner
        self.notes: list[str] = []
        if runner.unfetchable:
            self.notes.append(f"{len(runner.unfetchable)} node(s) inside while-loop frames are "
                              f"measured only through the loop's results")
        probe = graph_pb2.GraphDef()
        probe.CopyFrom(runner.graph_def)
        original = {nd.name for nd in runner.graph_def.node}
        converted = {nd.name: nd for nd in conversion.graph_def.node}
        builder = _ShadowBuilder(probe, conversion)
        #: fetch name -> (kind, node, rounded input, output index); kind "ref" for references
        self.labels: dict[str, tuple[str, str, str, int]] = {}
        for node in conversion.ir.graph.nodes:
            for slot, value in enumerate(node.outputs):
                if node.handle is None or value is None:
                    continue
                name = conversion.original_name(value)
                if name is None or value.original_dtype not in FLOAT_DTYPES \
                        or node.name not in original or node.name in runner.unfetchable:
                    continue
                self.labels[_tensor(name)] = ("ref", name, "", slot)
        for name in runner.fetches:
            self.labels[_tensor(name)] = ("ref", name, "", 0)
        for node in conversion.ir.graph.nodes:
            if node.handle is None or not runner._measurable(node) \
                    or node.name not in converted:
                continue
            if not any(g.precision in LOW_PRECISION_DTYPES for g in node.type_groups):
                continue
            for kind, rounded, index, tensor in builder.add(node, converted[node.name],
                                                            plan.shadows(node.name),
                                                            plan.rounds(node.name)):
                self.labels[tensor] = (kind, node.name, rounded, index)
        self.fetch_names = list(self.labels)
        self.probe = probe
        self.candidate_graph: graph_pb2.GraphDef | None = None
        self.candidate_session: Any = None
        self.candidate_fetches: dict[str, str] = {}
        if plan.candidate_tensors:
            for node in conversion.ir.graph.nodes:
                if node.handle is None or node.name in runner.unfetchable:
                    continue
                for value in node.outputs:
                    original_name = conversion.original_name(value) if value else None
                    if value is None or original_name is None \
                            or value.dtype not in FLOAT_DTYPES:
                        continue
                    self.candidate_fetches[_tensor(value.name)] = original_name
            self.candidate_graph = conversion.graph_def

    def open(self) -> Probe:
        self.session = self.runner._session(self.probe, "probe graph")
        if self.candidate_graph is not None:
            self.candidate_session = self.runner._session(self.candidate_graph,
                                                          "converted graph")
        return self

    def run(self, batch: Batch) -> ProbeBatch:
        values = self.runner._run(self.session, self.fetch_names, batch, "probe graph")
        reference: dict[str, np.ndarray] = {}
        local: dict[str, list[np.ndarray | None]] = {}
        rounded: dict[str, dict[str, list[np.ndarray | None]]] = {}
        for fetch, array in zip(self.fetch_names, values):
            kind, name, rounded_input, index = self.labels[fetch]
            if kind == "ref":
                reference[name] = array
                continue
            slots = (local.setdefault(name, []) if kind == "lp"
                     else rounded.setdefault(name, {}).setdefault(rounded_input, []))
            while len(slots) <= index:
                slots.append(None)
            slots[index] = array
        candidate: dict[str, np.ndarray] = {}
        if self.candidate_session is not None:
            fetches = list(self.candidate_fetches)
            outs = self.runner._run(self.candidate_session, fetches, batch, "converted graph")
            for fetch, array in zip(fetches, outs):
                candidate[self.candidate_fetches[fetch]] = array
        return ProbeBatch(reference, local, rounded, candidate)


class _ShadowBuilder:
    """Adds the lp and rd shadows of converted nodes to the probe GraphDef."""

    def __init__(self, probe: graph_pb2.GraphDef, conversion: TfConversion):
        self.probe = probe
        self.conversion = conversion
        self.casts: dict[tuple[str, str, bool], str] = {}
        self.constants: dict[tuple[Value, str], str] = {}
        self.count = 0

    def fresh(self, kind: str) -> str:
        self.count += 1
        return f"{PREFIX}{kind}/{self.count}"

    def _cast(self, reference: str, source_dtype: str, dtype: str, round_trip: bool) -> str:
        key = (reference, dtype, round_trip)
        name = self.casts.get(key)
        if name is not None:
            return name
        low = self._cast_node(reference, source_dtype, dtype)
        name = self._cast_node(low, dtype, source_dtype) if round_trip else low
        self.casts[key] = name
        return name

    def _cast_node(self, source: str, source_dtype: str, dtype: str) -> str:
        name = self.fresh("cast")
        nd = node_def_pb2.NodeDef(name=name, op="Cast", input=[source])
        nd.attr["SrcT"].type = dtype_enum(source_dtype)
        nd.attr["DstT"].type = dtype_enum(dtype)
        nd.attr["Truncate"].b = False
        self.probe.node.append(nd)
        return name

    def _constant(self, ref: Ref) -> str:
        key = (ref.value, ref.dtype or "")
        name = self.constants.get(key)
        if name is None:
            tensor = constant_as_read(ref)
            name = self.fresh("const")
            nd = node_def_pb2.NodeDef(name=name, op="Const")
            nd.attr["dtype"].type = dtype_enum(tensor.dtype)
            nd.attr["value"].tensor.CopyFrom(tensor_proto(tensor))
            self.probe.node.append(nd)
            self.constants[key] = name
        return name

    def add(self, node: Node, converted: node_def_pb2.NodeDef, local: bool, rounds: bool
            ) -> list[tuple[str, str, int, str]]:
        """Add the node's shadows (lp when `local`, rd when `rounds`); returns (kind, rounded
        input, output slot, tensor) to fetch."""
        name_of = self.conversion.original_name
        refs = [None if v is None else resolve(v, name_of) for v in node.inputs]
        lp_inputs: list[str] = []
        exact: list[str] = []
        rounding: list[tuple[str, str]] = []
        for ref in refs:
            if ref is None or ref.reference is None:
                return []
            if ref.kind == "constant":
                lp_inputs.append(self._constant(ref))
                exact.append(ref.reference)
                continue
            exact.append(ref.reference)
            if ref.dtype == ref.reference_dtype or ref.dtype is None \
                    or ref.reference_dtype is None:
                lp_inputs.append(ref.reference)
                continue
            lp_inputs.append(self._cast(ref.reference, ref.reference_dtype, ref.dtype, False))
            if ref.dtype in LOW_PRECISION_DTYPES and \
                    ref.reference not in (r for r, _ in rounding):
                rounding.append((ref.reference, self._cast(ref.reference, ref.reference_dtype,
                                                           ref.dtype, True)))
        float_slots = [slot for slot, v in enumerate(node.outputs)
                       if v is not None and v.original_dtype in FLOAT_DTYPES]
        found: list[tuple[str, str, int, str]] = []
        if local:
            lp = self._copy(converted, "lp", lp_inputs)
            found += [("lp", "", index, f"{lp}:{slot}")
                      for index, slot in enumerate(float_slots)]
        for reference, rounded in (rounding if rounds else []):
            inputs = [rounded if name == reference else name for name in exact]
            rd = self._copy(node.handle, "rd", inputs)
            found += [("rd", reference, index, f"{rd}:{slot}")
                      for index, slot in enumerate(float_slots)]
        return found

    def _copy(self, original: node_def_pb2.NodeDef, kind: str, inputs: list[str]) -> str:
        nd = node_def_pb2.NodeDef()
        nd.CopyFrom(original)
        nd.name = self.fresh(kind)
        nd.device = ""
        del nd.input[:]
        nd.input.extend(inputs)  # data inputs only: control edges stay with the original
        self.probe.node.append(nd)
        return nd.name
