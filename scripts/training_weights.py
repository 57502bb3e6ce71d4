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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--optimizers", default="momentum,adam")
    parser.add_argument("--types", default="fp16,bf16", help="the 16-bit weight types")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    from testkit.models.tf_training import digits_data, train_and_measure  # imports TensorFlow

    data = digits_data()
    results, ok = [], True
    for model in args.models.split(","):
        for optimizer in args.optimizers.split(","):
            reference = train_and_measure(model, optimizer, None, args.steps, data)
            results.append(reference)
            print(f"{model} {optimizer} fp32: test accuracy {reference['test_accuracy']:.1f}%, "
                  f"weights {reference['checkpoint_weight_bytes']} bytes in the checkpoint")
            for weights in args.types.split(","):
                result = train_and_measure(model, optimizer, weights, args.steps, data)
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
