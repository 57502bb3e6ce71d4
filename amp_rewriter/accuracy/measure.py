"""One streaming pass over the calibration batches: the fp32 reference's range of every float
tensor, each low-precision node's local error (and how much of it its inputs' rounding
explains), optionally the converted model's error at every tensor; plus the reference outputs
the verification runs compare against. Each batch's activations are dropped before the next."""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import AmpError
from .calibration import CalibrationSet
from .runner import Conversion, ModelRunner, NodeInfo, Probe, ProbeBatch, ProbePlan
from .stats import ErrorStats, RangeStats


def worst_relative(stats: list[ErrorStats]) -> float:
    """The largest relative error over a node's outputs (0 when it has none)."""
    return max((s.relative for s in stats), default=0.0)


@dataclass
class NodeMeasurement:
    """What the calibration batches showed about one node."""

    info: NodeInfo
    #: Per float output: low precision from fp32 inputs; the converted model's value there
    #: (diagnose only). Per low-precision input, per float output: fp32 from that input rounded.
    local: list[ErrorStats] = field(default_factory=list)
    rounded: dict[str, list[ErrorStats]] = field(default_factory=dict)
    converted: list[ErrorStats] = field(default_factory=list)

    @property
    def local_error(self) -> float:
        """The relative error the node adds on its own (0 for fp32 and unmeasured nodes)."""
        return worst_relative(self.local)

    @property
    def input_rounding_error(self) -> float:
        """The relative error of the node in fp32 fed one of its low-precision inputs rounded
        (the worst input)."""
        return max((worst_relative(s) for s in self.rounded.values()), default=0.0)

    def rounding_error_of(self, input_name: str) -> float:
        """The node's relative error in fp32 with only `input_name` rounded."""
        return worst_relative(self.rounded.get(input_name, []))

    @property
    def converted_error(self) -> float:
        return worst_relative(self.converted)

    @property
    def breaks_locally(self) -> bool:
        """NaN/Inf on its own, from finite fp32 inputs."""
        return any(s.broken for s in self.local)

    @property
    def batches_breaking(self) -> int:
        return max((s.batches_nonfinite for s in self.local), default=0)


@dataclass
class Measurement:
    """The result of one pass over the calibration data."""

    target: str
    batches: int
    calibration: str
    random_inputs: bool
    execution: str
    tensors: dict[str, RangeStats]
    nodes: dict[str, NodeMeasurement]
    #: Per batch, the fp32 model's outputs (small: outputs only), for verification runs.
    reference_outputs: list[dict[str, np.ndarray]]
    notes: list[str]
    seconds: float
    #: The first node (in execution order) whose converted output has NaN/Inf where fp32 has
    #: none (diagnose only), and the first whose local output does.
    first_nonfinite: str | None = None
    first_local_nonfinite: str | None = None
    #: The converted model's relative error at each model output (diagnose only).
    output_errors: dict[str, float] = field(default_factory=dict)
    #: Passes over the calibration data (a second one measures input rounding, when needed).
    reference_runs: int = 1

    def ranges_of(self, names: list[str]) -> list[RangeStats]:
        return [self.tensors[n] for n in names if n in self.tensors]


def open_probe(runner: ModelRunner, make: Callable[[], Conversion], plan: ProbePlan
               ) -> tuple[list[NodeInfo], Probe]:
    """Convert, describe and prepare the probe, drop the conversion, then start the probe: the
    conversion and the probe's sessions are never in memory together. Falls back to measuring
    control-flow bodies as a whole when onnxruntime cannot run the probe of their insides."""
    conversion = make()
    infos = runner.nodes(conversion)
    saturated = {name for record in conversion.report.structures
                 if record["rule"] == "attention_mask" for name in record["nodes"]}
    for info in infos:
        info.saturated = info.name in saturated
    prepared = runner.prepare_probe(conversion, plan)
    del conversion
    gc.collect()  # the IR is full of cycles: free its weights now, not at some later collection
    try:
        return infos, prepared.open()
    except AmpError as first:
        if not prepared.has_bodies:
            raise
        failure = str(first)
    return infos, _without_bodies(runner, make, plan, failure)


def _without_bodies(runner: ModelRunner, make: Callable[[], Conversion], plan: ProbePlan,
                    failure: str) -> Probe:
    conversion = make()
    prepared = runner.prepare_probe(conversion, dataclasses.replace(plan, bodies=False))
    del conversion
    gc.collect()
    probe = prepared.open()
    probe.notes.append(f"If/Loop bodies measured as a whole: the probe of their insides failed "
                       f"({failure})")
    return probe


