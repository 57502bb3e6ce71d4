"""Model formats, one package each (`onnx`, `tf`), behind the `Format` contract in `base`.

Detecting a file's format imports neither onnx nor tensorflow; `get` imports only the format
asked for.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Format

#: Format name -> its package.
PACKAGES = {"onnx": "amp_rewriter.formats.onnx", "tf": "amp_rewriter.formats.tf"}
#: File suffixes of TensorFlow graphs (a SavedModel is a directory with saved_model.pb).
TF_SUFFIXES = (".pb", ".pbtxt", ".meta")


def is_saved_model_dir(path: str | os.PathLike) -> bool:
    """A directory holding a SavedModel (decided without importing TensorFlow). Any entry named
    saved_model.pb(txt) counts, so that one that is not a regular file is refused by name."""
    p = Path(path)
    return p.is_dir() and any(os.path.lexists(p / name)
                              for name in ("saved_model.pb", "saved_model.pbtxt"))


def detect(path: str | os.PathLike) -> str:
    """The format name of a model file or SavedModel directory (ONNX unless it looks like TF)."""
    p = Path(path)
    if is_saved_model_dir(p) or (not p.is_dir() and p.suffix in TF_SUFFIXES):
        return "tf"
    return "onnx"


def get(name: str) -> Format:
    """The format object of `name`, importing its package (and its library) on first use."""
    return importlib.import_module(PACKAGES[name]).FORMAT


def for_path(path: str | os.PathLike) -> Format:
    """The format object for a model path."""
    return get(detect(path))
