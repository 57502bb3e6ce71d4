#!/usr/bin/env python
"""Prove that two versions of amp_rewriter convert a corpus to byte-identical output.

    .venv/bin/python scripts/same_output.py --before HEAD                 # HEAD vs the working tree
    .venv/bin/python scripts/same_output.py --before main~3 --after main  # two revisions
    .venv/bin/python scripts/same_output.py --before HEAD --skip real     # without the torch exports
    .venv/bin/python scripts/same_output.py --determinism                 # the working tree, twice

1. Builds the case corpus once into `--cache` (default bench_out/same_output; see CORPUS_PARTS),
   each part in its own subprocess, without importing amp_rewriter; later runs reuse it.
   Cases recorded by other tools (testkit/same_output_cases.py: record_case) in any folder
   below `<cache>/cases/` are part of the corpus too.
2. Checks REV out into a temporary `git worktree` (removed afterwards) and replays every case once
   per code version, each in its own subprocess whose PYTHONPATH is that checkout (the replay
   verifies that amp_rewriter and all its submodules are imported from there).
3. Compares per case the sha256 of the converted output bytes, the decisions of the report
   (node -> precision), how the report explains them (each entry's kind, reason and path) and
   the error (class and first line) and prints the cases that differ.

Exit status: 0 all identical, 1 some output, decision, explanation or error differs, 2 the run
itself failed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Run by path under each code version (PYTHONPATH = that version's root), so the replay imports
#: that version's amp_rewriter.
CASES_SCRIPT = REPO_ROOT / "testkit" / "same_output_cases.py"
DEFAULT_CACHE = REPO_ROOT / "bench_out" / "same_output"
BUILT_MARK = ".built.json"

sys.path.insert(0, str(REPO_ROOT))  # the checkout's testkit (this process never imports amp_rewriter)

from testkit import same_output_cases as cases_lib  # noqa: E402  (after the path set-up)
from testkit.same_output_corpus import CORPUS_PARTS  # noqa: E402


def build_part_here(part: str, cases_dir: Path) -> int:
    """The subprocess side of build_corpus: build one part into cases_dir/<part>."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import logging
    logging.getLogger("tensorflow").setLevel(logging.ERROR)  # deprecation notices of tf.compat.v1
    started = time.perf_counter()
    cases_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cases_dir, prefix=f".building-{part}-"))
    try:
        with tempfile.TemporaryDirectory(dir=cases_dir, prefix=f".tmp-{part}-") as tmp:
            CORPUS_PARTS[part](staging, Path(tmp))
        if "amp_rewriter" in sys.modules:
            print(f"building {part} imported amp_rewriter: the corpus must not depend on it",
                  file=sys.stderr)
            return 2
        count = len(cases_lib.find_cases(staging))
        mark = {"part": part, "cases": count, "seconds": round(time.perf_counter() - started, 1),
                "format": cases_lib.FORMAT}
        (staging / BUILT_MARK).write_text(json.dumps(mark, indent=1) + "\n")
        target = cases_dir / part
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return 0


