#!/usr/bin/env python3
"""Time `convert --external-data per-tensor` against `--external-data single` on one model with
many small weights (issue 35: per-tensor was quadratic in the number of tensors, its output
commit comparing every data file with every other).

    python scripts/bench_external_layouts.py                  # 10,000 tensors, 3 rounds
    python scripts/bench_external_layouts.py --tensors 3000 --rounds 5

The model is testkit/models/many_weights.py: a chain of Add nodes, each adding its own [32, 32] float32
weight (4 KiB; 2 KiB in fp16, so every converted weight goes external under the default
threshold). Both layouts
convert the same file through the CLI's `main` in this process, interleaved (single, then
per-tensor, then per-tensor, then single, ...) after one warm-up run of each, so drift in the
machine's load falls on both alike; each run writes into a fresh, empty folder of its own. The
folders are removed only at the end: ext4 skips recently deleted inodes when it allocates new
ones, so creating thousands of files right after deleting thousands costs many times more (on
the development machine, 0.03 ms a file growing to 0.6 ms), which would time the cleanup of
the previous run, not the layout. Prints each run and the ratio of the medians (per-tensor /
single).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from amp_rewriter import cli  # noqa: E402
from testkit.models.many_weights import build_model  # noqa: E402

LAYOUTS = ("single", "per-tensor")


def convert_once(source: Path, folder: Path, layout: str) -> float:
    """Seconds one CLI conversion takes, writing into `folder` (made here, empty)."""
    folder.mkdir()
    gc.collect()
    start = time.perf_counter()
    code = cli.main(["convert", str(source), str(folder / "out.onnx"), "--external-data", layout,
                     "--quiet"])
    seconds = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"convert --external-data {layout} exited {code}")
    files = sum(1 for _ in folder.iterdir())
    expected = 2 if layout == "single" else 1 + int(source.stem.split("_")[-1])
    if files != expected:
        raise SystemExit(f"--external-data {layout}: {files} files written, expected {expected}")
    return seconds


def file_creation_ms(folder: Path, count: int = 1000) -> float:
    """Milliseconds to create one empty file in a fresh folder here, right now: per-tensor
    writes one file a tensor, so this is what it pays on top of single (0.03 ms on a quiet
    ext4; 0.5-1 ms within a minute or so of thousands of deletions on the same file system)."""
    folder.mkdir()
    start = time.perf_counter()
    for index in range(count):
        os.close(os.open(folder / f"{index}.data", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    return (time.perf_counter() - start) * 1000 / count


def settle(work: Path, quiet_ms: float, patience_s: float) -> float:
    """Wait (up to `patience_s`) until creating a file costs at most `quiet_ms`: ext4 without
    a journal skips the inodes it freed in the last ~30 s when it allocates new ones, reading
    each one's table entry, so for a while after thousands of deletions (a previous run's
    cleanup, another job's) every file made costs 20-30 times more. That is the file system
    recovering, not the layout; the probes' files are kept (deleting them would start it
    again). Returns the last probe's cost."""
    deadline = time.monotonic() + patience_s
    probe = 0
    while True:
        cost = file_creation_ms(work / f"probe-{probe}")
        probe += 1
        if cost <= quiet_ms or time.monotonic() > deadline:
            return cost
        time.sleep(5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quiet-ms", type=float, default=0.1,
                        help="wait until creating a file costs at most this (default 0.1 ms)")
    parser.add_argument("--patience", type=float, default=90.0,
                        help="seconds to wait for that at most (default 90; 0: do not wait)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-layouts-") as tmp:
        work = Path(tmp)
        source = work / f"model_{args.tensors}.onnx"
        onnx.save(build_model(args.tensors), str(source))
        before = settle(work, args.quiet_ms, args.patience)
        print(f"{args.tensors} tensors, model {source.stat().st_size / 1e6:.1f} MB; "
              f"{args.rounds} interleaved rounds after a warm-up run of each; creating a file "
              f"here takes {before:.3f} ms")
        for layout in LAYOUTS:
            convert_once(source, work / f"warm-up-{layout}", layout)
        times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        for round_index in range(args.rounds):
            order = LAYOUTS if round_index % 2 == 0 else tuple(reversed(LAYOUTS))
            for layout in order:
                seconds = convert_once(source, work / f"round-{round_index}-{layout}", layout)
                times[layout].append(seconds)
                print(f"  round {round_index + 1} {layout:10s} {seconds:7.2f} s", flush=True)
        after = file_creation_ms(work / "probe-after")
        print("removing the outputs...", flush=True)
    medians = {layout: statistics.median(values) for layout, values in times.items()}
    ratio = medians["per-tensor"] / medians["single"]
    print(f"median: single {medians['single']:.2f} s, per-tensor {medians['per-tensor']:.2f} s; "
          f"per-tensor / single = {ratio:.2f} (creating a file took {after:.3f} ms at the end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
