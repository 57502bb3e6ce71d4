#!/usr/bin/env python
"""Which nodes of a model ORT's CUDA provider does not take, and why, from ORT's own verbose log.

    python scripts/ort_placement.py model.onnx [more.onnx ...]

Opens each model on CUDAExecutionProvider (CPU fallback allowed) with verbose logging and prints
the provider's "kernel not found" lines (op type, node, the types it was asked for) and the
session's error if it does not open. A node that no provider takes makes the session fail; a
node left to the CPU costs copies: both are reasons a converted model is slow or does not load.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile


def main(paths: list[str]) -> int:
    import torch  # noqa: F401, I001  (first: its CUDA libraries are the ones onnxruntime preloads)
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    for path in paths:
        print(f"== {path}")
        with tempfile.TemporaryFile(mode="w+") as log:
            saved = os.dup(2)
            os.dup2(log.fileno(), 2)  # ORT's native log goes to stderr
            error = None
            try:
                options = ort.SessionOptions()
                options.log_severity_level = 0
                options.log_verbosity_level = 1
                ort.InferenceSession(path, options, providers=["CUDAExecutionProvider",
                                                               "CPUExecutionProvider"])
            except Exception as exc:  # noqa: BLE001  (the failure is what we report)
                error = " ".join(str(exc).split())[:400]
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            log.seek(0)
            seen = set()
            for line in log:
                if re.search(r"kernel not found|not supported|no kernel|fall ?back|Could not find",
                             line, re.IGNORECASE):
                    text = line.strip().split("] ", 1)[-1][:300]
                    if text not in seen:
                        seen.add(text)
                        print("  " + text)
        print("  session:", error or "opens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
