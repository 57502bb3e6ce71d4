"""Keeping libraries' own output off the user's stderr: what fails reaches the user as one line
of ours (exit 2), never a library's log line before it."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 points at /dev/null while the block runs: a library's C++ side (its
    start-up notes on importing, a telemetry warning) writes there directly, past Python's
    sys.stderr. Python exceptions still propagate. AMP_REWRITER_DEBUG=1 keeps stderr as it is."""
    if os.environ.get("AMP_REWRITER_DEBUG"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
