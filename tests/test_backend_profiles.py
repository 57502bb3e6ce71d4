"""Backend profiles are validated data: each names its runtime, providers, device, emulation and
kernel source; an unknown key is an error naming the file and key; a profile in a config file
is used end to end (convert, --validate, --auto's execution, check), chosen by its fields and
not by its name."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from conftest import run_in_process as run

from amp_rewriter import op_lists
from amp_rewriter.errors import AmpError
from amp_rewriter.formats.onnx.execution import select_execution
from amp_rewriter.op_lists import BackendProfile, OpLists, Overrides
from testkit.builder import GraphBuilder


def small_model(path: Path) -> Path:
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    hidden = b.op("Relu", b.op("MatMul", x, b.weight("w", [8, 8], scale=0.5)))
    b.output(b.op("MatMul", hidden, b.weight("v", [8, 4], scale=0.5)))
    onnx.save(b.build(), str(path))
    return path


def config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


#: A profile of the user's: ort-cpu's tables, run natively on the CPU provider (no emulation).
NATIVE_CPU = """
[backends.native-cpu]
extends = "ort-cpu"
description = "onnxruntime's CPU provider, measured as it runs"
emulation = "never"

[backends.native-cpu.fp16]
deny = ["Relu"]
"""


def test_every_builtin_profile_names_how_it_runs() -> None:
    for fmt, runtime in (("onnx", "onnxruntime"), ("tf", "tensorflow")):
        found = op_lists.builtin_profiles(fmt)
        assert found, fmt
        for profile in found.values():
            assert profile.runtime == runtime
            assert profile.device in op_lists.DEVICES
            assert profile.emulation in op_lists.EMULATIONS
            assert profile.kernel_source in op_lists.KERNEL_SOURCES
        for target in op_lists.TARGETS:  # one default per target
            assert sum(target in p.default_for for p in found.values()) == 1


def test_an_unknown_key_in_a_config_profile_names_the_file_and_key(tmp_path: Path) -> None:
    bad = config(tmp_path / "typo.toml", NATIVE_CPU.replace("emulation", "emulaton"))
    with pytest.raises(AmpError, match=r"typo\.toml: \[backends\.native-cpu\]: unknown "
                                       r"key\(s\) 'emulaton'"):
        Overrides.from_config(bad)
    bad = config(tmp_path / "typo2.toml", NATIVE_CPU.replace("deny", "dney"))
    with pytest.raises(AmpError, match=r"typo2\.toml: \[backends\.native-cpu\.fp16\]: unknown "
                                       r"key\(s\) 'dney'"):
        Overrides.from_config(bad)
    bad = config(tmp_path / "value.toml", NATIVE_CPU.replace('"never"', '"sometimes"'))
    with pytest.raises(AmpError, match=r"value\.toml: \[backends\.native-cpu\]: emulation "
                                       r"'sometimes' is not one of never, fallback, always"):
        Overrides.from_config(bad)


def test_an_unknown_key_in_a_builtin_profile_names_the_list_file(monkeypatch) -> None:
    data = dict(op_lists.read_list_file("onnx"))
    backends = {name: dict(table) for name, table in data["backends"].items()}
    backends["ort-cpu"]["kernel_sources"] = "table"
    monkeypatch.setitem(op_lists._LIST_CACHE, "onnx", {**data, "backends": backends})
    monkeypatch.delitem(op_lists._PROFILE_CACHE, "onnx", raising=False)
    with pytest.raises(AmpError, match=r"onnx\.toml: \[backends\.ort-cpu\]: unknown key\(s\) "
                                       r"'kernel_sources'"):
        OpLists.load("onnx", "fp16", "ort-cpu")


def test_a_profile_needs_its_runtime_fields() -> None:
    with pytest.raises(AmpError, match=r"x\.toml: \[backends\.mine\]: 'runtime' is required"):
        BackendProfile.from_table("mine", {"format": "onnx", "description": "d"}, "x.toml")


def test_backend_help_lists_the_profiles_from_the_data(capsys) -> None:
    from amp_rewriter.cli import main

    text = " ".join(op_lists.backend_help().split())
    for name in (*op_lists.builtin_profiles("onnx"), *op_lists.builtin_profiles("tf")):
        assert name in text
    assert "ort-cuda (default)" in text and "tf-cpu (default for bf16)" in text
    for command in ("convert", "check"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "tf-gpu (default for fp16)" in " ".join(capsys.readouterr().out.split())


def test_a_config_profile_is_used_end_to_end(tmp_path: Path, capsys) -> None:
    source = small_model(tmp_path / "m.onnx")
    cfg = config(tmp_path / "profiles.toml", NATIVE_CPU)
    output, report = tmp_path / "m16.onnx", tmp_path / "r.json"
    code, out, err = run(capsys, "convert", source, output, "--backend", "native-cpu",
                         "--config", cfg, "--validate", "--report", report)
    assert code == 0, err
    data = json.loads(report.read_text())
    assert data["backend"] == "native-cpu"
    # Its own table: Relu is deny there (fp32), and its reason says whose list it is.
    relu = next(entry for entry in data["nodes"] if entry["op"] == "Relu")
    assert relu["precision"] == "fp32" and "native-cpu" in relu["reason"]
    # --validate ran where the profile says: natively on the CPU provider, not emulated.
    assert {o["computed"] for o in data["validation"]["outputs"]} == {"CPUExecutionProvider"}
    # The built-in default for the same model is emulated on this CPU-only machine.
    code, _, err = run(capsys, "convert", source, tmp_path / "d.onnx", "--validate",
                       "--report", tmp_path / "d.json", "--backend", "ort-cpu")
    assert code == 0, err
    emulated = json.loads((tmp_path / "d.json").read_text())["validation"]["outputs"]
    assert {o["computed"] for o in emulated} != {"CPUExecutionProvider"}
    # check knows the profile from the same config, and runs --reference there too.
    code, out, _ = run(capsys, "check", output, "--config", cfg, "--backend", "native-cpu",
                       "--reference", source, "--format", "json")
    assert code == 0, out
    assert "native-cpu" in out and "CPUExecutionProvider" in out


def test_a_profile_whose_providers_are_missing_is_refused_not_replaced(tmp_path: Path,
                                                                       capsys) -> None:
    source = small_model(tmp_path / "m.onnx")
    cfg = config(tmp_path / "trt.toml", """
