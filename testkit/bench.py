"""Measuring helpers the benchmark scripts share: resident-set readings of this process (its
peak since a reset point), a command run while its memory and its children's is sampled, and
size lists as the command lines take them (``1000,10k``), and the error of converted outputs
against fp32 ones."""

from __future__ import annotations

import platform
import resource
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# ---------------------------------------------------------------------------------------------
# Memory measurement (worker side)
# ---------------------------------------------------------------------------------------------


def read_proc_status_kib(field_name: str, pid: int | str = "self") -> int | None:
    """Return a ``VmRSS``/``VmHWM``-style field of /proc/PID/status in KiB (this process's by
    default), or None off Linux or for a process that is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def ru_maxrss_kib() -> int:
    """This process's peak resident set in KiB (ru_maxrss is in bytes on macOS)."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss // 1024 if platform.system() == "Darwin" else maxrss


def current_rss_kib() -> int:
    """This process's resident set now, in KiB (its peak where /proc has no VmRSS)."""
    current = read_proc_status_kib("VmRSS")
    return current if current is not None else ru_maxrss_kib()


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (Linux >= 4.0); return whether that worked."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def peak_rss_kib(peak_was_reset: bool) -> int:
    """This process's peak resident set in KiB: since `reset_peak_rss` where that worked."""
    if peak_was_reset:
        high_water_mark = read_proc_status_kib("VmHWM")
        if high_water_mark is not None:
            return high_water_mark
    return ru_maxrss_kib()


# ---------------------------------------------------------------------------------------------
# Memory of a measured process together with the processes it starts
# ---------------------------------------------------------------------------------------------

#: How often `sampled_run` reads the resident sets.
SAMPLE_SECONDS = 0.02


@dataclass
class SampledRun:
    """A finished command, and the peak of its resident set plus those of the processes it
    started (amp_rewriter's background check), read every `SAMPLE_SECONDS` (0 where /proc has
    no such numbers)."""

    returncode: int
    stderr: str
    peak_with_children_kib: int
    peak_children_kib: int


def sampled_run(command: list[str], timeout_s: float, cwd: Path) -> SampledRun:
    """Run `command` (raises subprocess.TimeoutExpired past `timeout_s`), sampling memory."""
    with tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, cwd=cwd)
        deadline = time.monotonic() + timeout_s
        peak = peak_children = 0
        while process.poll() is None:
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise subprocess.TimeoutExpired(command, timeout_s)
            # A child's own children (a worker) are read too: /proc/PID/task/PID/children.
            children = sum(read_proc_status_kib("VmRSS", child) or 0
                           for child in descendants_of(process.pid))
            peak = max(peak, (read_proc_status_kib("VmRSS", process.pid) or 0) + children)
            peak_children = max(peak_children, children)
            time.sleep(SAMPLE_SECONDS)
        stderr.seek(0)
        return SampledRun(process.returncode, stderr.read().decode("utf-8", "replace"), peak,
                          peak_children)


def descendants_of(pid: int) -> list[int]:
    """The processes `pid` started, and theirs, as /proc lists them now."""
    found, stack = [], [pid]
    while stack:
        parent = stack.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children", encoding="ascii") as children:
                kids = [int(child) for child in children.read().split()]
        except OSError:
            kids = []
        found += kids
        stack += kids
    return found


def parse_sizes(text: str) -> list[int]:
    """Parse ``1000,10k,50000`` into [1000, 10000, 50000] (a ``k`` suffix means thousands)."""
    sizes = []
    for item in text.split(","):
        item = item.strip().lower()
        if item:
            sizes.append(int(float(item[:-1]) * 1000) if item.endswith("k") else int(item))
    return sizes


def output_errors(reference: dict[str, np.ndarray], outputs: dict[str, np.ndarray]
                  ) -> dict[str, Any]:
    """Relative error per output and the non-finite values where fp32 is finite."""
    errors, new_nonfinite = {}, 0
    for name, expected in reference.items():
        got = outputs[name].astype(np.float64)
        expected = expected.astype(np.float64)
        finite = np.isfinite(expected)
        new_nonfinite += int(np.count_nonzero(finite & ~np.isfinite(got)))
        scale = float(np.max(np.abs(expected[finite]), initial=0.0)) or 1.0
        both = finite & np.isfinite(got)
        errors[name] = float(np.max(np.abs(got[both] - expected[both]), initial=0.0)) / scale
    return {"relative_error": errors, "worst_relative_error": max(errors.values()),
            "nonfinite": new_nonfinite}
