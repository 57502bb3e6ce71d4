"""Reading and writing TensorFlow files: GraphDefs (.pb, .pbtxt), MetaGraphDefs (.meta) and
SavedModel directories. Writes are atomic; bad files raise AmpError with one line."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from google.protobuf import message, text_format
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

from ...errors import AmpError
from ...fileio import read_input_bytes, write_atomically
from .. import is_saved_model_dir

__all__ = ["is_saved_model_dir", "read_graphdef", "read_meta_graph", "read_saved_model",
           "write_graphdef", "write_saved_model"]


def read_graphdef(path: str | os.PathLike) -> graph_pb2.GraphDef:
    """Parse a binary (.pb) or text (.pbtxt) GraphDef; anything else raises AmpError."""
    path = Path(path)
    data = read_input_bytes(path, "without saved_model.pb, expected a GraphDef (.pb/.pbtxt) or "
                                  "a SavedModel directory")
    graph_def = graph_pb2.GraphDef()
    if path.suffix in (".pbtxt", ".txt"):
        try:
            text_format.Parse(data.decode("utf-8"), graph_def)
        except (text_format.ParseError, UnicodeDecodeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise AmpError(f"{path}: not a text GraphDef ({first})") from None
    else:
        try:
            graph_def.ParseFromString(data)
        except (message.DecodeError, RuntimeError, ValueError):
            raise AmpError(f"{path}: not a GraphDef (the protobuf does not parse; truncated or "
                           f"another format?)") from None
    if not graph_def.node:
        raise AmpError(f"{path}: not a GraphDef (no nodes)")
    for node in graph_def.node:
        if not node.name or not node.op:
            raise AmpError(f"{path}: not a GraphDef (a node without a name or op)")
    return graph_def


def read_meta_graph(path: str | os.PathLike) -> meta_graph_pb2.MetaGraphDef:
    """Parse a binary MetaGraphDef (.meta); bad files raise AmpError."""
    path = Path(path)
    if not path.is_file():
        raise AmpError(f"{path}: no such file")
    meta = meta_graph_pb2.MetaGraphDef()
    try:
        meta.ParseFromString(path.read_bytes())
    except (message.DecodeError, RuntimeError):
        raise AmpError(f"{path}: not a MetaGraphDef (the protobuf does not parse; truncated or "
                       f"another format?)") from None
    if not meta.graph_def.node:
        raise AmpError(f"{path}: not a MetaGraphDef (no graph)")
    return meta


def read_saved_model(path: str | os.PathLike) -> saved_model_pb2.SavedModel:
    """Parse a SavedModel directory's saved_model.pb(txt); refused without its variables."""
    path = Path(path)
    binary, text = path / "saved_model.pb", path / "saved_model.pbtxt"
    saved = saved_model_pb2.SavedModel()
    try:
        if binary.is_file():
            saved.ParseFromString(binary.read_bytes())
        elif text.is_file():
            text_format.Parse(text.read_text(), saved)
        else:
            raise AmpError(f"{path}: not a SavedModel directory (no saved_model.pb)")
    except (message.DecodeError, text_format.ParseError, UnicodeDecodeError, RuntimeError):
        raise AmpError(f"{path}: saved_model.pb does not parse (truncated or another "
                       f"format?)") from None
    if not saved.meta_graphs:
        raise AmpError(f"{path}: the SavedModel has no MetaGraph")
    has_variables = any(meta.saver_def.filename_tensor_name
                        or any(node.HasField("variable") for node in meta.object_graph_def.nodes)
                        for meta in saved.meta_graphs)
    if has_variables and not (path / "variables" / "variables.index").is_file():
        raise AmpError(f"{path}: the SavedModel has variables but variables/variables.index is "
                       f"missing")
    return saved


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
    """Copy the SavedModel directory with the new saved_model.pb, then swap it into place.

    `write_variables(staged_dir)` rewrites the copied checkpoint (low-precision weights)."""
    if output_dir.resolve() == input_dir.resolve():
        raise AmpError("the output directory is the input SavedModel: refusing to overwrite it")
    if output_dir.exists() and (not output_dir.is_dir() or (
            any(output_dir.iterdir()) and not (output_dir / "saved_model.pb").exists())):
        raise AmpError(f"{output_dir}: exists and is not a SavedModel directory; refusing to "
                       f"replace it")
    parent = output_dir.resolve().parent
    if not parent.is_dir():
        raise AmpError(f"{output_dir}: output folder {parent} does not exist")
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=".amp-rewriter-"))
    try:
        staged = tmp / "model"
        shutil.copytree(input_dir, staged)
        (staged / "saved_model.pbtxt").unlink(missing_ok=True)
        (staged / "saved_model.pb").write_bytes(saved.SerializeToString(deterministic=True))
        if write_variables is not None:
            write_variables(staged)
        fingerprint = staged / "fingerprint.pb"
        if fingerprint.exists():
            fingerprint.unlink()
            _write_fingerprint(staged)
        if output_dir.exists():
            shutil.rmtree(output_dir)
        os.replace(staged, output_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_fingerprint(export_dir: Path) -> None:
    """A fresh fingerprint.pb for the new saved_model.pb (skipped if TF cannot make one)."""
    try:
        from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting
        data = fingerprinting.CreateFingerprintDef(str(export_dir))
    except Exception:  # fingerprints are optional metadata
        return
    (export_dir / "fingerprint.pb").write_bytes(data)
