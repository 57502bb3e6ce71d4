"""``python -m testkit.models OUT_DIR``: write the hand-built ONNX test models (``BUILDERS``) to
OUT_DIR/<name>.onnx."""

from __future__ import annotations

import sys

from testkit.models import BUILDERS
from testkit.models._common import output_dir_argument


def main(argv: list[str]) -> int:
    """Write all models into the directory given as the only argument."""
    out_dir = output_dir_argument(argv, "python -m testkit.models OUT_DIR")
    if out_dir is None:
        return 2
    for name, build_model in BUILDERS.items():
        (out_dir / f"{name}.onnx").write_bytes(build_model().SerializeToString())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
