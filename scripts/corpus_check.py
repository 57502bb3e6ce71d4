#!/usr/bin/env python3
"""Robustness sweep: run amp_rewriter over the ONNX backend test corpus and classify each outcome
(testkit.onnx_corpus says how the corpus is found and what each outcome means).

    .venv/bin/python scripts/corpus_check.py                       # fp16, whole corpus
    .venv/bin/python scripts/corpus_check.py --target bf16 --json out/corpus_bf16.json
    .venv/bin/python scripts/corpus_check.py --filter 'loop|scan' --limit 20 -v
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's amp_rewriter and testkit

from testkit.onnx_corpus import (  # noqa: E402  (after the path set-up)
    DEFAULT_RTOL,
    SUITES,
    default_cache_dir,
    list_cases,
    summarize,
    sweep,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="fp16", choices=("fp16", "bf16"))
    parser.add_argument("--backend", default="ort-cuda", choices=("ort-cuda", "ort-cpu"))
    parser.add_argument("--mode", default="default", choices=("default", "allow-all"),
                        help="allow-all: move every op type of the model to the allow list")
    parser.add_argument("--no-keep-io-types", dest="keep_io_types", action="store_false",
                        help="convert with keep_io_types=False (float graph I/O may go low)")
    parser.add_argument("--suites", default=",".join(SUITES),
                        help=f"comma-separated subset of {','.join(SUITES)}")
    parser.add_argument("--filter", help="regex on SUITE/NAME (e.g. 'node/test_(loop|scan)')")
    parser.add_argument("--limit", type=int, help="only the first N matching cases")
    parser.add_argument("--rtol", type=float, help="relative-error tolerance "
                        f"(default {DEFAULT_RTOL['fp16']} fp16, {DEFAULT_RTOL['bf16']} bf16)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (at most 2)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    parser.add_argument("--cache-dir", type=Path, help="where the generated node corpus lives "
                        f"(default {default_cache_dir()})")
    parser.add_argument("--json", type=Path, help="write every record and the summary here")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per case")
    args = parser.parse_args(argv)

    suites = tuple(s.strip() for s in args.suites.split(",") if s.strip())
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        parser.error(f"unknown suite(s) {unknown}")
    started = time.perf_counter()
    cases = list_cases(suites, args.cache_dir, args.filter)
    if args.limit is not None:
        cases = cases[:args.limit]
    if not cases:
        print("no corpus models match", file=sys.stderr)
        return 2
    options = {"target": args.target, "backend": args.backend, "mode": args.mode,
               "rtol": args.rtol, "keep_io_types": args.keep_io_types}
    listed = time.perf_counter()
    records = sweep(cases, options, args.jobs, args.timeout, args.verbose)
    elapsed = time.perf_counter() - started
    text = summarize(records)
    io_note = "" if args.keep_io_types else ", keep_io_types=False"
    print(f"\ntarget {args.target}, backend {args.backend}, mode {args.mode}{io_note}: "
          f"{len(records)} "
          f"models in {elapsed:.1f} s ({listed - started:.1f} s finding/generating the corpus, "
          f"{min(2, max(1, args.jobs))} processes)")
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"options": options, "seconds": round(elapsed, 1), "count": len(records),
                   "summary": dict(Counter(r["outcome"] for r in records)),
                   "records": records}
        args.json.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
