"""Progress bars on stderr for the slow steps of a run: loading, the passes, reading weights,
writing, validation.

The CLI turns them on (`enable`), except with --quiet; the Python API leaves them off. A bar is
drawn (by tqdm) only when stderr is a terminal and its step has taken longer than `delay()`
seconds (`AMP_REWRITER_PROGRESS_DELAY`, default 2): a quick run, a CI log or a pipe gets nothing
extra. Nothing here imports onnx or tensorflow, so the IR and the passes may report progress.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

#: Seconds a step runs before its bar appears, unless the environment says otherwise.
DEFAULT_DELAY = 2.0
DELAY_VARIABLE = "AMP_REWRITER_PROGRESS_DELAY"

_enabled = False


def enable(on: bool = True) -> None:
    """Turn the bars on (the CLI, without --quiet) or off."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    """Whether bars may be drawn (they still need a terminal on stderr)."""
    return _enabled


def delay() -> float:
    """Seconds a step runs before its bar appears (`AMP_REWRITER_PROGRESS_DELAY`)."""
    text = os.environ.get(DELAY_VARIABLE, "")
    try:
        value = float(text)
    except ValueError:
        return DEFAULT_DELAY
    return value if value >= 0 else DEFAULT_DELAY


class _Silent:
    """A bar that draws nothing (bars off)."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass


@contextlib.contextmanager
def bar(desc: str, total: int | None = None, unit: str = "it") -> Iterator[Any]:
    """A progress bar for one step: `update(n)` as work is done, `set_postfix_str` to say
    what is being done. Draws nothing when bars are off or stderr is no terminal; with unit
    "B", counts bytes (KiB, MiB, ...)."""
    if not _enabled:
        yield _Silent()
        return
    from tqdm import tqdm

    scaled = unit == "B"
    # A terminal that reports no size (a pty nobody sized: `script` or `docker run -t` under
    # automation) would get nothing drawn at the size it reports: it gets 80x24 instead.
    columns, lines = _stderr_size()
    size: dict[str, Any] = {"dynamic_ncols": True}
    if not (columns and lines):
        size = {"ncols": columns or FALLBACK_SIZE[0], "nrows": lines or FALLBACK_SIZE[1]}
    with tqdm(total=total, desc=desc, unit=unit, unit_scale=scaled,
              unit_divisor=1024 if scaled else 1000, file=sys.stderr, delay=delay(),
              leave=False, disable=None, **size) as drawn:
        yield drawn


#: (columns, lines) the bars assume on a terminal that reports no size.
FALLBACK_SIZE = (80, 24)


def _stderr_size() -> tuple[int, int]:
    """(columns, lines) of the terminal on stderr; zeros when it reports none or is no
    terminal."""
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # no terminal, or stderr replaced
        return 0, 0
    return size.columns, size.lines


class Steps:
    """A bar over named steps (the passes of a pipeline): `start(name)` finishes the step
    before and names the new one."""

    def __init__(self, drawn: Any):
        self._bar = drawn
        self._started = False

    def start(self, name: str) -> None:
        if self._started:
            self._bar.update(1)
        self._started = True
        self._bar.set_postfix_str(name, refresh=False)  # drawn at the next update, not now

    def finish(self) -> None:
        if self._started:
            self._bar.update(1)
            self._started = False
