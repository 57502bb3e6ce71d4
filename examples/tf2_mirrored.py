"""Mixed precision under MirroredStrategy (two logical CPU devices): the digits MLP with Adam,
trained with `amp_rewriter.tf.mixed_precision` wrapped per replica (`strategy.run(step, ...)`
inside the user's tf.function) and around the whole step (a tf.function that calls
`strategy.run`), next to the same training in fp32.

At two steps one replica's shard holds an inf: replica 1's first, then replica 0's. Every replica
must skip both steps (every copy of every model and optimizer variable unchanged, the scale
halved), and after the last step the mirrored copies of every variable must be identical.

    .venv/bin/python examples/tf2_mirrored.py                     # 300 steps
    .venv/bin/python examples/tf2_mirrored.py --steps 8 --forms per_replica --json out.json
    .venv/bin/python examples/tf2_mirrored.py --weights fp16      # fp16 weights, stochastic
    .venv/bin/python examples/tf2_mirrored.py --weights fp16 --build-16bit  # stored in fp16

With --build-16bit the rewritten runs build the model in the weights' type (Keras layers with
`dtype="float16"`: the mirrored variables and Adam's slots are stored in 16 bits), and every run
uses Adam's epsilon 1e-4 (Keras keeps the second moment in the variables' type, where 1e-7 is
too small: see tf2_custom_loop.py).

It prints per form the test accuracy (and fp32's), the skipped steps, the scale, and whether the
copies agree; it exits 1 when a check fails or a form ends more than 2 points below fp32.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import digits_data  # noqa: E402  (sets TF's log level before TensorFlow loads)

REPLICAS = 2


def _copies(variable) -> list:
    """Each device's copy of a (Keras) mirrored variable, as arrays."""
    inner = getattr(variable, "_value", variable)  # a Keras variable wraps the tf.Variable
    return [component.numpy().copy() for component in getattr(inner, "values", [inner])]


def train(form: str, steps: int, bad_steps: dict[int, int], batch: int,
          weights: str = "fp32", build16: bool = False) -> dict:
    """One run: `form` is "fp32", "per_replica" or "whole"; `bad_steps` maps a step to the
    replica whose shard gets an inf there; `weights`: "fp16" keeps the weights in fp16 values
    (each update rounded stochastically); `build16`: a rewritten run's model is built in that
    type (its variables stored in 16 bits)."""
    import keras
    import numpy as np
    import tensorflow as tf

    from amp_rewriter.tf import mixed_precision

    strategy = tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(REPLICAS)])
    x_train, y_train, x_test, y_test = digits_data.digits()
    with strategy.scope():
        built16 = build16 and form != "fp32" and weights != "fp32"
        model = digits_data.mlp(seed=0, dtype="float16" if built16 else None)
        optimizer = keras.optimizers.Adam(1e-3, epsilon=1e-4 if build16 else 1e-7)
        # built here: TensorFlow cannot make a mirrored optimizer slot on a tf.function's first
        # call (fp32 too: its initializers are not liftable and its cond fallback fails)
        optimizer.build(model.trainable_variables)
    per_replica_batch = batch // REPLICAS

    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            per_example = keras.losses.sparse_categorical_crossentropy(y, logits,
                                                                       from_logits=True)
            loss = tf.reduce_sum(per_example) / batch
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    amp_step = None
    if form == "per_replica":
        amp_step = mixed_precision(step, target="fp16", weights=weights)

        @tf.function
        def run(x, y):
            return strategy.run(amp_step, args=(x, y))
    else:
        @tf.function
        def whole(x, y):
            return strategy.run(step, args=(x, y))
        run = whole if form == "fp32" else mixed_precision(whole, target="fp16",
                                                           weights=weights)
        amp_step = None if form == "fp32" else run

    stream = digits_data.batches(x_train, y_train, batch)
    variables = model.variables + optimizer.variables
    skipped_cleanly = []
    start = time.perf_counter()
    for number in range(steps):
        x, y = next(stream)
        bad_replica = bad_steps.get(number) if form != "fp32" else None
        if bad_replica is not None:
            x = x.copy()
            x[bad_replica * per_replica_batch, 7] = np.inf
            before = [_copies(v) for v in variables]

        def shard(values):
            return strategy.experimental_distribute_values_from_function(
                lambda ctx: values[ctx.replica_id_in_sync_group * per_replica_batch:]
                [:per_replica_batch])

        run(shard(x), shard(y))
        if bad_replica is not None:
            after = [_copies(v) for v in variables]
            skipped_cleanly.append(all(np.array_equal(a, b) for va, vb in zip(before, after)
                                       for a, b in zip(va, vb)))
    copies_identical = all(all(np.array_equal(c, copies[0]) for c in copies[1:])
                           for copies in map(_copies, variables))
    skipped = amp_step.skipped_steps if amp_step is not None else None
    scale = amp_step.loss_scale if amp_step is not None else None
    training = amp_step.report.training if amp_step is not None and amp_step.report else None
    return {"form": form, "steps": steps, "seconds": round(time.perf_counter() - start, 1),
            "test_accuracy": digits_data.accuracy(model, x_test, y_test),
            "copies_identical": copies_identical,
            "bad_steps_left_every_copy_unchanged": skipped_cleanly,
            "skipped_steps": int(skipped) if skipped is not None else 0,
            "loss_scale": float(scale) if scale is not None else None,
            "optimizer_steps": int(optimizer.iterations.numpy()),
            "weight_dtypes": sorted({v.dtype for v in model.trainable_variables}),
            "variables_stored_16bit": sorted(training["variables_stored_16bit"])
            if training is not None else []}