def _child_env(pythonpath: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONDONTWRITEBYTECODE": "1",
                "OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
                "TF_NUM_INTEROP_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
                "PYTHONWARNINGS": "ignore"})
    env.pop("PYTHONPATH", None)
    env.pop(cases_lib.RECORD_ENV, None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def build_corpus(cache: Path, parts: list[str], rebuild: bool) -> dict[str, float]:
    """Build each missing (or, with rebuild, each) part in its own subprocess; part -> seconds."""
    cases_dir = cache / "cases"
    timings = {}
    for part in parts:
        if (cases_dir / part / BUILT_MARK).is_file() and not rebuild:
            continue
        print(f"building corpus part {part} ...", flush=True)
        started = time.perf_counter()
        cases_dir.mkdir(parents=True, exist_ok=True)
        log = cases_dir / f".build-{part}.log"  # TensorFlow's start-up noise goes here
        with open(log, "w") as log_handle:
            result = subprocess.run([sys.executable, str(Path(__file__).resolve()),
                                     "--build-part", part, "--cache", str(cache)],
                                    cwd=REPO_ROOT, env=_child_env(REPO_ROOT), stderr=log_handle,
                                    check=False)
        if result.returncode != 0:
            tail = "\n    ".join(log.read_text().splitlines()[-15:])
            raise RuntimeError(f"building corpus part {part} failed (exit {result.returncode}); "
                               f"{log}:\n    {tail}")
        timings[part] = time.perf_counter() - started
        mark = json.loads((cases_dir / part / BUILT_MARK).read_text())
        print(f"  {part}: {mark['cases']} cases in {timings[part]:.1f} s", flush=True)
    return timings


def record_tests(cases_dir: Path, rebuild: bool) -> None:
    """Run this checkout's test suite with AMP_REWRITER_RECORD_CASES set, so every conversion the
    tests make in-process becomes a case under cases_dir/tests (testkit/record_cases.py)."""
    target = cases_dir / "tests"
    if (target / BUILT_MARK).is_file() and not rebuild:
        return
    print("recording the test suite's conversions (runs the whole suite) ...", flush=True)
    started = time.perf_counter()
    shutil.rmtree(target, ignore_errors=True)
    env = {**_child_env(REPO_ROOT), cases_lib.RECORD_ENV: str(target)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            check=False)
    if result.returncode != 0:
        tail = "\n    ".join((result.stdout + result.stderr).splitlines()[-15:])
        raise RuntimeError(f"the test suite failed while recording (exit {result.returncode}):"
                           f"\n    {tail}")
    count = len(cases_lib.find_cases(target))
    mark = {"part": "tests", "cases": count, "seconds": round(time.perf_counter() - started, 1),
            "format": cases_lib.FORMAT}
    (target / BUILT_MARK).write_text(json.dumps(mark, indent=1) + "\n")
    print(f"  tests: {count} cases in {mark['seconds']:.1f} s", flush=True)


# ================================================================================================
# Code versions
# ================================================================================================
def _git(*args: str, cwd: Path = REPO_ROOT) -> str:
    result = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout.strip()


class Version:
    """One code version: a checkout folder (the working tree, or a temporary git worktree)."""

    def __init__(self, spec: str, workdir: Path, label: str):
        self.spec = spec
        self.worktree: Path | None = None
        path = Path(spec)
        if path.is_dir() and (path / "amp_rewriter").is_dir():
            self.root = path.resolve()
            self.describe = f"{spec} (checkout {self.root})"
            return
        try:
            sha = _git("rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}")
        except RuntimeError:
            raise RuntimeError(f"{spec!r} is neither a checkout folder (with amp_rewriter/) nor "
                               f"a git revision") from None
        self.worktree = workdir / f"{label}-{sha[:12]}"
        _git("worktree", "add", "--detach", "--quiet", str(self.worktree), sha)
        self.root = self.worktree
        self.describe = f"{spec} = {sha[:12]} (worktree {self.worktree})"

    def remove(self) -> None:
        if self.worktree is None:
            return
        try:
            _git("worktree", "remove", "--force", str(self.worktree))
        except RuntimeError:
            shutil.rmtree(self.worktree, ignore_errors=True)
            subprocess.run(["git", "worktree", "prune"], cwd=REPO_ROOT, capture_output=True,
                           check=False)
        self.worktree = None


# ================================================================================================
# Replay and comparison
# ================================================================================================
def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as handle:
            return sum(1 for _ in handle)
    except FileNotFoundError:
        return 0


def replay(sides: list[tuple[str, Path]], cases_dir: Path, workdir: Path, only: list[str],
           skip: list[str], total: int, jobs: int, timeout: float
           ) -> dict[str, dict[str, Any]]:
    """Replay the corpus once per side, each in a subprocess with PYTHONPATH=its root.

    Returns label -> {"header", "results": {case: record}, "footer", "seconds", "log", "rc"}.
    """
    runs: dict[str, dict[str, Any]] = {}
    pending = list(sides)
    active: dict[str, dict[str, Any]] = {}
    last_progress = time.perf_counter()
    while pending or active:
        while pending and len(active) < jobs:
            label, root = pending.pop(0)
            slug = label.replace(" ", "_")
            results, log = workdir / f"results-{slug}.jsonl", workdir / f"replay-{slug}.log"
            command = [sys.executable, str(CASES_SCRIPT), "replay", str(cases_dir), str(results),
                       "--expect-root", str(root)]
            if only:
                command += ["--only", ",".join(only)]
            if skip:
                command += ["--skip", ",".join(skip)]
            with open(log, "w") as log_handle:
                process = subprocess.Popen(command, cwd=root, env=_child_env(root),
                                           stdout=log_handle, stderr=subprocess.STDOUT)
            active[label] = {"process": process, "results": results, "log": log,
                             "started": time.perf_counter()}
        time.sleep(0.5)
        for label in list(active):
            run = active[label]
            rc = run["process"].poll()
            elapsed = time.perf_counter() - run["started"]
            if rc is None and elapsed > timeout:
                run["process"].kill()
                rc = run["process"].wait()
                print(f"[{label}] timed out after {timeout:.0f} s", flush=True)
            if rc is not None:
                run["rc"] = rc
                run["seconds"] = elapsed
                runs[label] = run
                del active[label]
                print(f"[{label}] replay finished in {elapsed:.1f} s (exit {rc})", flush=True)
        if active and time.perf_counter() - last_progress > 30:
            last_progress = time.perf_counter()
            progress = ", ".join(f"{label} {min(max(_count_lines(run['results']) - 1, 0), total)}"
                                 f"/{total}"
                                 for label, run in active.items())
            print(f"  replaying: {progress}", flush=True)
    for run in runs.values():
        run["header"], run["footer"], run["records"] = None, None, {}
        if run["results"].is_file():
            for line in run["results"].read_text().splitlines():
                record = json.loads(line)
                if record.get("header"):
                    run["header"] = record
                elif record.get("footer"):
                    run["footer"] = record
                else:
                    run["records"][record["case"]] = record
    return runs


def _outcome(record: dict[str, Any] | None) -> str:
    if record is None:
        return "missing"
    if record["status"] == "error":
        return f"error {record['error']}"
    return "ok"


def _decision_changes(before: dict[str, str], after: dict[str, str], limit: int = 8
                      ) -> tuple[int, list[str]]:
    changes = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key, "(absent)"), after.get(key, "(absent)")
        if old != new:
            changes.append(f"{key}: {old} -> {new}")
    return len(changes), changes[:limit]


