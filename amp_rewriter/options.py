"""The conversion options: one object from the CLI or the Python API down to the passes.

`Options` holds the fields every format shares; each format's options subclass it with that
format's own fields (`OnnxOptions`, `TfOptions`; a `Format` names its class in
`options_class`). They are declared here rather than in the format packages because the
command line offers every format's flags before it knows the format, and importing a format
package imports its library. Each field declares its command-line flag beside its default
(`cli_flags` adds them to a parser, `cli_given` reads them back); the API takes every field as a
keyword argument, and `format_options` refuses, in one line, a field of another format's options.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from .errors import AmpError
from .flags import flag_field as _flag
from .node_patterns import NodePattern
from .op_lists import TARGETS, Overrides, backend_help
from .training.rule import LossScaleRule
from .training.update import UpdateOptions

T = TypeVar("T")
OptionsT = TypeVar("OptionsT", bound="Options")

#: The target of every entry point (CLI, Python API, every format) when none is given.
DEFAULT_TARGET = "fp16"
#: `--external-data` layouts (ONNX outputs): see formats/onnx/emit.py.
EXTERNAL_LAYOUTS = ("single", "per-tensor", "inline")



@dataclass
class Options:
    """What a conversion does, in every format: the fields the formats share (a format's own
    fields are in its subclass)."""

    #: The format the fields are for, as messages name it.
    format_title: ClassVar[str] = "every format"

    target: str = _flag(DEFAULT_TARGET, "--target", f"fp16 or bf16 (default {DEFAULT_TARGET})")
    backend: str | None = _flag(None, "--backend", backend_help())
    allow: list[str] = _flag([], "--allow", "move OP to the allow class (repeatable)",
                             metavar="OP", kind="list")
    infer: list[str] = _flag([], "--infer", "move OP to the infer class (repeatable)",
                             metavar="OP", kind="list")
    deny: list[str] = _flag([], "--deny", "move OP to the deny class (repeatable)",
                            metavar="OP", kind="list")
    clear: list[str] = _flag([], "--clear", "move OP to the clear class (repeatable)",
                             metavar="OP", kind="list")
    keep_nodes: list[str] = _flag([], "--keep-node", "pin matching nodes to fp32 (repeatable)",
                                  metavar="NAME_OR_REGEX", kind="list")
    config: str | os.PathLike | None = _flag(
        None, "--config", "op-list overrides, pattern rules and backend profiles from a TOML "
        "file", metavar="TOML")
    keep_io_types: bool = _flag(True, "--keep-io-types",
                                "keep graph inputs/outputs fp32 (default); --no-keep-io-types "
                                "lets them take the low-precision dtype", kind="switch",
                                negation="--no-keep-io-types")
    clamp: bool = _flag(False, "--clamp", "saturate constants beyond the target's range instead "
                                          "of keeping them fp32", kind="switch")
    #: Python API only: run the format's validity check (onnx.checker, TF import) on the result.
    check: bool = True
    #: Python API only (the CLI's `convert --plot` sets it): record the converted graph's nodes
    #: in `Report.precision_map`.
    precision_map: bool = False
    _overrides: Overrides = field(init=False, repr=False, compare=False)
    _patterns: list[NodePattern] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise AmpError(f"unknown target {self.target!r} (expected fp16 or bf16)")
        for name in ("allow", "infer", "deny", "clear", "keep_nodes"):
            setattr(self, name, _names(getattr(self, name)))
        self._overrides = self._build_overrides()
        self._patterns = self._overrides.keep_node_patterns()

    def _build_overrides(self) -> Overrides:
        """Op-class moves and pinned nodes: the config file first, explicit options win. Naming
        one op in two classes is an error."""
        overrides = (Overrides.from_config(os.fspath(self.config)) if self.config is not None
                     else Overrides())
        explicit: dict[str, str] = {}
        for op_class in ("allow", "infer", "deny", "clear"):
            for op in getattr(self, op_class):
                if explicit.get(op, op_class) != op_class:
                    raise AmpError(f"--{explicit[op]} and --{op_class} both name {op!r}")
                explicit[op] = op_class
                overrides.move(op, op_class, f"--{op_class}")
        overrides.keep_nodes.extend(self.keep_nodes)
        return overrides

    @property
    def overrides(self) -> Overrides:
        """The op-class moves and pinned nodes of the options and the config file."""
        return self._overrides

    @property
    def keep_node_patterns(self) -> list[NodePattern]:
        """--keep-node entries (and the config's keep_nodes) as regexes, matched whole (RE2:
        linear time, whatever the pattern)."""
        return self._patterns

    def with_backend(self: OptionsT, default: str) -> OptionsT:
        """These options with `default` as the backend when none was chosen."""
        return self if self.backend else dataclasses.replace(self, backend=default)

    def as_kwargs(self) -> dict[str, Any]:
        """The options as the Python API's keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}


