"""bf16 for a CPU backend on a CPU without native bf16 (no avx512_bf16 / amx_bf16): one warning
that the model will likely run slower than fp32 here, naming the flags looked for and what would
help; the report records the host check either way. The CPU description comes from the file
AMP_REWRITER_CPUINFO names (here: one without bf16 and one with it), as from /proc/cpuinfo."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_in_process

from amp_rewriter.host import read_cpuinfo
from testkit.builder import GraphBuilder

#: /proc/cpuinfo of an AVX2 server (abridged) and of a Sapphire Rapids one.
AVX2_CPU = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx avx2 fma f16c\n"
BF16_CPU = ("processor\t: 0\nvendor_id\t: GenuineIntel\n"
            "flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
ARM_CPU = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32 atomics\n"


@pytest.fixture
def layer_norms(tmp_path: Path) -> Path:
    """Two LayerNormalizations around a Relu: with --allow LayerNormalization, the norms run
    bf16 on ort-cpu (it has their bf16 kernel), the Relu stays fp32 (it has none)."""
    b = GraphBuilder(opset=17)
    x = b.input("x", [4, 8])
    gamma, beta = b.const("g", np.ones(8, np.float32)), b.const("b", np.zeros(8, np.float32))
    h = b.op("Relu", b.op("LayerNormalization", x, gamma, beta, name="ln1"), name="relu")
    b.output(b.op("LayerNormalization", h, gamma, beta, name="ln2"))
    path = tmp_path / "ln.onnx"
    onnx.save(b.build(), str(path))
    return path


def _convert(capsys, monkeypatch, tmp_path: Path, model: Path, cpuinfo: str | None,
             *options: str) -> tuple[str, dict]:
    if cpuinfo is not None:
        (tmp_path / "cpuinfo").write_text(cpuinfo)
        monkeypatch.setenv("AMP_REWRITER_CPUINFO", str(tmp_path / "cpuinfo"))
    report = tmp_path / "report.json"
    code, _, err = run_in_process(capsys, "convert", model, tmp_path / "out.onnx", "--report",
                                  report, *options)
    assert code == 0, err
    return err, json.loads(report.read_text())


def test_bf16_on_ort_cpu_without_native_bf16_warns_that_it_will_be_slower(
        layer_norms, tmp_path, capsys, monkeypatch) -> None:
    err, report = _convert(capsys, monkeypatch, tmp_path, layer_norms, AVX2_CPU, "--target",
                           "bf16", "--backend", "ort-cpu", "--allow", "LayerNormalization")
    assert report["summary"]["low_precision_nodes"] == 2
    slower = [line for line in err.splitlines() if "slower than fp32" in line]
    assert len(slower) == 1
    assert "lists no avx512_bf16 or amx_bf16" in slower[0]  # the flags it looked for
    assert "onnxruntime emulates the bf16 kernels" in slower[0]
    assert "fp16 storage of the weights only" in slower[0]  # what would help
    assert report["host"] == {"cpuinfo": str(tmp_path / "cpuinfo"), "machine": report["host"]["machine"],
                              "looked_for": ["avx512_bf16", "amx_bf16"], "found": [],
                              "native_bf16": False}


def test_no_warning_where_the_cpu_has_bf16_or_nothing_runs_in_it(
        layer_norms, tmp_path, capsys, monkeypatch) -> None:
    err, report = _convert(capsys, monkeypatch, tmp_path, layer_norms, BF16_CPU, "--target",
                           "bf16", "--backend", "ort-cpu", "--allow", "LayerNormalization")
    assert "slower than fp32" not in err
    assert report["host"]["found"] == ["avx512_bf16", "amx_bf16"] and report["host"]["native_bf16"]
    # Nothing converted: nothing to be slower (the warning that says so is another one).
    err, report = _convert(capsys, monkeypatch, tmp_path, layer_norms, AVX2_CPU, "--target",
                           "bf16", "--backend", "ort-cpu")
    assert report["summary"]["low_precision_nodes"] == 0 and "slower than fp32" not in err
    assert report["host"]["native_bf16"] is False
    # An Arm CPU is asked for its own flag.
    err, report = _convert(capsys, monkeypatch, tmp_path, layer_norms, ARM_CPU, "--target",
                           "bf16", "--backend", "ort-cpu", "--allow", "LayerNormalization")
    assert "lists no bf16" in err and report["host"]["looked_for"] == ["bf16"]


def test_fp16_and_gpu_backends_have_no_host_check(layer_norms, tmp_path, capsys, monkeypatch) -> None:
    for options in (("--target", "fp16", "--backend", "ort-cpu"),
                    ("--target", "bf16", "--backend", "ort-cuda")):
        err, report = _convert(capsys, monkeypatch, tmp_path, layer_norms, AVX2_CPU, *options)
        assert "host" not in report and "slower than fp32" not in err


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="no /proc/cpuinfo here")
def test_proc_cpuinfo_is_read_whole_though_it_says_its_size_is_zero() -> None:
    text = read_cpuinfo("/proc/cpuinfo")
    assert text == Path("/proc/cpuinfo").read_text(errors="replace")
    assert "processor" in text
