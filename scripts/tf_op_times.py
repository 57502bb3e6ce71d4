"""Where a TensorFlow SavedModel's serving time goes, per op type, for several variants of a model.

    .venv/bin/python scripts/tf_op_times.py FP32_DIR BF16_DIR [MORE_DIRS...] [--calls 10]
        [--batch 8]

Each SavedModel's `serving_default` function is frozen (its variables become constants) and run in
a TF1 session with full tracing on one batch of seeded random 224x224 images; TensorFlow's step
statistics give every executed kernel's time, summed per op type (after Grappler's rewrites, so
oneDNN's fused and native ops show under their own names). Printed: the median traced call and,
per op type, the milliseconds per call and the count of each variant side by side.

This is how docs/benchmarks.md shows which kernels make a bf16 model slower or faster than fp32
on a CPU (MobileNetV2's bf16 Relu6). Freezing drops the variable reads, so the totals are the
kernels' own time, not the served call's (which `bench_tf_cpu.py` measures).

`--served-vs-frozen` instead times, in one process and interleaved (`--rounds` x 5 calls), each
model's served call against the same function with its variables frozen into constants: what
the variables cost a call.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

#: "name = Op(inputs)": a step statistic's label, whose op is the kernel's op type.
_LABEL = re.compile(r".*? = ([^(]+)\(")


def _child(model_dir: str, calls: int, batch: int) -> None:
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2,
    )

    images = np.random.default_rng(0).standard_normal((batch, 224, 224, 3)).astype(np.float32)
    loaded = tf.saved_model.load(model_dir)  # kept: the function refers to its variables
    frozen = convert_variables_to_constants_v2(loaded.signatures["serving_default"])
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(frozen.graph.as_graph_def(), name="")
    feed, fetch = frozen.inputs[0].name, frozen.outputs[0].name
    trace = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    micros: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    walls = []
    with tf.compat.v1.Session(graph=graph) as session:
        for _ in range(3):
            session.run(fetch, {feed: images})
        for _ in range(calls):
            metadata = tf.compat.v1.RunMetadata()
            start = time.perf_counter()
            session.run(fetch, {feed: images}, options=trace, run_metadata=metadata)
            walls.append(time.perf_counter() - start)
            for device in metadata.step_stats.dev_stats:
                for stats in device.node_stats:
                    match = _LABEL.match(stats.timeline_label)
                    op = match.group(1) if match else stats.node_name
                    micros[op] += stats.all_end_rel_micros
                    counts[op] += 1
    print(json.dumps({"call_ms": statistics.median(walls) * 1e3,
                      "ops": {op: [total / calls / 1e3, counts[op] // calls]
                              for op, total in micros.items()}}))


def _served_vs_frozen(models: list[str], rounds: int, batch: int) -> None:
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2,
    )

    x = tf.constant(np.random.default_rng(0).standard_normal((batch, 224, 224, 3))
                    .astype(np.float32))
    calls: dict[str, Callable[..., Any]] = {}  # called bare: the defaults bind the loop values
    kept = []
    for model in models:
        loaded = tf.saved_model.load(model)
        kept.append(loaded)  # the functions refer to its variables
        serve = loaded.signatures["serving_default"]
        key = next(iter(serve.structured_input_signature[1]))
        frozen = convert_variables_to_constants_v2(serve)
        name = os.path.basename(os.path.normpath(model))
        calls[f"{name} served"] = lambda s=serve, k=key: next(iter(s(**{k: x}).values())).numpy()
        calls[f"{name} frozen"] = lambda f=frozen: f(x)[0].numpy()
    for call in calls.values():
        for _ in range(3):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            for _ in range(5):
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
    for name, spent in times.items():
        print(f"{name:48s} median {statistics.median(spent) * 1e3:7.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="SavedModel folders (the first is the base)")
    parser.add_argument("--calls", type=int, default=10, help="traced calls per model")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--served-vs-frozen", action="store_true",
                        help="time served against frozen calls instead (see above)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of --served-vs-frozen")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.served_vs_frozen:
        _served_vs_frozen(args.models, args.rounds, args.batch)
        return
    if args.child:
        _child(args.models[0], args.calls, args.batch)
        return
    results = []
    for model in args.models:  # one process each: a session's kernels stay for its lifetime
        run = subprocess.run([sys.executable, __file__, "--child", model, "--calls",
                              str(args.calls), "--batch", str(args.batch)],
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"{model} failed:\n{run.stderr[-3000:]}")
        results.append(json.loads(run.stdout.strip().splitlines()[-1]))
    names = [os.path.basename(os.path.normpath(m)) for m in args.models]
    print("traced call (ms): " + ", ".join(f"{n} {r['call_ms']:.1f}" for n, r in zip(names, results)))
    ops = sorted({op for r in results for op in r["ops"]},
                 key=lambda op: -max(r["ops"].get(op, [0, 0])[0] for r in results))
    print("| op | " + " | ".join(f"{n} ms (count)" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for op in ops:
        cells = [f"{r['ops'].get(op, [0, 0])[0]:.2f} ({r['ops'].get(op, [0, 0])[1]})"
                 for r in results]
        print(f"| {op} | " + " | ".join(cells) + " |")
    totals = [sum(v[0] for v in r["ops"].values()) for r in results]
    print("| all kernels | " + " | ".join(f"{t:.2f}" for t in totals) + " |")


if __name__ == "__main__":
    main()
