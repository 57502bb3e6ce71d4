#!/usr/bin/env python
"""Train every TF1 training graph the tests build with two versions of the training rewrite and
check that the results are bit-identical.

    .venv/bin/python scripts/training_identity.py                    # all cases vs BASELINE
    .venv/bin/python scripts/training_identity.py --cases mlp-adam-ref-step-1-fp16,batch_norm-fp16
    .venv/bin/python scripts/training_identity.py --baseline HEAD~3 --json out.json
    .venv/bin/python scripts/training_identity.py --list

For each case (a graph from models/tf_training.py, a target and a loss-scale rule) each version
rewrites the same graph with `rewrite_training_graph`, then trains it from the same initial
weights on the same 50 mini-batches of the digits data, with an inf injected into step 20's
batch. After every step it records the loss, the all-finite flag, the loss scale and the
good-step counter; after the last, every global variable (weights, optimizer slots, beta
powers, global step). The two versions agree when every one of these arrays has the same
dtype, shape and bytes (NaNs included).

The baseline (default: BASELINE, the commit before the training rewrite moved onto the IR) is
exported with `git archive` into a temporary folder (or given as a checkout with
`--baseline-dir`); each version runs in its own subprocess whose amp_rewriter is imported from
its checkout, both at once. Sessions run one thread per op so that reductions add up in one
order. The graphs come from this checkout's models/ for both.

Exit status: 0 all identical, 1 some case differs, 2 the run itself failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
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

def _load_graph_builders():
    """models/tf_training.py of this checkout, loaded by path (each checkout has a `models`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("identity_graphs",
                                                  REPO / "models" / "tf_training.py")
    if spec is None or spec.loader is None:
        raise ImportError("cannot load models/tf_training.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    graphs = _load_graph_builders()
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

def _export(revision: str, folder: Path) -> Path:
    """`git archive` of `revision` unpacked into `folder`."""
    archive = folder / "baseline.tar"
    with open(archive, "wb") as handle:
        subprocess.run(["git", "-C", str(REPO), "archive", revision], stdout=handle, check=True)
    target = folder / "baseline"
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    return target


def _differences(before: Path, after: Path) -> list[str]:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=BASELINE,
                        help=f"the git revision to compare with (default {BASELINE})")
    parser.add_argument("--baseline-dir", type=Path, help="a checkout to compare with instead")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the cases and stop")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    parser.add_argument("--side", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    every = cases()
    names = [n.strip() for n in args.cases.split(",")] if args.cases else list(every)
    unknown = [n for n in names if n not in every]
    if unknown:
        print(f"training_identity: unknown case(s) {', '.join(unknown)} (see --list)",
              file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(every))
        return 0
    if args.side is not None:
        return run_side(args.side, names, args.out)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="training_identity_") as tmp:
        work = Path(tmp)
        try:
            baseline = args.baseline_dir or _export(args.baseline, work)
        except (subprocess.CalledProcessError, OSError) as exc:
            print(f"training_identity: cannot export {args.baseline}: {exc}", file=sys.stderr)
            return 2
        sides = {"baseline": baseline, "this version": REPO}
        processes = {}
        for label, root in sides.items():
            out = work / label.replace(" ", "_")
            log = open(work / f"{out.name}.log", "w")
            env = {**os.environ, "PYTHONPATH": str(root)}
            processes[label] = (subprocess.Popen(
                [sys.executable, __file__, "--side", str(root), "--out", str(out), "--cases",
                 ",".join(names)], cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT),
                out, log)
        failed = False
        for label, (process, _out, log) in processes.items():
            rc = process.wait()
            log.close()
            if rc != 0:
                failed = True
                print(f"[{label}] failed (exit {rc}):\n{Path(log.name).read_text()[-3000:]}",
                      file=sys.stderr)
        if failed:
            return 2
        results = {}
        for name in names:
            results[name] = _differences(processes["baseline"][1] / f"{name}.npz",
                                         processes["this version"][1] / f"{name}.npz")
    identical = [n for n, found in results.items() if not found]
    for name, found in results.items():
        print(f"{'identical' if not found else 'DIFFERS  '} {name}"
              + (f": {'; '.join(found[:4])}" if found else ""))
    seconds = time.perf_counter() - started
    print(f"{len(identical)} of {len(results)} cases bit-identical ({STEPS} steps, inf at step "
          f"{INF_STEP}, growth interval {GROWTH_INTERVAL}; baseline "
          f"{args.baseline_dir or args.baseline}) in {seconds:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"baseline": str(args.baseline_dir or args.baseline),
                                         "steps": STEPS, "inf_step": INF_STEP,
                                         "differences": results}, indent=2))
    return 0 if len(identical) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
