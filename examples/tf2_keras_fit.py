"""Mixed precision for Keras 3 `fit` with `amp_rewriter.keras.enable`, on scikit-learn's digits.

The model ends with a custom layer that calls `tf.matmul` on a weight made with
`autocast=False`: Keras's own `mixed_float16` policy leaves that weight fp32 and the layer fails
with a dtype error (the script shows it), while the rewrite runs its MatMul, forward and
backward, in fp16 without changing the model.

    .venv/bin/python examples/tf2_keras_fit.py                    # 10 epochs
    .venv/bin/python examples/tf2_keras_fit.py --epochs 3 --json out.json

It trains the same seeded model twice on the same batches, fp32 `fit` and `fit` after
`enable(model, target="fp16")`, and prints `evaluate`'s test accuracy for both, the loss scale
and skipped steps from the History, and the precision of the custom layer's MatMuls. It exits 1
when fp16 ends more than 2 points below fp32 or a MatMul of the train step stays fp32.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import digits_data  # noqa: E402  (sets TF's log level before TensorFlow loads)


def make_model(policy: str | None = None):
    """Dense(64, relu) -> a custom layer: logits = tf.matmul(h, kernel), kernel autocast=False."""
    import keras
    import tensorflow as tf

    class RawMatMul(keras.layers.Layer):
        """A layer written with TensorFlow ops on a weight Keras does not cast."""

        def build(self, input_shape):
            self.kernel = self.add_weight(shape=(input_shape[-1], 10),
                                          initializer="glorot_uniform", autocast=False)

        def call(self, inputs):
            return tf.matmul(inputs, self.kernel)

    keras.utils.set_random_seed(0)
    layers = [keras.Input((64,)), keras.layers.Dense(64, activation="relu", dtype=policy),
              RawMatMul(dtype=policy)]
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    import amp_rewriter.keras

    x, y, x_test, y_test = digits_data.digits()
    try:
        make_model("mixed_float16").fit(x, y, batch_size=64, epochs=1, verbose=0)
        policy_result = "ran"
    except Exception as exc:  # the point: Keras's policy cannot run this layer
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # Keras colours its messages
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        said = next((line for line in lines if "does not match" in line or "expected" in line),
                    lines[0] if lines else "")
        policy_result = f"{type(exc).__name__}: {said[:160]}"
    print(f"Keras mixed_float16 policy on this model: {policy_result}")

    fp32 = make_model()
    fp32.fit(x, y, batch_size=64, epochs=args.epochs, verbose=0, shuffle=False)
    fp32_accuracy = fp32.evaluate(x_test, y_test, verbose=0)[1] * 100
    model = make_model()
    step = amp_rewriter.keras.enable(model, target="fp16")
    history = model.fit(x, y, batch_size=64, epochs=args.epochs, verbose=0, shuffle=False)
    accuracy = model.evaluate(x_test, y_test, verbose=0)[1] * 100
    predicted = model.predict(x_test, verbose=0).argmax(axis=1)
    assert step.report is not None  # fit traced the step
    matmuls = {n["name"]: n["precision"] for n in step.report.nodes if n["op"] == "MatMul"}
    custom = {name: p for name, p in matmuls.items() if "raw_mat_mul" in name}
    result = {"epochs": args.epochs, "fp32_test_accuracy": fp32_accuracy,
              "fp16_test_accuracy": accuracy,
              "predict_accuracy": float((predicted == y_test).mean() * 100),
              "loss_scale": history.history["loss_scale"][-1],
              "skipped_steps": history.history["skipped_steps"][-1],
              "train_step_matmuls": matmuls, "keras_policy": policy_result,
              "evaluate_rewritten": model.test_step.report is not None}
    ok = accuracy >= fp32_accuracy - 2 and all(p == "fp16" for p in matmuls.values()) \
        and bool(custom)
    print(f"fit fp32: test accuracy {fp32_accuracy:.1f}%; fit after enable (fp16): "
          f"{accuracy:.1f}% ({accuracy - fp32_accuracy:+.1f}), predict agrees with labels "
          f"{result['predict_accuracy']:.1f}%; loss scale {result['loss_scale']:g}, skipped "
          f"{result['skipped_steps']}")
    print(f"the custom layer's MatMuls (forward and backward): {custom}")
    return digits_data.finish([result], args.json, ok)


if __name__ == "__main__":
    sys.exit(main())
