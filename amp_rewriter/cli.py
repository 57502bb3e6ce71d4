"""Command line: convert / check / explain.

Exit codes: 0 ok, 1 a check or validation failed, 2 bad input or usage. Every error is one line
on stderr; set AMP_REWRITER_DEBUG=1 to see the traceback of an unexpected failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

from .errors import AmpError, CheckFailed
from .fileio import write_atomically

PROG = "amp-rewriter"


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        raise AmpError(f"{message} (see {self.prog} --help)")


def _add_lists_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="fp16", help="fp16 (default) or bf16")
    parser.add_argument("--backend", default=None,
                        help="whose kernels the op lists assume: ONNX ort-cuda (default) or "
                             "ort-cpu; TensorFlow tf-gpu (default for fp16) or tf-cpu (default "
                             "for bf16)")
    parser.add_argument("--outputs", metavar="A,B", default=None,
                        help="TensorFlow GraphDefs: the fetch nodes or tensors (y or y:1), "
                             "comma-separated; they keep their dtype (default: nodes nothing "
                             "reads)")
    for op_class in ("allow", "infer", "deny", "clear"):
        parser.add_argument(f"--{op_class}", action="append", default=[], metavar="OP",
                            help=f"move OP to the {op_class} class (repeatable)")
    parser.add_argument("--keep-node", action="append", default=[], metavar="NAME_OR_REGEX",
                        help="pin matching nodes to fp32 (repeatable)")
    parser.add_argument("--config", metavar="TOML", help="op-list overrides from a TOML file")
    parser.add_argument("--keep-io-types", dest="keep_io_types", action="store_true",
                        default=True, help="keep graph inputs/outputs fp32 (default)")
    parser.add_argument("--no-keep-io-types", dest="keep_io_types", action="store_false",
                        help="let graph inputs/outputs take the low-precision dtype")
    parser.add_argument("--clamp", action="store_true",
                        help="saturate constants beyond the target's range instead of keeping "
                             "them fp32")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Automatic mixed precision for ONNX and TensorFlow "
                                            "models.")
    commands = parser.add_subparsers(dest="command", parser_class=_Parser, required=True)

    convert = commands.add_parser("convert", help="convert an fp32 model to mixed precision")
    convert.add_argument("input", help="the fp32 model: .onnx, a TensorFlow GraphDef (.pb, "
                                       ".pbtxt) or a SavedModel directory")
    convert.add_argument("output", help="where to write the converted model")
    _add_lists_options(convert)
    convert.add_argument("--report", metavar="JSON", help="write the decisions as JSON")
    convert.add_argument("--validate", action="store_true",
                         help="run both models on the CPU (onnxruntime or TensorFlow) and "
                              "compare outputs")
    convert.add_argument("--inputs", metavar="NPZ",
                         help="inputs for --validate (.npz keyed by input / placeholder name)")
    convert.add_argument("--rtol", type=float, default=None,
                         help="largest relative error --validate accepts (fp16 2e-2, bf16 1e-1)")
    convert.add_argument("--quiet", action="store_true", help="print only errors")
    training = convert.add_argument_group(
        "training graphs (TensorFlow .meta, or .pb/.pbtxt with --loss and --train-op)")
    training.add_argument("--training", action="store_true",
                          help="rewrite a TF1 training graph: fp32 master weights and optimizer, "
                               "loss scaling for fp16")
    training.add_argument("--loss", metavar="NAME",
                          help="the loss (default: the tensor the gradients are taken of)")
    training.add_argument("--train-op", metavar="NAME",
                          help="the train op (default: the 'train_op' collection's entry)")
    training.add_argument("--loss-scale", metavar="dynamic|none|VALUE", default=None,
                          help="dynamic (default for fp16), none (default for bf16) or a fixed "
                               "scale")
    for flag, kind, default in (("--initial-scale", float, "32768"),
                                ("--growth-interval", int, "2000"),
                                ("--growth-factor", float, "2"),
                                ("--backoff-factor", float, "0.5"),
                                ("--min-scale", float, "1"),
                                ("--hysteresis", int, "1: back off at the first bad step")):
        training.add_argument(flag, type=kind, default=None, help=f"default {default}")

    check = commands.add_parser("check", help="check a converted model (for CI)")
    check.add_argument("model", help="the mixed-precision model: .onnx, or a TensorFlow graph "
                                      "(.meta, .pb, .pbtxt; training graphs included)")
    check.add_argument("--target", default=None, help="fp16 or bf16 (default: detected)")
    check.add_argument("--backend", default="ort-cuda", help="ort-cuda (default) or ort-cpu")
    check.add_argument("--reference", metavar="FP32_ONNX", help="the fp32 model to compare with")
    check.add_argument("--rtol", type=float, default=None, help="tolerance with --reference")
    check.add_argument("--report", metavar="JSON", help="write the findings as JSON")

    explain = commands.add_parser("explain", help="why does a node run in its precision?")
    explain.add_argument("source", help="a report JSON from convert, or an .onnx model")
    explain.add_argument("node", help="the node name")
    _add_lists_options(explain)
    return parser


def _write_text_atomically(path: str, text: str) -> None:
    write_atomically(path, text.encode())


def is_tensorflow_input(path: str) -> bool:
    """A TensorFlow GraphDef file or SavedModel directory (decided without importing TF)."""
    p = Path(path)
    if p.is_dir():
        return (p / "saved_model.pb").is_file() or (p / "saved_model.pbtxt").is_file()
    return p.suffix in (".pb", ".pbtxt", ".meta")


def _options(args: argparse.Namespace) -> dict:
    return dict(target=args.target, backend=args.backend or "ort-cuda",
                keep_io_types=args.keep_io_types,
                clamp=args.clamp, allow=args.allow, infer=args.infer, deny=args.deny,
                clear=args.clear, keep_nodes=args.keep_node, config=args.config)


def _run_convert(args: argparse.Namespace) -> int:
    from .api import convert_file

    if args.inputs and not args.validate:
        raise AmpError("--inputs only makes sense with --validate")
    if args.rtol is not None and not args.validate:
        raise AmpError("--rtol only makes sense with --validate")
    if args.rtol is not None and not args.rtol >= 0:  # also refuses nan
        raise AmpError(f"--rtol must be a number >= 0, got {args.rtol}")
    if is_tensorflow_input(args.input):
        return _run_convert_tf(args)
    if args.training:
        raise AmpError("--training is for TensorFlow training graphs (.meta, .pb, .pbtxt)")
    if args.outputs:
        raise AmpError("--outputs is for TensorFlow GraphDefs: an ONNX model names its outputs")
    if args.report and Path(args.report).resolve() in (Path(args.input).resolve(),
                                                         Path(args.output).resolve()):
        raise AmpError("--report must not be the input or output model path")
    model, report = convert_file(args.input, args.output, **_options(args))
    return _finish_convert(args, report, lambda: _validate_onnx(args, model, report))


def _remove_output(output: Path) -> None:
    """Validation could not run: leave no converted model for a build to pick up."""
    if output.is_dir():
        shutil.rmtree(output, ignore_errors=True)
    else:
        output.unlink(missing_ok=True)
        Path(str(output) + ".data").unlink(missing_ok=True)


def _finish_convert(args: argparse.Namespace, report, validate: Callable[[], int]) -> int:
    """Warnings, validation (when asked), the report and the summary line; the exit status."""
    for warning in report.warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    status = 0
    if args.validate:
        try:
            status = validate()
        except AmpError:
            _remove_output(Path(args.output))
            raise
    if args.report:
        _write_text_atomically(args.report, report.to_json())
    if not args.quiet:
        s = report.summary
        flushed = (f", {s['values_flushed_to_zero']} values flushed to zero"
                   if s["values_flushed_to_zero"] else "")
        print(f"converted {s['low_precision_nodes']}/{s['nodes']} nodes to {args.target} "
              f"(backend {report.backend}): casts {s['casts_inserted']} inserted, "
              f"{s['casts_removed']} removed; constants {s['constants_converted']} converted, "
              f"{s['constants_kept_fp32']} kept fp32 for range{flushed} -> {args.output}")
    if status:
        print(f"{PROG}: validation failed: relative error above rtol", file=sys.stderr)
    return status


def _validate_onnx(args: argparse.Namespace, model, report) -> int:
    """Run fp32 and converted models on the same inputs; 1 when an output is off."""
    from .loaders.onnx import read_model_file
    from .validate import (compare_models, default_rtol, emulate_bfloat16, has_bfloat16,
                           load_inputs, random_inputs)

    rtol = default_rtol(args.target) if args.rtol is None else args.rtol
    feeds = (load_inputs(args.inputs) if args.inputs
             else random_inputs(read_model_file(args.input)))
    candidate = str(args.output)
    if args.target == "bf16" and has_bfloat16(model):
        candidate = emulate_bfloat16(model)
        if not args.quiet:
            print("validate: onnxruntime's CPU provider lacks bf16 kernels; running the bf16 "
                  "model emulated (fp32 compute, every bf16 tensor rounded to bf16)")
    comparisons = compare_models(str(args.input), candidate, feeds)
    failed = [c for c in comparisons if c.relative > rtol or c.nonfinite_new]
    report.validation = {"rtol": rtol, "passed": not failed,
                         "outputs": [c.to_dict() for c in comparisons]}
    if not args.quiet:
        for c in comparisons:
            mark = "FAIL" if c in failed else "ok"
            print(f"validate {c.name}: max_abs={c.max_abs:.3g} relative={c.relative:.3g} "
                  f"{mark}")
    return 1 if failed else 0


def _import_tf_api():
    """Import the TensorFlow front end with TF's start-up chatter kept off stderr.

    TensorFlow's C++ runtime writes its start-up notes (oneDNN, CUDA drivers) straight to file
    descriptor 2 before any log level applies, so fd 2 points at /dev/null during the import.
    """
    # 3: TensorFlow's own error lines too (e.g. "failed call to cuInit" on GPU-less machines);
    # failures reach the user as one AmpError line instead.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if os.environ.get("AMP_REWRITER_DEBUG"):
        from . import tf_api
        return tf_api
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            from . import tf_api
    except ImportError as exc:
        raise AmpError(f"TensorFlow models need TensorFlow ({exc}); install it with "
                       f"pip install -e '.[tensorflow]'") from None
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    return tf_api


_TRAINING_ONLY = ("loss", "train_op", "loss_scale", "initial_scale", "growth_interval",
                  "growth_factor", "backoff_factor", "min_scale", "hysteresis")


def _run_convert_tf(args: argparse.Namespace) -> int:
    tf_api = _import_tf_api()
    if args.training:
        return _run_convert_training(args)
    given = [f"--{name.replace('_', '-')}" for name in _TRAINING_ONLY
             if getattr(args, name) is not None]
    if given:
        raise AmpError(f"{', '.join(given)} only apply with --training")

    if args.report and Path(args.report).resolve() in (Path(args.input).resolve(),
                                                         Path(args.output).resolve()):
        raise AmpError("--report must not be the input or output model path")
    outputs = [o.strip() for o in args.outputs.split(",") if o.strip()] if args.outputs else None
    options = dict(target=args.target, backend=args.backend, keep_io_types=args.keep_io_types,
                   clamp=args.clamp, allow=args.allow, infer=args.infer, deny=args.deny,
                   clear=args.clear, keep_nodes=args.keep_node, config=args.config)
    report = tf_api.convert_tf_file(args.input, args.output, outputs, **options)
    return _finish_convert(args, report, lambda: _validate_tf(args, tf_api, report))


def _run_convert_training(args: argparse.Namespace) -> int:
    """`convert --training`: the TF1 training-graph rewrite."""
    from . import tf_training

    if args.validate:
        raise AmpError("--validate compares inference outputs; a training graph is checked by "
                       "training it (see scripts/train_digits.py)")
    if args.outputs:
        raise AmpError("--outputs does not apply with --training: name --loss and --train-op")
    if not args.keep_io_types:
        raise AmpError("--no-keep-io-types does not apply with --training: the loss and "
                       "placeholders keep their dtypes")
    if args.report and Path(args.report).resolve() in (Path(args.input).resolve(),
                                                         Path(args.output).resolve()):
        raise AmpError("--report must not be the input or output model path")
    report = tf_training.convert_training_file(
        args.input, args.output, loss=args.loss, train_op=args.train_op, target=args.target,
        backend=args.backend, loss_scale=args.loss_scale, initial_scale=args.initial_scale,
        growth_interval=args.growth_interval, growth_factor=args.growth_factor,
        backoff_factor=args.backoff_factor, min_scale=args.min_scale,
        hysteresis=args.hysteresis, clamp=args.clamp, allow=args.allow, infer=args.infer,
        deny=args.deny, clear=args.clear, keep_nodes=args.keep_node, config=args.config)
    status = _finish_convert(args, report, lambda: 0)
    if not args.quiet:
        training = report.training
        rule = training["loss_scale_rule"]
        if training.get("loss_scale_variable"):
            print(f"loss scaling: dynamic, initial {rule['initial']:g}, x{rule['growth_factor']:g}"
                  f" every {rule['growth_interval']} good steps, x{rule['backoff_factor']:g} on "
                  f"overflow (min {rule['min_scale']:g}); {len(training['update_ops_gated'])} "
                  f"update ops skip bad steps; scale {training['loss_scale']}, counter "
                  f"{training['good_steps']}")
        elif rule["mode"] == "fixed":
            print(f"loss scaling: fixed {rule['initial']:g}; "
                  f"{len(training['update_ops_gated'])} update ops skip bad steps")
        else:
            print("loss scaling: none")
    return status


def _validate_tf(args: argparse.Namespace, tf_api, report) -> int:
    """Run both TensorFlow models on the CPU on the same inputs; 1 when an output is off."""
    from .validate import default_rtol, load_inputs

    rtol = default_rtol(args.target) if args.rtol is None else args.rtol
    feeds = load_inputs(args.inputs) if args.inputs else None
    if tf_api.is_saved_model_dir(args.input):
        comparisons = tf_api.compare_saved_models(args.input, args.output, feeds)
    elif args.input.endswith(".meta"):
        comparisons = tf_api.compare_graphdefs(
            tf_api.read_meta_graph(args.input).graph_def,
            tf_api.read_meta_graph(args.output).graph_def, report.summary["outputs"], feeds)
    else:
        comparisons = tf_api.compare_graphdefs(
            tf_api.read_graphdef(args.input), tf_api.read_graphdef(args.output),
            report.summary["outputs"], feeds)
    report.validation = tf_api.validation_dict(comparisons, rtol)
    failed = {o["name"] for o in report.validation["outputs"]
              if o["relative_error"] > rtol or o["new_nan_or_inf"]}
    if not args.quiet:
        for c in comparisons:
            print(f"validate {c.name}: max_abs={c.max_abs:.3g} relative={c.relative:.3g} "
                  f"{'FAIL' if c.name in failed else 'ok'}")
    return 1 if failed else 0


def _run_check(args: argparse.Namespace) -> int:
    from .check import check_model

    if is_tensorflow_input(args.model):
        if args.reference:
            raise AmpError("--reference is for ONNX models")
        _import_tf_api()
        from .tf_training import check_tf_graph
        result = check_tf_graph(args.model, args.target,
                                None if args.backend == "ort-cuda" else args.backend)
    else:
        result = check_model(args.model, args.target, args.backend, args.reference, args.rtol)
    for note in result.notes:
        print(f"note: {note}")
    for problem in result.problems:
        print(f"{problem['kind']}: {problem['message']}")
    for output in result.outputs:
        print(f"output {output['name']}: relative error {output['relative_error']:.3g}")
    if args.report:
        _write_text_atomically(args.report, json.dumps(result.to_dict(), indent=2) + "\n")
    print(f"check: {'ok' if result.ok else f'{len(result.problems)} problem(s)'}")
    if not result.ok:
        raise CheckFailed(f"{len(result.problems)} problem(s) in {args.model}")
    return 0


def _run_explain(args: argparse.Namespace) -> int:
    from .report import explain_text, load_report

    if is_tensorflow_input(args.source):
        tf_api = _import_tf_api()
        options = dict(target=args.target, backend=args.backend, keep_io_types=args.keep_io_types,
                       clamp=args.clamp, allow=args.allow, infer=args.infer, deny=args.deny,
                       clear=args.clear, keep_nodes=args.keep_node, config=args.config, check=False)
        outputs = [o for o in (args.outputs or "").split(",") if o] or None
        if tf_api.is_saved_model_dir(args.source):
            with tempfile.TemporaryDirectory(prefix="amp-rewriter-explain-") as tmp:
                report = tf_api.convert_saved_model(args.source, Path(tmp) / "out", **options)
        else:
            _gd, report = tf_api.convert_graphdef(tf_api.read_graphdef(args.source), outputs,
                                                  **options)
    elif args.source.endswith(".onnx"):
        from .api import convert
        _model, report = convert(args.source, check=False, **_options(args))
    else:
        given = [f"--{name.replace('_', '-')}" for name in ("allow", "infer", "deny", "clear",
                                                          "keep_node") if getattr(args, name)]
        given += [flag for flag, value, default in (("--target", args.target, "fp16"),
                                                    ("--config", args.config, None),
                                                    ("--clamp", args.clamp, False))
                  if value != default]
        if given:
            raise AmpError(f"{', '.join(given)} only apply when explaining a model: a report "
                           f"already holds the decisions of its conversion")
        report = load_report(args.source)
    print(explain_text(report, args.node))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        runner = {"convert": _run_convert, "check": _run_check, "explain": _run_explain}
        return runner[args.command](args)
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
