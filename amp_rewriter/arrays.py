"""Arrays from the user's input files: `.npz` archives (every `--inputs`: `--validate`, `check`,
calibration batches, an archive inside Polygraphy JSON) and `.npy` bytes, read through the one
checked reader of `fileio`.

An archive is a zip file: the size each member declares is checked against the bytes the file
really holds before anything is inflated (together at most `MAX_INFLATION` times the archive's
size plus `INFLATION_ALLOWANCE`, each at most `MAX_ARRAY_BYTES`), so 1.5 MB of zeros cannot
become 1.6 GB; each array's header (name, dtype, shape) can be checked by the caller before its
data is read; arrays of Python objects are refused (they would need pickle); data is read a
chunk at a time, so SIGTERM and Ctrl-C are honoured while it is.
"""

from __future__ import annotations

import io
import math
import os
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO

import numpy as np

from .errors import AmpError, first_line
from .fileio import open_input

#: An archive's arrays may take at most this many times the archive's size on disk...
MAX_INFLATION = 64
#: ...plus this much (a compressed attention mask of ones inflates a thousandfold).
INFLATION_ALLOWANCE = 16 << 20
#: The largest array one archive member may declare.
MAX_ARRAY_BYTES = 1 << 32
#: Bytes read (and inflated) at a time.
_CHUNK = 1 << 22

#: Called with (name, dtype, shape) of each array before its data is read; raises AmpError
#: for an array the caller cannot use (a wrong dtype or shape: refused before it is inflated).
HeaderCheck = Callable[[str, np.dtype, tuple[int, ...]], None]


def read_npz(path: str | os.PathLike, what: str = "inputs file",
             check_header: HeaderCheck | None = None) -> dict[str, np.ndarray]:
    """The arrays of an `.npz` file, by name (see the module docstring for the checks)."""
    label = f"{what} {path}" if what else str(path)
    fd, size = open_input(Path(path), label)
    with os.fdopen(fd, "rb") as handle:
        return _read_archive(handle, size, label, check_header)


def read_npz_bytes(data: bytes, label: str, check_header: HeaderCheck | None = None
                   ) -> dict[str, np.ndarray]:
    """The arrays of an `.npz` archive held in memory, checked as `read_npz` checks a file."""
    return _read_archive(io.BytesIO(data), len(data), label, check_header)


def read_npy_bytes(data: bytes, label: str, name: str = "",
                   check_header: HeaderCheck | None = None) -> np.ndarray:
    """The array of `.npy` bytes (its header checked against their length); `name` is what
    `check_header` is told, `label` what messages say."""
    return _read_array(io.BytesIO(data), len(data), label, name, check_header)


def _read_archive(handle: IO[bytes], size: int, label: str,
                  check_header: HeaderCheck | None) -> dict[str, np.ndarray]:
    try:
        archive = zipfile.ZipFile(handle)
        members = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as exc:
        raise AmpError(f"{label}: not an .npz file ({type(exc).__name__})") from None
    budget = MAX_INFLATION * size + INFLATION_ALLOWANCE
    declared = 0
    for info in members:
        declared += info.file_size
        if info.file_size > MAX_ARRAY_BYTES or declared > budget:
            raise AmpError(f"{label}: member {info.filename!r} declares {info.file_size} bytes "
                           f"inflated from {info.compress_size}: more than an archive of "
                           f"{size} bytes may hold (at most {MAX_INFLATION}x its size plus "
                           f"{INFLATION_ALLOWANCE >> 20} MiB)")
        if not info.filename.endswith(".npy"):
            raise AmpError(f"{label}: member {info.filename!r} is not an array (.npy)")
    arrays: dict[str, np.ndarray] = {}
    with archive:
        for info in members:
            name = info.filename[:-len(".npy")]
            try:
                member = archive.open(info)
            except (zipfile.BadZipFile, NotImplementedError, RuntimeError, OSError,
                    ValueError) as exc:  # encrypted, an unknown compression, a bad header
                raise AmpError(f"{label}: cannot read member {info.filename!r} "
                               f"({type(exc).__name__})") from None
            with member:
                arrays[name] = _read_array(member, info.file_size, f"{label}: array {name!r}",
                                           name, check_header)
    return arrays


def _read_array(stream: IO[bytes], size: int, where: str, name: str,
                check_header: HeaderCheck | None) -> np.ndarray:
    """One `.npy` array named `name` from `stream`, which holds `size` bytes; messages start
    with `where`."""
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise AmpError(f"{where}: .npy format version {version} is not supported")
    except AmpError:
        raise
    except (ValueError, OSError, EOFError, SyntaxError, zipfile.BadZipFile, zlib.error) as exc:
        raise AmpError(f"{where}: not an .npy array ({type(exc).__name__})") from None
    if dtype.hasobject:
        raise AmpError(f"{where}: holds Python objects (dtype {dtype}), not numbers")
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    held = size - stream.tell()  # the bytes after the header
    if nbytes > held:
        raise AmpError(f"{where}: its shape {list(shape)} of {dtype} needs {nbytes} bytes, the "
                       f"file holds {held}")
    if check_header is not None:
        check_header(name, dtype, tuple(shape))
    data = bytearray(nbytes)
    view = memoryview(data)
    filled = 0
    try:
        while filled < nbytes:  # a chunk at a time: a signal is handled between chunks
            got = stream.readinto(view[filled:filled + _CHUNK])  # type: ignore[attr-defined]
            if not got:
                raise AmpError(f"{where}: ends after {filled} of its {nbytes} bytes")
            filled += got
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise AmpError(f"{where}: cannot read its data ({type(exc).__name__})") from None
    try:
        array = np.frombuffer(data, dtype=dtype, count=count)
    except ValueError as exc:  # a dtype numpy cannot lay out (itemsize 0)
        raise AmpError(f"{where}: cannot hold dtype {dtype} ({first_line(exc)})") from None
    return array.reshape(shape, order="F" if fortran_order else "C")