def compare(names: list[str], before: dict[str, dict], after: dict[str, dict]
            ) -> dict[str, list[dict[str, Any]]]:
    """Classify each case: identical, differing (bytes, decisions or error), missing."""
    identical, differing, missing, errors = [], [], [], []
    for name in names:
        a, b = before.get(name), after.get(name)
        if a is None or b is None:
            missing.append({"case": name, "before": _outcome(a), "after": _outcome(b)})
            continue
        entry: dict[str, Any] = {"case": name, "kind": b.get("kind")}
        if a["status"] == "error" or b["status"] == "error":
            errors.append({**entry, "before": a.get("error"), "after": b.get("error")})
        reasons = []
        if a["status"] != b["status"] or a.get("error") != b.get("error"):
            reasons.append(f"before: {_outcome(a)}; after: {_outcome(b)}")
        if a["status"] == b["status"] == "ok":
            if a["digest"] != b["digest"]:
                changed = sorted(k for k in set(a["outputs"]) | set(b["outputs"])
                                 if a["outputs"].get(k) != b["outputs"].get(k))
                reasons.append(f"output bytes differ ({', '.join(changed)})")
            if a["decisions_digest"] != b["decisions_digest"]:
                count, shown = _decision_changes(a["decisions"], b["decisions"])
                entry["decisions_changed"] = count
                entry["decision_changes"] = shown
                reasons.append(f"{count} node decision(s) differ")
            elif a["digest"] != b["digest"]:
                reasons.append("the decisions are the same (node -> precision)")
            if a.get("explanations_digest") != b.get("explanations_digest"):
                reasons.append("the report explains a decision differently (kind, reason or "
                               "path)")
        if reasons:
            differing.append({**entry, "reasons": reasons})
        else:
            identical.append(entry)
    return {"identical": identical, "differing": differing, "missing": missing,
            "errors": errors}


def _print_section(title: str, entries: list[str], show: int) -> None:
    print(title)
    for line in entries[:show]:
        print(f"  {line}")
    if len(entries) > show:
        print(f"  ... and {len(entries) - show} more (--show N, or --json)")


