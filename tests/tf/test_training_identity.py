"""The training rewrite on the IR trains bit-identically to the rewrite it replaced: two of the
cases of testkit.training_identity (scripts/training_identity.py), run against the baseline commit (git archive)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "training_identity.py"
CASES = "mlp-adam-ref-step-2-fp16,batch_norm-fp16"


def _baseline_reachable() -> bool:
    from testkit.training_identity import BASELINE

    if shutil.which("git") is None or not (REPO / ".git").exists():
        return False
    probe = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{BASELINE}^{{commit}}"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _baseline_reachable(), reason="needs the git history (a clone)")
def test_two_graphs_train_bit_identically_to_the_baseline_rewrite():
    run = subprocess.run([sys.executable, str(SCRIPT), "--cases", CASES], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 of 2 cases bit-identical" in run.stdout
