"""Reading input files (regular files only, never past their size), and writing every output of
a run as one transaction.

A run stages each output (the model, its external data, a SavedModel directory, the report) in a
temporary folder beside its destination and moves all of them into place only at `commit`, after
validation passed; a run that fails, or is interrupted, removes its temporary folders and leaves
every destination as it was. No destination may be, or replace, a file the run reads.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from .errors import AmpError

#: Prefix of every temporary file and folder a run makes (beside its destinations); the run's
#: process id follows it, so a later run can tell abandoned ones (see `sweep_abandoned`).
TEMP_PREFIX = ".amp-rewriter-"

#: (path, what it is to the run) for each file or folder the run reads.
InputFiles = Iterable[tuple[Path, str]]

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


def owned_prefix(prefix: str = TEMP_PREFIX) -> str:
    """`prefix` plus this process's id: the start of every temporary name this run makes."""
    return f"{prefix}{os.getpid()}-"


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # someone else's process: alive
        return False
    return False


def sweep_abandoned(folder: Path, prefix: str = TEMP_PREFIX) -> list[Path]:
    """Remove the temporary files and folders (`prefix<pid>-...`, ours by owner) that runs
    killed before they could clean up (SIGKILL, the out-of-memory killer) left in `folder`;
    a run that is still going keeps its own. A folder holding the backup of a destination
    (a run killed in the middle of `commit`) is left for the user. Returns what was removed."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        pid_text = entry.name[len(prefix):].partition("-")[0] \
            if entry.name.startswith(prefix) else ""
        if not pid_text.isdigit() or int(pid_text) == os.getpid() \
                or not _process_gone(int(pid_text)):
            continue
        path = Path(entry.path)
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            if entry.is_dir(follow_symlinks=False):
                if any(child.name.startswith(".old-") and any(child.iterdir())
                       for child in path.iterdir() if child.is_dir()):
                    continue
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed


#: Prefix of the run's scratch folders in the system's temp folder.
SCRATCH_PREFIX = "amp-rewriter-"


def scratch_dir(kind: str, parent: Path | None = None) -> tempfile.TemporaryDirectory[str]:
    """A temporary folder for this run's intermediate files (removed by its context manager),
    in `parent` (hidden) or the system's temp folder; abandoned ones are swept first."""
    if parent is None:
        folder, prefix = Path(tempfile.gettempdir()), SCRATCH_PREFIX
    else:
        folder, prefix = parent, TEMP_PREFIX
    sweep_abandoned(folder, prefix)
    return tempfile.TemporaryDirectory(dir=folder, prefix=f"{owned_prefix(prefix)}{kind}-")


def write_atomically(path: str | os.PathLike, data: bytes | Iterable[str]) -> None:
    """Write `data` to `path` so that a failure never leaves a partial file behind. `data`:
    bytes, or text as UTF-8 in pieces (a report made as it is written, never whole in memory)."""
    target = Path(path)
    check_output_path(target)
    parent = Path(os.path.realpath(target)).parent
    sweep_abandoned(parent)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=owned_prefix())
    try:
        with os.fdopen(fd, "wb") as handle:
            if isinstance(data, bytes):
                handle.write(data)
            else:
                _write_pieces(handle, data)
        os.chmod(tmp, default_file_mode())  # mkstemp makes it 0600
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


#: Text pieces joined per write of `_write_pieces` (a JSON encoder yields one per token).
_PIECES_PER_WRITE = 1 << 16


def _write_pieces(handle: BinaryIO, pieces: Iterable[str]) -> None:
    batch: list[str] = []
    for piece in pieces:
        batch.append(piece)
        if len(batch) >= _PIECES_PER_WRITE:
            handle.write("".join(batch).encode())
            batch.clear()
    handle.write("".join(batch).encode())


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


def open_input(path: str | os.PathLike, label: str) -> tuple[int, int]:
    """(descriptor, size) of a regular input file opened for reading (the caller closes it);
    anything else raises AmpError naming `label`."""
    return _open_regular(Path(path), label, "expected a file")


def pread_exact(fd: int, count: int, offset: int, label: str) -> bytes:
    """`count` bytes of an open file from `offset`; AmpError when the file ends before."""
    parts = []
    while count > 0:
        try:
            part = os.pread(fd, min(count, _CHUNK << 2), offset)
        except OSError as exc:
            raise AmpError(f"{label}: cannot read ({exc.strerror})") from None
        if not part:
            raise AmpError(f"{label}: ends before offset {offset + count} (was it changed "
                           f"during the run?)")
        parts.append(part)
        count -= len(part)
        offset += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


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