def report(comparison: dict[str, list[dict]], labels: tuple[str, str], show: int) -> None:
    first, second = labels
    differing = comparison["differing"]
    identical = comparison["identical"]
    errors = comparison["errors"]
    same_errors = sum(1 for e in errors if e["before"] == e["after"])
    total = len(identical) + len(differing) + len(comparison["missing"])
    print(f"\nidentical: {len(identical)} of {total} cases"
          + (f" ({same_errors} of them raise the same error on both sides)" if same_errors else ""))
    lines = []
    for entry in differing:
        text = f"{entry['case']} [{entry['kind']}]: " + "; ".join(entry["reasons"])
        if entry.get("decision_changes"):
            text += "\n      " + "\n      ".join(entry["decision_changes"])
            if entry["decisions_changed"] > len(entry["decision_changes"]):
                text += f"\n      ... {entry['decisions_changed'] - len(entry['decision_changes'])} more"
        lines.append(text)
    _print_section(f"differing: {len(differing)}", lines, show)
    if comparison["missing"]:
        _print_section(f"missing (a replay stopped early): {len(comparison['missing'])}",
                       [f"{m['case']}: {first} {m['before']}, {second} {m['after']}"
                        for m in comparison["missing"]], show)
    lines = []
    for entry in errors:
        if entry["before"] == entry["after"]:
            lines.append(f"{entry['case']}: {entry['before']}  (both)")
        else:
            lines.append(f"{entry['case']}: {first}: {entry['before'] or 'ok'} | "
                         f"{second}: {entry['after'] or 'ok'}")
    _print_section(f"errors on either side: {len(errors)}", lines, show)