@dataclass
class OnnxOptions(Options):
    """A conversion of an ONNX model: the shared fields and ONNX's own."""

    format_title: ClassVar[str] = "ONNX"

    #: ONNX: onnxruntime's transformer optimizer (its fusions) runs first (formats/onnx/optimize).
    optimize: str | None = _flag(
        None, "--optimize", "ONNX: run onnxruntime's transformer optimizer for this model type "
        "first (bert, gpt2, ...: its Attention, SkipLayerNormalization, ... fusions), then convert",
        metavar="MODEL_TYPE")
    num_heads: int | None = _flag(None, "--num-heads", "with --optimize: the attention heads "
                                                       "(default: detected)", type=int)
    hidden_size: int | None = _flag(None, "--hidden-size", "with --optimize: the hidden size "
                                                           "(default: detected)", type=int)
    #: ONNX files: where the output's initializers go (formats/onnx/emit.py `save_onnx`).
    external_data: str | None = _flag(
        None, "--external-data", "ONNX: where the output's weights go: single (one OUT.data "
        "beside the model; the default when the input has external data or the output passes "
        "2 GiB), per-tensor (one OUT.N.data file each) or inline (all in the .onnx, at most "
        "2 GiB)", metavar="single|per-tensor|inline")
    external_data_threshold: int | None = _flag(
        None, "--external-data-threshold", "ONNX, with external data: tensors of at least this "
        "many bytes go external, counted as onnx.save_model counts them (default 1024)",
        metavar="BYTES", type=int)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, flag in (("num_heads", "--num-heads"), ("hidden_size", "--hidden-size")):
            value = getattr(self, name)
            if value is None:
                continue
            if self.optimize is None:
                raise AmpError(f"{flag} only applies with --optimize")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise AmpError(f"{flag} must be a positive integer, got {value!r}")
        if self.external_data is not None and self.external_data not in EXTERNAL_LAYOUTS:
            raise AmpError(f"--external-data must be one of {', '.join(EXTERNAL_LAYOUTS)}, got "
                           f"{self.external_data!r}")
        threshold = self.external_data_threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int)
                                      or threshold < 0):
            raise AmpError(f"--external-data-threshold must be an integer >= 0, got "
                           f"{threshold!r}")


@dataclass
class TfOptions(Options):
    """A conversion of a TensorFlow graph or SavedModel: the shared fields and TensorFlow's
    own."""

    format_title: ClassVar[str] = "TensorFlow"

    #: GraphDefs: the fetch tensors ("y" or "y:1"); a SavedModel's signatures name its outputs.
    outputs: list[str] | None = _flag(
        None, "--outputs", "TensorFlow GraphDefs: the fetch nodes or tensors (y or y:1), "
        "comma-separated; they keep their dtype (default: nodes nothing reads)",
        metavar="A,B", kind="comma")
    keep_fp32_weights: bool = _flag(
        False, "--keep-fp32-weights", "TensorFlow SavedModels: keep every variable fp32 (by "
        "default variables read only in low precision are stored in it)", kind="switch")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.outputs is not None:
            self.outputs = _names(self.outputs) or None


#: Every format's options (the command line offers all their flags).
FORMAT_OPTIONS: tuple[type[Options], ...] = (OnnxOptions, TfOptions)


def format_options(cls: type[OptionsT], kwargs: dict[str, Any]) -> OptionsT:
    """`cls` (a format's options) from keyword arguments. A field of another format's options
    is refused in one line naming its flag and that format when it is set (at its default it
    asks for nothing and is dropped); any other unknown name is a TypeError, as for a call."""
    own = {f.name for f in dataclasses.fields(cls)}
    mine = dict(kwargs)
    for other in FORMAT_OPTIONS:
        for f in dataclasses.fields(other):
            if f.name in own or f.name not in mine:
                continue
            value = mine.pop(f.name)
            if value is None or value == f.default:
                continue
            flag = f.metadata["cli"]["flag"] if "cli" in f.metadata else f.name
            raise AmpError(f"{flag} is an option of {other.format_title} models, not of "
                           f"{cls.format_title} ones")
    return cls(**mine)


