"""One Options object: every field is a CLI flag of convert and explain, a keyword argument of
the Python API, and reaches the passes; unknown or conflicting options fail with one line."""

from __future__ import annotations

import dataclasses
import json

import pytest

import amp_rewriter
from amp_rewriter import AmpError, OnnxOptions, Options, TfOptions, TrainingOptions
from amp_rewriter.cli import build_parser, main
from amp_rewriter.ir import decisions
from amp_rewriter.options import FORMAT_OPTIONS, cli_given, format_options, from_cli
from amp_rewriter.training import LossScaleRule
from testkit.models import BUILDERS

FLAGGED = [f for cls in FORMAT_OPTIONS for f in dataclasses.fields(cls) if "cli" in f.metadata]


def help_text(command: str) -> str:
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    return sub.format_help()


@pytest.mark.parametrize("command", ["convert", "explain"])
def test_every_option_field_is_a_flag(command):
    text = help_text(command)
    for f in FLAGGED:
        assert f.metadata["cli"]["flag"] in text, f.name


def test_training_fields_and_loss_scale_knobs_are_flags_of_convert():
    text = help_text("convert")
    flagged = [f for cls in (TrainingOptions, LossScaleRule) for f in dataclasses.fields(cls)
               if "cli" in f.metadata]
    assert {f.name for f in flagged} == {"loss", "train_op", "loss_scale",
                                         *LossScaleRule.knobs()}
    for f in flagged:
        assert f.metadata["cli"]["flag"] in text, f.name
    args = build_parser().parse_args(["convert", "in.meta", "out.meta", "--training",
                                      "--growth-interval", "7", "--loss-scale", "dynamic"])
    assert cli_given(args, LossScaleRule) == {"growth_interval": 7}


def test_flags_come_back_as_the_same_options():
    args = build_parser().parse_args([
        "convert", "in.onnx", "out.onnx", "--target", "bf16", "--backend", "ort-cpu",
        "--allow", "Tanh", "--deny", "Exp", "--deny", "Pow", "--keep-node", "mm.*",
        "--no-keep-io-types", "--clamp", "--outputs", "a, b:1"])
    options = from_cli(args, TfOptions)
    assert options == TfOptions(target="bf16", backend="ort-cpu", allow=["Tanh"],
                                deny=["Exp", "Pow"], keep_nodes=["mm.*"], keep_io_types=False,
                                clamp=True, outputs=["a", "b:1"])
    nothing = build_parser().parse_args(["convert", "in.onnx", "out.onnx"])
    assert cli_given(nothing, *FORMAT_OPTIONS) == {}
    assert from_cli(nothing, OnnxOptions) == OnnxOptions()


def test_every_field_is_a_keyword_of_the_api(tmp_path):
    model = BUILDERS["transformer_block"]()
    defaults = {f.name: getattr(OnnxOptions(), f.name) for f in dataclasses.fields(OnnxOptions)
                if f.init}
    defaults["outputs"] = None  # another format's option at its default asks for nothing
    converted, report = amp_rewriter.convert(model, **defaults)
    plain, _ = amp_rewriter.convert(model)
    assert converted.SerializeToString() == plain.SerializeToString()
    with pytest.raises(TypeError):
        amp_rewriter.convert(model, no_such_option=True)


def test_each_format_has_its_own_options_on_one_shared_base():
    shared = {f.name for f in dataclasses.fields(Options)}
    onnx_only = {f.name for f in dataclasses.fields(OnnxOptions)} - shared
    tf_only = {f.name for f in dataclasses.fields(TfOptions)} - shared
    assert issubclass(OnnxOptions, Options) and issubclass(TfOptions, Options)
    assert onnx_only == {"optimize", "num_heads", "hidden_size", "external_data",
                         "external_data_threshold"}
    assert tf_only == {"outputs", "keep_fp32_weights"}


