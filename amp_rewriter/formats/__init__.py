"""Model formats, one package each (`onnx`, `tf`), behind the `Format` contract in `base`.

Detecting a file's format imports neither onnx nor tensorflow; `get` imports only the format
asked for.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..op_lists import FormatDeclaration, format_declarations

if TYPE_CHECKING:
    from .base import Format


@functools.cache
def declarations() -> dict[str, FormatDeclaration]:
    """Format name -> how its models are recognised, from each list file's `[format]` table
    (amp_rewriter/op_lists/<name>.toml): a new format is its package and its list file."""
    return format_declarations()


def directory_format(path: str | os.PathLike) -> str | None:
    """The format of a directory that is one model (a SavedModel), decided without importing
    any format's library, or None. Any entry with a declared name counts, so that one that is
    not a regular file is refused by name."""
    p = Path(path)
    if not p.is_dir():
        return None
    return next((name for name, declared in declarations().items()
                 if any(os.path.lexists(p / f) for f in declared.directory_files)), None)


def model_format(path: str | os.PathLike) -> str | None:
    """The format name of a path that is a model by its name (a known suffix, a SavedModel
    directory), or None (a report, say)."""
    p = Path(path)
    if p.is_dir():
        return directory_format(p)
    return next((name for name, declared in declarations().items()
                 if p.suffix in declared.suffixes), None)


def detect(path: str | os.PathLike) -> str:
    """The format name of a model file or SavedModel directory (ONNX unless it looks like TF)."""
    return model_format(path) or "onnx"


def model_path(argument: str | os.PathLike) -> Path:
    """The model a path argument names: a SavedModel's saved_model.pb stands for its folder
    (what a pre-commit hook passes when a SavedModel changes)."""
    path = Path(argument)
    folder = directory_format(path.parent)
    if folder is not None and path.name in declarations()[folder].directory_files:
        return path.parent
    return path


def get(name: str) -> Format:
    """The format object of `name`, importing its package (and its library) on first use."""
    return importlib.import_module(declarations()[name].package).FORMAT


def for_path(path: str | os.PathLike) -> Format:
    """The format object for a model path."""
    return get(detect(path))


def for_model(model: object) -> Format:
    """The format of an in-memory model (each format whose library is loaded is asked)."""
    for name, declared in declarations().items():
        if declared.library in sys.modules and get(name).accepts(model):
            return get(name)
    raise TypeError(f"expected an onnx.ModelProto, a TensorFlow GraphDef or a path, got "
                    f"{type(model).__name__}")


def for_model_or_path(model_or_path: object) -> Format:
    """The format of a model given as a path or in memory."""
    if isinstance(model_or_path, (str, os.PathLike)):
        return for_path(model_or_path)
    return for_model(model_or_path)
