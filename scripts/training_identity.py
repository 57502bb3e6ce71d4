#!/usr/bin/env python3
"""Train every TF1 training graph the tests build with two versions of the training rewrite and
check that the results are bit-identical (testkit.training_identity says what is compared).

    .venv/bin/python scripts/training_identity.py                    # all cases vs BASELINE
    .venv/bin/python scripts/training_identity.py --cases mlp-adam-ref-step-1-fp16,batch_norm-fp16
    .venv/bin/python scripts/training_identity.py --baseline HEAD~3 --json out.json
    .venv/bin/python scripts/training_identity.py --list

Exit status: 0 all identical, 1 some case differs, 2 the run itself failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's amp_rewriter and testkit

from testkit.training_identity import (  # noqa: E402  (after the path set-up)
    BASELINE,
    GROWTH_INTERVAL,
    INF_STEP,
    REPO,
    STEPS,
    cases,
    differences,
    export_revision,
    run_side,
)


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
            baseline = (args.baseline_dir.resolve() if args.baseline_dir
                        else export_revision(args.baseline, work))
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
            results[name] = differences(processes["baseline"][1] / f"{name}.npz",
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
