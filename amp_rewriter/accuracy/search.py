"""`convert --auto`: the smallest set of fp32 pins it can find under which the converted model
meets the metric on the calibration data.

1. One reference run (`measure`): ranges, local errors, reference outputs.
2. Data-range rules (`rules.hazards`) pin what is clearly broken: overflow, NaN/Inf on its own,
   flushed divisors. Then a verification run checks the conversion with those pins (the plain
   conversion when there are none; a hazard-free model that passes is written as plain
   `convert` writes it, after exactly one reference and one verification run).
3. If the metric fails, the other low-precision nodes are ranked by the error they add on their
   own, behind the layer normalisations (`ModelRunner.normalization_ops`: in a transformer
   they write the residual stream, whose rounding accumulates over every later layer, which a
   node's own error does not show), and the pinned set grows along that order (the
   normalisations, then x4 each step; 1, 4, 16, ... without them) until a verification
   run passes; each pinned node also pins the producers of its low-precision inputs when their
   rounding alone breaks it (its fp32 copy fed that input rounded is off by more than
   `--local-max`). Then the set narrows: bisection between the last failing and the first
   passing size (to within 1/16 of it), and, for small sets, dropping one node at a time while
   the metric holds. Hazards return to fp32 alone; nodes the ranking adds are fp32 barriers, so
   fp32 regions form around them: an error spread over many nodes comes as much from rounding
   the activations between them as from the ops, and pinning lone nodes would keep that.
   A large passing set is then thinned with the trials left (`_Search.release`): the same pins
   without their fp32 regions, then groups of ranked pins given back from the least-ranked end,
   each kept only when its verification run passes.
4. Every step is bounded by `--max-trials` verification runs. All fp32 (every low-precision node
   pinned) meets any metric the fp32 model meets, so the search ends there at worst, verified;
   it never fails when a solution exists.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import AmpError
from ..ir import decisions
from ..options import AutoOptions
from ..passes.base import Pin
from .calibration import CalibrationSet
from .measure import Measurement, format_number, measure, measure_rounding
from .metrics import Metric
from .rules import SHORT, hazards, local_max
from .runner import Conversion, ModelRunner, ProbePlan

#: Above this many ranked pins, dropping them one at a time costs more trials than it saves.
PRUNE_LIMIT = 8
#: The pinned set grows by this factor until the metric holds (then bisection narrows it).
GROWTH = 4
#: Bisection stops when the set is known to within 1/NARROW of its size.
NARROW = 16


@dataclass
class Trial:
    """One verification run."""

    step: str
    pins: list[str]
    value: float
    passed: bool
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "pinned": len(self.pins),
                "metric": self.value if math.isfinite(self.value) else str(self.value),
                "passed": self.passed, "seconds": round(self.seconds, 3)}


@dataclass
class AutoResult:
    """What the search found and what it cost."""

    pins: dict[str, Pin]
    trials: list[Trial]
    measurement: Measurement
    metric: Metric
    hazards: dict[str, str]
    final_value: float
    same_as_plain: bool
    seconds: float
    #: Per pinned node: its measurements (local error, ranges) and why it was pinned.
    contributions: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        m = self.measurement
        return {
            "metric": self.metric.name, "max_error": self.metric.max_error,
            "final_metric": (self.final_value if math.isfinite(self.final_value)
                             else str(self.final_value)),
            "passed": self.metric.passes(self.final_value),
            "calibration": m.calibration, "random_inputs": m.random_inputs,
            "batches": m.batches, "execution": m.execution,
            "reference_runs": m.reference_runs, "verification_runs": len(self.trials),
            "same_as_plain_convert": self.same_as_plain,
            "pinned": self.contributions,
            "trials": [t.to_dict() for t in self.trials],
            "seconds": {"total": round(self.seconds, 3), "reference": round(m.seconds, 3)},
            "notes": self.notes + m.notes,
        }


class _Search:
    """The state of one search (see the module docstring)."""

    def __init__(self, runner: ModelRunner, calibration: CalibrationSet, metric: Metric,
                 options: AutoOptions, target_dtype: str,
                 progress: Callable[[str], None] | None):
        self.runner = runner
        self.calibration = calibration
        self.metric = metric
        self.options = options
        self.target = target_dtype
        self.progress = progress or (lambda message: None)
        self.trials: list[Trial] = []
        self.reasons: dict[str, str] = {}
        self.hazard_set: set[str] = set()
        #: Ranked pins that `release` found need no fp32 region around them.
        self.lone: set[str] = set()
        self.measurement: Measurement

    # -- verification ------------------------------------------------------------------------
    def pins(self, names: list[str]) -> dict[str, Pin]:
        """Hazards (and the producers their rounding breaks) return to fp32 alone; nodes the
        search adds are barriers, so fp32 regions form around them (removing the rounding of
        the activations between them, which pinning lone nodes would keep)."""
        return {name: Pin(self.reasons[name], decisions.MEASUREMENT,
                          barrier=name not in self.hazard_set and name not in self.lone)
                for name in names}

    def verify(self, step: str, names: list[str]) -> Trial:
        """Convert with `names` pinned and run the calibration batches; stop at the first batch
        that fails the metric."""
        start = time.perf_counter()
        pins = self.pins(names)
        conversion = self.runner.convert(pins)
        session = self.runner.open_candidate(conversion)
        del conversion  # the session has what it needs; memory holds one model at a time
        gc.collect()  # (the IR is full of cycles)
        worst = 0.0
        for index, batch in enumerate(self.calibration):
            outputs = self.runner.run_candidate(session, batch)
            value = self.metric.evaluate(self.measurement.reference_outputs[index], outputs)
            worst = value if math.isnan(value) else max(worst, value)
            if not self.metric.passes(worst):
                break
        del session
        trial = Trial(step, list(names), worst, self.metric.passes(worst),
                      time.perf_counter() - start)
        self.trials.append(trial)
        self.progress(f"auto: {step}: {len(names)} pinned, {self.metric.name} "
                      f"{format_number(worst)} {'ok' if trial.passed else 'fails'}")
        return trial

    def budget_left(self) -> bool:
        return len(self.trials) < self.options.max_trials

    # -- ranking -----------------------------------------------------------------------------
    def closure(self, names: list[str]) -> list[str]:
        """`names` and, transitively, the low-precision producers whose rounding alone breaks a
        node of the set (in execution order)."""
        nodes = self.measurement.nodes
        threshold = local_max(self.options, self.target)
        chosen: set[str] = set()
        stack = list(names)
        while stack:
            name = stack.pop()
            if name in chosen:
                continue
            chosen.add(name)
            node = nodes[name]
            for tensor, producer in zip(node.info.low_inputs, node.info.producers):
                error = node.rounding_error_of(tensor)
                if error > threshold and producer in nodes and nodes[producer].info.low \
                        and producer not in chosen:
                    self.reasons.setdefault(producer, (
                        f"its {SHORT[self.target]} output {tensor!r} feeds {name!r}, which is "
                        f"off by {format_number(error)} even in fp32 when fed {tensor!r} "
                        f"rounded to {SHORT[self.target]}"))
                    stack.append(producer)
        return [n for n in nodes if n in chosen]

    def ranked(self, exclude: set[str]) -> list[str]:
        """Low-precision nodes by the error they add on their own, largest first; unmeasured
        ones last."""
        candidates = [m for m in self.measurement.nodes.values()
                      if m.info.low and m.info.name not in exclude]
        measured = [m for m in candidates if m.info.measured]
        unmeasured = [m for m in candidates if not m.info.measured]
        measured.sort(key=lambda m: (-m.local_error, m.info.order))
        for m in measured:
            self.reasons.setdefault(m.info.name, (
                f"adds {format_number(m.local_error)} relative error on its own in "
                f"{SHORT[self.target]} (max |{SHORT[self.target]} - fp32| / max |fp32| of its "
                f"output, fed fp32 inputs)"))
        for m in unmeasured:
            self.reasons.setdefault(m.info.name, (
                f"kept fp32 so that the metric holds ({m.info.op} is not measured on its own)"))
        return [m.info.name for m in measured + unmeasured]

    def normalizations(self, order: list[str]) -> list[str]:
        """The low-precision layer normalisations among `order`, the last one first (the
        nearer the outputs, the less later layers dilute its rounding), with their reason. In a
        transformer they write the residual stream: fp32 there keeps the sum every layer adds
        to unrounded, which the ranking by local error does not see."""
        ops = self.runner.normalization_ops
        nodes = self.measurement.nodes
        found = sorted((name for name in order if nodes[name].info.op in ops),
                       key=lambda name: -nodes[name].info.order)
        threshold = local_max(self.options, self.target)
        for name in found:
            node = nodes[name]
            if node.breaks_locally or node.local_error > threshold:
                continue  # its own error says enough (ranked's reason)
            self.reasons[name] = (
                f"a layer normalisation (adds {format_number(node.local_error)} relative error "
                f"on its own in {SHORT[self.target]}), kept fp32 so that the residual stream it "
                f"writes stays fp32: rounding there accumulates over every later layer")
        return found

    # -- the search --------------------------------------------------------------------------
    def run(self) -> tuple[list[str], Trial]:
        m = self.measurement
        found = hazards(m, self.options)
        self.reasons.update(found)
        base = self.closure(list(found)) if found else []
        self.hazard_set = set(base)
        first = self.verify("plain conversion" if not base else "data-range rules", base)
        if first.passed:
            return base, first
        order = self.ranked(set(base))
        if not order:
            return base, first  # nothing left to pin: everything low is already pinned
        norms = self.normalizations(order)
        tried_first = set(norms)
        order = norms + [name for name in order if name not in tried_first]
        best: tuple[list[str], Trial] | None = None
        failed_k, k = 0, len(norms) or 1
        while self.budget_left():
            pins = self.closure(base + order[:k])
            step = f"normalizations ({k})" if norms and k == len(norms) else \
                f"top {k} of {len(order)}"
            trial = self.verify(step, pins)
            if trial.passed:
                best = (pins, trial)
                break
            failed_k = k
            if k == len(order):
                break
            k = min(GROWTH * k, len(order))
        if best is None:
            everything = self.closure(base + order)
            if self.trials[-1].pins != everything:
                trial = self.verify("all fp32", everything)
            else:
                trial = self.trials[-1]
            return everything, trial
        passing_k = k
        # Narrow to within 1/16 of the set: the last few bisection steps would each cost a
        # verification run to save a node or two.
        while passing_k - failed_k > max(1, passing_k // NARROW) and self.budget_left():
            middle = (failed_k + passing_k) // 2
            pins = self.closure(base + order[:middle])
            trial = self.verify(f"top {middle} of {len(order)}", pins)
            if trial.passed:
                passing_k, best = middle, (pins, trial)
            else:
                failed_k = middle
        pins, trial = best
        ranked_part = [n for n in order[:passing_k]]
        if len(ranked_part) <= PRUNE_LIMIT:
            for name in reversed(ranked_part):
                if not self.budget_left() or len(ranked_part) == 1:
                    break
                kept = [n for n in ranked_part if n != name]
                candidate = self.closure(base + kept)
                if candidate == pins:
                    continue
                attempt = self.verify(f"without {name}", candidate)
                if attempt.passed:
                    ranked_part, pins, trial = kept, candidate, attempt
            return pins, trial
        if passing_k == len(order):
            return pins, trial  # no part of the ranking passed: nothing worth giving back
        return self.release(base, ranked_part, pins, trial)

    def release(self, base: list[str], ranked_part: list[str], pins: list[str], trial: Trial
                ) -> tuple[list[str], Trial]:
        """Give back to low precision what a passing set of many ranked pins does not need,
        with the trials left: first the same nodes as lone pins (fp32 with casts around them,
        their neighbours low again), then groups of ranked pins from the least-ranked end,
        halving the group size after each sweep. Every adopted step is a passing verification,
        so the result still meets the metric."""
        if self.budget_left():
            barrier_free = set(ranked_part)
            self.lone |= barrier_free
            attempt = self.verify("as lone pins", pins)
            if attempt.passed:
                trial = attempt
            else:
                self.lone -= barrier_free
        group = max(1, len(ranked_part) // 4)
        while self.budget_left() and ranked_part:
            end = len(ranked_part)
            while end > 0 and self.budget_left():
                start = max(0, end - group)
                kept = ranked_part[:start] + ranked_part[end:]
                candidate = self.closure(base + kept)
                if candidate != pins:
                    attempt = self.verify(f"release {end - start} of {len(ranked_part)}",
                                          candidate)
                    if attempt.passed:
                        ranked_part, pins, trial = kept, candidate, attempt
                end = start
            if group == 1:
                break
            group = max(1, group // 2)
        return pins, trial


def auto_convert(runner: ModelRunner, calibration: CalibrationSet, metric: Metric,
                 options: AutoOptions, target_dtype: str,
                 progress: Callable[[str], None] | None = None) -> AutoResult:
    """Run the search (see the module docstring); the runner then writes `result.pins`."""
    start = time.perf_counter()
    search = _Search(runner, calibration, metric, options, target_dtype, progress)
    def plain() -> Conversion:
        return runner.convert({})

    measurement = measure(runner, plain, calibration, target_dtype,
                          ProbePlan(rounding=frozenset()), data_max=options.data_max)
    threshold = local_max(options, target_dtype)
    large = frozenset(name for name, node in measurement.nodes.items()
                      if node.info.low and node.info.low_inputs and not node.info.saturated
                      and (node.breaks_locally or node.local_error > threshold))
    if large:  # only then does it matter whether their inputs' rounding explains their error
        measure_rounding(runner, plain, calibration, measurement, large)
    search.measurement = measurement
    search.progress(f"auto: reference run: {measurement.batches} batch(es), "
                    f"{len(measurement.tensors)} tensors, "
                    f"{sum(1 for n in measurement.nodes.values() if n.info.low)} low-precision "
                    f"nodes measured in {measurement.seconds:.1f} s")
    for index, outputs in enumerate(measurement.reference_outputs):
        value = metric.evaluate(outputs, outputs)
        if not metric.passes(value):
            raise AmpError(f"--metric {metric.name} gives {format_number(value)} comparing the "
                           f"fp32 model with itself (batch {index}): no conversion can meet "
                           f"--max-error {metric.max_error:g}")
    names, trial = search.run()
    pins = search.pins(names)
    found = {n: r for n, r in search.reasons.items() if n in names}
    contributions = []
    for name in names:
        node = measurement.nodes[name]
        ranges = measurement.ranges_of(node.info.outputs)
        contributions.append({
            "node": name, "op": node.info.op, "graph": node.info.graph,
            "reason": found[name],
            "local_error": _number(node.local_error),
            "input_rounding_error": _number(node.input_rounding_error),
            "output_absmax": max((s.absmax for s in ranges), default=0.0),
            "overflow_fraction": max((s.overflow_fraction for s in ranges), default=0.0),
            "flush_fraction": max((s.flush_fraction for s in ranges), default=0.0),
        })
    notes = []
    if not trial.passed:
        notes.append(f"even all fp32 gives {metric.name} {format_number(trial.value)} on this "
                     f"runtime (the fp32 model itself passes): the metric is at the edge of "
                     f"run-to-run noise")
    return AutoResult(pins, search.trials, measurement, metric, hazards(measurement, options),
                      trial.value, not names, time.perf_counter() - start, contributions, notes)


def _number(value: float) -> float | str:
    return value if math.isfinite(value) else "inf"

