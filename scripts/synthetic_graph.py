#!/usr/bin/env python3
"""Write a transformer-like fp32 ONNX graph of a chosen size (testkit.synthetic), for converter
benchmarks: ``python scripts/synthetic_graph.py 10000 out.onnx [--seed 0]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's testkit

import onnx

from testkit.synthetic import build_synthetic_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("num_nodes", type=int, help="number of nodes in the graph")
    parser.add_argument("output", type=Path, help="where to write the .onnx file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = build_synthetic_model(args.num_nodes, seed=args.seed)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(args.output))
    size_mb = args.output.stat().st_size / 1e6
    print(f"wrote {args.output}: {len(model.graph.node)} nodes, {size_mb:.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