# ================================================================================================
# Command line
# ================================================================================================
def _parts(value: str | None) -> list[str]:
    return [p.strip() for p in (value or "").split(",") if p.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="corpus parts: " + ", ".join(CORPUS_PARTS) + " (plus any folder of recorded "
               "cases below CACHE/cases)")
    parser.add_argument("--before", metavar="REV", help="the reference version: a git revision "
                        "(or a checkout folder)")
    parser.add_argument("--after", metavar="PATH_OR_REV", default=str(REPO_ROOT),
                        help="the version under test: a checkout folder or a git revision "
                             "(default: this working tree)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                        help="corpus and results folder (default: bench_out/same_output)")
    parser.add_argument("--only", help="comma-separated corpus parts to build and replay")
    parser.add_argument("--skip", help="comma-separated corpus parts to leave out")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    parser.add_argument("--rebuild", action="store_true",
                        help="rebuild the selected parts of the corpus even if cached")
    parser.add_argument("--no-build", action="store_true",
                        help="replay only what is in the cache (e.g. recorded cases)")
    parser.add_argument("--build-only", action="store_true", help="build the corpus and stop")
    parser.add_argument("--record-tests", action="store_true",
                        help="also run this checkout's test suite once, recording every "
                             "conversion it makes in-process as the corpus part 'tests' (about "
                             "5 minutes; kept in the cache like the other parts)")
    parser.add_argument("--determinism", action="store_true",
                        help="replay the --after version twice (two processes) and compare")
    parser.add_argument("--jobs", type=int, choices=(1, 2), default=2,
                        help="replays run at once (default 2: both versions in parallel)")
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds one replay may take (default 3600)")
    parser.add_argument("--show", type=int, default=40, help="list at most N cases per section")
    parser.add_argument("--build-part", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if isinstance(sys.stdout, io.TextIOWrapper):  # (a test may have replaced it)
        sys.stdout.reconfigure(line_buffering=True)  # progress and errors in order when piped

    cache = args.cache.resolve()
    cases_dir = cache / "cases"
    if args.build_part:
        return build_part_here(args.build_part, cases_dir)
    only, skip = _parts(args.only), _parts(args.skip)
    if not (args.before or args.determinism or args.build_only):
        parser.error("give --before REV (or --determinism, or --build-only)")
    if args.before and args.determinism:
        parser.error("--determinism replays --after twice; leave out --before")

    started = time.perf_counter()
    build_parts = [p for p in CORPUS_PARTS if (not only or p in only) and p not in skip]
    unknown = [p for p in only + skip if p not in CORPUS_PARTS
               and not (cases_dir / p).is_dir()]
    if unknown:
        parser.error(f"unknown corpus part(s) {', '.join(unknown)} (known: "
                     f"{', '.join(CORPUS_PARTS)}, or a folder below {cases_dir})")
    try:
        build_times = {} if args.no_build else build_corpus(cache, build_parts, args.rebuild)
        if args.record_tests:
            record_tests(cases_dir, args.rebuild)
    except RuntimeError as exc:
        print(f"same_output: {exc}", file=sys.stderr)
        return 2
    built_at = time.perf_counter()
    cases = cases_lib.find_cases(cases_dir, only or None, skip)
    per_part = Counter(cases_lib.part_of(name) for name, _ in cases)
    print(f"corpus {cases_dir}: {len(cases)} cases ("
          + ", ".join(f"{part} {count}" for part, count in per_part.items()) + ")")
    if args.build_only:
        return 0
    if not cases:
        print("same_output: no cases to replay", file=sys.stderr)
        return 2

    workdir = Path(tempfile.mkdtemp(prefix="same_output-"))
    versions: list[Version] = []
    try:
        try:
            if args.determinism:
                after = Version(args.after, workdir, "after")
                versions.append(after)
                sides = [("run 1", after.root), ("run 2", after.root)]
                print(f"version: {after.describe}, replayed twice")
            else:
                before = Version(args.before, workdir, "before")
                versions.append(before)
                after = Version(args.after, workdir, "after")
                versions.append(after)
                sides = [("before", before.root), ("after", after.root)]
                print(f"before: {before.describe}\nafter:  {after.describe}")
        except RuntimeError as exc:
            print(f"same_output: {exc}", file=sys.stderr)
            return 2
        runs = replay(sides, cases_dir, workdir, only, skip, len(cases), args.jobs, args.timeout)
        failed = False
        for label, _root in sides:
            run = runs[label]
            origin = (run["header"] or {}).get("amp_rewriter", "?")
            print(f"[{label}] amp_rewriter imported from {origin}; {len(run['records'])} cases "
                  f"in {run['seconds']:.1f} s")
            stray = (run["footer"] or {}).get("stray_modules")
            if run["rc"] != 0 or run["footer"] is None:
                failed = True
                tail = run["log"].read_text().splitlines()[-15:] if run["log"].is_file() else []
                print(f"[{label}] replay failed (exit {run['rc']}); last log lines:\n    "
                      + "\n    ".join(tail), file=sys.stderr)
            if stray:
                print(f"[{label}] modules imported from outside the checkout: {stray}",
                      file=sys.stderr)
        names = [name for name, _ in cases]
        labels = (sides[0][0], sides[1][0])
        comparison = compare(names, runs[labels[0]]["records"], runs[labels[1]]["records"])
        report(comparison, labels, args.show)
        slowest = sorted(((r["seconds"], n) for n, r in runs[labels[1]]["records"].items()),
                         reverse=True)[:5]
        total_seconds = time.perf_counter() - started
        print(f"\ntime: {total_seconds:.0f} s in all (corpus build "
              f"{built_at - started:.0f} s, replays "
              + ", ".join(f"{label} {runs[label]['seconds']:.0f} s" for label in labels)
              + "; slowest cases: " + ", ".join(f"{n} {s:.1f} s" for s, n in slowest) + ")")
        last = cache / "last"  # the raw results (every digest and decision) of this run
        shutil.rmtree(last, ignore_errors=True)
        last.mkdir(parents=True)
        for label in labels:
            for key in ("results", "log"):
                if runs[label][key].is_file():
                    shutil.copyfile(runs[label][key], last / runs[label][key].name)
        print(f"raw results and replay logs: {last}")
        if args.json:
            data = {
                "versions": {label: {"spec": v.spec, "root": str(root), "amp_rewriter":
                                     (runs[label]["header"] or {}).get("amp_rewriter")}
                             for (label, root), v in zip(sides, versions * (2 // len(versions)))},
                "cases": len(cases), "parts": dict(per_part),
                "build_seconds": build_times, "replay_seconds": {label: runs[label]["seconds"]
                                                                 for label in labels},
                **comparison,
            }
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(data, indent=1) + "\n")
        if failed or comparison["missing"]:
            print("RESULT: the replay failed (see above)")
            return 2
        if comparison["differing"]:
            print(f"RESULT: {len(comparison['differing'])} case(s) differ")
            return 1
        print("RESULT: identical")
        return 0
    finally:
        for version in versions:
            version.remove()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
