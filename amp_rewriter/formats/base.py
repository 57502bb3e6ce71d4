"""The contract every format package fulfils, so the CLI and the API never name a format's
details: a format converts a model in memory or a file, validates a conversion, checks a
converted model and explains a model, all with the format's options (`options_class`, a
subclass of `Options`, built by `options`); `convert_to` is the one transaction around a
conversion that writes a file."""

from __future__ import annotations

import contextlib
import gc
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic

from .. import op_lists
from ..errors import AmpError
from ..fileio import Companions, InputFiles, OutputTransaction
from ..op_lists import Overrides
from ..options import OptionsT, TrainingOptions, files_read, format_options
from ..passes.base import FormatRules
from ..report import CheckResult, CheckRule, Report
from ..validation import Validation

if TYPE_CHECKING:
    from ..accuracy.runner import ModelRunner


class Format(ABC, Generic[OptionsT]):
    """One model format (ONNX, TensorFlow): its rules for the passes and its entry points."""

    #: Short name ("onnx", "tf"), as in op_lists/<name>.toml.
    name: str
    #: The format's options: `Options`' shared fields and the format's own.
    options_class: type[OptionsT]
    rules: FormatRules
    #: What `check` looks for (the kinds of its problems), for reports that list what passed.
    check_rules: tuple[CheckRule, ...] = ()

    def options(self, **kwargs: Any) -> OptionsT:
        """The format's options from keyword arguments (the API's, the parsed flags): another
        format's option is refused in one line naming it and that format."""
        return format_options(self.options_class, kwargs)

    def default_backend(self, target: str) -> str:
        """The backend profile used when the user names none (the format's list file says)."""
        return op_lists.default_backend(self.name, target)

    @abstractmethod
    def accepts(self, model: object) -> bool:
        """Whether `model` is an in-memory model of this format (its library's message type)."""

    @abstractmethod
    def convert(self, model: Any, options: OptionsT, source_dir: Path | None = None
                ) -> tuple[Any, Report]:
        """Convert in memory: `model` is an in-memory model of the format (left unmodified)
        or the path of a model file; returns the converted model and the report. `source_dir`:
        the folder the model's own files (ONNX's external data) are relative to, when `model`
        is in memory."""

    @abstractmethod
    def convert_file(self, input_path: Path, output_path: Path, options: OptionsT,
                     training: TrainingOptions | None = None) -> tuple[Any, Report]:
        """Convert `input_path` and write the result to `output_path`, a fresh path in the
        private folder of an `OutputTransaction` (which moves it, and any file written beside
        it, into place at commit); the input is never touched. Returns the converted model
        when the format holds it in memory anyway (ONNX's ModelProto), else None, and the
        report. A format without training graphs refuses `training`."""

    @abstractmethod
    def validate(self, input_path: Path, output_path: Path, report: Report, options: OptionsT,
                 inputs: str | None, rtol: float, device: str | None = None) -> Validation:
        """Run the fp32 and converted models on the same inputs and compare their outputs
        (the converted one where the backend profile runs, or on `device`: "cpu", or "cuda"
        where the format supports it)."""

    @abstractmethod
    def check(self, path: Path, target: str | None, backend: str | None,
              reference: Path | None, rtol: float | None, inputs: str | None = None,
              device: str | None = None, overrides: Overrides | None = None) -> CheckResult:
        """Lint a converted model for CI; with `reference`, also compare outputs (on `inputs`,
        an .npz, or seeded random ones), running them where the backend profile runs (or on
        `device`). `overrides`: the config's profiles and class moves, as convert had them."""

    @abstractmethod
    def explain(self, source: Path, options: OptionsT) -> Report:
        """Convert `source` in memory (nothing written) for `explain`."""

    def input_files(self, input_path: Path) -> list[tuple[Path, str]]:
        """Every file (or folder) reading `input_path` involves, with what it is to the user:
        outputs must never overwrite them."""
        return [self.input_entry(input_path)]

    def input_entry(self, path: Path, what: str = "input") -> tuple[Path, str]:
        """A model path as an input the outputs must not overwrite, found without parsing it
        (`what`: "input", "checked", "reference")."""
        return path, f"the {what} model"

    def transaction(self, input_path: Path,
                    more_reads: InputFiles = ()) -> OutputTransaction:
        """The `OutputTransaction` of a run that reads the model at `input_path` (and
        `more_reads`: a config, --inputs, a metric file): the files parsing the model finds
        (external data) are looked for only when a destination exists already."""
        return OutputTransaction([self.input_entry(input_path), *more_reads],
                                 lambda: self.input_files(input_path))

    def convert_to(self, input_path: Path, output: str | os.PathLike, options: OptionsT,
                   training: TrainingOptions | None = None) -> tuple[Any, Report]:
        """Convert `input_path` and write the result at `output` (with what the format writes
        beside it): all of it or, on failure, nothing, never over a file the run reads; the
        entry point of every API function that writes a converted model."""
        with self.transaction(input_path, files_read(options.config)) as outputs:
            staged = self.stage_output(outputs, output, input_path, options)
            result = self.convert_file(input_path, staged, options, training)
            outputs.commit()
        return result

    def output_kind(self, input_path: Path) -> str:
        """"file", or "dir" when converting `input_path` writes a directory."""
        return "file"

    def replaceable_output_dir(self, path: Path) -> bool:
        """Whether an existing, non-empty output directory may be replaced (a model of ours)."""
        return False

    def output_companions(self, output_name: str, options: OptionsT) -> Companions | None:
        """The files a conversion with `options` may write beside an output named
        `output_name` (ONNX: its external data); None when it writes none."""
        return None

    def stage_output(self, outputs: OutputTransaction, output: str | os.PathLike,
                     input_path: Path, options: OptionsT) -> Path:
        """Stage the converted model's destination in `outputs`, with what the format writes
        there (a file or a directory, files beside it), so that every path the conversion
        will write is checked before anything is; returns the path to write the model to."""
        return outputs.stage(output, "output", self.output_kind(input_path),
                             replace_dir=self.replaceable_output_dir,
                             companions=self.output_companions(os.path.basename(output), options))

    def accuracy_runner(self, path: Path, options: OptionsT) -> ModelRunner:
        """The model at `path` as `convert --auto` and `diagnose` run it."""
        raise AmpError(f"--auto and diagnose do not support {self.name} models yet")


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """The IR makes hundreds of thousands of small objects that live until the end; Python's
    cyclic collector would rescan them again and again (half the run time at 50k nodes)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
