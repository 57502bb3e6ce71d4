"""The data and models the TF2 examples train: scikit-learn's digits (8x8 images, 10 classes,
shipped with scikit-learn: no download), a small MLP and a small CNN, seeded."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np


def digits(images: bool = False, seed: int = 0
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): 1437 training and 360 test digits, pixels scaled
    to [0, 1] (flat 64-vectors, or 8x8x1 images with `images`), labels int32."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    if images:
        x = x.reshape(-1, 8, 8, 1)
    split = 1437
    return x[:split], y[:split], x[split:], y[split:]


def batches(x: np.ndarray, y: np.ndarray, size: int, seed: int = 0):
    """An endless stream of (x, y) mini-batches, reshuffled every epoch (seeded)."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(x))
        for start in range(0, len(x) - size + 1, size):
            index = order[start:start + size]
            yield x[index], y[index]


def mlp(seed: int = 0, dtype: str | None = None):
    """64 -> 64 (relu) -> 10 logits; `dtype`: the layers' dtype policy ("float16",
    "bfloat16": variables stored, and compute written, in 16 bits), None for Keras's default."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)),
                             keras.layers.Dense(64, activation="relu", dtype=dtype),
                             keras.layers.Dense(10, dtype=dtype)])


def cnn(seed: int = 0, dtype: str | None = None):
    """8x8x1 -> conv 16 (3x3, relu) -> conv 32 (3x3, relu) -> flatten -> 10 logits; `dtype`
    as `mlp`'s."""
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8, 8, 1)),
                             keras.layers.Conv2D(16, 3, activation="relu", dtype=dtype),
                             keras.layers.Conv2D(32, 3, activation="relu", dtype=dtype),
                             keras.layers.Flatten(dtype=dtype),
                             keras.layers.Dense(10, dtype=dtype)])


def accuracy(model, x: np.ndarray, y: np.ndarray) -> float:
    """Share of `x` the model classifies right, in percent."""
    logits = np.asarray(model(x, training=False))
    return float(np.mean(np.argmax(logits, axis=1) == y) * 100.0)


def keras_train_step(model, optimizer, loss_fn):
    """The train step as a custom Keras loop writes it: loss under a GradientTape, gradients,
    `optimizer.apply_gradients`; returns the loss."""
    import tensorflow as tf

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def versus_fp32(accuracy: float, reference: float) -> str:
    """`accuracy` and its difference to fp32's, as the examples print them."""
    return f"test accuracy {accuracy:.1f}% ({accuracy - reference:+.1f} vs fp32)"


def finish(results: list, json_path: str | None, ok: bool) -> int:
    """Write `results` to `json_path` when one is given; the exit status (1: a check failed)."""
    if json_path:
        import json
        from pathlib import Path

        Path(json_path).write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


def arguments(doc: str, steps: int):
    """An argument parser with the examples' common options (--steps, --json)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--json", help="write the results here")
    return parser
