#!/usr/bin/env python3
"""What onnxruntime's CPU provider does with the fused transformer ops in fp16 and bf16: a table of
kernel / casts / decomposed / fails per op and dtype (testkit.ort_kernels says how it is probed).

    python scripts/ort_cpu_kernels.py            # markdown table on stdout, with the ORT version
    python scripts/ort_cpu_kernels.py --json out.json

amp_rewriter/op_lists/onnx.toml's ort-cpu profile and the validation's emulation
(amp_rewriter/formats/onnx/validate.py) rely on these facts; re-run when onnxruntime moves.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's amp_rewriter and testkit

from testkit.ort_kernels import (  # noqa: E402  (after the path set-up)
    DTYPES,
    OPS,
    probe,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the probes as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        probes = [probe(op, dtype, Path(tmp)) for op in OPS for dtype in DTYPES]
    print(f"onnxruntime {ort.__version__} ({', '.join(ort.get_available_providers())}), "
          f"onnx {onnx.__version__}\n")
    print("| op | dtype | CPU kernel registry (T) | on the CPU provider | detail | rel. error vs fp32 |")
    print("|---|---|---|---|---|---|")
    for p in probes:
        error = "" if p.max_relative_error is None else f"{p.max_relative_error:.2e}"
        print(f"| {p.op} | {p.dtype} | {p.registry} | {p.outcome} | {p.detail} | {error} |")
    if args.json:
        args.json.write_text(json.dumps({"onnxruntime": ort.__version__,
                                         "probes": [asdict(p) for p in probes]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
