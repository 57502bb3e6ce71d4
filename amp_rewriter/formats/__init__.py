"""Model formats, one package each (`onnx`, `tf`), behind the `Format` contract in `base`.

Detecting a file's format imports neither onnx nor tensorflow; `get` imports only the format
asked for.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Format

#: Format name -> its package.
PACKAGES = {"onnx": "amp_rewriter.formats.onnx", "tf": "amp_rewriter.formats.tf"}
#: Format name -> the library its in-memory models come from: a model object can only be of a
#: format whose library is imported already.
LIBRARIES = {"onnx": "onnx", "tf": "tensorflow"}
#: File suffixes of TensorFlow graphs (a SavedModel is a directory with saved_model.pb).
TF_SUFFIXES = (".pb", ".pbtxt", ".meta")
#: Format name -> the file suffixes of its models.
SUFFIXES = {"onnx": (".onnx",), "tf": TF_SUFFIXES}
#: The files that stand for a SavedModel directory (a pre-commit hook names them).
SAVED_MODEL_FILES = ("saved_model.pb", "saved_model.pbtxt")


def is_saved_model_dir(path: str | os.PathLike) -> bool:
    """A directory holding a SavedModel (decided without importing TensorFlow). Any entry named
    saved_model.pb(txt) counts, so that one that is not a regular file is refused by name."""
    p = Path(path)
    return p.is_dir() and any(os.path.lexists(p / name) for name in SAVED_MODEL_FILES)


def model_format(path: str | os.PathLike) -> str | None:
    """The format name of a path that is a model by its name (a known suffix, a SavedModel
    directory), or None (a report, say)."""
    p = Path(path)
    if is_saved_model_dir(p):
        return "tf"
    if p.is_dir():
        return None
    return next((name for name, suffixes in SUFFIXES.items() if p.suffix in suffixes), None)


def detect(path: str | os.PathLike) -> str:
    """The format name of a model file or SavedModel directory (ONNX unless it looks like TF)."""
    return model_format(path) or "onnx"


def model_path(argument: str | os.PathLike) -> Path:
    """The model a path argument names: a SavedModel's saved_model.pb stands for its folder
    (what a pre-commit hook passes when a SavedModel changes)."""
    path = Path(argument)
    if path.name in SAVED_MODEL_FILES and is_saved_model_dir(path.parent):
        return path.parent
    return path


def get(name: str) -> Format:
    """The format object of `name`, importing its package (and its library) on first use."""
    return importlib.import_module(PACKAGES[name]).FORMAT


def for_path(path: str | os.PathLike) -> Format:
    """The format object for a model path."""
    return get(detect(path))


def for_model(model: object) -> Format:
    """The format of an in-memory model (each format whose library is loaded is asked)."""
    for name, library in LIBRARIES.items():
        if library in sys.modules and get(name).accepts(model):
            return get(name)
    raise TypeError(f"expected an onnx.ModelProto, a TensorFlow GraphDef or a path, got "
                    f"{type(model).__name__}")


def for_model_or_path(model_or_path: object) -> Format:
    """The format of a model given as a path or in memory."""
    if isinstance(model_or_path, (str, os.PathLike)):
        return for_path(model_or_path)
    return for_model(model_or_path)
