"""CPU latency of Keras ResNet-50 and MobileNetV2 SavedModels: fp32, Grappler's own bf16 rewrite,
and amp-rewriter's bf16 SavedModels (weights stored in bf16, and weights kept fp32), in one run.

    .venv/bin/python scripts/bench_tf_cpu.py [--models resnet50,mobilenetv2] [--batch 8]
        [--runs 10] [--warmup 3] [--rounds 3] [--json results.json]

For each model (weights=None, seeded, logits output) the script exports an fp32 SavedModel with
`model.export`, converts it with `amp_rewriter.tf.convert_saved_model(target="bf16",
backend="tf-cpu")`, and serves `serving_default` on the same batch of seeded random images in
three fresh processes (TensorFlow's optimizer options are process-wide):

    fp32                 the exported SavedModel as is
    grappler-bf16        the same SavedModel with
                         tf.config.optimizer.set_experimental_options(
                             {"auto_mixed_precision_onednn_bfloat16": True})
    ours-bf16            the converted SavedModel: variables read only in bf16 stored in bf16
                         (the default; no weight cast on the call path)
    ours-bf16-fp32-weights  converted with keep_fp32_weights=True: weights cast on every call

The variants run in `--rounds` interleaved rounds (fp32, grappler, ours, fp32, ...) so that a
slow spell of a shared machine hits all of them. It prints the median latency per call over all
rounds, the fastest call, the speed-up of the medians over fp32, and the relative error of the
logits (max-abs error / max |fp32 logit|) against fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("fp32", "grappler-bf16", "ours-bf16", "ours-bf16-fp32-weights")


def _child(args: argparse.Namespace) -> None:
    """Serve one SavedModel and time it; writes the outputs and timings."""
    import numpy as np
    import tensorflow as tf

    if args.variant == "grappler-bf16":
        tf.config.optimizer.set_experimental_options(
            {"auto_mixed_precision_onednn_bfloat16": True})
    images = np.load(args.inputs)["images"]
    model = tf.saved_model.load(args.model)
    serve = model.signatures["serving_default"]
    key = next(iter(serve.structured_input_signature[1]))
    x = tf.constant(images)
    load_start = time.perf_counter()
    out = serve(**{key: x})
    first_call = time.perf_counter() - load_start
    for _ in range(args.warmup):
        out = serve(**{key: x})
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        out = serve(**{key: x})
        value = next(iter(out.values())).numpy()
        times.append(time.perf_counter() - start)
    np.save(args.output, value.astype(np.float32))
    print(json.dumps({"times_s": times, "first_call_s": first_call}))


def _export(name: str, path: Path) -> None:
    import keras

    keras.utils.set_random_seed(0)
    if name == "resnet50":
        model = keras.applications.ResNet50(weights=None, classifier_activation=None)
    elif name == "mobilenetv2":
        model = keras.applications.MobileNetV2(weights=None, classifier_activation=None)
    else:
        raise SystemExit(f"unknown model {name!r} (resnet50, mobilenetv2)")
    model.export(str(path), verbose=False)


def _run_variant(variant: str, model: Path, inputs: Path, output: Path,
                 args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", "--variant", variant, "--model", str(model),
           "--inputs", str(inputs), "--output", str(output), "--runs", str(args.runs),
           "--warmup", str(args.warmup)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,mobilenetv2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--runs", type=int, default=10, help="timed calls per process")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds of the three variants (one process each)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--inputs", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return

    import numpy as np

    sys.path.insert(0, str(REPO))
    import tensorflow as tf

    from amp_rewriter.tf import convert_saved_model

    print(f"TensorFlow {tf.__version__}, {os.cpu_count()} CPU(s), batch {args.batch} at 224x224, "
          f"{args.rounds} rounds x {args.runs} calls per variant (after {args.warmup} warm-up "
          f"calls per process)")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-tf-cpu-") as folder:
        tmp = Path(folder)
        images = np.random.default_rng(0).standard_normal(
            (args.batch, 224, 224, 3)).astype(np.float32)
        inputs = tmp / "inputs.npz"
        np.savez(inputs, images=images)
        for name in args.models.split(","):
            fp32_dir, ours_dir = tmp / f"{name}_fp32", tmp / f"{name}_bf16"
            cast_dir = tmp / f"{name}_bf16_fp32_weights"
            _export(name, fp32_dir)
            start = time.perf_counter()
            report = convert_saved_model(fp32_dir, ours_dir, target="bf16", backend="tf-cpu",
                                         check=False)
            convert_s = time.perf_counter() - start
            cast_report = convert_saved_model(fp32_dir, cast_dir, target="bf16",
                                              backend="tf-cpu", check=False,
                                              keep_fp32_weights=True)
            s = report.summary
            sizes = {label: sum(f.stat().st_size for f in (d / "variables").iterdir())
                     for label, d in (("fp32", fp32_dir), ("ours", ours_dir))}
            print(f"\n{name}: converted {s['low_precision_nodes']}/{s['nodes']} nodes in "
                  f"{convert_s:.2f} s, {s['casts_inserted']} casts "
                  f"({cast_report.summary['casts_inserted']} with fp32 weights); "
                  f"{s.get('weights_stored_low', 0)} variables stored in bf16, variables/ "
                  f"{sizes['fp32'] / 1e6:.1f} MB -> {sizes['ours'] / 1e6:.1f} MB")
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            round_medians: dict[str, list[float]] = {v: [] for v in VARIANTS}
            outputs = {}
            for _ in range(args.rounds):
                for variant in VARIANTS:
                    model = {"ours-bf16": ours_dir,
                             "ours-bf16-fp32-weights": cast_dir}.get(variant, fp32_dir)
                    out = tmp / f"{name}_{variant}.npy"
                    timing = _run_variant(variant, model, inputs, out, args)
                    times[variant].extend(timing["times_s"])
                    round_medians[variant].append(statistics.median(timing["times_s"]))
                    outputs[variant] = np.load(out).astype(np.float64)
            ref = outputs["fp32"]
            scale = float(np.abs(ref).max()) or 1.0
            base = statistics.median(times["fp32"])
            for variant in VARIANTS:
                median = statistics.median(times[variant])
                rel = float(np.abs(outputs[variant] - ref).max()) / scale
                top1 = float(np.mean(outputs[variant].argmax(-1) == ref.argmax(-1)))
                rounds = "/".join(f"{m * 1e3:.0f}" for m in round_medians[variant])
                print(f"  {variant:22s} median {median * 1e3:7.1f} ms (rounds {rounds}, fastest "
                      f"{min(times[variant]) * 1e3:.1f})  x{base / median:.2f}  relative error "
                      f"{rel:.3g}  top-1 agreement {top1:.2f}")
                results.append({"model": name, "variant": variant, "batch": args.batch,
                                "median_ms": median * 1e3, "min_ms": min(times[variant]) * 1e3,
                                "round_medians_ms": [m * 1e3 for m in round_medians[variant]],
                                "speedup": base / median, "relative_error": rel,
                                "top1_agreement": top1, "convert_s": convert_s,
                                "casts_inserted": s["casts_inserted"]})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
