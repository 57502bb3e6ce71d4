"""Print the tf-gpu kernel tables of amp_rewriter/op_lists/tf.toml from TensorFlow's registry.

TensorFlow's Linux wheel registers its CUDA kernels whether or not a GPU is present, so the GPU
kernels of every listed op can be read on any machine:

    .venv/bin/python scripts/tf_kernel_table.py

prints, per target, the listed ops that have no GPU kernel for that dtype (the `no_kernel` arrays).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from amp_rewriter.formats.tf.lists import kernel_checker  # noqa: E402
from amp_rewriter.op_lists import read_list_file  # noqa: E402

DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def main() -> None:
    import tensorflow as tf

    data = read_list_file("tf")
    print(f"# TensorFlow {tf.__version__}")
    for target, dtype in DTYPES.items():
        check = kernel_checker("GPU", dtype)
        ops = sorted({op for cls in ("allow", "infer", "deny", "clear")
                      for op in data[target].get(cls, [])})
        missing = [op for op in ops if not check(op, None)]
        print(f"[backends.tf-gpu.{target}]")
        print("no_kernel = [")
        line = " "
        for op in missing:
            item = f' "{op}",'
            if len(line) + len(item) > 99:
                print(line)
                line = " "
            line += item
        if line.strip():
            print(line)
        print("]")


if __name__ == "__main__":
    main()