def default_file_mode() -> int:
    """The mode a plain new file gets under the current umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _resolved_entry(path: Path) -> tuple[str, str]:
    """(entry, target) of a destination: the directory entry a move into place replaces (its
    folder resolved, its own name kept) and where that entry leads now (the same path unless it
    is a symbolic link)."""
    entry = os.path.join(os.path.realpath(path.parent), path.name)
    return entry, os.path.realpath(entry) if os.path.islink(entry) else entry


def _inode(path: str | Path) -> tuple[int, int] | None:
    """(device, inode) of the file a path leads to; None when it leads nowhere."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    return info.st_dev, info.st_ino


def _ancestors(resolved: str) -> Iterator[str]:
    """The folders above a resolved path, nearest first."""
    parent = os.path.dirname(resolved)
    while parent and parent != resolved:
        yield parent
        resolved, parent = parent, os.path.dirname(parent)


class _PathIndex:
    """Paths found by identity in constant time, by resolved path and (for files that exist) by
    inode, so that checking n outputs against m inputs and against each other costs n + m
    lookups rather than n x m comparisons (a per-tensor layout writes thousands of files)."""

    def __init__(self) -> None:
        self.by_path: dict[str, str] = {}
        self.by_inode: dict[tuple[int, int], str] = {}
        #: Resolved folders (an input SavedModel, a folder of --inputs).
        self.folders: dict[str, str] = {}

    def add(self, path: Path, what: str) -> None:
        try:
            resolved = os.path.realpath(path)
        except ValueError:  # a NUL in the path (the API): nothing there to overwrite
            return
        self.by_path.setdefault(resolved, what)
        inode = _inode(resolved)
        if inode is not None:
            self.by_inode.setdefault(inode, what)
        if os.path.isdir(resolved):
            self.folders.setdefault(resolved, what)

    def same(self, *resolved: str, inode: tuple[int, int] | None = None) -> str | None:
        """What one of these resolved paths (or this inode) is, if it is in the index."""
        if inode is not None and inode in self.by_inode:
            return self.by_inode[inode]
        return next((self.by_path[path] for path in resolved if path in self.by_path), None)

    def folder_holding(self, *resolved: str) -> str | None:
        """The folder of the index that one of these resolved paths lies in, if any."""
        for path in resolved:
            for folder in _ancestors(path):
                if folder in self.folders:
                    return self.folders[folder]
        return None

    def under(self, folder: str) -> str | None:
        """A path of the index inside the resolved `folder` (a directory that would be
        replaced), if any."""
        prefix = folder.rstrip(os.sep) + os.sep
        return next((what for path, what in self.by_path.items() if path.startswith(prefix)),
                    None)


