"""Train TF1 graphs on scikit-learn's digits in fp32 and after the amp-rewriter fp16 and bf16
training rewrites, and compare loss curves and test accuracy.

For every (model, optimizer) pair, three runs start from the same seeded initial weights and see
the same mini-batches:

* ``fp32``: the graph from ``testkit.models.tf_training.build_training_graph`` as built;
* ``fp16``: ``rewrite_training_graph(..., target="fp16")`` with its default dynamic loss scaling;
* ``bf16``: ``rewrite_training_graph(..., target="bf16")`` (no loss scaling, the bf16 default).

The script prints a table of final test accuracy and final loss, the loss averaged over every 50
steps side by side, and the fp16 run's final loss scale; it writes a PNG with one panel per pair.
It exits with status 1 when a rewrite ends more than 2 accuracy points below fp32.

Example (from the repository root)::

    .venv/bin/python scripts/train_digits.py
    .venv/bin/python scripts/train_digits.py --models mlp --optimizers adam --steps 100 \\
        --out /tmp/digits.png --json /tmp/digits.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

# TensorFlow reads this when it loads, so it has to be set before the first TF import (ours or
# amp_rewriter's). setdefault keeps a value the user chose to see TF's logs.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

REPO_ROOT = Path(__file__).resolve().parents[1]
# `testkit` is not an installed package: it is importable only from the checkout.
sys.path.insert(0, str(REPO_ROOT))

#: absl's INFO lines ("I0000 00:00:17... 123 port.cc:153] ...") and the banner before them.
_STARTUP_NOISE = re.compile(r"I\d{4} [\d:.]+\s+\d+ \S+:\d+\] "
                            r"|WARNING: All log messages before absl::InitializeLog\(\)")


def _import_tensorflow_quietly():
    """`import tensorflow` without the INFO lines TF 2.16+ logs while it loads.

    Those lines (oneDNN notice, "no CUDA drivers") are written through absl before its logging
    is initialized, which ignores TF_CPP_MIN_LOG_LEVEL. So file descriptor 2 goes to a temporary
    file during the import, and everything captured except those lines is passed on (all of it
    if the import fails).
    """
    sys.stderr.flush()
    saved_stderr = os.dup(2)
    imported = False
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow
            imported = True
        finally:
            sys.stderr.flush()
            os.dup2(saved_stderr, 2)
            os.close(saved_stderr)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines
                                     if not (imported and _STARTUP_NOISE.match(line))))
            sys.stderr.flush()
    return tensorflow


tf = _import_tensorflow_quietly()
tf.get_logger().setLevel("ERROR")

from amp_rewriter.tf import rewrite_training_graph  # noqa: E402
from testkit.models.tf_training import OPTIMIZERS, build_training_graph, digits_data, train  # noqa: E402

MODELS = ("mlp", "cnn")
VARIANTS = ("fp32", "fp16", "bf16")
#: Steps per average in the printed loss curve.
CURVE_WINDOW = 50
#: Steps per trailing mean in the plotted curves: single-batch losses are too noisy to compare.
PLOT_SMOOTHING = 10
#: A rewrite more than this many accuracy points (percent) below fp32 fails the run.
MAX_ACCURACY_DROP_POINTS = 2.0


@dataclass
class VariantRun:
    """One training run: the loss after every step, test accuracy (0..1) and wall times."""

    losses: list[float]
    accuracy: float
    #: Time spent in rewrite_training_graph (0 for fp32) and in train().
    rewrite_seconds: float
    train_seconds: float
    #: The fp16 rewrite's loss scale after the last step (None without loss scaling).
    final_loss_scale: float | None = None


@dataclass
class PairResult:
    """The three runs of one (model, optimizer) pair, keyed by variant name."""

    model: str
    optimizer: str
    runs: dict[str, VariantRun]

    def drop_points(self, variant: str) -> float:
        """Accuracy of `variant` minus fp32, in percentage points (negative: worse than fp32)."""
        return 100.0 * (self.runs[variant].accuracy - self.runs["fp32"].accuracy)


def run_variant(model: str, optimizer: str, variant: str, steps: int, batch: int,
                data: tuple) -> VariantRun:
    """Build the pair's graph, rewrite it for `variant` (unless fp32) and train it."""
    # Every variant builds its own graph with the same seed, so all three start from the same
    # weights; train() draws the same seeded batches for each.
    graph = build_training_graph(model, optimizer)
    final_scale: list[float] = []
    end_hook = None
    started = time.perf_counter()
    if variant != "fp32":
        rewrite = rewrite_training_graph(graph, loss="loss", train_op="train", target=variant)
        graph = rewrite.graph
        if rewrite.loss_scale is not None:
            def end_hook(session, scale_tensor=rewrite.loss_scale):
                final_scale.append(float(session.run(scale_tensor)))
    rewritten = time.perf_counter()
    losses, accuracy = train(graph, steps=steps, batch=batch, data=data, end_hook=end_hook)
    return VariantRun(losses=losses, accuracy=accuracy, rewrite_seconds=rewritten - started,
                      train_seconds=time.perf_counter() - rewritten,
                      final_loss_scale=final_scale[0] if final_scale else None)


