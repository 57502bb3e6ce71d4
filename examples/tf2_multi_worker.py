"""Mixed precision under MultiWorkerMirroredStrategy: two worker processes on localhost train the
digits MLP with `amp_rewriter.tf.mixed_precision`; at one step only one worker's batch holds an
inf. Both workers must skip that step (the flag is taken after the all-reduce), neither may
hang, and their weights must be equal after every step.

    .venv/bin/python examples/tf2_multi_worker.py                    # 20 steps, both forms
    .venv/bin/python examples/tf2_multi_worker.py --steps 6 --form whole --json out.json

The script starts the two workers itself (each is this script with --worker), on free ports,
and prints one line per worker and form: skipped steps, loss scale, a digest of every model and
optimizer variable, the accuracy on the test digits. It exits 1 when the workers disagree, when
the bad step was not skipped, or when a worker did not finish within --timeout seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import digits_data  # noqa: E402  (sets TF's log level before TensorFlow loads)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("localhost", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def _digest(variables) -> str:
    digest = hashlib.sha256()
    for variable in variables:
        digest.update(variable.numpy().tobytes())
    return digest.hexdigest()[:16]


def run_worker(index: int, ports: list[int], args: argparse.Namespace) -> dict:
    """One worker's training run (both processes run this, with their own index)."""
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"localhost:{port}" for port in ports]},
        "task": {"type": "worker", "index": index}})
    import keras
    import tensorflow as tf

    from amp_rewriter.tf import mixed_precision

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x_train, y_train, x_test, y_test = digits_data.digits()
    with strategy.scope():
        model = digits_data.mlp(seed=0)
        optimizer = keras.optimizers.Adam(1e-2)
    batch = args.batch

    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            per_example = keras.losses.sparse_categorical_crossentropy(y, logits,
                                                                       from_logits=True)
            loss = tf.reduce_sum(per_example) / (batch * len(ports))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    if args.form == "whole":
        @tf.function
        def whole(x, y):
            return strategy.run(step, args=(x, y))
        train = mixed_precision(whole, target="fp16")
        amp_step = train
    else:
        amp_step = mixed_precision(step, target="fp16")

        @tf.function
        def train(x, y):
            return strategy.run(amp_step, args=(x, y))

    stream = digits_data.batches(x_train[index::len(ports)], y_train[index::len(ports)], batch)
    digests = []
    for number in range(args.steps):
        x, y = next(stream)
        if number == args.bad_step and index == args.bad_worker:
            x = x.copy()
            x[0, 0] = float("inf")
        train(x, y)
        digests.append(_digest(model.variables + optimizer.variables))
    # fp16's default scale is dynamic: the step holds its scale and skip count in variables
    assert amp_step.skipped_steps is not None and amp_step.loss_scale is not None
    return {"worker": index, "form": args.form, "skipped_steps": int(amp_step.skipped_steps),
            "loss_scale": float(amp_step.loss_scale),
            "optimizer_steps": int(optimizer.iterations.numpy()), "digests": digests,
            "test_accuracy": digits_data.accuracy(model, x_test, y_test)}


def run_pair(args: argparse.Namespace, form: str) -> list[dict]:
    """Start both workers for one form and collect their results (each prints one JSON line)."""
    ports = _free_ports(2)
    command = [sys.executable, __file__, "--form", form, "--steps", str(args.steps),
               "--bad-step", str(args.bad_step), "--bad-worker", str(args.bad_worker),
               "--batch", str(args.batch), "--ports", ",".join(map(str, ports))]
    workers = [subprocess.Popen([*command, "--worker", str(i)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=args.timeout)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if worker.returncode != 0 or not lines:
                raise RuntimeError(f"a worker failed (exit {worker.returncode}): "
                                   f"{err.strip().splitlines()[-1:]}")
            results.append(json.loads(lines[-1]))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the workers did not finish in {args.timeout} s: a hang") from None
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    return results


def main() -> int:
    parser = digits_data.arguments(__doc__, steps=20)
    parser.add_argument("--bad-step", type=int, default=5)
    parser.add_argument("--bad-worker", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--form", choices=["whole", "per_replica", "both"], default="both")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        ports = [int(port) for port in args.ports.split(",")]
        print(json.dumps(run_worker(args.worker, ports, args)), flush=True)
        return 0
    forms = ["whole", "per_replica"] if args.form == "both" else [args.form]
    ok, everything = True, []
    for form in forms:
        try:
            results = run_pair(args, form)
        except RuntimeError as exc:
            print(f"{form}: {exc}")
            ok = False
            continue
        everything.extend(results)
        for result in results:
            print(f"{form:12s} worker {result['worker']}: skipped {result['skipped_steps']}, "
                  f"scale {result['loss_scale']:g}, optimizer steps "
                  f"{result['optimizer_steps']}, weights {result['digests'][-1]}, test accuracy "
                  f"{result['test_accuracy']:.1f}%")
        same = results[0]["digests"] == results[1]["digests"]
        skipped = all(r["skipped_steps"] == 1 and r["optimizer_steps"] == args.steps - 1
                      for r in results) if 0 <= args.bad_step < args.steps else True
        print(f"{form:12s} weights equal on both workers after every step: {same}; the bad "
              f"step skipped by both: {skipped}")
        ok = ok and same and skipped
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