def _kind_of(path: Path) -> str | None:
    """"file", "dir", "other" (device, FIFO, socket), "link" (a dangling symbolic link) or None
    (missing) where `path` leads."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "link" if os.path.islink(path) else None
    except OSError as exc:
        raise AmpError(f"{path}: cannot inspect it ({exc.strerror})") from None
    return _mode_kind(mode)


def _mode_kind(mode: int) -> str:
    """"file", "dir" or "other" for a file mode."""
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    return "other"


@dataclass(frozen=True)
class Companions:
    """The files a writer may put beside its destination (an ONNX model's external data), named
    when the destination is staged so that they are checked before anything is written."""

    #: Matches (in full) the name of each such file in the destination's folder.
    pattern: re.Pattern[str]
    #: What they are, for messages ("external data").
    what: str


class _Stage:
    """One destination and the private folder beside it where its files are written first."""

    __slots__ = ("destination", "folder", "label", "entry", "companions")

    def __init__(self, destination: Path, folder: Path, label: str, entry: str,
                 companions: Companions | None):
        self.destination = destination
        self.folder = folder
        self.label = label
        #: The resolved directory entry the destination replaces (see `_resolved_entry`).
        self.entry = entry
        self.companions = companions

    def claims(self, path: str) -> str | None:
        """What of this stage's output a resolved path is (see `_claim`), in words."""
        how = _claim(self.entry, self.companions, path)
        if how == "same":
            return f"the {self.label} {self.destination}"
        if how == "companion":
            assert self.companions is not None
            return (f"the {self.label} {self.destination}'s {self.companions.what} "
                    f"({os.path.basename(path)})")
        if how == "inside":
            return f"something inside the {self.label} {self.destination}"
        return None


def _claim(entry: str, companions: Companions | None, path: str) -> str | None:
    """How the resolved `path` belongs to the output at the resolved `entry`: "same",
    "companion" (a file `companions` names beside it), "inside" (a directory output holds it),
    or None."""
    if path == entry:
        return "same"
    folder, name = os.path.split(path)
    if companions is not None and folder == os.path.dirname(entry) \
            and companions.pattern.fullmatch(name):
        return "companion"
    if path.startswith(entry.rstrip(os.sep) + os.sep):
        return "inside"
    return None


class OutputTransaction:
    """Every output of one run, written all together or not at all.

        with OutputTransaction([(model_path, "the input model")]) as outputs:
            staged = outputs.stage("out.onnx", "output", companions=...)
            write_model(staged)                 # and staged.name + ".data" beside it
            outputs.commit()                    # only now do out.onnx (and its .data) change

    `stage` checks a destination at once and returns a path in a fresh private folder beside
    it; whatever the writer puts in that folder (a model and its `.data`, a SavedModel
    directory) replaces the entries of the same names beside the destination at `commit`.
    Leaving the `with` block without committing (an error, a failed validation, Ctrl-C) removes
    the private folders, so no destination changes.

    The one rule for every path a run writes, checked when it is staged (before anything is
    written) and again for every entry at `commit`: a destination, or a file its `companions`
    name, is refused when its folder is missing; when it names a folder but a file is
    written (`out.onnx/`); when it is a device, FIFO or socket; when it is, leads to (hard or
    symbolic link) or holds a file the run reads, or lies inside an input folder (a
    SavedModel, a folder of --inputs); and when it is, holds, lies inside or is a companion of
    another output of the run. `inputs` lists what the run reads; `more_inputs` (called only
    when a destination or a companion already exists, since only an existing file can be
    overwritten) adds what costs a parse to find, such as external data. Every check is a
    lookup by resolved path or inode, so a run writing thousands of files checks in linear
    time.
    """

    def __init__(self, inputs: InputFiles = (),
                 more_inputs: Callable[[], InputFiles] | None = None):
        self._inputs = _PathIndex()
        for path, what in inputs:
            self._inputs.add(Path(path), what)
        self._more_inputs = more_inputs
        self._stages: list[_Stage] = []
        self._done = False

    # -- checks ---------------------------------------------------------------------------------
    def _all_inputs(self) -> _PathIndex:
        """The inputs, with those `more_inputs` finds (looked for once, when first needed)."""
        if self._more_inputs is not None:
            more = self._more_inputs
            self._more_inputs = None
            for path, what in more():
                self._inputs.add(Path(path), what)
        return self._inputs

    @staticmethod
    def _check_name(raw: str, label: str, kind: str) -> None:
        """A destination must name an entry of its own: a file destination `out.onnx/` or
        `out/.` names a folder (Path would quietly drop the slash and write `out.onnx`), and
        `.`, `..` or `/` name no entry a directory output could replace."""
        if "\0" in raw:
            raise AmpError(f"{label} {raw!r}: a path cannot hold a NUL byte")
        if kind == "file":
            if raw.endswith(("/", os.sep)) or os.path.basename(raw) in ("", ".", ".."):
                raise AmpError(f"{label} {raw}: names a folder, expected an output file name")
        elif os.path.basename(raw.rstrip("/" + os.sep)) in ("", ".", ".."):
            raise AmpError(f"{label} {raw}: names no folder of its own; give the output "
                           f"directory's name")

    def _check_place(self, destination: Path, label: str, kind: str,
                     replace_dir: Callable[[Path], bool] | None) -> str | None:
        """Refuse a destination whose folder is missing or that cannot be replaced by an entry
        of `kind`; returns what is there now (see `_kind_of`)."""
        parent = destination.parent
        if not parent.is_dir():
            raise AmpError(f"{destination}: output folder {parent} does not exist")
        found = _kind_of(destination)
        self._check_kind(destination, label, found, kind, replace_dir)
        return found

    @staticmethod
    def _check_kind(destination: Path, label: str, found: str | None, kind: str,
                    replace_dir: Callable[[Path], bool] | None) -> None:
        """Refuse to replace `found` (what `_kind_of` says is at `destination`) by an entry of
        `kind`: a device, FIFO or socket, a directory by a file or the other way round, a
        non-empty directory that `replace_dir` does not accept."""
        if found == "other":
            raise AmpError(f"{label} {destination} is not a regular file (a device, FIFO or "
                           f"socket): refusing to replace it")
        if found == "dir" and kind == "file":
            raise AmpError(f"{label} {destination}: is a directory, expected an output file "
                           f"name")
        if found == "file" and kind == "dir":
            raise AmpError(f"{label} {destination}: exists and is a file, expected a directory")
        if found == "dir" and kind == "dir" and any(destination.iterdir()) and not (
                replace_dir is not None and replace_dir(destination)):
            raise AmpError(f"{label} {destination}: exists and is neither empty nor a model "
                           f"directory; refusing to replace it")
        if found == "dir" and kind == "dir":
            here, target = os.path.realpath(os.getcwd()), os.path.realpath(destination)
            if here == target or here.startswith(target.rstrip(os.sep) + os.sep):
                raise AmpError(f"{label} {destination}: is (or holds) the current folder; "
                               f"refusing to replace it")

    def _check_against_inputs(self, destination: Path, label: str, entry: str, target: str,
                              found: str | None, kind: str) -> None:
        """Refuse a destination that is, leads to, holds or lies inside a file the run reads."""
        inputs = self._all_inputs() if found is not None else self._inputs
        what = inputs.same(entry, target, inode=_inode(target) if found is not None else None)
        if what is not None:
            raise AmpError(f"{label} {destination} is {what}: refusing to overwrite it")
        what = inputs.folder_holding(entry, target)
        if what is not None:
            raise AmpError(f"{label} {destination} is inside {what}: refusing to write into it")
        if kind == "dir" and found is not None:
            what = inputs.under(target)
            if what is not None:
                raise AmpError(f"{label} {destination} holds {what}: refusing to replace it")

    def _check_against_outputs(self, destination: Path, label: str, entry: str, target: str,
                               companions: Companions | None) -> None:
        """Refuse a destination that another staged output is, holds, lies inside or writes
        beside itself, in either direction."""
        for stage in self._stages:
            claim = stage.claims(entry) or stage.claims(target)
            if claim is None and _claim(entry, companions, stage.entry) is not None:
                claim = f"the {stage.label} {stage.destination}"  # it lies in, or beside, ours
            if claim is not None:
                raise AmpError(f"{label} {destination} is also written as {claim}: give each "
                               f"output its own path")

    def _check_companions(self, destination: Path, label: str, entry: str,
                          companions: Companions) -> None:
        """Refuse a destination whose companions, where they exist already, are files the run
        reads (converting to `out.onnx` beside an input whose data is `out.onnx.data`)."""
        folder = os.path.dirname(entry)
        try:
            names = [e.name for e in os.scandir(folder) if companions.pattern.fullmatch(e.name)]
        except OSError:
            return
        for name in names:
            path = destination.parent / name
            what = f"{label} {destination}'s {companions.what}"
            found = _kind_of(path)
            self._check_kind(path, what, found, "file", None)  # a folder, a FIFO there
            self._check_against_inputs(path, what, *_resolved_entry(path), found, "file")

    # -- staging and committing ---------------------------------------------------------------
    def stage(self, destination: str | os.PathLike, label: str = "output", kind: str = "file",
              replace_dir: Callable[[Path], bool] | None = None,
              companions: Companions | None = None) -> Path:
        """A path to write `destination`'s content to (see the class docstring). `kind` is
        "file" or "dir"; `replace_dir` says whether an existing non-empty folder may go;
        `companions` names the files the writer may put beside it."""
        if self._done:
            raise RuntimeError("the transaction is over")
        self._check_name(os.fspath(destination), label, kind)
        destination = Path(destination)
        found = self._check_place(destination, label, kind, replace_dir)
        entry, target = _resolved_entry(destination)
        self._check_against_inputs(destination, label, entry, target, found, kind)
        self._check_against_outputs(destination, label, entry, target, companions)
        if companions is not None:
            self._check_companions(destination, label, entry, companions)
        sweep_abandoned(destination.parent)
        try:  # absolute: a commit must not depend on the current folder
            folder = Path(os.path.abspath(tempfile.mkdtemp(dir=destination.parent,
                                                           prefix=owned_prefix())))
        except OSError as exc:
            raise AmpError(f"{destination}: cannot write in {destination.parent} "
                           f"({exc.strerror})") from None
        self._stages.append(_Stage(destination, folder, label, entry, companions))
        return folder / destination.name

    def commit(self) -> None:
        """Move every staged entry into place; if one move fails, undo the others. Each entry
        is checked first, each with one `lstat` and lookups: linear in their number."""
        if self._done:
            raise RuntimeError("the transaction is over")
        # (staged, destination, backup folder, whether something is there to back up)
        moves: list[tuple[str, str, str, bool]] = []
        placed: dict[str, str] = {}  # resolved entry -> what is moved there
        directories = [stage for stage in self._stages if stage.companions is None
                       and os.path.isdir(stage.folder / stage.destination.name)]
        for stage in self._stages:
            with os.scandir(stage.folder) as listing:
                entries = sorted((e.name, e.is_dir(follow_symlinks=False)) for e in listing)
            # Created after listing, so its random name cannot be one of the entries.
            backups = tempfile.mkdtemp(dir=stage.folder, prefix=".old-")
            # Strings, not Paths: a per-tensor layout has thousands of entries.
            staged_in, folder = os.fspath(stage.folder), os.path.dirname(stage.entry)
            for name, is_dir in entries:
                # Moved by its resolved, absolute entry: the same place, whatever moves.
                destination = entry = os.path.join(folder, name)
                kind = "dir" if is_dir else "file"
                companion = name != stage.destination.name
                what = f"{stage.label}'s {name}" if companion else stage.label
                if entry in placed:
                    raise AmpError(f"{what} {destination} is also written as {placed[entry]}: "
                                   f"give each output its own path")
                placed[entry] = f"{what} {destination}"
                if companion:  # checked again, each
                    there = self._check_companion(destination, what, entry, kind, directories)
                else:
                    there = os.path.lexists(destination)
                    if there:  # what may have appeared since `stage`
                        self._check_place(stage.destination, what, kind, lambda _: True)
                moves.append((os.path.join(staged_in, name), destination, backups, there))
        done: list[tuple[str, str | None]] = []
        try:
            for source, destination, backups, there in moves:
                backup = None
                if there:
                    backup = os.path.join(backups, os.path.basename(destination))
                    os.replace(destination, backup)
                done.append((destination, backup))
                os.replace(source, destination)
        except BaseException as exc:
            self._undo(done)
            self.rollback()
            if isinstance(exc, OSError):
                raise AmpError(f"cannot move the output into place ({exc.strerror}): nothing "
                               f"was changed") from None
            raise
        self._done = True
        self._remove_stages()

    def _check_companion(self, destination: str, what: str, entry: str, kind: str,
                         directories: list[_Stage]) -> bool:
        """A file a writer put beside its destination, at commit: what is there may be
        replaced, it is no input and lies in no directory output. Its folder is its
        destination's, checked at `stage`; one `lstat` says what is there (a link, rare, is
        followed). Returns whether something is there now."""
        try:
            info = os.lstat(destination)
        except FileNotFoundError:
            info = None
        except OSError as exc:
            raise AmpError(f"{destination}: cannot inspect it ({exc.strerror})") from None
        if info is None:
            found, target, inode = None, entry, None
        elif stat.S_ISLNK(info.st_mode):
            found, target = _kind_of(Path(destination)), os.path.realpath(entry)
            inode = _inode(target)
        else:
            found, target = _mode_kind(info.st_mode), entry
            inode = (info.st_dev, info.st_ino)
        self._check_kind(Path(destination), what, found, kind, None)
        inputs = self._all_inputs() if found is not None else self._inputs
        what_input = inputs.same(entry, target, inode=inode)
        if what_input is not None:
            raise AmpError(f"{what} {destination} is {what_input}: refusing to overwrite it")
        if target != entry:
            self._check_against_inputs(Path(destination), what, entry, target, found, kind)
        for stage in directories:
            if _claim(stage.entry, None, target) in ("same", "inside"):
                raise AmpError(f"{what} {destination} is also written as "
                               f"{stage.claims(target)}: give each output its own path")
        return info is not None

    @staticmethod
    def _undo(done: list[tuple[str, str | None]]) -> None:
        """Put back what a failed commit moved: new entries out, old ones back in."""
        for destination, backup in reversed(done):
            if backup is None or os.path.lexists(backup):
                _remove(destination)
            if backup is not None and os.path.lexists(backup):
                os.replace(backup, destination)

    def rollback(self) -> None:
        """Remove every staged entry; the destinations stay as they were."""
        self._done = True
        self._remove_stages()

    def _remove_stages(self) -> None:
        for stage in self._stages:
            shutil.rmtree(stage.folder, ignore_errors=True)

    def __enter__(self) -> OutputTransaction:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._done:
            self.rollback()


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)
