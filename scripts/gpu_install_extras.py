#!/usr/bin/env python3
"""Install the wheels in a folder into a target folder, skipping any whose module the host's Python
already imports (the GPU host has no package index: see docs/benchmarks.md, "GPU").

    python3 scripts/gpu_install_extras.py WHEEL_FOLDER TARGET_FOLDER

A wheel the host already has is skipped so that its own build (numpy ABI, CUDA libraries) stays
the one that is imported.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

#: Distribution name (as in the wheel's file name) -> the module it installs.
MODULES = {"nvidia_modelopt": "modelopt", "nvidia_ml_py": "pynvml", "google_re2": "re2"}


def main() -> int:
    folder, target = Path(sys.argv[1]), Path(sys.argv[2])
    wanted = []
    for wheel in sorted(folder.glob("*.whl")):
        distribution = wheel.name.split("-")[0]
        module = MODULES.get(distribution, distribution)
        if importlib.util.find_spec(module) is None:
            wanted.append(str(wheel))
        else:
            print(f"host has {module}: skipping {wheel.name}")
    if wanted:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--target", str(target), *wanted], check=True)
        print("installed: " + ", ".join(Path(w).name for w in wanted))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
