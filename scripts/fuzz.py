#!/usr/bin/env python3
"""Fuzz the amp-rewriter CLI with corrupted and hostile inputs and misuses, and check that it
never crashes, hangs, prints a traceback or an "unexpected" error, writes more than one error
line, exits other than 0/1/2, changes an input, leaves a file behind on failure, destroys an
existing file, writes outside its output, leaves an output that does not load or does not hold
its input's weights (on success), or uses memory its input did not pay for.

    python scripts/fuzz.py --cases 2000               # the full run: a summary table per family
    python scripts/fuzz.py --cases 300 --json out.json
    python scripts/fuzz.py --replay case.json         # one recipe again (printed on failure)

Cases are recipes hypothesis draws (testkit/fuzz_cases.py: ONNX, TF GraphDef, MetaGraph and
SavedModel inputs corrupted byte-wise and structurally, external data and symlinks, FIFOs,
devices, option typos and conflicts, output paths that are the input in disguise, reports and
diagnose --json colliding with what a run reads or writes in every layout, hostile calibration
inputs, misbehaving --metric functions, layouts of hundreds of data files, ...).

Each case runs as the CLI (`amp_rewriter.cli.main`) in a child process forked from a server that
imported amp_rewriter, onnx, onnxruntime and TensorFlow once (TensorFlow's import takes seconds;
a fresh interpreter per case would make 2000 cases take hours), in its own folder, with stdin
closed, stdout/stderr captured, under RLIMIT_AS (--mem-cap), RLIMIT_FSIZE and a wall-clock
limit (--timeout). The server never runs a TensorFlow op itself (its thread pools would not
survive the fork); seeds are built in a child too. `--spawn` runs each case as
`python -m amp_rewriter ...` instead, to confirm on a sample that forking changes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The CLI's own default: TensorFlow's C++ log lines off. The CLI keeps a level the user set (the
# test suite sets 2), and the cases must not depend on who runs them.
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"

# This checkout's testkit, whichever amp_rewriter runs the cases (`--code`): testkit's fuzz modules
# import no amp_rewriter, so main() can still put the chosen checkout first.
sys.path.insert(0, str(REPO))
from testkit import fuzz_cases  # noqa: E402
from testkit.fuzz import (  # noqa: E402
    GIB,
    Outcome,
    Runner,
    build_seeds_in_child,
    check,
    generate,
    import_everything,
    measure_baseline,
    prepare,
    summarize,
)


def use_code(code: Path) -> None:
    """Make `code`'s amp_rewriter the one every case imports (forked or spawned)."""
    if not (code / "amp_rewriter" / "__init__.py").is_file():
        raise SystemExit(f"fuzz: --code {code}: no amp_rewriter package there")
    if "amp_rewriter" in sys.modules:  # a testkit module imported it: the choice would be ignored
        raise SystemExit("fuzz: amp_rewriter was imported before --code could take effect")
    sys.path.insert(0, str(code))
    import amp_rewriter

    origin = Path(amp_rewriter.__file__).resolve()
    if code not in origin.parents:
        raise SystemExit(f"fuzz: amp_rewriter imported from {origin}, not from {code}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--cases", type=int, default=None,
                        help="how many recipes to generate (default 300, or none with --replay)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2,
                        help="cases at a time (default: the CPU count)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds before a case counts as hung (default 60)")
    parser.add_argument("--mem-cap", type=float, default=3.0,
                        help="address-space limit per case in GiB (default 3)")
    parser.add_argument("--work", type=Path, default=None,
                        help="folder for seeds and cases (default: a temporary folder, removed)")
    parser.add_argument("--keep", action="store_true", help="keep the case folders")
    parser.add_argument("--json", type=Path, help="write every outcome as JSON")
    parser.add_argument("--replay", type=Path,
                        help="run the recipe(s) in this JSON file (first, before any --cases)")
    parser.add_argument("--family", action="append",
                        help="only these families (repeatable): " + ", ".join(fuzz_cases.FAMILIES))
    parser.add_argument("--code", type=Path, metavar="DIR",
                        help="run the amp_rewriter of this checkout instead (e.g. an export of an "
                             "older commit, to see which cases a change fixes)")
    parser.add_argument("--spawn", action="store_true",
                        help="run each case as `python -m amp_rewriter` (slow) instead of forking")
    args = parser.parse_args(argv)
    code = (args.code or REPO).resolve()
    use_code(code)

    started = time.monotonic()
    work = args.work or Path(tempfile.mkdtemp(prefix="amp-fuzz-"))
    work.mkdir(parents=True, exist_ok=True)
    seed_dir = work / "seeds"
    recipes: list[dict] = []
    if args.replay:
        loaded = json.loads(args.replay.read_text())
        recipes = loaded if isinstance(loaded, list) else [loaded]
    count = args.cases if args.cases is not None else (0 if args.replay else 300)
    recipes += generate(count, args.seed, args.family) if count else []
    print(f"fuzz: {len(recipes)} cases, {args.jobs} at a time, work folder {work}", flush=True)
    if not args.spawn:
        import_everything()
    if not (seed_dir / "seeds.json").exists():
        build_seeds_in_child(seed_dir)
    seeds = fuzz_cases.Seeds.load(seed_dir)
    runner = Runner(args.jobs, int(args.mem_cap * GIB), args.timeout, args.spawn, code)
    baseline = measure_baseline(runner, work, seeds)

    cases = []
    broken = []
    for index, recipe in enumerate(recipes, start=1):
        try:
            cases.append(prepare(index, recipe, work, seeds))
        except Exception as exc:  # a recipe the generator cannot build is a harness bug
            broken.append(f"case {index}: cannot build {recipe}: {type(exc).__name__}: {exc}")
    for line in broken:
        print(f"fuzz: {line}", file=sys.stderr)

    outcomes: list[Outcome] = []
    for case, status, usage, seconds, timed_out in runner.run(cases):
        outcome = check(case, status, usage, seconds, timed_out, baseline)
        outcomes.append(outcome)
        if outcome.problems:
            print(f"FAIL case {case.index} [{outcome.family}/{outcome.op}] "
                  f"{' '.join(case.argv)}: {'; '.join(outcome.problems)}\n"
                  f"     stderr: {outcome.stderr.strip()[:300]!r}\n"
                  f"     recipe: {case.meta / 'recipe.json'}", flush=True)
        elif not args.keep:
            shutil.rmtree(case.folder, ignore_errors=True)
        if len(outcomes) % 100 == 0:
            print(f"fuzz: {len(outcomes)}/{len(cases)} done", flush=True)
    outcomes.sort(key=lambda o: o.index)
    wall = time.monotonic() - started
    print(summarize(outcomes, wall))
    if args.json:
        args.json.write_text(json.dumps({
            "cases": len(outcomes), "seconds": wall, "baseline_rss": baseline,
            "broken_recipes": broken, "failed": sum(bool(o.problems) for o in outcomes),
            "outcomes": [asdict(o) for o in outcomes]}, indent=1))
    if not args.keep and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    elif not args.keep:
        shutil.rmtree(work / "cases", ignore_errors=True)
    return 1 if broken or any(o.problems for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