def window_means(values: list[float], window: int) -> list[float]:
    """Mean of each consecutive `window` values; the last window may be shorter."""
    return [sum(chunk) / len(chunk)
            for chunk in (values[i:i + window] for i in range(0, len(values), window))]


def trailing_means(values: list[float], window: int) -> list[float]:
    """Mean over the last `window` values at every position (fewer at the start)."""
    means, running = [], 0.0
    for i, value in enumerate(values):
        running += value
        if i >= window:
            running -= values[i - window]
        means.append(running / min(i + 1, window))
    return means


def _format_loss(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else str(value)


def print_summary_table(results: list[PairResult]) -> None:
    """Accuracy per variant, the rewrites' difference to fp32, last-step losses, final scale."""
    header = ["model", "optimizer", "acc fp32", "acc fp16", "acc bf16", "d fp16", "d bf16",
              "loss fp32", "loss fp16", "loss bf16", "fp16 scale"]
    rows = []
    for result in results:
        runs = result.runs
        scale = runs["fp16"].final_loss_scale
        rows.append([
            result.model, result.optimizer,
            *(f"{100 * runs[v].accuracy:.1f}%" for v in VARIANTS),
            *(f"{result.drop_points(v):+.1f}" for v in ("fp16", "bf16")),
            *(_format_loss(runs[v].losses[-1]) for v in VARIANTS),
            f"{scale:g}" if scale is not None else "-",
        ])
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    # Names left-aligned, numbers right-aligned so the columns line up on the decimal point.
    def line(cells: list[str]) -> str:
        return "  ".join(cell.ljust(width) if i < 2 else cell.rjust(width)
                         for i, (cell, width) in enumerate(zip(cells, widths)))
    print(line(header))
    print("  ".join("-" * width for width in widths))
    for row in rows:
        print(line(row))
    print("acc: test accuracy on 500 held-out digits; d: points vs fp32; "
          "loss: the last step's batch loss; fp16 scale: the dynamic loss scale after training")


def print_loss_curves(results: list[PairResult], steps: int) -> None:
    """For each pair, the loss averaged over every CURVE_WINDOW steps, variants side by side."""
    for result in results:
        print(f"\n{result.model} / {result.optimizer}: mean loss per {CURVE_WINDOW} steps")
        print(f"  {'steps':>9}  " + "  ".join(f"{v:>8}" for v in VARIANTS))
        curves = {v: window_means(result.runs[v].losses, CURVE_WINDOW) for v in VARIANTS}
        for index in range(len(curves["fp32"])):
            first, last = index * CURVE_WINDOW, min((index + 1) * CURVE_WINDOW, steps) - 1
            values = "  ".join(f"{_format_loss(curves[v][index]):>8}" for v in VARIANTS)
            print(f"  {first:>4}-{last:<4}  {values}")


def write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Call `write` on a temporary file next to `path`, then rename it to `path`.

    The rename is atomic within one file system, so a reader (or an interrupted run) never
    leaves a half-written file at `path`.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as stream:
            write(stream)
        # mkstemp creates the file 0600; give it the mode a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp_name, 0o666 & ~umask)
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


def write_plot(results: list[PairResult], path: Path) -> None:
    """One panel per pair with the smoothed loss of each variant; written atomically to `path`."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in results))
    optimizers = list(dict.fromkeys(r.optimizer for r in results))
    figure, axes = plt.subplots(len(models), len(optimizers), squeeze=False,
                                figsize=(4.2 * len(optimizers), 3.4 * len(models)))
    # fp32 wide and light underneath: the low-precision curves often lie right on top of it.
    styles = {"fp32": dict(color="0.65", linewidth=3.2),
              "fp16": dict(color="tab:orange", linewidth=1.2),
              "bf16": dict(color="tab:blue", linewidth=1.2, linestyle="--")}
    for result in results:
        axis = axes[models.index(result.model)][optimizers.index(result.optimizer)]
        for variant in VARIANTS:
            run = result.runs[variant]
            smoothed = trailing_means(run.losses, PLOT_SMOOTHING)
            axis.plot(range(len(smoothed)), smoothed, **styles[variant],
                      label=f"{variant}  acc {100 * run.accuracy:.1f}%")
        axis.set_title(f"{result.model} / {result.optimizer}")
        axis.set_xlabel("step")
        axis.set_ylabel(f"loss (mean of last {PLOT_SMOOTHING} steps)")
        axis.set_yscale("log")  # the interesting differences are late, at small losses
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize="small")
    for row in axes:  # panels of pairs that were not run (a partial grid)
        for axis in row:
            if not axis.has_data():
                axis.set_visible(False)
    figure.suptitle("digits: fp32 vs amp-rewriter fp16 (dynamic loss scale) and bf16")
    figure.tight_layout()
    try:
        write_atomically(path, lambda stream: figure.savefig(stream, format="png", dpi=110))
    finally:
        plt.close(figure)


def write_json(results: list[PairResult], args: argparse.Namespace, total_seconds: float,
               path: Path) -> None:
    """All numbers, per-step losses included; written atomically like the plot."""
    payload = {
        "steps": args.steps, "batch": args.batch, "total_seconds": total_seconds,
        "tensorflow": tf.__version__,
        "pairs": [{"model": r.model, "optimizer": r.optimizer,
                   "accuracy_drop_points": {v: r.drop_points(v) for v in ("fp16", "bf16")},
                   "runs": {v: asdict(run) for v, run in r.runs.items()}} for r in results],
    }
    write_atomically(path, lambda stream: stream.write(json.dumps(payload, indent=1).encode()))


def _name_list(text: str, allowed: tuple[str, ...], what: str,
               parser: argparse.ArgumentParser) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        parser.error(f"--{what}: expected a comma-separated list from {', '.join(allowed)}, "
                     f"got {text!r}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; --models and --optimizers become validated lists."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,cnn", help="comma-separated: mlp, cnn")
    parser.add_argument("--optimizers", default="sgd,momentum,adam",
                        help=f"comma-separated: {', '.join(OPTIMIZERS)}")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument("--batch", type=int, default=64, help="mini-batch size")
    parser.add_argument("--out", type=Path, default=Path("docs/training_digits.png"),
                        help="PNG to write (default: docs/training_digits.png)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    args.models = _name_list(args.models, MODELS, "models", parser)
    args.optimizers = _name_list(args.optimizers, OPTIMIZERS, "optimizers", parser)
    if args.steps < 1 or args.batch < 1:
        parser.error("--steps and --batch must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every pair, print the comparison, write the plot; 1 if a rewrite loses accuracy."""
    args = parse_args(argv)
    data = digits_data()
    started = time.perf_counter()
    results = []
    for model in args.models:
        for optimizer in args.optimizers:
            runs = {}
            for variant in VARIANTS:
                runs[variant] = run_variant(model, optimizer, variant, args.steps, args.batch,
                                            data)
                run = runs[variant]
                print(f"  {model}/{optimizer} {variant}: acc {100 * run.accuracy:.1f}%, "
                      f"rewrite {run.rewrite_seconds:.1f} s, train {run.train_seconds:.1f} s",
                      file=sys.stderr, flush=True)
            results.append(PairResult(model, optimizer, runs))
    total_seconds = time.perf_counter() - started

    print(f"digits, {args.steps} steps of batch {args.batch} per run, "
          f"TensorFlow {tf.__version__}\n")
    print_summary_table(results)
    print_loss_curves(results, args.steps)
    write_plot(results, args.out)
    print(f"\nplot: {args.out}")
    if args.json is not None:
        write_json(results, args, total_seconds, args.json)
        print(f"numbers: {args.json}")
    print(f"total training time: {total_seconds:.1f} s for {3 * len(results)} runs")

    failures = [(r, v) for r in results for v in ("fp16", "bf16")
                if r.drop_points(v) < -MAX_ACCURACY_DROP_POINTS]
    for result, variant in failures:
        print(f"WARNING: {result.model}/{result.optimizer} {variant} accuracy is "
              f"{-result.drop_points(variant):.1f} points below fp32 "
              f"(more than {MAX_ACCURACY_DROP_POINTS:g})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