@dataclass
class TrainingOptions:
    """The training rewrite's options (TensorFlow training graphs): what to rewrite, the loss
    scale and the update. `loss_scale` chooses the mode ("dynamic", "none", a fixed scale; None:
    the target's default); `rule` holds the loss-scale rule's knobs the user set (their flags are
    declared on `training.LossScaleRule`, with their defaults) and `update` the update's
    (`training.UpdateOptions`: weights, rounding, slots, rounding_seed, unscale, accumulate)."""

    loss: str | None = _flag(None, "--loss", "the loss (default: the tensor the gradients are "
                                             "taken of)", metavar="NAME")
    train_op: str | None = _flag(None, "--train-op", "the train op (default: the 'train_op' "
                                                     "collection's entry)", metavar="NAME")
    loss_scale: str | float | None = _flag(
        None, "--loss-scale", "dynamic (default for fp16), none (default for bf16) or a fixed "
        "scale", metavar="dynamic|none|VALUE")
    rule: dict[str, Any] = field(default_factory=dict)
    update: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for what, given, knobs in (("loss scale", self.rule, LossScaleRule.knobs()),
                                   ("update", self.update, UpdateOptions.knobs())):
            unknown = sorted(set(given) - set(knobs))
            if unknown:
                raise AmpError(f"{what}: no option {unknown[0]!r} (options: {', '.join(knobs)})")
        self.rule = {name: value for name, value in self.rule.items() if value is not None}
        self.update = {name: value for name, value in self.update.items() if value is not None}

    def loss_scale_rule(self, target: str) -> LossScaleRule:
        """The loss-scale rule these options ask for on `target`."""
        return LossScaleRule.from_spec(self.loss_scale, target, **self.rule)

    def update_options(self) -> UpdateOptions:
        """How the step updates its variables (weights, rounding, unscaling, accumulation)."""
        return UpdateOptions(**self.update)

    def given_flags(self) -> list[str]:
        """The flags of the options that were set."""
        given = [f.metadata["cli"]["flag"] for f in dataclasses.fields(self)
                 if "cli" in f.metadata and getattr(self, f.name) is not None]
        return given + [f.metadata["cli"]["flag"] for f in dataclasses.fields(LossScaleRule)
                        if f.name in self.rule] + [
            f.metadata["cli"]["flag"] for f in dataclasses.fields(UpdateOptions)
            if f.name in self.update]

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> tuple[TrainingOptions, dict[str, Any]]:
        """The training options among an API call's keyword arguments (the rule's and the
        update's knobs by name: `growth_interval=...`, `weights="fp16"`), and the rest."""
        mine = {name: kwargs[name] for name in ("loss", "train_op", "loss_scale")
                if name in kwargs}
        knobs = {name: kwargs[name] for name in LossScaleRule.knobs() if name in kwargs}
        update = {name: kwargs[name] for name in UpdateOptions.knobs() if name in kwargs}
        rest = {name: value for name, value in kwargs.items()
                if name not in mine and name not in knobs and name not in update}
        return cls(**mine, rule=knobs, update=update), rest


@dataclass
class AutoOptions:
    """`convert --auto` and `diagnose`: the accuracy target and the thresholds of the data-range
    rules. None means the default (see each flag's help)."""

    max_error: float | None = _flag(
        None, "--max-error", "--auto: the largest metric value accepted (required with --auto)",
        metavar="R", type=float)
    metric: str = _flag("max-rel", "--metric", "--auto: max-rel (default: max|out-ref| / "
                        "max|ref| over outputs), cosine (1 - cosine similarity), or "
                        "module:function / file.py:function taking (reference_outputs, outputs) "
                        "and returning a number, lower is better",
                        metavar="max-rel|cosine|MODULE:FUNCTION")
    data_max: float | None = _flag(
        None, "--data-max", "a low-precision node whose fp32 inputs or outputs exceed this "
        "magnitude on the calibration data stays fp32 (default: the target's largest finite "
        "value, 65504 for fp16)", metavar="X", type=float)
    flush_max: float = _flag(0.5, "--flush-max", "a node whose output loses more than this "
                             "fraction of its non-zero values to zero in the target stays fp32 "
                             "(default 0.5; any flush in a divisor counts)", metavar="F",
                             type=float)
    local_max: float | None = _flag(
        None, "--local-max", "local error that counts as large: pinning such a node pins the "
        "producers whose rounding causes it (default: 32 units of the target's rounding, 1.6e-2 "
        "for fp16)", metavar="E", type=float)
    max_reduction: int | None = _flag(
        None, "--max-reduction", "a low-precision reduction (Reduce*, MatMul) over more elements "
        "than this stays fp32 (default: off)", metavar="N", type=int)
    max_trials: int = _flag(20, "--max-trials", "--auto: most verification runs of the search "
                            "(default 20; all-fp32 is verified beyond it if needed)",
                            metavar="N", type=int)
    random_batches: int = _flag(4, "--random-batches", "seeded random batches used when no "
                                "--inputs are given (default 4)", metavar="N", type=int)

    def __post_init__(self) -> None:
        if self.max_error is not None and not self.max_error >= 0:
            raise AmpError(f"--max-error must be a number >= 0, got {self.max_error}")
        for name, flag in (("data_max", "--data-max"), ("local_max", "--local-max")):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise AmpError(f"{flag} must be a number > 0, got {value}")
        if not 0 <= self.flush_max <= 1:
            raise AmpError(f"--flush-max must be between 0 and 1, got {self.flush_max}")
        if self.max_reduction is not None and self.max_reduction < 1:
            raise AmpError(f"--max-reduction must be >= 1, got {self.max_reduction}")
        if self.max_trials < 1:
            raise AmpError(f"--max-trials must be >= 1, got {self.max_trials}")
        if self.random_batches < 1:
            raise AmpError(f"--random-batches must be >= 1, got {self.random_batches}")


