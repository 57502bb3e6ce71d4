"""Reading and writing TensorFlow files: GraphDefs (.pb, .pbtxt), MetaGraphDefs (.meta) and
SavedModel directories. Writers write in place, into the private folder of an
`OutputTransaction`; bad files raise AmpError with one line."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from google.protobuf import message, text_format
from tensorflow.core.framework import attr_value_pb2, function_pb2, graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

from ...errors import AmpError, first_line
from ...fileio import copy_regular_file, non_regular_kind, read_input_bytes, write_atomically
from .. import directory_format

__all__ = ["check_function_library", "check_saved_model_tree", "is_saved_model_dir",
           "read_graphdef", "read_meta_graph", "read_saved_model", "write_graphdef",
           "write_saved_model"]


def is_saved_model_dir(path: str | os.PathLike) -> bool:
    """A directory holding a SavedModel (by the files tf.toml's [format] table names)."""
    return directory_format(path) == "tf"


def _parse_text(text: str, proto: message.Message, label: str, what: str) -> None:
    """Parse a text-format proto; a syntax error or absurd nesting raises AmpError."""
    try:
        text_format.Parse(text, proto)
    except (text_format.ParseError, UnicodeDecodeError) as exc:
        raise AmpError(f"{label}: not a text {what} ({first_line(exc)})") from None
    except RecursionError:
        raise AmpError(f"{label}: not a text {what} (nested too deeply)") from None


def _parse_binary(data: bytes, proto: message.Message, label: str, what: str) -> None:
    try:
        proto.ParseFromString(data)
    except (message.DecodeError, RuntimeError, ValueError, RecursionError):
        raise AmpError(f"{label}: not a {what} (the protobuf does not parse; truncated or "
                       f"another format?)") from None


def read_graphdef(path: str | os.PathLike) -> graph_pb2.GraphDef:
    """Parse a binary (.pb) or text (.pbtxt) GraphDef; anything else raises AmpError."""
    path = Path(path)
    data = read_input_bytes(path, "without saved_model.pb, expected a GraphDef (.pb/.pbtxt) or "
                                  "a SavedModel directory")
    graph_def = graph_pb2.GraphDef()
    if path.suffix in (".pbtxt", ".txt"):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise AmpError(f"{path}: not a text GraphDef (not UTF-8 text)") from None
        _parse_text(text, graph_def, str(path), "GraphDef")
    else:
        _parse_binary(data, graph_def, str(path), "GraphDef")
    if not graph_def.node:
        raise AmpError(f"{path}: not a GraphDef (no nodes)")
    for node in graph_def.node:
        if not node.name or not node.op:
            raise AmpError(f"{path}: not a GraphDef (a node without a name or op)")
    check_function_library(graph_def.library, str(path))
    return graph_def


def read_meta_graph(path: str | os.PathLike) -> meta_graph_pb2.MetaGraphDef:
    """Parse a binary MetaGraphDef (.meta); bad files raise AmpError."""
    path = Path(path)
    data = read_input_bytes(path, "expected a MetaGraphDef (.meta) file")
    meta = meta_graph_pb2.MetaGraphDef()
    _parse_binary(data, meta, str(path), "MetaGraphDef")
    if not meta.graph_def.node:
        raise AmpError(f"{path}: not a MetaGraphDef (no graph)")
    check_function_library(meta.graph_def.library, str(path))
    return meta


def read_saved_model(path: str | os.PathLike) -> saved_model_pb2.SavedModel:
    """Parse a SavedModel directory's saved_model.pb(txt); refused without its variables, with
    a file that is not regular, or with a symlink that leaves the directory."""
    path = Path(path)
    check_saved_model_tree(path)
    binary, text = path / "saved_model.pb", path / "saved_model.pbtxt"
    saved = saved_model_pb2.SavedModel()
    label = f"{path}: saved_model.pb"
    if os.path.lexists(binary):
        _parse_binary(read_input_bytes(binary, "expected a file"), saved, label,
                      "SavedModel")
    elif os.path.lexists(text):
        try:
            content = read_input_bytes(text, "expected a file").decode("utf-8")
        except UnicodeDecodeError:
            raise AmpError(f"{path}: saved_model.pbtxt is not UTF-8 text") from None
        _parse_text(content, saved, f"{path}: saved_model.pbtxt", "SavedModel")
    else:
        raise AmpError(f"{path}: not a SavedModel directory (no saved_model.pb)")
    if not saved.meta_graphs:
        raise AmpError(f"{path}: the SavedModel has no MetaGraph")
    for index, meta in enumerate(saved.meta_graphs):
        check_function_library(meta.graph_def.library, f"{path} (MetaGraph {index})")
    has_variables = any(meta.saver_def.filename_tensor_name
                        or any(node.HasField("variable") for node in meta.object_graph_def.nodes)
                        for meta in saved.meta_graphs)
    if has_variables and not (path / "variables" / "variables.index").is_file():
        raise AmpError(f"{path}: the SavedModel has variables but variables/variables.index is "
                       f"missing")
    return saved


def check_saved_model_tree(path: Path) -> None:
    """Refuse a SavedModel directory holding anything but regular files, folders and symlinks
    to regular files inside it: a FIFO or device (or a link to one, such as variables data
    linked to /dev/zero) would block or never end when TensorFlow or the copy reads it, and a
    link out of the directory would carry a file from elsewhere into the output."""
    root = path.resolve()
    for folder, dirs, names in os.walk(path):
        for name in dirs + names:
            entry = Path(folder) / name
            shown = entry.relative_to(path)
            try:
                info = entry.lstat()
            except OSError as exc:
                raise AmpError(f"{path}: cannot read {shown} ({exc.strerror})") from None
            if stat.S_ISLNK(info.st_mode):
                try:
                    target = entry.resolve()
                except (OSError, RuntimeError):  # a symlink loop (RuntimeError before 3.13)
                    raise AmpError(f"{path}: {shown} is a symlink that cannot be resolved (a "
                                   f"loop?)") from None
                if not target.is_relative_to(root):
                    raise AmpError(f"{path}: {shown} is a symlink that leaves the SavedModel "
                                   f"directory ({target}); refusing to read it")
                try:
                    mode = target.stat().st_mode
                except OSError:
                    raise AmpError(f"{path}: {shown} is a broken symlink") from None
                if not stat.S_ISREG(mode):
                    kind = non_regular_kind(mode) or "a directory"
                    raise AmpError(f"{path}: {shown} is a symlink to {kind}; only regular files "
                                   f"may be linked")
            elif not stat.S_ISREG(info.st_mode) and not stat.S_ISDIR(info.st_mode):
                raise AmpError(f"{path}: {shown} is {non_regular_kind(info.st_mode)}, not a "
                               f"regular file")


def _called_functions(fdef: function_pb2.FunctionDef, names: set[str]) -> set[str]:
    """The library functions a function's body calls: as an op, or through a `func` attribute
    (PartitionedCall's `f`, While's `body`, ...), at any depth of nested attributes."""
    called: set[str] = set()
    stack: list[attr_value_pb2.AttrValue] = []
    for node in fdef.node_def:
        if node.op in names:
            called.add(node.op)
        stack.extend(node.attr.values())
    while stack:
        value = stack.pop()
        funcs = [value.func] if value.HasField("func") else list(value.list.func)
        for func in funcs:
            if func.name in names:
                called.add(func.name)
            stack.extend(func.attr.values())
    return called


def check_function_library(library: function_pb2.FunctionDefLibrary, label: str) -> None:
    """Refuse a function library in which a function calls itself, directly or through others.

    TensorFlow does not support recursion, and its graph importer recurses until the process
    dies (SIGSEGV) on such a library, so this runs before anything hands the graph to TF.
    """
    names = {fdef.signature.name for fdef in library.function}
    if not names:
        return
    calls = {fdef.signature.name: _called_functions(fdef, names) for fdef in library.function}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(calls):
        if state.get(start):
            continue
        path = [start]
        pending = [iter(sorted(calls[start]))]
        state[start] = 1
        while pending:
            callee = next(pending[-1], None)
            if callee is None:
                state[path.pop()] = 2
                pending.pop()
                continue
            if state.get(callee) == 1:
                cycle = path[path.index(callee):] + [callee]
                raise AmpError(f"{label}: function {callee!r} calls itself "
                               f"({' -> '.join(cycle)}); TensorFlow functions cannot recurse")
            if not state.get(callee):
                state[callee] = 1
                path.append(callee)
                pending.append(iter(sorted(calls[callee])))


def write_graphdef(graph_def: graph_pb2.GraphDef | meta_graph_pb2.MetaGraphDef,
                   path: str | os.PathLike) -> None:
    """Write a GraphDef (or MetaGraphDef) atomically; text format for .pbtxt, binary otherwise."""
    path = Path(path)
    if path.suffix in (".pbtxt", ".txt"):
        data = text_format.MessageToString(graph_def).encode()
    else:
        data = graph_def.SerializeToString(deterministic=True)
    write_atomically(path, data)


def write_saved_model(saved: saved_model_pb2.SavedModel, input_dir: Path, output_dir: Path,
                      write_variables: Callable[[Path], None] | None = None) -> None:
    """Write the SavedModel directory at `output_dir` (a fresh path: callers give the private
    path of an `OutputTransaction`): the input's files with the new saved_model.pb and a
    fingerprint.pb made for it. `write_variables(output_dir)` rewrites the copied checkpoint
    (low-precision weights)."""
    check_saved_model_tree(input_dir)
    shutil.copytree(input_dir, output_dir, copy_function=copy_regular_file)
    (output_dir / "saved_model.pbtxt").unlink(missing_ok=True)
    (output_dir / "saved_model.pb").write_bytes(saved.SerializeToString(deterministic=True))
    if write_variables is not None:
        write_variables(output_dir)
    fingerprint = output_dir / "fingerprint.pb"
    if fingerprint.exists():
        fingerprint.unlink()
        _write_fingerprint(output_dir)


def _write_fingerprint(export_dir: Path) -> None:
    """A fresh fingerprint.pb for the new saved_model.pb (skipped if TF cannot make one).

    TensorFlow fills the fingerprint's `uuid` at random; it is derived from the hash of
    saved_model.pb instead, in TF's own format (a decimal 128-bit number), so converting the
    same SavedModel twice gives the same bytes and different models still get different uuids.
    """
    try:
        from tensorflow.core.protobuf import fingerprint_pb2
        from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting
        data = fingerprinting.CreateFingerprintDef(str(export_dir))
        fingerprint = fingerprint_pb2.FingerprintDef()
        fingerprint.ParseFromString(data)
    except Exception:  # fingerprints are optional metadata
        return
    if "uuid" in fingerprint.DESCRIPTOR.fields_by_name:
        digest = hashlib.sha256((export_dir / "saved_model.pb").read_bytes()).digest()
        fingerprint.uuid = str(int.from_bytes(digest[:16], "big"))
    (export_dir / "fingerprint.pb").write_bytes(fingerprint.SerializeToString(deterministic=True))