def measure(runner: ModelRunner, make: Callable[[], Conversion], calibration: CalibrationSet,
            target_dtype: str, plan: ProbePlan | None = None,
            data_max: float | None = None) -> Measurement:
    """Run the probe of the conversion `make()` returns over every batch and fold each batch
    into per-tensor statistics."""
    start = time.perf_counter()
    plan = plan or ProbePlan()
    groups = _shadow_groups(runner, make, plan)
    if groups:  # the shadows' weights would not fit beside the model's: a pass per group
        plan = dataclasses.replace(plan, local_nodes=groups[0])
    infos, probe = open_probe(runner, make, plan)
    outputs = runner.output_names()
    tensors: dict[str, RangeStats] = {}
    nodes = {info.name: NodeMeasurement(info) for info in infos}
    converted: dict[str, ErrorStats] = {}
    reference_outputs: list[dict[str, np.ndarray]] = []
    batches = 0
    for batch in calibration:
        try:
            result = probe.run(batch)
        except AmpError as exc:
            if batches or not plan.bodies:
                raise
            # onnxruntime may refuse a body's probe only when it runs (a tensor whose shape
            # changes between loop iterations): measure the bodies as a whole instead.
            probe = _without_bodies(runner, make, plan, str(exc))
            result = probe.run(batch)
        # One function call per batch: its locals (the batch's arrays) go when it returns.
        reference_outputs.append(_absorb(result, outputs, tensors, nodes, converted,
                                         target_dtype, data_max))
        del result
        batches += 1
    notes = list(probe.notes)
    if groups:
        notes.append(f"the low-precision copies of the weights would not fit in memory beside "
                     f"the model's: local errors measured in {len(groups)} passes")
    del probe
    extra_runs = 0
    for group in groups[1:]:
        gc.collect()
        _, probe = open_probe(runner, make, ProbePlan(local_nodes=group,
                                                      rounding=plan.rounding, bodies=plan.bodies))
        for batch in calibration:
            _absorb(probe.run(batch), [], {}, nodes, {}, target_dtype, None, ranges=False)
        del probe
        extra_runs += 1
    for measurement in nodes.values():
        measurement.converted = [converted[name] for name in measurement.info.outputs
                                 if name in converted]
    ordered = sorted(nodes.values(), key=lambda m: m.info.order)
    first = next((m.info.name for m in ordered if any(s.broken for s in m.converted)), None)
    first_local = next((m.info.name for m in ordered if m.breaks_locally), None)
    return Measurement(target_dtype, batches, calibration.description, calibration.random,
                       runner.execution_note, tensors, {m.info.name: m for m in ordered},
                       reference_outputs, notes, time.perf_counter() - start,
                       first, first_local,
                       {name: converted[name].relative for name in outputs if name in converted},
                       reference_runs=1 + extra_runs)


#: Models whose weights take more than this are measured with the memory bound in mind.
BIG_MODEL_BYTES = 256 * 2**20
#: Per pass, the shadows' weights may take this share of the model's.
SHADOW_SHARE = 0.4


def _shadow_groups(runner: ModelRunner, make: Callable[[], Conversion], plan: ProbePlan
                   ) -> list[frozenset[str]]:
    """For a big model, the low-precision nodes split into groups whose shadows' weights fit in
    SHADOW_SHARE of the model's size (the probe holds the model's weights, and the shadows'
    weights in fp32 where low precision is emulated). [] when one pass fits."""
    if runner.weight_bytes < BIG_MODEL_BYTES or not plan.local:
        return []
    conversion = make()
    costs = runner.shadow_bytes(conversion)
    del conversion
    gc.collect()
    budget = SHADOW_SHARE * runner.weight_bytes
    if sum(costs.values()) <= budget:
        return []
    groups: list[set[str]] = [set()]
    used = 0.0
    for name, cost in costs.items():
        if groups[-1] and used + cost > budget:
            groups.append(set())
            used = 0.0
        groups[-1].add(name)
        used += cost
    return [frozenset(g) for g in groups]


def measure_rounding(runner: ModelRunner, make: Callable[[], Conversion],
                     calibration: CalibrationSet, measurement: Measurement,
                     names: frozenset[str]) -> None:
    """A second pass for `names` only: how much of each node's error its low-precision inputs'
    rounding explains (folded into `measurement`; needed only for nodes with a large local
    error, so most models never pay for it)."""
    start = time.perf_counter()
    _, probe = open_probe(runner, make, ProbePlan(local=False, rounding=names))
    nodes = measurement.nodes
    for batch in calibration:
        _absorb(probe.run(batch), [], {}, nodes, {}, measurement.target, None, ranges=False)
    measurement.seconds += time.perf_counter() - start
    measurement.reference_runs += 1


def _absorb(result: ProbeBatch, outputs: list[str], tensors: dict[str, RangeStats],
            nodes: dict[str, NodeMeasurement], converted: dict[str, ErrorStats],
            target_dtype: str, data_max: float | None, ranges: bool = True
            ) -> dict[str, np.ndarray]:
    """Fold one batch's probe results into the statistics; returns its model outputs."""
    for name, array in result.reference.items() if ranges else ():
        stats = tensors.get(name)
        if stats is None:
            stats = tensors[name] = RangeStats(target_dtype, limit=data_max)
        stats.update(array)
    for node_name, arrays in result.local.items():
        _fold(nodes[node_name].local, nodes[node_name].info.outputs, result.reference, arrays)
    for node_name, per_input in result.rounded.items():
        node = nodes[node_name]
        for input_name, rounded in per_input.items():
            _fold(node.rounded.setdefault(input_name, []), node.info.outputs, result.reference,
                  rounded)
    for name, array in result.candidate.items():
        if name in result.reference:
            converted.setdefault(name, ErrorStats()).update(result.reference[name], array)
    return {name: result.reference[name] for name in outputs}


def _fold(stats: list[ErrorStats], output_names: list[str], reference: dict[str, Any],
          arrays: list[np.ndarray | None]) -> None:
    """Add one batch of a node's computed outputs to its per-output error statistics."""
    while len(stats) < len(arrays):
        stats.append(ErrorStats())
    for slot, (name, array) in enumerate(zip(output_names, arrays)):
        if array is not None and name in reference:
            stats[slot].update(reference[name], array)


def format_number(value: float) -> str:
    """A short number for reasons and tables ("9.1e+04", "inf")."""
    if math.isinf(value):
        return "inf"
    if math.isnan(value):
        return "nan"
    return f"{value:.2g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.1e}"
