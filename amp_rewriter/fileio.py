"""Writing output files atomically: a temporary file in the same folder, then a rename."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import AmpError


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that a failure never leaves a partial file behind."""
    target = Path(path)
    parent = target.resolve().parent
    if not parent.is_dir():
        raise AmpError(f"{path}: output folder {parent} does not exist")
    if target.is_dir():
        raise AmpError(f"{path}: is a directory, expected an output file name")
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=".amp-rewriter-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_input_bytes(path: str | os.PathLike, directory_hint: str) -> bytes:
    """The bytes of an input file; a missing, unreadable or directory path raises AmpError."""
    path = Path(path)
    if not path.exists():
        raise AmpError(f"{path}: no such file")
    if path.is_dir():
        raise AmpError(f"{path}: is a directory, {directory_hint}")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise AmpError(f"{path}: cannot read ({exc.strerror})") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
