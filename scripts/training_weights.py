"""16-bit weights with stochastic rounding on scikit-learn's digits, TF1 graphs: for each model
(MLP, CNN) and optimizer (SGD + momentum, Adam), one run with fp32 master weights as built and
one per 16-bit type with the weights stored in it (`rewrite_training_graph(..., target=T,
weights=T)`, stochastic rounding, the target's default loss scale), from the same seeded
initial weights on the same mini-batches. It prints the test accuracy of each run against fp32,
and the bytes the trained weights take in a checkpoint (the optimizer's slots stay fp32 without
`slots=`).

    .venv/bin/python scripts/training_weights.py                  # 300 steps per run
    .venv/bin/python scripts/training_weights.py --models mlp --optimizers adam --steps 100 \\
        --json /tmp/weights.json

It exits 1 when a 16-bit run ends more than 2 points below fp32, or its weights do not take
half of fp32's checkpoint bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(model: str, optimizer: str, weights: str | None, steps: int, data) -> dict:
    """One run: test accuracy and the checkpoint bytes of the model's weights."""
    import tensorflow as tf

    from amp_rewriter.tf import rewrite_training_graph
    from models.tf_training import batches, build_training_graph

    graph = build_training_graph(model, optimizer)
    if weights is not None:
        graph = rewrite_training_graph(graph, target=weights, weights=weights).graph
    with graph.as_default():
        saver = tf.compat.v1.train.Saver()
    x_train, y_train, x_test, y_test = data
    with tf.compat.v1.Session(graph=graph) as session, tempfile.TemporaryDirectory() as tmp:
        session.run("init")
        for xb, yb in batches(x_train, y_train, 64, steps):
            session.run("train", {"x:0": xb, "y:0": yb})
        accuracy = float(session.run("accuracy:0", {"x:0": x_test, "y:0": y_test}))
        path = saver.save(session, str(Path(tmp) / "ckpt"))
        reader = tf.train.load_checkpoint(path)
        names = [name for name in reader.get_variable_to_dtype_map()
                 if name.startswith("model/") and "/" not in name[len("model/"):]]
        weight_bytes = sum(reader.get_tensor(name).nbytes for name in names)
        dtypes = sorted({reader.get_variable_to_dtype_map()[name].name for name in names})
    return {"model": model, "optimizer": optimizer, "weights": weights or "fp32",
            "steps": steps, "test_accuracy": round(100 * accuracy, 2),
            "checkpoint_weight_bytes": weight_bytes, "checkpoint_weight_dtypes": dtypes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--optimizers", default="momentum,adam")
    parser.add_argument("--types", default="fp16,bf16", help="the 16-bit weight types")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    from models.tf_training import digits_data

    data = digits_data()
    results, ok = [], True
    for model in args.models.split(","):
        for optimizer in args.optimizers.split(","):
            reference = run(model, optimizer, None, args.steps, data)
            results.append(reference)
            print(f"{model} {optimizer} fp32: test accuracy {reference['test_accuracy']:.1f}%, "
                  f"weights {reference['checkpoint_weight_bytes']} bytes in the checkpoint")
            for weights in args.types.split(","):
                result = run(model, optimizer, weights, args.steps, data)
                results.append(result)
                drop = reference["test_accuracy"] - result["test_accuracy"]
                half = 2 * result["checkpoint_weight_bytes"] == \
                    reference["checkpoint_weight_bytes"]
                ok = ok and drop <= 2.0 and half
                print(f"{model} {optimizer} {weights} weights, stochastic rounding: test "
                      f"accuracy {result['test_accuracy']:.1f}% ({-drop:+.1f} vs fp32), weights "
                      f"{result['checkpoint_weight_bytes']} bytes "
                      f"({'/'.join(result['checkpoint_weight_dtypes'])}; half of fp32: {half})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
