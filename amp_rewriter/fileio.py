"""Files: reading inputs (regular files only, never past their size) and writing outputs
atomically (a temporary file in the same folder, then a rename)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import AmpError

#: Read size: large enough for speed, small enough not to matter for memory.
_CHUNK = 1 << 24


def check_output_path(path: str | os.PathLike) -> None:
    """Refuse an output file path that cannot or must not be written: its folder is missing,
    or it is a directory, a FIFO, a device or a socket (the rename would replace the node)."""
    target = Path(path)
    parent = Path(os.path.realpath(target)).parent  # realpath: a symlink loop does not raise
    if not parent.is_dir():
        raise AmpError(f"{path}: output folder {parent} does not exist")
    if target.is_dir():
        raise AmpError(f"{path}: is a directory, expected an output file name")
    try:
        kind = non_regular_kind(os.stat(target).st_mode)
    except OSError:
        kind = None
    if kind is not None:
        raise AmpError(f"{path}: is {kind}; refusing to replace it with the output")


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that a failure never leaves a partial file behind."""
    target = Path(path)
    check_output_path(target)
    parent = Path(os.path.realpath(target)).parent
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=".amp-rewriter-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def non_regular_kind(mode: int) -> str | None:
    """What a non-regular file is ("a FIFO", "a character device", ...); None for a regular file
    or a directory."""
    for test, kind in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return None


def check_input_path(path: str | os.PathLike, what: str = "") -> None:
    """Refuse an input path that leads nowhere (missing, a symlink loop, no permission) before
    anything resolves or compares it; what it leads to is checked where it is read."""
    label = f"{what} {path}" if what else str(path)
    try:
        os.stat(path)
    except FileNotFoundError:
        raise AmpError(f"{label}: no such file") from None
    except (OSError, ValueError) as exc:  # ELOOP, EACCES, ENAMETOOLONG; NUL in the path
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise AmpError(f"{label}: cannot read ({reason})") from None


def _open_regular(path: Path, label: str, directory_hint: str) -> tuple[int, int]:
    """(descriptor, size) of a regular file opened for reading; AmpError for anything else.

    The kind is checked before opening (opening a FIFO blocks, opening a device may act) and
    again on the descriptor (the path may have been replaced in between).
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise AmpError(f"{label}: no such file") from None
    except OSError as exc:
        raise AmpError(f"{label}: cannot read ({exc.strerror})") from None
    if stat.S_ISDIR(mode):
        raise AmpError(f"{label}: is a directory, {directory_hint}")
    kind = non_regular_kind(mode)
    if kind is not None:
        raise AmpError(f"{label}: is {kind}, not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise AmpError(f"{label}: cannot read ({exc.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise AmpError(f"{label}: is not a regular file")
    return fd, info.st_size


def _chunks(fd: int, size: int, label: str) -> Iterator[bytes]:
    """The file's bytes in chunks, never more than `size` in all."""
    left = size
    while left > 0:
        try:
            chunk = os.read(fd, min(left, _CHUNK))
        except OSError as exc:
            raise AmpError(f"{label}: cannot read ({exc.strerror})") from None
        if not chunk:
            return
        left -= len(chunk)
        yield chunk


def read_input_bytes(path: str | os.PathLike, directory_hint: str, what: str = "") -> bytes:
    """The bytes of an input file; a missing, unreadable, directory or non-regular path raises
    AmpError.

    Only regular files are read (a FIFO would block forever, /dev/zero never ends), and never
    past the size the file had when it was opened. `what` names the file in messages ("inputs
    file", "config file"); a model is named by its path alone.
    """
    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    fd, size = _open_regular(path, label, directory_hint)
    try:
        return b"".join(_chunks(fd, size, label))
    finally:
        os.close(fd)


def read_input_text(path: str | os.PathLike, what: str) -> str:
    """An input text file (UTF-8), read as `read_input_bytes` reads one."""
    data = read_input_bytes(path, f"expected a {what}", what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise AmpError(f"{what} {path}: not UTF-8 text") from None


def copy_regular_file(source: str | os.PathLike, destination: str | os.PathLike) -> None:
    """Copy a regular file's bytes (up to the size it had when opened) and its mode: a copy
    function for `shutil.copytree` that refuses FIFOs and devices, which would block the copy
    or fill the disk."""
    label = str(source)
    fd, size = _open_regular(Path(source), label, "expected a file")
    try:
        with open(destination, "wb") as handle:
            for chunk in _chunks(fd, size, label):
                handle.write(chunk)
    finally:
        os.close(fd)
    shutil.copymode(source, destination)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
