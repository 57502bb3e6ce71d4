"""`check` where CI systems read it: JUnit XML (read back with junitparser, a JUnit reader of its
own), a Markdown summary with the verdict first, JSON on stdout, several models in one run (as
a pre-commit hook passes them), GitHub's step summary; every file through the output
transaction, the same bytes for the same check."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import onnx
import pytest
from conftest import REPO_ROOT, describe_run, one_error_line
from junitparser import Failure, JUnitXml, Skipped
from onnx import TensorProto, helper

from testkit.models import BUILDERS


def run_cli(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "GITHUB_STEP_SUMMARY"}
    environment["PYTHONPATH"] = str(REPO_ROOT)
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", "amp_rewriter", *map(str, args)],
                          capture_output=True, text=True, timeout=180, env=environment)


def _two_deny_ops_in_fp16() -> onnx.ModelProto:
    """x -> fp16 -> Exp and CumSum (both on the fp16 deny list) -> fp32."""
    nodes = [helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16, name="to16"),
             helper.make_node("Exp", ["x16"], ["e16"], name="exp"),
             helper.make_node("CumSum", ["e16", "axis"], ["l16"], name="cumsum"),
             helper.make_node("Cast", ["l16"], ["y"], to=TensorProto.FLOAT, name="to32")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                              [helper.make_tensor("axis", TensorProto.INT64, [], [0])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("ci")
    paths = {"bad": folder / "bad.onnx", "fp32": folder / "block.onnx",
             "converted": folder / "block_fp16.onnx"}
    onnx.save(_two_deny_ops_in_fp16(), str(paths["bad"]))
    onnx.save(BUILDERS["transformer_block"](), str(paths["fp32"]))
    result = run_cli("convert", paths["fp32"], paths["converted"])
    assert result.returncode == 0, describe_run(result)
    return paths


def test_junit_has_a_failing_case_per_finding_and_a_case_per_rule(models, tmp_path: Path) -> None:
    junit, report = tmp_path / "check.xml", tmp_path / "check.json"
    result = run_cli("check", models["bad"], models["converted"], "--junit", junit,
                     "--report", report)
    assert result.returncode == 1, describe_run(result)
    findings = json.loads(report.read_text())
    assert not findings["ok"] and [m["model"] for m in findings["models"]] == [
        str(models["bad"]), str(models["converted"])]
    problems = findings["models"][0]["problems"]
    assert [p["node"] for p in problems] == ["exp", "cumsum"]

    suites = list(JUnitXml.fromfile(str(junit)))
    assert [suite.name for suite in suites] == [str(models["bad"]), str(models["converted"])]
    bad, good = suites
    failing = [case for case in bad if any(isinstance(r, Failure) for r in case.result)]
    assert len(failing) == len(problems) == bad.failures == 2
    assert {case.name for case in failing} == {"deny_op_in_low_precision: exp",
                                               "deny_op_in_low_precision: cumsum"}
    messages = {r.message for case in failing for r in case.result}
    assert messages == {p["message"] for p in problems}
    # Every other rule class of the format is a case of its own: passed, or skipped when it
    # needs the fp32 model.
    names = [case.name for case in good]
    assert names == ["invalid_model", "deny_op_in_low_precision", "constant_overflow",
                     "constant_flushed", "run_failed", "output_mismatch"]
    skipped = [case.name for case in good if any(isinstance(r, Skipped) for r in case.result)]
    assert skipped == ["constant_overflow", "run_failed", "output_mismatch"]
    assert good.failures == 0 and good.tests == 6
    # The report's details ride along as each suite's system-out (which junitparser does not
    # read: the standard library does).
    outs = [suite.findtext("system-out") for suite in ElementTree.parse(junit).getroot()]
    assert "exp (Exp) runs in low precision" in outs[0] and outs[0].endswith("check: 2 problem(s)")
    assert outs[1].startswith("cost: ") and outs[1].endswith("check: ok")


def test_summary_puts_the_verdict_first_and_is_the_same_bytes_twice(models, tmp_path: Path) -> None:
    summaries = []
    for attempt in range(2):
        summary, junit = tmp_path / f"summary{attempt}.md", tmp_path / f"check{attempt}.xml"
        result = run_cli("check", models["converted"], "--reference", models["fp32"],
                         "--summary", summary, "--junit", junit)
        assert result.returncode == 0, describe_run(result)
        summaries.append((summary.read_bytes(), junit.read_bytes()))
    assert summaries[0] == summaries[1]
    text = summaries[0][0].decode()
    assert text.splitlines()[0] == "## ✅ amp-rewriter check: passed"
    assert "`cost: 95% of" in text and "| out |" in text  # the cost line and the output compared
    suite = next(iter(JUnitXml.fromfile(str(tmp_path / "check0.xml"))))
    assert suite.tests == 6 and suite.failures == 0 and suite.skipped == 0


def test_failed_summary_lists_the_findings(models, tmp_path: Path) -> None:
    summary = tmp_path / "summary.md"
    result = run_cli("check", models["bad"], "--summary", summary)
    assert result.returncode == 1
    lines = summary.read_text().splitlines()
    assert lines[0] == "## ❌ amp-rewriter check: failed (2 problem(s))"
    assert "| deny_op_in_low_precision | exp | exp (Exp) runs in low precision" in "\n".join(lines)


def test_github_step_summary_is_appended_to(models, tmp_path: Path) -> None:
    step_summary = tmp_path / "step_summary.md"
    step_summary.write_text("# earlier step\n")
    result = run_cli("check", models["converted"], env={"GITHUB_STEP_SUMMARY": str(step_summary)})
    assert result.returncode == 0, describe_run(result)
    text = step_summary.read_text()
    assert text.startswith("# earlier step\n## ✅ amp-rewriter check: passed")


def test_json_on_stdout_is_the_report(models, tmp_path: Path) -> None:
    report = tmp_path / "check.json"
    result = run_cli("check", models["bad"], "--format", "json", "--report", report)
    assert result.returncode == 1
    assert json.loads(result.stdout) == json.loads(report.read_text())
    assert json.loads(result.stdout)["problems"][0]["kind"] == "deny_op_in_low_precision"
    assert one_error_line(result.stderr).endswith(f"2 problem(s) in {models['bad']}")


def test_ci_outputs_that_collide_are_refused_before_anything_is_written(models, tmp_path: Path) -> None:
    before = models["converted"].read_bytes()
    for args in (["--junit", models["converted"]],                       # the model itself
                 ["--summary", models["converted"].with_suffix(".onnx")],
                 ["--junit", tmp_path / "same", "--summary", tmp_path / "same"]):
        result = run_cli("check", models["converted"], *args)
        assert result.returncode == 2, describe_run(result)
        line = one_error_line(result.stderr)
        assert "refusing" in line or "also written as" in line, line
    assert models["converted"].read_bytes() == before
    assert not (tmp_path / "same").exists()
    result = run_cli("check", models["converted"], models["bad"], "--reference", models["fp32"])
    assert result.returncode == 2 and "give one model" in one_error_line(result.stderr)


def test_the_github_actions_job_runs_as_written(tmp_path: Path) -> None:
    """The job's amp-rewriter steps, run as written in a copy of what they read (the install
    step is this test's own environment)."""
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load((REPO_ROOT / "docs" / "ci" / "github-actions.yml").read_text())
    (job,) = workflow["jobs"].values()
    example = tmp_path / "examples" / "tiny_cnn.onnx"
    example.parent.mkdir(parents=True)
    shutil.copy(REPO_ROOT / "examples" / "tiny_cnn.onnx", example)
    step_summary = tmp_path / "step_summary.md"
    env = {**os.environ, **workflow["env"], "GITHUB_STEP_SUMMARY": str(step_summary),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    ran = []
    for step in job["steps"]:
        if "run" not in step or "pip install" in step["run"]:
            continue
        result = subprocess.run(["bash", "-eo", "pipefail", "-c", step["run"]], cwd=tmp_path,
                                env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, (step["name"], describe_run(result))
        ran.append(step["name"])
    assert ran == ["Convert", "Check against the fp32 model"]
    suites = list(JUnitXml.fromfile(str(tmp_path / "out" / "amp-rewriter-check.xml")))
    assert len(suites) == 1 and suites[0].failures == 0 and suites[0].skipped == 0
    assert step_summary.read_text().startswith("## ✅ amp-rewriter check: passed")
    assert (tmp_path / "out" / "precision_map.png").read_bytes()[:4] == b"\x89PNG"
    for uses in ("actions/checkout@", "EnricoMi/publish-unit-test-result-action@",
                 "actions/upload-artifact@"):
        assert any(step.get("uses", "").startswith(uses) for step in job["steps"]), uses