@pytest.mark.parametrize("cls, options, message", [
    (OnnxOptions, dict(outputs=["y"]), "--outputs is an option of TensorFlow models, not of ONNX"),
    (OnnxOptions, dict(keep_fp32_weights=True), "--keep-fp32-weights is an option of TensorFlow"),
    (TfOptions, dict(optimize="bert"), "--optimize is an option of ONNX models, not of TensorFlow"),
    (TfOptions, dict(external_data="single"), "--external-data is an option of ONNX models"),
])
def test_another_formats_option_is_one_line_naming_it_and_the_format(cls, options, message):
    with pytest.raises(AmpError) as caught:
        format_options(cls, options)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert format_options(cls, {name: None for name in options}) == cls()  # unset: no error
    with pytest.raises(TypeError):
        format_options(cls, {"no_such_option": 1})


def test_the_api_and_the_cli_refuse_another_formats_option(tmp_path, capsys):
    model = BUILDERS["transformer_block"]()
    with pytest.raises(AmpError, match="--outputs is an option of TensorFlow models"):
        amp_rewriter.convert(model, outputs=["y"])
    source = tmp_path / "m.onnx"
    source.write_bytes(model.SerializeToString())
    assert main(["convert", str(source), str(tmp_path / "o.onnx"), "--outputs", "y"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--outputs is an option of TensorFlow models, not of ONNX" in err[0]
    assert not (tmp_path / "o.onnx").exists()


def test_options_reach_the_passes(tmp_path):
    model = BUILDERS["transformer_block"]()
    _, report = amp_rewriter.convert(model, keep_nodes=[".*"])
    assert all(e["precision"] in ("fp32", "n/a") for e in report.nodes)
    assert {e["kind"] for e in report.nodes if e["class"] == "fp32"} == {"user_override"}


@pytest.mark.parametrize("options, message", [
    (dict(target="fp8"), "unknown target"),
    (dict(allow=["Exp"], deny=["Exp"]), "both name 'Exp'"),
    (dict(keep_nodes=["("]), "not a valid regex"),
    (dict(config="/no/such/config.toml"), "config file not found"),
])
def test_bad_options_fail_with_one_clear_line(options, message):
    with pytest.raises(AmpError, match=message):
        Options(**options)


def test_a_config_file_joins_the_flags(tmp_path):
    config = tmp_path / "lists.toml"
    config.write_text('deny = ["Tanh"]\nkeep_nodes = ["attn/.*"]\n')
    options = Options(config=config, allow=["Exp"])
    assert options.overrides.moves == {"Tanh": "deny", "Exp": "allow"}
    assert [p.pattern for p in options.keep_node_patterns] == ["attn/.*"]


def test_training_flags_without_training_are_refused(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    model.write_bytes(BUILDERS["cnn"]().SerializeToString())
    assert main(["convert", str(model), str(tmp_path / "o.onnx"), "--growth-interval", "5"]) == 2
    assert "--growth-interval only apply with --training" in capsys.readouterr().err
    assert not (tmp_path / "o.onnx").exists()


def test_report_kinds_for_every_decision(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    model.write_bytes(BUILDERS["transformer_block"]().SerializeToString())
    report_path = tmp_path / "r.json"
    assert main(["convert", str(model), str(tmp_path / "o.onnx"), "--report", str(report_path),
                 "--quiet"]) == 0
    report = json.loads(report_path.read_text())
    kinds = {e["kind"] for e in report["nodes"]}
    assert kinds <= set(decisions.ALL_KINDS) | {""}
    assert "propagation" in kinds and "op_list" in kinds
    for entry in report["nodes"]:
        for group in entry.get("groups", []):
            assert group["kind"], (entry["name"], group)
    decided = next(e for e in report["nodes"] if e.get("groups"))
    assert main(["explain", str(report_path), decided["name"]]) == 0
    assert f"decided by: {decided['kind']}" in capsys.readouterr().out
