"""``python -m testkit.models OUT_DIR``: write every test model to OUT_DIR/<name>.onnx."""

from __future__ import annotations

import sys
from pathlib import Path

from testkit.models import BUILDERS


def main(argv: list[str]) -> int:
    """Write all models into the directory given as the only argument."""
    if len(argv) != 1:
        print("usage: python -m testkit.models OUT_DIR", file=sys.stderr)
        return 2
    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, build_model in BUILDERS.items():
        (out_dir / f"{name}.onnx").write_bytes(build_model().SerializeToString())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
