"""What it costs this machine to hand a process memory it has not touched before.

On the virtual machines these benchmarks run on, the first write to a page can cost far more
once a process has taken a few GB (the host backs guest memory lazily): then every GB a
conversion's peak grows by also costs seconds. This allocates `--gb` GB in 0.5 GB blocks,
writes one byte per 4 KiB page, and prints the seconds each block took; a flat series means
memory is cheap to take, a step means it is not (and where it happens).

Example::

    python scripts/bench_fresh_memory.py --gb 6
"""

from __future__ import annotations

import argparse
import mmap
import time

BLOCK = 512 * 1024 * 1024
PAGE = 4096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=6.0, help="how much to take (GB)")
    args = parser.parse_args()
    blocks = []
    print("GB taken | seconds for this 0.5 GB | microseconds per page")
    for index in range(int(args.gb * 2)):
        start = time.perf_counter()
        block = mmap.mmap(-1, BLOCK)
        for offset in range(0, BLOCK, PAGE):
            block[offset] = 1
        seconds = time.perf_counter() - start
        blocks.append(block)
        print(f"{(index + 1) / 2:8.1f} | {seconds:23.2f} | {seconds / (BLOCK // PAGE) * 1e6:.1f}",
              flush=True)


if __name__ == "__main__":
    main()
