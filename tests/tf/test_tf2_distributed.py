"""The TF2 hook under TensorFlow's distribution strategies, each run by its example script in
fresh processes (logical devices are fixed before TensorFlow starts; workers are processes):
MirroredStrategy over two logical CPUs, per replica and around the whole step, with an inf in
replica 1's shard and then replica 0's; MultiWorkerMirroredStrategy with two workers on
localhost, an inf on one worker only. The long runs (300 and 20 steps) are the same scripts
with their defaults."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(script: str, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True,
                          text=True, timeout=timeout)


def test_mirrored_replicas_all_skip_a_step_with_an_inf_in_one_shard(tmp_path):
    out = tmp_path / "mirrored.json"
    result = _run("tf2_mirrored.py", "--steps", "6", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    runs = {run["form"]: run for run in json.loads(out.read_text())}
    for form in ("per_replica", "whole"):
        run = runs[form]
        assert run["bad_steps_left_every_copy_unchanged"] == [True, True], run
        assert run["copies_identical"] and run["skipped_steps"] == 2, run
        assert run["loss_scale"] == 2.0 ** 13 and run["optimizer_steps"] == 4, run


def test_two_workers_both_skip_an_inf_on_one_worker_and_stay_equal(tmp_path):
    out = tmp_path / "workers.json"
    result = _run("tf2_multi_worker.py", "--steps", "4", "--bad-step", "1", "--bad-worker", "1",
                  "--form", "per_replica", "--timeout", "300", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    first, second = json.loads(out.read_text())
    assert first["digests"] == second["digests"]  # equal weights after every step
    for worker in (first, second):
        assert worker["skipped_steps"] == 1 and worker["optimizer_steps"] == 3, worker
        assert worker["loss_scale"] == 2.0 ** 14, worker
