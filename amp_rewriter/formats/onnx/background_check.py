"""onnx.checker's structural check of a big converted model, in a second process while this
one runs the cost summary's shape inference.

Both are onnx's C++ and hold the GIL for their whole call, so on one process they run one after
the other (at a million nodes, 4 s of checking after 13 s of inference). A worker process takes
the check: a fresh interpreter (not a fork of this process, which may have threads), given the
model's encoding through an unlinked scratch file, since a pipe would need this process to feed
it while the inference holds the GIL. Its answer is onnx's own verdict; if it cannot start or
dies, the caller checks in-process as before.

Run as a module, this is the worker: `python -m amp_rewriter.formats.onnx.background_check FD`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

from ...errors import first_line
from ...fileio import owned_prefix

#: Set to "0" to check in the converting process.
ENVIRONMENT_SWITCH = "AMP_REWRITER_BACKGROUND_CHECK"

#: What the worker prints when the model passes.
_PASSED = "passed"
#: What starts the worker's line when the checker refuses the model (its message follows).
_FAILED = "failed: "


def usable_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class BackgroundCheck:
    """A running check: `start` it, then ask `verdict`, or `cancel` it."""

    def __init__(self, process: subprocess.Popen[bytes], spool: IO[bytes]):
        self.process = process
        self.spool = spool

    @classmethod
    def start(cls, encoding: bytes | bytearray) -> BackgroundCheck | None:
        """Check the model `encoding` holds in a worker; None where there is no second core,
        the switch (`ENVIRONMENT_SWITCH`) is off or the worker cannot start."""
        if os.environ.get(ENVIRONMENT_SWITCH, "1") == "0" or usable_cores() < 2 \
                or not sys.executable or os.name != "posix":
            return None
        package_root = str(Path(__file__).resolve().parents[3])
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(
            [package_root] + [p for p in environment.get("PYTHONPATH", "").split(os.pathsep) if p])
        spool = tempfile.TemporaryFile(prefix=owned_prefix())
        try:
            spool.write(encoding)
            spool.flush()
            process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(spool.fileno())],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env=environment, pass_fds=(spool.fileno(),))
        except OSError:  # no room for the scratch file, or no process: check in-process
            spool.close()
            return None
        return cls(process, spool)

    def verdict(self) -> str | None:
        """Wait for the worker: "" when the model passed, the checker's message when it did
        not, None when the worker gave no verdict (the caller checks in-process)."""
        try:
            assert self.process.stdout is not None
            line = self.process.stdout.readline().decode("utf-8", "replace").rstrip("\n")
        except OSError:
            line = ""
        self.cancel()
        if line == _PASSED:
            return ""
        if line.startswith(_FAILED):
            return line[len(_FAILED):]
        return None

    def cancel(self) -> None:
        """Stop the worker (at once, if it is still checking) and drop the scratch file."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdout, self.spool):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def _work(descriptor: int) -> None:
    import onnx.checker

    with os.fdopen(descriptor, "rb") as spool:
        spool.seek(0)
        encoding = spool.read()
    try:
        onnx.checker.check_model(encoding)
    except Exception as exc:  # the checker raises several exception types
        print(_FAILED + first_line(exc), flush=True)
        return
    print(_PASSED, flush=True)


if __name__ == "__main__":
    _work(int(sys.argv[1]))
