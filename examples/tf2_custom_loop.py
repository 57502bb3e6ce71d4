"""Mixed precision for a custom TF2 training loop: `amp_rewriter.tf.mixed_precision` around a
tf.function train step with tf.GradientTape, on scikit-learn's digits.

Two pairs, each trained three times from the same seeded weights on the same batches: an MLP
with Adam and a small CNN with SGD + momentum, in fp32 (the step as written), fp16 (dynamic loss
scale) and bf16 (no loss scale, so no check either: bf16 has fp32's range). One batch of the fp16
run (--inf-step) holds an inf: the step is skipped (every weight and slot unchanged), the scale
halves and training goes on.

    .venv/bin/python examples/tf2_custom_loop.py                   # 300 steps each
    .venv/bin/python examples/tf2_custom_loop.py --steps 100 --models mlp --json out.json
    .venv/bin/python examples/tf2_custom_loop.py --weights 16bit   # fp16/bf16 weights too

With --weights 16bit the fp16 and bf16 runs keep their weights in fp16 and bf16 values
(`mixed_precision(..., weights=...)`: each update computed in fp32 and rounded stochastically);
the tf.Variables stay float32 objects, so a TF2 checkpoint does not shrink (the TF1 rewrite
stores them in 16 bits: scripts/training_weights.py).

It prints test accuracy per run, the loss scale and skipped steps, and how many of the step's
MatMul / Conv2D / Conv2DBackpropFilter / Conv2DBackpropInput ops run in low precision (from the
rewrite's report, forward and backward). It exits 1 when a rewrite ends more than 2 points below
fp32, or when one of those ops is left in fp32.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import digits_data  # noqa: E402  (sets TF's log level before TensorFlow loads)

COMPUTE_OPS = ("MatMul", "Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput")


def train(model_name: str, precision: str, steps: int, inf_step: int,
          weights16: bool = False) -> dict:
    """One run: the pair's model and optimizer, `steps` steps of batch 64, test accuracy;
    `weights16`: a rewritten run keeps its weights in its 16-bit type (stochastic rounding)."""
    import keras
    import numpy as np
    import tensorflow as tf

    from amp_rewriter.tf import mixed_precision

    images = model_name == "cnn"
    x_train, y_train, x_test, y_test = digits_data.digits(images=images)
    model = digits_data.cnn() if images else digits_data.mlp()
    optimizer = (keras.optimizers.SGD(0.05, momentum=0.9) if images
                 else keras.optimizers.Adam(1e-3))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = tf.function(digits_data.keras_train_step(model, optimizer, loss_fn))
    low_weights = precision if weights16 and precision != "fp32" else None
    amp_run = None if precision == "fp32" else mixed_precision(step, target=precision,
                                                               weights=low_weights)
    run = step if amp_run is None else amp_run
    stream = digits_data.batches(x_train, y_train, 64)
    unchanged = None
    start = time.perf_counter()
    for number in range(steps):
        x, y = next(stream)
        bad = number == inf_step and precision == "fp16"
        if bad:
            x = x.copy()
            x.flat[5] = np.inf
            before = [v.numpy().copy() for v in model.variables + optimizer.variables]
        run(x, y)
        if bad:
            after = [v.numpy() for v in model.variables + optimizer.variables]
            unchanged = all(np.array_equal(a, b) for a, b in zip(before, after))
    result = {"model": model_name, "precision": precision, "steps": steps,
              "seconds": round(time.perf_counter() - start, 1),
              "test_accuracy": digits_data.accuracy(model, x_test, y_test)}
    if amp_run is not None:
        assert amp_run.report is not None  # the first call traced the step
        counts = amp_run.report.summary["compute_ops_by_type"]
        result["low_precision_compute_ops"] = {op: counts[op] for op in COMPUTE_OPS
                                               if op in counts}
        result["skipped_steps"] = int(amp_run.skipped_steps) \
            if amp_run.skipped_steps is not None else None
        result["loss_scale"] = float(amp_run.loss_scale) if amp_run.loss_scale is not None \
            else None
        result["inf_step_left_every_variable_unchanged"] = unchanged
        if low_weights is not None:
            dtype = tf.as_dtype({"fp16": "float16", "bf16": "bfloat16"}[precision])
            values = [v.numpy() for v in model.trainable_variables]
            result["weights"] = low_weights
            result["weights_hold_16bit_values"] = all(
                np.array_equal(v, v.astype(dtype.as_numpy_dtype).astype(np.float32))
                for v in values)
    return result


def _summary(result: dict, reference: float) -> str:
    """One line for a rewritten run: accuracy against fp32, the scaler, the compute ops."""
    ops = ", ".join(f"{op} {low}/{total}"
                    for op, (low, total) in result["low_precision_compute_ops"].items())
    return (f"{result['model']} {result['precision']}: "
            f"{digits_data.versus_fp32(result['test_accuracy'], reference)}, loss scale "
            f"{result['loss_scale']}, skipped {result['skipped_steps']}, the inf batch left "
            f"every variable unchanged: {result['inf_step_left_every_variable_unchanged']}, "
            f"low-precision compute ops (low/total): {ops} ({result['seconds']} s)")


def main() -> int:
    parser = digits_data.arguments(__doc__, steps=300)
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--inf-step", type=int, default=50)
    parser.add_argument("--weights", choices=("fp32", "16bit"), default="fp32",
                        help="16bit: the fp16 and bf16 runs keep their weights in that type, "
                             "each update computed in fp32 and rounded stochastically")
    args = parser.parse_args()
    results, ok = [], True
    for model_name in args.models.split(","):
        reference = None
        for precision in ("fp32", "fp16", "bf16"):
            result = train(model_name, precision, args.steps, args.inf_step,
                           args.weights == "16bit")
            results.append(result)
            if precision == "fp32":
                reference = result["test_accuracy"]
                print(f"{model_name} fp32: test accuracy {reference:.1f}% ({result['seconds']} s)")
                continue
            assert reference is not None  # fp32 runs first
            counts = result["low_precision_compute_ops"]
            all_low = all(low == total for low, total in counts.values())
            close = result["test_accuracy"] >= reference - 2.0
            skipped_right = precision != "fp16" or (
                result["inf_step_left_every_variable_unchanged"] and result["skipped_steps"] == 1)
            sixteen = result.get("weights_hold_16bit_values", True)
            ok = ok and all_low and close and skipped_right and sixteen
            print(_summary(result, reference))
            if "weights" in result:
                print(f"  {precision} weights, stochastic rounding: every weight holds a "
                      f"{precision} value: {sixteen}")
    return digits_data.finish(results, args.json, ok)


if __name__ == "__main__":
    sys.exit(main())
