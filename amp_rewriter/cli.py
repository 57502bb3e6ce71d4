"""Command line: convert / check / explain, for every format.

Exit codes: 0 ok, 1 a check or validation failed, 2 bad input or usage. Every error is one line
on stderr; set AMP_REWRITER_DEBUG=1 to see the traceback of an unexpected failure, and
AMP_REWRITER_LINT=1 to check the IR's invariants after every pass.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from . import ci, formats, progress
from .cost import summary_line
from .errors import AmpError, CheckFailed, ConvertedModelFailed
from .fileio import OutputTransaction, check_input_path, read_input_bytes, write_atomically
from .ir import short_name
from .op_lists import Overrides, backend_help
from .options import (
    FORMAT_OPTIONS,
    AutoOptions,
    Options,
    TrainingOptions,
    cli_flags,
    cli_given,
    files_read,
)
from .plots import diagnose_figure, plot_paths, precision_map_figure, save
from .report import Report
from .training import LossScaleRule
from .training.update import UpdateOptions
from .validation import default_rtol, load_inputs
from .version import package_version

PROG = "amp-rewriter"
#: Where validation runs the converted model (ONNX: onnxruntime's CPU or CUDA provider).
DEVICES = ("cpu", "cuda")
#: What `check --format` prints on stdout.
CHECK_FORMATS = ("text", "json")
#: The file GitHub Actions shows as a job's summary (`check` appends to it).
STEP_SUMMARY_VARIABLE = "GITHUB_STEP_SUMMARY"


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise AmpError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; conversion flags come from every format's options."""
    parser = _Parser(prog=PROG, description="Automatic mixed precision for ONNX and TensorFlow "
                                            "models.")
    parser.add_argument("--version", action="version", version=f"{PROG} {package_version()}")
    commands = parser.add_subparsers(dest="command", parser_class=_Parser, required=True)

    convert = commands.add_parser("convert", help="convert an fp32 model to mixed precision")
    convert.add_argument("input", help="the fp32 model: .onnx, a TensorFlow GraphDef (.pb, "
                                       ".pbtxt, .meta) or a SavedModel directory")
    convert.add_argument("output", help="where to write the converted model")
    cli_flags(convert, *FORMAT_OPTIONS)
    convert.add_argument("--report", metavar="JSON", help="write the decisions as JSON")
    convert.add_argument("--validate", action="store_true",
                         help="run both models on the backend profile's runtime (onnxruntime "
                              "or TensorFlow) and compare outputs; on the CPU, ONNX ops "
                              "without a low-precision CPU kernel are emulated (fp32 compute, "
                              "low-precision outputs rounded)")
    convert.add_argument("--inputs", metavar="FILE|DIR", nargs="+",
                         help="--validate: one .npz keyed by input / placeholder name; --auto: "
                              "calibration batches: .npz files, folders of them, Polygraphy "
                              "JSON input files")
    convert.add_argument("--rtol", type=float, default=None,
                         help="largest relative error --validate accepts (fp16 2e-2, bf16 1e-1)")
    convert.add_argument("--device", choices=DEVICES, default=None,
                         help="where --validate runs the converted model: cpu (ops without a "
                              "low-precision CPU kernel are emulated) or cuda (onnxruntime-gpu "
                              "and a GPU); default: where the backend profile runs (its "
                              "providers when this runtime has them, else the CPU, emulated)")
    convert.add_argument("--quiet", action="store_true",
                         help="print only errors (no summary, no progress bars)")
    convert.add_argument("--plot", metavar="FILE.png|svg", action="append",
                         help="draw the converted model's precision map: each node a cell in "
                              "graph order, coloured by precision (repeatable; needs the plot "
                              "extra, matplotlib)")
    training = convert.add_argument_group(
        "training graphs (TensorFlow .meta, or .pb/.pbtxt with --loss and --train-op)")
    training.add_argument("--training", action="store_true",
                          help="rewrite a TF1 training graph: fp32 master weights and optimizer, "
                               "loss scaling for fp16")
    cli_flags(training, TrainingOptions)
    cli_flags(training, LossScaleRule)
    cli_flags(training, UpdateOptions)
    auto = convert.add_argument_group(
        "accuracy-driven conversion (--auto): convert as much as possible while the metric "
        "holds on calibration data")
    auto.add_argument("--auto", action="store_true",
                      help="measure on calibration data (--inputs) and keep fp32 the smallest "
                           "set of nodes it finds under which --metric <= --max-error")
    cli_flags(auto, AutoOptions)

    diagnose = commands.add_parser(
        "diagnose", help="which node overflows, flushes or adds the error, on calibration data")
    diagnose.add_argument("model", help="the fp32 model: .onnx or a TensorFlow GraphDef")
    cli_flags(diagnose, *FORMAT_OPTIONS)
    diagnose.add_argument("--inputs", metavar="FILE|DIR", nargs="+",
                          help="calibration batches: .npz files, folders of them, Polygraphy "
                               "JSON input files (default: seeded random batches)")
    diagnose.add_argument("--json", metavar="OUT", help="write the full report as JSON")
    diagnose.add_argument("--top", type=int, default=25, metavar="N",
                          help="nodes shown in the text report (default 25)")
    diagnose.add_argument("--plot", metavar="FILE.png|svg", action="append",
                          help="draw each node's local and accumulated error and its overflow "
                               "and flush shares in graph order, the culprit named (repeatable; "
                               "needs the plot extra, matplotlib)")
    rules = diagnose.add_argument_group("data-range rules (as --auto applies them)")
    for flag in ("--data-max", "--flush-max", "--max-reduction", "--random-batches"):
        _add_auto_flag(rules, flag)

    check = commands.add_parser("check", help="check converted models (for CI)")
    check.add_argument("models", nargs="+", metavar="model",
                       help="the mixed-precision model(s): .onnx, a TensorFlow graph (.meta, "
                            ".pb, .pbtxt; training graphs included) or a SavedModel directory "
                            "(or its saved_model.pb)")
    check.add_argument("--target", default=None, help="fp16 or bf16 (default: detected)")
    check.add_argument("--backend", default=None, help=backend_help())
    check.add_argument("--config", metavar="TOML",
                       help="the config file convert had: its backend profiles and op-class "
                            "moves")
    check.add_argument("--reference", metavar="FP32_MODEL",
                       help="the fp32 model (same format) to compare constants and outputs with")
    check.add_argument("--inputs", metavar="NPZ",
                       help="inputs for --reference (.npz keyed by input / placeholder name; "
                            "default: seeded random ones)")
    check.add_argument("--rtol", type=float, default=None,
                       help="largest relative error --reference accepts (fp16 2e-2, bf16 1e-1)")
    check.add_argument("--device", choices=DEVICES, default=None,
                       help="where --reference runs the model: cpu or cuda (default: where "
                            "the backend profile runs)")
    check.add_argument("--report", metavar="JSON", help="write the findings as JSON")
    check.add_argument("--format", choices=CHECK_FORMATS, default="text",
                       help="what stdout gets: text (default) or the JSON of --report")
    check.add_argument("--junit", metavar="XML",
                       help="write a JUnit XML file: per model a test case per rule class, a "
                            "failing one per finding")
    check.add_argument("--summary", metavar="MD",
                       help="write a Markdown summary (verdict, cost line, findings); without "
                            "it, appended to $GITHUB_STEP_SUMMARY when that is set")

    explain = commands.add_parser("explain", help="why does a node run in its precision?")
    explain.add_argument("source", help="a report JSON from convert, or a model")
    explain.add_argument("node", help="the node name")
    cli_flags(explain, *FORMAT_OPTIONS)
    return parser


