"""Train every TF1 training graph the tests build with two versions of the training rewrite and
check that the results are bit-identical.

The command line is scripts/training_identity.py.

For each case (a graph from testkit/models/tf_training.py, a target and a loss-scale rule) each
version rewrites the same graph with `rewrite_training_graph`, then trains it from the same initial
weights on the same 50 mini-batches of the digits data, with an inf injected into step 20's
batch. After every step it records the loss, the all-finite flag, the loss scale and the
good-step counter; after the last, every global variable (weights, optimizer slots, beta
powers, global step). The two versions agree when every one of these arrays has the same
dtype, shape and bytes (NaNs included).

The baseline (default: BASELINE, the commit before the training rewrite moved onto the IR) is
exported with `git archive` into a temporary folder (or given as a checkout with
`--baseline-dir`); each version runs in its own subprocess whose amp_rewriter is imported from
its checkout, both at once. Sessions run one thread per op so that reductions add up in one
order. The graphs come from this checkout's testkit.models for both.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: The commit before the training rewrite was rebuilt on the IR ("today's rewrite").
BASELINE = "981e37e"
STEPS, INF_STEP, GROWTH_INTERVAL = 50, 20, 10


def cases() -> dict[str, dict]:
    """Every case by name: the graph to build, the target and the rewrite's options."""
    found: dict[str, dict] = {}
    for model in ("mlp", "cnn"):
        for optimizer in ("sgd", "momentum", "adam", "rmsprop"):
            for resource in (False, True):
                for global_step in (True, False):
                    for towers in (1, 2):
                        name = (f"{model}-{optimizer}-{'resource' if resource else 'ref'}-"
                                f"{'step' if global_step else 'nostep'}-{towers}")
                        graph = {"model": model, "optimizer": optimizer, "resource": resource,
                                 "global_step": global_step, "towers": towers}
                        found[f"{name}-fp16"] = {"graph": graph, "target": "fp16"}
                        if not resource and global_step:
                            found[f"{name}-bf16"] = {"graph": graph, "target": "bf16"}
    adam = {"model": "mlp", "optimizer": "adam", "resource": True, "global_step": True,
            "towers": 2}
    found["mlp-adam-hysteresis-fp16"] = {"graph": adam, "target": "fp16",
                                         "options": {"hysteresis": 2}}
    found["mlp-adam-fixed-fp16"] = {"graph": adam, "target": "fp16",
                                    "options": {"loss_scale": 1024}}
    found["mlp-adam-dynamic-bf16"] = {"graph": adam, "target": "bf16",
                                      "options": {"loss_scale": "dynamic"}}
    for special in ("integer_fill", "sparse_ref", "sparse_resource", "batch_norm"):
        found[f"{special}-fp16"] = {"graph": special, "target": "fp16"}
    return found


# -- one side (a subprocess) -------------------------------------------------------------------

def run_side(root: Path, names: list[str], out: Path) -> int:
    """Rewrite and train each case with the amp_rewriter of `root`; write one .npz per case."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, str(root))
    import numpy as np
    import tensorflow as tf

    import amp_rewriter
    from amp_rewriter.tf import rewrite_training_graph

    imported_from = Path(amp_rewriter.__file__).resolve()
    if root.resolve() not in imported_from.parents:
        print(f"amp_rewriter imported from {imported_from}, not {root}", file=sys.stderr)
        return 2
    tf.get_logger().setLevel("ERROR")
    from testkit.models import tf_training as graphs  # this checkout's, whichever `root` is

    x_train, y_train, _, _ = graphs.digits_data()
    feeds = list(graphs.batches(x_train, y_train, 64, STEPS, seed=0))
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=1)
    every = cases()
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        case = every[name]
        spec = case["graph"]
        graph = (graphs.SPECIAL_GRAPHS[spec]() if isinstance(spec, str)
                 else graphs.build_training_graph(**spec))
        options = {"growth_interval": GROWTH_INTERVAL, **case.get("options", {})}
        result = rewrite_training_graph(graph, loss="loss", train_op="train",
                                        target=case["target"], **options)
        poisoned_by = "poison:0" if "poison" in {op.name for op in graph.get_operations()} \
            else None
        record: dict[str, list] = {"loss": [], "finite": [], "scale": [], "good_steps": []}
        with tf.compat.v1.Session(graph=result.graph, config=config) as session:
            session.run("init")
            for step, (xb, yb) in enumerate(feeds):
                feed = {"x:0": xb, "y:0": yb}
                if step == INF_STEP:
                    if poisoned_by:
                        feed[poisoned_by] = np.float32(np.inf)
                    else:
                        xb = xb.copy()
                        xb[1, 3] = np.inf
                        feed["x:0"] = xb
                fetches = [result.train_op, result.loss]
                scaled = result.all_finite is not None
                if result.all_finite is not None:
                    fetches.append(result.all_finite)
                values = session.run(fetches, feed)
                record["loss"].append(values[1])
                if scaled:
                    record["finite"].append(values[2])
                if result.good_steps is not None:
                    scale, good = session.run([result.loss_scale, result.good_steps])
                    record["scale"].append(scale)
                    record["good_steps"].append(good)
            arrays = {f"state/{key}": np.asarray(value) for key, value in record.items()}
            for variable in result.graph.get_collection("variables"):
                arrays[f"variable/{variable.name}"] = np.asarray(session.run(variable))
        np.savez(out / f"{name}.npz", allow_pickle=False, **arrays)
        print(f"{name}: done", flush=True)
    return 0


# -- the comparison ------------------------------------------------------------------------------

def export_revision(revision: str, folder: Path) -> Path:
    """`git archive` of `revision` unpacked into `folder`."""
    archive = folder / "baseline.tar"
    with open(archive, "wb") as handle:
        subprocess.run(["git", "-C", str(REPO), "archive", revision], stdout=handle, check=True)
    target = folder / "baseline"
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    return target


def differences(before: Path, after: Path) -> list[str]:
    """What differs between two cases' records ([] when every array is bit-identical)."""
    import numpy as np

    a, b = np.load(before), np.load(after)
    found = [f"{key}: only in the baseline" for key in sorted(set(a.files) - set(b.files))]
    found += [f"{key}: only in this version" for key in sorted(set(b.files) - set(a.files))]
    for key in sorted(set(a.files) & set(b.files)):
        x, y = a[key], b[key]
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            found.append(f"{key}: differs")
    return found
