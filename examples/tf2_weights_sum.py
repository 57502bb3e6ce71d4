"""The classic case for stochastic rounding, through `amp_rewriter.tf.mixed_precision`: a weight
of 1000 independent copies starts at 0.0 and a constant gradient adds 1e-4 to each copy per step,
10,000 steps (a MatMul in the step, which the rewrite runs in fp16). With fp16 weights and
round-to-nearest the sum stalls at 0.25 (half an ulp there exceeds 1e-4); with stochastic
rounding it lands near 1.0 on average; fp32 master weights give 1.0.

    .venv/bin/python examples/tf2_weights_sum.py                 # 10,000 steps, about 1.5 min
    .venv/bin/python examples/tf2_weights_sum.py --steps 2000 --json out.json

It prints each run's mean and exits 1 when fp16 stochastic is not within 1% of the exact sum,
or a second run with the same seed is not bit-identical.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import digits_data  # noqa: E402  (sets TF's log level before TensorFlow loads)

COPIES, UPDATE = 1000, 1e-4


def run(steps: int, **options) -> tuple:
    """The weight's copies after `steps` steps of the step wrapped with `options`."""
    import tensorflow as tf

    from amp_rewriter.tf import mixed_precision

    w = tf.Variable(tf.zeros([COPIES]), name="w")
    ones = tf.ones([2, COPIES])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = -tf.reduce_sum(tf.matmul(ones, tf.reshape(w, [COPIES, 1]))) / 2.0
        (gradient,) = tape.gradient(loss, [w])  # -1 for every copy
        w.assign_sub(UPDATE * gradient)
        return loss

    wrapped = mixed_precision(step, "fp16", loss_scale=1024, **options)
    start = time.perf_counter()
    for _ in range(steps):
        wrapped()
    return w.numpy(), round(time.perf_counter() - start, 1)


def main() -> int:
    parser = digits_data.arguments(__doc__, steps=10_000)
    parser.add_argument("--seed", type=int, default=0, help="the rounding seed")
    args = parser.parse_args()
    exact = args.steps * UPDATE
    runs = {"fp32 master weights": {}, "fp16 stochastic": dict(weights="fp16"),
            "fp16 nearest": dict(weights="fp16", rounding="nearest"),
            "bf16 stochastic": dict(weights="bf16")}
    results, values = [], {}
    for name, options in runs.items():
        if "weights" in options:
            options["rounding_seed"] = args.seed
        value, seconds = run(args.steps, **options)
        values[name] = value
        results.append({"run": name, "mean": float(value.mean()), "min": float(value.min()),
                        "max": float(value.max()), "seconds": seconds})
        print(f"{name}: mean {value.mean():.5f} (exact {exact:g}; min {value.min():.5f}, "
              f"max {value.max():.5f}; {seconds} s)")
    again, _ = run(args.steps, weights="fp16", rounding_seed=args.seed)
    deterministic = bool((again == values["fp16 stochastic"]).all())
    print(f"fp16 stochastic again with seed {args.seed}: bit-identical {deterministic}")
    results.append({"run": "fp16 stochastic, same seed again", "bit_identical": deterministic})
    ok = abs(values["fp16 stochastic"].mean() - exact) <= 0.01 * exact and deterministic
    return digits_data.finish(results, args.json, ok)


if __name__ == "__main__":
    sys.exit(main())
