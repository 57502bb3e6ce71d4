"""Shared test helpers: run the amp_rewriter CLI as a subprocess, record conversions on request."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Every conversion in the tests, in-process or through the CLI, checks the IR's invariants after
# loading and after every pass (an error names the pass that broke them).
os.environ["AMP_REWRITER_LINT"] = "1"

# AMP_REWRITER_RECORD_CASES=DIR: every in-process conversion is kept as a case for
# scripts/same_output.py (installed before test modules import the entry points).
if os.environ.get("AMP_REWRITER_RECORD_CASES"):
    from testkit.record_cases import install as _install_recorder

    _install_recorder()

#: Generous per-call limit: a hung CLI should fail one test, not stall the suite.
CLI_TIMEOUT_S = 120

CliRunner = Callable[..., subprocess.CompletedProcess]


def run_amp_rewriter(*args: str | os.PathLike) -> subprocess.CompletedProcess:
    """Run ``python -m amp_rewriter ARGS...`` from the repo root and capture its output as text."""
    env = dict(os.environ)
    # Works whether or not the package is pip-installed into the venv.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "amp_rewriter", *map(str, args)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )


@pytest.fixture(scope="session")
def amp_cli() -> CliRunner:
    """The CLI runner as a fixture, so module-scoped fixtures can depend on it."""
    return run_amp_rewriter


def describe_run(result: subprocess.CompletedProcess) -> str:
    """A failure message that shows what the CLI printed."""
    return f"exit code {result.returncode}\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"


def run_in_process(capsys: pytest.CaptureFixture, *args: str | os.PathLike
                   ) -> tuple[int, str, str]:
    """The CLI's `main` in this process: (exit code, stdout, stderr)."""
    from amp_rewriter import cli

    code = cli.main([str(a) for a in args])
    printed = capsys.readouterr()
    return code, printed.out, printed.err


def one_error_line(err: str) -> str:
    """The single line an error prints (asserting there is one, and no traceback)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]
