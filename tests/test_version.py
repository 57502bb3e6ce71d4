"""`amp-rewriter --version` prints the version pip installed (the package's metadata)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

from conftest import run_amp_rewriter

import amp_rewriter


def test_version_comes_from_the_package_metadata() -> None:
    installed = metadata.version("amp-rewriter")
    assert amp_rewriter.__version__ == installed
    result = run_amp_rewriter("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"amp-rewriter {installed}\n"


def test_the_console_script_prints_it_too() -> None:
    script = Path(sys.executable).with_name("amp-rewriter")
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["amp-rewriter", metadata.version("amp-rewriter")]
