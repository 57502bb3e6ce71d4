"""The contract between the format-neutral measurement and a format's model runner.

A runner converts its model (with pins), describes the converted nodes (`NodeInfo`), and runs
three kinds of session one batch at a time:

- the *probe*: the fp32 model with every float tensor exposed, plus, for each node that runs in
  low precision in a conversion, a shadow copy fed the fp32 reference activations (cast to what
  the node reads) -- its *local* output -- and, per input it reads in low precision, an fp32
  copy fed that input rounded to the target dtype (does the node's error come from that
  input's rounding, i.e. from its producer?). Optionally it also
  runs the converted model with every tensor exposed (`diagnose`).
- the *candidate*: a converted model as it would run, outputs only (verification runs).

Sessions return plain numpy arrays for one batch and keep nothing, so a measurement holds one
batch's activations at a time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..passes.base import Pin
from ..report import Report
from .calibration import Batch, InputSpec


@dataclass
class NodeInfo:
    """One node of the model, as a conversion left it."""

    name: str
    op: str
    #: "main", or the path of the body it sits in.
    graph: str
    #: Execution order over the whole model (a body's nodes come right before their owner).
    order: int
    #: "fp16" / "bf16" / "mixed" when any of its float slots runs low precision, else "fp32".
    precision: str
    #: Reference names of its float outputs and of the float activations it reads.
    outputs: list[str]
    inputs: list[str]
    #: Of `inputs`, those it reads in low precision, and the nodes producing them (aligned; ""
    #: for a graph input).
    low_inputs: list[str] = field(default_factory=list)
    producers: list[str] = field(default_factory=list)
    #: Float activations in a divisor slot (x / d): a flushed value gives inf.
    divisor_inputs: list[str] = field(default_factory=list)
    #: For reductions (`--max-reduction`): ("ratio", input, output) when each output value sums
    #: input size / output size elements (Reduce*), ("last", input, "") when it sums the input's
    #: last dimension (MatMul).
    reduction: tuple[str, str, str] | None = None
    #: Whether the probe measures this node's local error (False: control flow measured through
    #: its body, Scan bodies, nodes the format cannot cut out).
    measured: bool = True
    #: Part of an attention mask the conversion saturates (a structure rule: its construction,
    #: the masked sums, the Softmax): values beyond the target's range there are -inf by design
    #: and saturated before the Softmax, so they are no data-range hazard.
    saturated: bool = False

    @property
    def low(self) -> bool:
        return self.precision not in ("fp32", "n/a")


@dataclass
class ProbeBatch:
    """What the probe computed for one batch."""

    #: Reference (fp32 model) value of every float tensor, by name.
    reference: dict[str, np.ndarray]
    #: Node name -> its outputs computed in low precision from the reference inputs.
    local: dict[str, list[np.ndarray | None]]
    #: Node name -> low-precision input (reference name) -> the node's outputs computed in fp32
    #: from the reference inputs, that one rounded to the target dtype.
    rounded: dict[str, dict[str, list[np.ndarray | None]]]
    #: The converted model's value of every float tensor, by reference name (when asked for).
    candidate: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class ProbePlan:
    """What a probe computes besides the reference tensors."""

    #: The converted model's value of every float tensor (diagnose).
    candidate_tensors: bool = False
    #: The lp shadow (local output) of every low-precision node (of `local_nodes` only, when
    #: given).
    local: bool = True
    local_nodes: frozenset[str] | None = None
    #: rd shadows (one per low-precision input) of these nodes; None: of every node.
    rounding: frozenset[str] | None = None
    #: Measure inside control-flow bodies (off: they count as one node).
    bodies: bool = True

    def rounds(self, node: str) -> bool:
        return self.rounding is None or node in self.rounding

    def shadows(self, node: str) -> bool:
        """Whether the node's lp shadow is part of this probe."""
        return self.local and (self.local_nodes is None or node in self.local_nodes)


class Probe(ABC):
    """An open probe session."""

    #: Notes on what could not be measured (shown in reports).
    notes: list[str]

    @abstractmethod
    def run(self, batch: Batch) -> ProbeBatch:
        """Run one batch."""


class PreparedProbe(ABC):
    """A probe built from a conversion and ready to run: the conversion may be dropped before
    `open`, so that it and the sessions are never in memory together."""

    notes: list[str]
    #: Whether it measures inside control-flow bodies (a fallback without them exists).
    has_bodies: bool = False

    @abstractmethod
    def open(self) -> Probe:
        """Start its sessions."""


class Conversion(ABC):
    """A converted model in memory, with its report."""

    report: Report
    pins: Mapping[str, Pin]


class ModelRunner(ABC):
    """A model in one format, converted and run for the accuracy tools."""

    #: "onnx" or "tf".
    format: str
    #: Where and how models run (which provider, emulated or not), for reports.
    execution_note: str
    #: The size of the model's weights (bytes), for the probe's memory bound.
    weight_bytes: int = 0
    #: Ops (`NodeInfo.op`) that normalise a transformer's residual stream (LayerNorm and its
    #: fused forms): `--auto` tries them fp32 first (see accuracy/search.py).
    normalization_ops: frozenset[str] = frozenset()

    def shadow_bytes(self, conversion: Conversion) -> dict[str, int]:
        """Low-precision node -> the memory its lp shadow's weights take in the probe."""
        return {}

    def close(self) -> None:
        """Remove what the runner keeps on disk (its work folder); called when a run ends."""
        return None

    @abstractmethod
    def input_specs(self) -> list[InputSpec]:
        """What calibration batches must provide."""

    @abstractmethod
    def output_names(self) -> list[str]:
        """The model outputs the metric compares."""

    @abstractmethod
    def random_batch(self, seed: int) -> Batch:
        """Seeded random data of the right names, dtypes and shapes."""

    @abstractmethod
    def convert(self, pins: Mapping[str, Pin]) -> Conversion:
        """Convert the model in memory with these front-end pins."""

    @abstractmethod
    def nodes(self, conversion: Conversion) -> list[NodeInfo]:
        """Every original node of the model, as `conversion` left it, in execution order."""

    @abstractmethod
    def prepare_probe(self, conversion: Conversion, plan: ProbePlan) -> PreparedProbe:
        """The probe for `conversion` (see the module docstring), built but not yet running."""

    @abstractmethod
    def open_candidate(self, conversion: Conversion) -> Any:
        """A session running `conversion` as it would run: `run_candidate(session, batch)`.
        It may use the conversion up (its model changed in place, to save a copy): the caller
        drops it afterwards."""

    @abstractmethod
    def run_candidate(self, session: Any, batch: Batch) -> dict[str, np.ndarray]:
        """The model outputs of one batch."""

    @abstractmethod
    def write(self, output_path: Path, pins: Mapping[str, Pin]) -> Report:
        """Convert with `pins` and write the result exactly as plain `convert` writes it."""