def _add_auto_flag(parser: argparse._ArgumentGroup, flag: str) -> None:
    """One of AutoOptions' flags on another command."""
    for f in dataclasses.fields(AutoOptions):
        cli = f.metadata.get("cli")
        if cli and cli["flag"] == flag:
            parser.add_argument(flag, dest=f.name, default=None, type=cli["type"],
                                metavar=cli["metavar"], help=cli["help"])


def _check_rtol(rtol: float | None) -> None:
    if rtol is not None and not rtol >= 0:  # also refuses nan
        raise AmpError(f"--rtol must be a number >= 0, got {rtol}")


def _extra_inputs(args: argparse.Namespace) -> list[tuple[Path, str]]:
    """The files a run reads besides its model(s): --inputs, --config and a --metric file."""
    return files_read(getattr(args, "config", None), getattr(args, "inputs", None),
                      getattr(args, "metric", None))


@contextlib.contextmanager
def _warnings_as_lines(into: list[str]) -> Iterator[None]:
    """Collect the Python warnings libraries raise (onnx's notes on a model, say) as one line
    each, so they print as ours after a successful run, and not at all before an error."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            yield
        finally:
            for warning in caught:
                text = str(warning.message).strip()
                line = text.splitlines()[0] if text else type(warning.message).__name__
                if line not in into:
                    into.append(line)


def _run_convert(args: argparse.Namespace) -> int:
    # Progress bars on stderr for the slow steps, when it is a terminal (progress.py).
    progress.enable(not args.quiet)
    try:
        return _convert(args)
    finally:
        progress.enable(False)


def _convert(args: argparse.Namespace) -> int:
    auto_given = cli_given(args, AutoOptions)
    if args.auto:
        return _run_auto(args, AutoOptions(**auto_given))
    if auto_given:
        flags = [f.metadata["cli"]["flag"] for f in dataclasses.fields(AutoOptions)
                 if f.name in auto_given]
        raise AmpError(f"{', '.join(flags)} only apply with --auto")
    if args.inputs and not args.validate:
        raise AmpError("--inputs only makes sense with --validate or --auto")
    if args.inputs and len(args.inputs) > 1:
        raise AmpError("--validate takes one --inputs .npz file")
    if args.rtol is not None and not args.validate:
        raise AmpError("--rtol only makes sense with --validate")
    if args.device is not None and not args.validate:
        raise AmpError("--device only makes sense with --validate")
    _check_rtol(args.rtol)
    check_input_path(args.input)
    input_path = Path(args.input)
    fmt = formats.for_path(input_path)
    training_given = TrainingOptions(**cli_given(args, TrainingOptions),
                                     rule=cli_given(args, LossScaleRule),
                                     update=cli_given(args, UpdateOptions))
    training = None
    if args.training:
        if args.validate:
            raise AmpError("--validate compares inference outputs; a training graph is checked "
                           "by training it (see scripts/train_digits.py)")
        training = training_given
    elif training_given.given_flags():
        flags = training_given.given_flags()
        raise AmpError(f"{', '.join(flags)} only apply with --training")
    plots = plot_paths(args.plot)  # before any work: a bad name or no matplotlib costs none
    options = dataclasses.replace(_options(args, fmt), precision_map=bool(plots))
    if args.inputs:
        load_inputs(args.inputs[0])  # a bad inputs file is refused before anything is converted
    library_warnings: list[str] = []
    # Everything the run writes is staged beside its destination and moved into place only
    # when the whole run succeeded (validation included): a failed run changes nothing.
    with fmt.transaction(input_path, _extra_inputs(args)) as outputs:
        staged = fmt.stage_output(outputs, args.output, input_path, options)
        staged_report = outputs.stage(args.report, "--report") if args.report else None
        staged_plots = [(outputs.stage(argument, "--plot"), path)
                        for argument, path in zip(args.plot or [], plots)]
        with _warnings_as_lines(library_warnings):
            report = fmt.convert_file(input_path, staged, options, training)[1]
        report.warnings.extend(library_warnings)
        status = _validate(args, fmt, report, options, staged) if args.validate else 0
        if status:
            _print_warnings(report)  # a typo in an override may be why
            raise CheckFailed(f"validation failed: relative error above rtol; nothing was "
                              f"written ({args.output} is as it was)")
        if staged_report is not None:
            write_atomically(staged_report, report.json_pieces())
        _write_precision_map(report, input_path, args.output, staged_plots)
        outputs.commit()
    # Warnings only once the run is through: an error (exit 2) prints that one line alone.
    _print_warnings(report)
    if not args.quiet:
        if report.optimizer is not None:
            print(_optimizer_line(report.optimizer))
        print(_summary_line(report, args.output))
        if report.cost is not None:
            print(summary_line(report.cost))
        if report.training is not None:
            print(_training_line(report.training))
        if report.weights is not None:
            w = report.weights
            count = w["objects"] - w.get("copies", 0)
            print(f"weights: {count} variables stored in {short_name(w['dtype'])} "
                  f"({w['bytes_before'] / 1e6:.1f} MB -> {w['bytes_after'] / 1e6:.1f} MB), read "
                  f"without a cast (--keep-fp32-weights keeps them fp32)")
    return 0


def _write_precision_map(report: Report, input_path: Path, output: str,
                         staged_plots: list[tuple[Path, Path]]) -> None:
    """`--plot`: the precision map of the conversion, titled with its cost line, to each
    staged path."""
    if not staged_plots:
        return
    assert report.precision_map is not None, "--plot asks the conversion for its cells"
    title = summary_line(report.cost) if report.cost is not None \
        else _summary_line(report, output)
    subtitle = (f"{input_path.name} -> {Path(output).name}: {report.target}, backend "
                f"{report.backend}; {len(report.precision_map)} nodes in graph order, left to "
                f"right and top to bottom")
    figure = precision_map_figure(report.precision_map, title, subtitle, report.target)
    for staged, destination in staged_plots:
        save(figure, staged, destination)


def _print_warnings(report: Report) -> None:
    for warning in report.warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)


def _run_auto(args: argparse.Namespace, auto: AutoOptions) -> int:
    """convert --auto: search on calibration data, write the result, say what it pinned."""
    from .accuracy import run_auto
    from .accuracy.measure import format_number

    for flag, given in (("--validate", args.validate), ("--training", args.training),
                        ("--rtol", args.rtol is not None)):
        if given:
            raise AmpError(f"{flag} does not combine with --auto (--auto verifies the result on "
                           f"its calibration data)")
    if cli_given(args, TrainingOptions) or cli_given(args, LossScaleRule) \
            or cli_given(args, UpdateOptions):
        raise AmpError("training options do not combine with --auto")
    check_input_path(args.input)
    input_path = Path(args.input)
    fmt = formats.for_path(input_path)
    plots = plot_paths(args.plot)
    options = dataclasses.replace(_options(args, fmt), precision_map=bool(plots))
    say = None if args.quiet else (lambda line: print(line, flush=True))
    # Staged like a plain conversion: the model and the report appear together or not at all.
    with fmt.transaction(input_path, _extra_inputs(args)) as outputs:
        staged = fmt.stage_output(outputs, args.output, input_path, options)
        staged_report = outputs.stage(args.report, "--report") if args.report else None
        staged_plots = [(outputs.stage(argument, "--plot"), path)
                        for argument, path in zip(args.plot or [], plots)]
        runner = fmt.accuracy_runner(input_path, options)
        report, result = run_auto(runner, staged, args.inputs, auto, options.target, say)
        if staged_report is not None:
            write_atomically(staged_report, report.json_pieces())
        _write_precision_map(report, input_path, args.output, staged_plots)
        outputs.commit()
    _print_warnings(report)
    if not args.quiet:
        summary = report.auto or {}
        runs = (f"{summary.get('reference_runs', 1)} reference run, "
                f"{summary.get('verification_runs', 0)} verification run(s)")
        if result.same_as_plain:
            print(f"auto: no node needs fp32 beyond the op lists: the same model as plain "
                  f"convert ({runs})")
        else:
            print(f"auto: {len(result.pins)} node(s) kept fp32 by measurement ({runs}):")
            for entry in result.contributions:
                print(f"  {entry['node']} ({entry['op']}): {entry['reason']}")
        print(f"auto: {result.metric.name} {format_number(result.final_value)} <= "
              f"{result.metric.max_error:g}" if result.metric.passes(result.final_value)
              else f"auto: {result.metric.name} {format_number(result.final_value)}")
        print(_summary_line(report, args.output))
    return 0


def _run_diagnose(args: argparse.Namespace) -> int:
    from .accuracy import run_diagnose
    from .accuracy.diagnose import diagnose_text, to_json

    check_input_path(args.model)
    model = Path(args.model)
    fmt = formats.for_path(model)
    options = _options(args, fmt)
    auto = AutoOptions(**cli_given(args, AutoOptions))
    if args.top < 1:
        raise AmpError(f"--top must be >= 1, got {args.top}")
    plots = plot_paths(args.plot)
    # --json and the pictures are outputs like any other: checked against everything the run
    # reads before the run starts, all written once the measurement is through, none when it
    # fails.
    with fmt.transaction(model, _extra_inputs(args)) as outputs:
        staged_json = outputs.stage(args.json, "--json") if args.json else None
        staged_plots = [(outputs.stage(argument, "--plot"), path)
                        for argument, path in zip(args.plot or [], plots)]
        runner = fmt.accuracy_runner(model, options)
        resolved = runner.options if hasattr(runner, "options") else options
        report, warnings = run_diagnose(runner, args.inputs, auto, options.target,
                                        resolved.backend or "")
        if staged_json is not None:
            write_atomically(staged_json, to_json(report).encode())
        if staged_plots:
            figure = diagnose_figure(report, model.name)
            for staged, destination in staged_plots:
                save(figure, staged, destination)
        outputs.commit()
    for warning in warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    print(diagnose_text(report, args.top))
    return 0


def _validate(args: argparse.Namespace, fmt: formats.base.Format, report: Report,
              options: Options, converted: Path) -> int:
    """Run the fp32 model and the converted one (still at its staged path) on the same inputs;
    1 when an output is off."""
    rtol = default_rtol(options.target) if args.rtol is None else args.rtol
    try:
        validation = fmt.validate(Path(args.input), converted, report, options,
                                  args.inputs[0] if args.inputs else None, rtol, args.device)
    except ConvertedModelFailed as exc:
        raise ConvertedModelFailed(f"validation failed: the converted model does not run: {exc}; "
                                   f"nothing was written ({args.output} is as it was)") from None
    report.validation = validation.to_dict()
    if not args.quiet:
        for note in validation.notes:
            print(f"validate: {note}")
        for c in validation.comparisons:
            mark = "FAIL" if validation.failed(c) else "ok"
            print(f"validate {c.name}: max_abs={c.max_abs:.3g} relative={c.relative:.3g} "
                  f"{mark}{c.how()}")
    return 0 if validation.passed else 1


def _summary_line(report: Report, output: str) -> str:
    """One line: the compute ops (what decides the speed-up) in low precision, per op type, then
    all nodes (shape arithmetic included), casts and constants."""
    s = report.summary
    by_type = s.get("compute_ops_by_type", {})
    if by_type:
        types = ", ".join(f"{op} {low}/{total}" for op, (low, total) in by_type.items())
        compute = f"compute ops {s['low_precision_compute_ops']}/{s['compute_ops']} ({types})"
    else:
        compute = "no compute ops (matrix products, convolutions) on float data"
    unserved = s.get("graphs_not_served", 0)
    scope = (f" in the functions the signatures run ({unserved} other function"
             f"{'s' if unserved != 1 else ''} converted, not counted)" if unserved else "")
    flushed = (f", {s['values_flushed_to_zero']} values flushed to zero"
               if s["values_flushed_to_zero"] else "")
    return (f"converted to {report.target} (backend {report.backend}): {compute}, nodes "
            f"{s['low_precision_nodes']}/{s['nodes']}{scope}; casts {s['casts_inserted']} "
            f"inserted, {s['casts_removed']} removed; constants {s['constants_converted']} "
            f"converted, {s['constants_kept_fp32']} kept fp32 for range{flushed} -> {output}")


def _optimizer_line(optimizer: dict) -> str:
    added = ", ".join(f"{count} {op}" for op, count in optimizer["ops_added"].items())
    return (f"optimized with onnxruntime {optimizer['onnxruntime']}'s {optimizer['model_type']} "
            f"fusions: {added or 'nothing fused'}")


def _training_line(training: dict) -> str:
    stored = training.get("variables_stored_16bit") or {}
    update = training.get("update") or {}
    if stored:
        dtypes = ", ".join(sorted({short_name(d) or d for d in stored.values()}))
        return (f"{_scaling_line(training)}; {len(stored)} variables stored in {dtypes}, "
                f"updates rounded {update.get('rounding')}")
    return _scaling_line(training)


def _scaling_line(training: dict) -> str:
    rule = training["loss_scale_rule"]
    gated = len(training["update_ops_gated"])
    if training.get("loss_scale_variable"):
        return (f"loss scaling: dynamic, initial {rule['initial_scale']:g}, "
                f"x{rule['growth_factor']:g} "
                f"every {rule['growth_interval']} good steps, x{rule['backoff_factor']:g} on "
                f"overflow (min {rule['min_scale']:g}); {gated} update ops skip bad steps; scale "
                f"{training['loss_scale']}, counter {training['good_steps']}")
    if rule["mode"] == "fixed":
        return f"loss scaling: fixed {rule['initial_scale']:g}; {gated} update ops skip bad steps"
    return "loss scaling: none"


def _run_check(args: argparse.Namespace) -> int:
    if args.inputs and not args.reference:
        raise AmpError("--inputs only makes sense with --reference (they feed both models)")
    if args.rtol is not None and not args.reference:
        raise AmpError("--rtol only makes sense with --reference")
    if args.reference and len(args.models) > 1:
        raise AmpError("--reference compares one model with its fp32 original: give one model")
    _check_rtol(args.rtol)
    models = [formats.model_path(argument) for argument in args.models]
    for model in models:
        check_input_path(model)
    if args.reference:
        check_input_path(args.reference, "--reference")
    reference = Path(args.reference) if args.reference else None
    model_formats = [formats.for_path(model) for model in models]
    if reference is not None and formats.detect(reference) != model_formats[0].name:
        raise AmpError(f"--reference {reference} is not a {model_formats[0].name} model like "
                       f"{models[0]}")
    reads = [fmt.input_entry(model, "checked") for model, fmt in zip(models, model_formats)]
    reads += _extra_inputs(args)
    if reference is not None:
        reads.append(model_formats[0].input_entry(reference, "reference"))

    def every_file_read() -> list[tuple[Path, str]]:
        files = [entry for model, fmt in zip(models, model_formats)
                 for entry in fmt.input_files(model)]
        if reference is not None:
            files += [(path, f"{what} (--reference)")
                      for path, what in model_formats[0].input_files(reference)]
        return files

    step_summary = os.environ.get(STEP_SUMMARY_VARIABLE) if not args.summary else None
    with OutputTransaction(reads, every_file_read) as outputs:
        # Every destination is checked before any model is read: a collision costs no check.
        staged = {flag: outputs.stage(path, flag) for flag, path in (
            ("--report", args.report), ("--junit", args.junit), ("--summary", args.summary),
            (f"${STEP_SUMMARY_VARIABLE}", step_summary)) if path}
        checked = []
        overrides = Overrides.from_config(args.config) if args.config else None
        for model, fmt in zip(models, model_formats):
            result = fmt.check(model, args.target, args.backend, reference, args.rtol,
                               args.inputs, args.device, overrides)
            checked.append(ci.CheckedModel(str(model), result, fmt.check_rules,
                                           args.reference))
            if args.format == "text":
                _print_check(checked[-1], several=len(models) > 1)
        # The findings are the outputs: written pass or fail.
        if "--report" in staged:
            write_atomically(staged["--report"], ci.json_text(checked).encode())
        if "--junit" in staged:
            write_atomically(staged["--junit"], ci.junit_xml(checked))
        if "--summary" in staged:
            write_atomically(staged["--summary"], ci.markdown_summary(checked).encode())
        if step_summary:  # GitHub's file collects every step's summary: ours is added to it
            before = read_input_bytes(step_summary, "expected a file", "summary file") \
                if Path(step_summary).exists() else b""
            separator = b"\n" if before and not before.endswith(b"\n") else b""
            write_atomically(staged[f"${STEP_SUMMARY_VARIABLE}"],
                             before + separator + ci.markdown_summary(checked).encode())
        outputs.commit()
    if args.format == "json":
        print(ci.json_text(checked), end="")
    else:
        print(ci.verdict_line(checked))
    problems = sum(len(entry.result.problems) for entry in checked)
    if problems:
        failed = [entry.path for entry in checked if not entry.result.ok]
        raise CheckFailed(f"{problems} problem(s) in {', '.join(failed)}")
    return 0


def _print_check(model: ci.CheckedModel, several: bool) -> None:
    """One model's findings on stdout; several models each under their path."""
    if not several:
        for line in ci.text_lines(model):
            print(line)
        return
    print(f"{model.path}:")
    for line in ci.text_lines(model) + [ci.verdict_line([model])]:
        print(f"  {line}")