def metric_source_file(spec: str) -> Path | None:
    """The file a `--metric path/file.py:function` loads; None for a built-in metric or a
    module found by its dotted name."""
    module_name, sep, _ = spec.rpartition(":")
    if sep and module_name and (module_name.endswith(".py") or "/" in module_name
                                or "\\" in module_name):
        return Path(module_name)
    return None


def files_read(config: str | os.PathLike | None = None,
               inputs: Iterable[str | os.PathLike] | str | os.PathLike | None = None,
               metric: str | None = None) -> list[tuple[Path, str]]:
    """The files a run reads besides its model(s), with what each is: the --config file, the
    --inputs (files or folders) and a --metric file. No output may overwrite them."""
    files = []
    given = [] if inputs is None else [inputs] if isinstance(inputs, (str, os.PathLike)) \
        else list(inputs)
    files += [(Path(path), "the --inputs folder" if os.path.isdir(path) else "the --inputs file")
              for path in given]
    if config is not None:
        files.append((Path(config), "the --config file"))
    metric_file = metric_source_file(metric or "")
    if metric_file is not None:
        files.append((metric_file, "the --metric file"))
    elif metric and ":" in metric:  # a module by name: where the current folder would hold it
        parts = Path(*metric.rpartition(":")[0].split("."))
        files += [(candidate, "the --metric module") for candidate in
                  (parts.with_name(parts.name + ".py"), parts / "__init__.py")
                  if parts.name and candidate.exists()]
    return files


def _names(values: Iterable[str] | str | None) -> list[str]:
    """A single string is one name; None is none."""
    if values is None:
        return []
    return [values] if isinstance(values, str) else list(values)


def split_kwargs(cls: type[T], kwargs: dict[str, Any]) -> tuple[T, dict[str, Any]]:
    """An instance of `cls` from the keyword arguments that are its fields, and the rest."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    mine = {k: v for k, v in kwargs.items() if k in names}
    rest = {k: v for k, v in kwargs.items() if k not in names}
    return cls(**mine), rest


# -- the command line ---------------------------------------------------------------------------

def _flagged_fields(classes: tuple[type, ...]) -> list[dataclasses.Field]:
    """The fields of `classes` that declare a flag, each name once (in the order met)."""
    fields = {f.name: f for cls in classes for f in dataclasses.fields(cls)
              if "cli" in f.metadata}
    return list(fields.values())


def cli_flags(parser: argparse.ArgumentParser | Any, *classes: type) -> None:
    """Add a flag for every field of `classes` that declares one (a field they share, once)."""
    for f in _flagged_fields(classes):
        cli = f.metadata["cli"]
        if cli["kind"] == "switch":
            parser.add_argument(cli["flag"], dest=f.name, action="store_true", default=None,
                                help=cli["help"])
            if cli["negation"]:
                parser.add_argument(cli["negation"], dest=f.name, action="store_false",
                                    help=argparse.SUPPRESS)
        elif cli["kind"] == "list":
            parser.add_argument(cli["flag"], dest=f.name, action="append", default=None,
                                metavar=cli["metavar"], help=cli["help"])
        else:
            parser.add_argument(cli["flag"], dest=f.name, default=None, type=cli["type"],
                                metavar=cli["metavar"], help=cli["help"])


def cli_given(args: argparse.Namespace, *classes: type) -> dict[str, Any]:
    """The fields of `classes` whose flags were given, as keyword arguments."""
    given = {}
    for f in _flagged_fields(classes):
        cli = f.metadata["cli"]
        value = getattr(args, f.name, None)
        if value is None:
            continue
        if cli["kind"] == "comma":
            value = [part.strip() for part in value.split(",") if part.strip()]
        given[f.name] = value
    return given


def from_cli(args: argparse.Namespace, cls: type[T]) -> T:
    """An instance of `cls` from parsed flags; flags not given keep the field defaults."""
    return cls(**cli_given(args, cls))