[backends.my-trt]
extends = "ort-cuda"
description = "TensorRT through onnxruntime"
providers = ["TensorrtExecutionProvider", "CUDAExecutionProvider"]
emulation = "never"
""")
    code, _, err = run(capsys, "convert", source, tmp_path / "o.onnx", "--backend", "my-trt",
                       "--config", cfg, "--validate")
    assert code == 2
    assert "backend my-trt: this onnxruntime has no TensorrtExecutionProvider" in err
    # Without --validate the conversion uses its tables (ort-cuda's) and needs no runtime.
    code, _, err = run(capsys, "convert", source, tmp_path / "o.onnx", "--backend", "my-trt",
                       "--config", cfg)
    assert code == 0, err


def test_auto_measures_where_the_profile_runs(tmp_path: Path) -> None:
    overrides = Overrides.from_config(config(tmp_path / "p.toml", NATIVE_CPU))
    native = select_execution(overrides.backends["native-cpu"], "fp16")
    assert native.providers == ("CPUExecutionProvider",) and not native.emulate
    builtin = select_execution(op_lists.find_profile("onnx", "ort-cpu"), "fp16")
    assert builtin.emulate
    assert select_execution(op_lists.find_profile("onnx", "ort-cpu"), "fp16", "cpu").emulate


def test_a_profile_for_another_runtime_is_refused(tmp_path: Path, capsys) -> None:
    source = small_model(tmp_path / "m.onnx")
    cfg = config(tmp_path / "p.toml", """
[backends.odd]
format = "onnx"
description = "an ONNX profile that says TensorFlow runs it"
runtime = "tensorflow"
device = "cpu"
emulation = "never"
kernel_source = "table"
""")
    code, _, err = run(capsys, "convert", source, tmp_path / "o.onnx", "--backend", "odd",
                       "--config", cfg, "--validate")
    assert code == 2
    assert "backend odd" in err and "runs on tensorflow" in err

