"""Calibration inputs for `convert --auto` and `diagnose`: where they come from, and checking
them against the model's inputs before anything runs.

A *batch* is one feed: input name -> array. Sources, each giving one or more batches:

- an ``.npz`` file (one batch, keyed by input name);
- a folder: every ``*.npz`` in it, in name order (one batch each);
- a Polygraphy JSON input file (``polygraphy run --save-inputs``): a list of feeds whose arrays
  are encoded as ``{"array": base64 of the .npy bytes, "polygraphy_class": "ndarray"}``;
- several of these (``--inputs a.npz b.npz dir/``), in the order given.

Batches are read one at a time, when the measurement gets to them, so memory holds one batch
(files are listed and checked up front; a Polygraphy file is parsed once, as a whole). When no
source is given, the format makes seeded random batches of the right shapes and dtypes.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np

from ..arrays import HeaderCheck, read_npy_bytes, read_npz, read_npz_bytes
from ..errors import AmpError
from ..fileio import read_input_text

Batch = dict[str, np.ndarray]


@dataclass(frozen=True)
class InputSpec:
    """One model input as calibration data must fill it."""

    name: str
    #: numpy dtype name ("float32", "int64", "bool", ...).
    dtype: str
    #: None for an unknown rank; None for a dimension of any size.
    shape: tuple[int | None, ...] | None

    def describe_shape(self) -> str:
        if self.shape is None:
            return "any shape"
        return "[" + ", ".join("?" if d is None else str(d) for d in self.shape) + "]"


def check_batch(batch: Batch, specs: Sequence[InputSpec], where: str) -> Batch:
    """`batch` restricted to the model's inputs, or AmpError naming what does not fit: a missing
    or unknown input name, a dtype or shape the model does not take, NaN or Inf in a float input."""
    by_name = {spec.name: spec for spec in specs}
    unknown = sorted(set(batch) - set(by_name))
    if unknown:
        _refuse_unknown(unknown, specs, where)
    missing = [spec.name for spec in specs if spec.name not in batch]
    if missing:
        raise AmpError(f"{where}: no data for model {_plural('input', missing)} "
                       f"{', '.join(map(repr, missing))}")
    checked: Batch = {}
    for spec in specs:
        array = np.asarray(batch[spec.name])
        _check_array(spec, array.dtype, array.shape, where)
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            bad = int(np.count_nonzero(~np.isfinite(array)))
            raise AmpError(f"{where}: input {spec.name!r} has {bad} NaN or Inf value(s); "
                           f"calibration data must be finite")
        checked[spec.name] = array
    return checked


def header_check(specs: Sequence[InputSpec], where: str) -> HeaderCheck:
    """The check of an array's name, dtype and shape against the model's inputs that a reader
    applies before the array's data is read (a wrong shape is refused before it is inflated)."""
    by_name = {spec.name: spec for spec in specs}

    def check(name: str, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        spec = by_name.get(name)
        if spec is None:
            _refuse_unknown([name], specs, where)
        else:
            _check_array(spec, dtype, shape, where)

    return check


def _refuse_unknown(names: Sequence[str], specs: Sequence[InputSpec], where: str) -> NoReturn:
    """Refuse arrays named after no input of the model."""
    raise AmpError(f"{where}: {_plural('input', names)} {', '.join(map(repr, names))} not in "
                   f"the model (it takes {', '.join(repr(s.name) for s in specs)})")


def _check_array(spec: InputSpec, dtype: np.dtype, shape: tuple[int, ...], where: str) -> None:
    """Refuse an array of a dtype or shape the input `spec` does not take."""
    if dtype.name != spec.dtype:
        raise AmpError(f"{where}: input {spec.name!r} is {dtype.name}, the model takes "
                       f"{spec.dtype}")
    if spec.shape is not None:
        fits = len(shape) == len(spec.shape) and all(
            want is None or want == got for want, got in zip(spec.shape, shape))
        if not fits:
            raise AmpError(f"{where}: input {spec.name!r} has shape {list(shape)}, the model "
                           f"takes {spec.describe_shape()}")


def _plural(word: str, items: Sequence[object]) -> str:
    return word if len(items) == 1 else f"{word}s"


@dataclass(frozen=True)
class _Source:
    """One batch: where it is, and how to read it."""

    label: str
    read: Callable[[], Batch]


class CalibrationSet:
    """The batches to measure on, read lazily one at a time and checked against the model."""

    def __init__(self, sources: list[_Source], specs: Sequence[InputSpec], random: bool = False,
                 description: str = ""):
        if not sources:
            raise AmpError("no calibration batches")
        self._sources = sources
        self.specs = list(specs)
        #: True when the batches are seeded random data, not the user's.
        self.random = random
        self.description = description

    def __len__(self) -> int:
        return len(self._sources)

    def __iter__(self) -> Iterator[Batch]:
        for source in self._sources:
            yield check_batch(source.read(), self.specs, source.label)

    @classmethod
    def from_paths(cls, paths: Sequence[str | os.PathLike], specs: Sequence[InputSpec]
                   ) -> CalibrationSet:
        """Batches from .npz files, folders of them and Polygraphy JSON files, in order; every
        file is read by the checked readers (`fileio`, `arrays`): regular files only, arrays no
        bigger than their file, each header checked against the model before its data."""
        sources: list[_Source] = []
        for raw in paths:
            path = Path(raw)
            if path.is_dir():
                files = sorted(p for p in path.iterdir() if p.suffix == ".npz"
                               and not p.is_dir())  # FIFOs and links too: the reader says why
                if not files:
                    raise AmpError(f"{path}: no .npz files in this folder")
                sources.extend(_npz_source(f, specs) for f in files)
            elif not os.path.lexists(path):
                raise AmpError(f"{path}: no such calibration file or folder")
            elif path.suffix == ".json":
                sources.extend(_polygraphy_sources(path, specs))
            else:
                sources.append(_npz_source(path, specs))
        described = ", ".join(str(p) for p in paths)
        return cls(sources, specs, description=f"{len(sources)} batch(es) from {described}")

    @classmethod
    def from_batches(cls, batches: Sequence[Batch], specs: Sequence[InputSpec],
                     random: bool = False, label: str = "batch") -> CalibrationSet:
        """Batches already in memory (the API, random data)."""
        sources = [_Source(f"{label} {i}", _constant(b)) for i, b in enumerate(batches)]
        kind = "seeded random" if random else "given"
        return cls(sources, specs, random=random,
                   description=f"{len(sources)} {kind} batch(es)")


def _constant(batch: Batch) -> Callable[[], Batch]:
    return lambda: batch


def _npz_source(path: Path, specs: Sequence[InputSpec]) -> _Source:
    def read() -> Batch:
        return read_npz(path, "calibration file", header_check(specs, str(path)))

    return _Source(str(path), read)


def _polygraphy_sources(path: Path, specs: Sequence[InputSpec]) -> list[_Source]:
    """Polygraphy's input file: a JSON list of feeds {name: encoded ndarray}."""
    text = read_input_text(path, "Polygraphy JSON input file")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # too deeply nested: RecursionError
        raise AmpError(f"{path}: not a Polygraphy JSON input file ({type(exc).__name__})") \
            from None
    del text
    if isinstance(data, dict):  # a single feed
        data = [data]
    if not isinstance(data, list) or not data or not all(isinstance(f, dict) for f in data):
        raise AmpError(f"{path}: not a Polygraphy JSON input file (expected a list of feeds)")
    sources = []
    for index, feed in enumerate(data):
        label = f"{path} feed {index}"
        check = header_check(specs, label)
        batch = {name: _decode_polygraphy_array(value, f"{label} input {name!r}", name, check)
                 for name, value in feed.items()}
        sources.append(_Source(label, _constant(batch)))
    return sources


def _decode_polygraphy_array(value: object, where: str, name: str,
                             check: HeaderCheck) -> np.ndarray:
    """An array as Polygraphy's JSON encoder writes it: the .npy bytes in base64 (or, in files
    from old versions, as latin-1 text; very old ones hold an .npz with one array)."""
    if not isinstance(value, dict) or not isinstance(value.get("array"), str):
        raise AmpError(f"{where}: not a Polygraphy-encoded array")
    text = value["array"]
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        try:
            data = text.encode("latin-1")
        except UnicodeEncodeError:
            raise AmpError(f"{where}: cannot decode the array (neither base64 nor latin-1 "
                           f"text)") from None
    if data.startswith(_NPY_MAGIC):
        return read_npy_bytes(data, where, name, check)
    if data.startswith(_ZIP_MAGIC):
        arrays = read_npz_bytes(data, where)
        if len(arrays) != 1:
            raise AmpError(f"{where}: an .npz with {len(arrays)} arrays, expected one")
        (array,) = arrays.values()
        check(name, array.dtype, array.shape)
        return array
    raise AmpError(f"{where}: cannot decode the array (not .npy or .npz data)")


#: How .npy data and zip archives (.npz) begin.
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK"