def _options(args: argparse.Namespace, fmt: formats.base.Format) -> Options:
    """The conversion flags given, as the options of `fmt` (the parser offers every format's;
    another format's is refused in one line)."""
    return fmt.options(**cli_given(args, *FORMAT_OPTIONS))


def _run_explain(args: argparse.Namespace) -> int:
    from .report import explain_text, load_report

    source = Path(args.source)
    check_input_path(source)
    if formats.model_format(source) is not None:
        fmt = formats.for_path(source)
        report = fmt.explain(source, _options(args, fmt))
    else:
        given = cli_given(args, *FORMAT_OPTIONS)
        if given:
            flags = [f.metadata["cli"]["flag"] for cls in FORMAT_OPTIONS
                     for f in dataclasses.fields(cls) if f.name in given]
            flags = list(dict.fromkeys(flags))
            raise AmpError(f"{', '.join(flags)} only apply when explaining a model: a report "
                           f"already holds the decisions of its conversion")
        report = load_report(source)
    print(explain_text(report, args.node))
    return 0


class _Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: the run unwinds as on Ctrl-C, so its staged outputs and work
    folders are removed (a plain termination would leave them behind)."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated(signum)


@contextlib.contextmanager
def _unwind_on_termination() -> Iterator[None]:
    """Turn SIGTERM / SIGHUP into `_Terminated` while the run lasts (main thread only)."""
    previous = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous[signum] = signal.signal(signum, _terminate)
        except ValueError:  # not the main thread: leave the signals as they are
            break
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    library_warnings: list[str] = []
    try:
        with _unwind_on_termination():
            return _main(argv, library_warnings)
    except _Terminated as exc:
        print(f"{PROG}: terminated by signal {exc.args[0]} before the run finished",
              file=sys.stderr)
        return 128 + int(exc.args[0])


def _main(argv: list[str] | None, library_warnings: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
        runner = {"convert": _run_convert, "check": _run_check, "explain": _run_explain,
                  "diagnose": _run_diagnose}
        # A library's own warnings (onnx on a model's odd fields) print as one line each after
        # the run, and not at all when the run ends in an error: that error is the one line.
        with _warnings_as_lines(library_warnings):
            status = runner[args.command](args)
        for warning in library_warnings:
            print(f"{PROG}: warning: {warning}", file=sys.stderr)
        return status
    except AmpError as exc:
        print(f"{PROG}: error: {exc}" if exc.exit_code == 2 else f"{PROG}: {exc}",
              file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader (e.g. `| head`) stopped early: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # a bug or an input we did not foresee: still one line, exit 2
        if os.environ.get("AMP_REWRITER_DEBUG"):
            raise
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"{PROG}: error: unexpected {type(exc).__name__}: {detail} "
              f"(set AMP_REWRITER_DEBUG=1 for a traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
