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
import io
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import AmpError

Batch = dict[str, np.ndarray]

#: How many random batches stand in for calibration data when the user gives none.
RANDOM_BATCHES = 4


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
        raise AmpError(f"{where}: {_plural('input', unknown)} {', '.join(map(repr, unknown))} "
                       f"not in the model (it takes {', '.join(repr(s.name) for s in specs)})")
    missing = [spec.name for spec in specs if spec.name not in batch]
    if missing:
        raise AmpError(f"{where}: no data for model {_plural('input', missing)} "
                       f"{', '.join(map(repr, missing))}")
    checked: Batch = {}
    for spec in specs:
        array = np.asarray(batch[spec.name])
        if array.dtype.name != spec.dtype:
            raise AmpError(f"{where}: input {spec.name!r} is {array.dtype.name}, the model takes "
                           f"{spec.dtype}")
        if spec.shape is not None:
            fits = array.ndim == len(spec.shape) and all(
                want is None or want == got for want, got in zip(spec.shape, array.shape))
            if not fits:
                raise AmpError(f"{where}: input {spec.name!r} has shape {list(array.shape)}, the "
                               f"model takes {spec.describe_shape()}")
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            bad = int(np.count_nonzero(~np.isfinite(array)))
            raise AmpError(f"{where}: input {spec.name!r} has {bad} NaN or Inf value(s); "
                           f"calibration data must be finite")
        checked[spec.name] = array
    return checked


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

    def check_all(self) -> None:
        """Read and check every batch once (before any output is written), then let them go."""
        for _batch in self:
            pass

    @classmethod
    def from_paths(cls, paths: Sequence[str | os.PathLike], specs: Sequence[InputSpec]
                   ) -> CalibrationSet:
        """Batches from .npz files, folders of them and Polygraphy JSON files, in order."""
        sources: list[_Source] = []
        for raw in paths:
            path = Path(raw)
            if path.is_dir():
                files = sorted(p for p in path.iterdir() if p.suffix == ".npz" and p.is_file())
                if not files:
                    raise AmpError(f"{path}: no .npz files in this folder")
                sources.extend(_npz_source(f) for f in files)
            elif not path.exists():
                raise AmpError(f"{path}: no such calibration file or folder")
            elif path.suffix == ".json":
                sources.extend(_polygraphy_sources(path))
            else:
                sources.append(_npz_source(path))
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


def _npz_source(path: Path) -> _Source:
    def read() -> Batch:
        try:
            with np.load(path, allow_pickle=False) as data:
                return {key: data[key] for key in data.files}
        except Exception as exc:  # numpy raises several types for a bad file
            raise AmpError(f"{path}: not an .npz file of inputs ({type(exc).__name__})") from None

    return _Source(str(path), read)


def _polygraphy_sources(path: Path) -> list[_Source]:
    """Polygraphy's input file: a JSON list of feeds {name: encoded ndarray}."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise AmpError(f"{path}: not a Polygraphy JSON input file ({type(exc).__name__})") \
            from None
    if isinstance(data, dict):  # a single feed
        data = [data]
    if not isinstance(data, list) or not data or not all(isinstance(f, dict) for f in data):
        raise AmpError(f"{path}: not a Polygraphy JSON input file (expected a list of feeds)")
    sources = []
    for index, feed in enumerate(data):
        label = f"{path} feed {index}"
        batch = {name: _decode_polygraphy_array(value, f"{label} input {name!r}")
                 for name, value in feed.items()}
        sources.append(_Source(label, _constant(batch)))
    return sources


def _decode_polygraphy_array(value: object, where: str) -> np.ndarray:
    """An array as Polygraphy's JSON encoder writes it: the .npy bytes in base64 (or, in files
    from old versions, as latin-1 text)."""
    if not isinstance(value, dict) or not isinstance(value.get("array"), str):
        raise AmpError(f"{where}: not a Polygraphy-encoded array")
    text = value["array"]
    for decode in (lambda: base64.b64decode(text.encode(), validate=True),
                   lambda: text.encode("latin-1")):
        try:
            loaded = np.load(io.BytesIO(decode()), allow_pickle=False)
        except Exception:  # noqa: BLE001  (try the other encoding)
            continue
        if isinstance(loaded, np.ndarray):
            return loaded
        with loaded as archive:  # an .npz inside (very old files): its one array
            return archive[archive.files[0]]
    raise AmpError(f"{where}: cannot decode the array")