def main() -> int:
    parser = digits_data.arguments(__doc__, steps=300)
    parser.add_argument("--forms", default="per_replica,whole")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--build-16bit", action="store_true",
                        help="the rewritten runs build the model in fp16 (its variables stored "
                             "in 16 bits); with --weights fp16")
    parser.add_argument("--weights", choices=("fp32", "fp16"), default="fp32",
                        help="fp16: the rewritten runs keep fp16 weights, rounded stochastically "
                             "(the random bits keyed by step and variable, the same on each "
                             "replica)")
    args = parser.parse_args()
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(REPLICAS)])
    bad_steps = {min(2, args.steps - 1): 1, min(4, args.steps - 1): 0}
    results = [train("fp32", args.steps, {}, args.batch, build16=args.build_16bit)]
    reference = results[0]["test_accuracy"]
    print(f"fp32: test accuracy {reference:.1f}%, copies identical "
          f"{results[0]['copies_identical']} ({results[0]['seconds']} s)")
    ok = True
    for form in args.forms.split(","):
        result = train(form, args.steps, bad_steps, args.batch, args.weights, args.build_16bit)
        results.append(result)
        good = (result["copies_identical"] and all(result["bad_steps_left_every_copy_unchanged"])
                and result["skipped_steps"] == len(bad_steps)
                and result["optimizer_steps"] == args.steps - len(bad_steps)
                and result["test_accuracy"] >= reference - 2.0)
        ok = ok and good
        print(f"{form}: {digits_data.versus_fp32(result['test_accuracy'], reference)}; "
              f"inf in replica 1 at step "
              f"{min(bad_steps)} and replica 0 at step {max(bad_steps)}: skipped "
              f"{result['skipped_steps']}, every copy unchanged "
              f"{result['bad_steps_left_every_copy_unchanged']}; scale {result['loss_scale']:g}; "
              f"mirrored copies identical {result['copies_identical']}; weights stored in "
              f"{', '.join(result['weight_dtypes'])} ({result['seconds']} s)")
    return digits_data.finish(results, args.json, ok)


if __name__ == "__main__":
    sys.exit(main())
