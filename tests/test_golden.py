"""Golden texts: what `convert --report` writes and what `explain` prints for every node (and every
inserted cast) of a few small models, compared byte for byte with tests/golden/.

A change to a decision, a reason, a count or the wording of either text shows up here as a diff
of the checked-in files. After an intended change, regenerate them and review the diff:

    AMP_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py
    git diff tests/golden/

The texts must not depend on the machine or the run: the models are built from fixed seeds, the
report holds no timings or paths (checked below), and the one host-dependent part of a report,
`host` (the CPU flags behind the bf16-on-CPU warning), is removed with that warning before the
comparison (see `_report_text`). No case converts to bf16 for a CPU backend today, so nothing is
removed; the normalisation keeps a new such case from making the test pass on one machine only.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_in_process as run

from amp_rewriter.report import to_json
from testkit.builder import GraphBuilder
from testkit.models import BUILDERS

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("AMP_UPDATE_GOLDEN") == "1"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _masked_attention() -> onnx.ModelProto:
    """Attention scores masked with finfo(float32).min (BERT's form) before a Softmax: the
    attention-mask rule's case, with its saturation and its entry in `structures`."""
    b = GraphBuilder(seed=3)
    x = b.input("x", [2, 4, 8])
    q = b.op("MatMul", x, b.weight("wq", [8, 8], scale=0.3), name="query")
    k = b.op("Transpose", b.op("MatMul", x, b.weight("wk", [8, 8], scale=0.3), name="key"),
             perm=[0, 2, 1], name="key_t")
    scores = b.op("MatMul", q, k, name="scores")
    mask = np.zeros((2, 1, 4), np.float32)
    mask[1, 0, 3] = np.finfo(np.float32).min
    probs = b.op("Softmax", b.op("Add", scores, b.const("mask", mask), name="masked"), axis=-1,
                 name="probs")
    b.output(b.op("MatMul", probs, b.op("MatMul", x, b.weight("wv", [8, 8]), name="value"),
                  name="context"))
    return b.build()


def _onnx(build: Callable[[], onnx.ModelProto]) -> Callable[[Path], tuple[Path, list[str]]]:
    def write(folder: Path) -> tuple[Path, list[str]]:
        path = folder / "model.onnx"
        onnx.save(build(), str(path))
        return path, []
    return write


def _tiny_cnn(folder: Path) -> tuple[Path, list[str]]:
    return Path(shutil.copy(EXAMPLES / "tiny_cnn.onnx", folder / "model.onnx")), []


def _tf_graph(name: str, *args: str) -> Callable[[Path], tuple[Path, list[str]]]:
    def write(folder: Path) -> tuple[Path, list[str]]:
        pytest.importorskip("tensorflow")
        from testkit.models import tf_graphs

        graph_def, outputs = getattr(tf_graphs, name)()
        path = folder / "model.pb"
        path.write_bytes(graph_def.SerializeToString(deterministic=True))
        return path, ["--outputs", ",".join(outputs), *args]
    return write


#: case name -> writes the source model into a folder: (its path, convert's extra arguments)
CASES: dict[str, Callable[[Path], tuple[Path, list[str]]]] = {
    "onnx_tiny_cnn": _tiny_cnn,
    "onnx_transformer_block": _onnx(lambda: BUILDERS["transformer_block"]()),
    "onnx_control_flow_bf16": lambda folder: (_onnx(BUILDERS["control_flow"])(folder)[0],
                                              ["--target", "bf16"]),
    "onnx_masked_attention": _onnx(_masked_attention),
    "tf_exp_pow_deny": _tf_graph("exp_pow_deny", "--target", "fp16"),
    "tf_conv_matmul_bf16": _tf_graph("conv_matmul", "--target", "bf16", "--backend", "tf-gpu"),
}


def _report_text(text: str) -> str:
    """The report as `convert --report` wrote it, less its host-dependent part: `host` (this
    machine's CPU flags) and the warning made from it (whether this CPU has native bf16)."""
    data = json.loads(text)
    if "host" not in data:
        return text
    del data["host"]
    data["warnings"] = [w for w in data["warnings"] if "this CPU has no native bf16" not in w]
    return to_json(data)


def _explain_text(capsys: pytest.CaptureFixture, report: Path) -> str:
    """`explain REPORT NAME` for each node name of the report (once per name: a name several
    graphs share is explained for each of them in one answer) and each inserted cast."""
    data = json.loads(report.read_text())
    names = list(dict.fromkeys(node["name"] for node in data["nodes"]))
    names += [cast["name"] for cast in data.get("cost", {}).get("inserted_casts", [])]
    pieces = []
    for name in names:
        code, out, err = run(capsys, "explain", report, name)
        assert code == 0 and not err, (name, err)
        pieces.append(f"$ amp-rewriter explain REPORT {name}\n{out}")
    return "\n".join(pieces)


@pytest.mark.parametrize("case", sorted(CASES))
def test_report_and_explain_match_the_golden_texts(case: str, tmp_path: Path, capsys) -> None:
    source, extra = CASES[case](tmp_path)
    report = tmp_path / "report.json"
    code, _, err = run(capsys, "convert", source, tmp_path / f"out{source.suffix}",
                       "--report", report, "--quiet", *extra)
    assert code == 0, err
    texts = {f"{case}.report.json": _report_text(report.read_text()),
             f"{case}.explain.txt": _explain_text(capsys, report)}
    for name, text in texts.items():
        # nothing of this run in the text: no temporary folder, no file name of the case
        assert str(tmp_path) not in text and "report.json" not in text, name
        golden = GOLDEN / name
        if UPDATE:
            golden.parent.mkdir(exist_ok=True)
            golden.write_text(text)
            continue
        assert golden.is_file(), f"no {golden}: run with AMP_UPDATE_GOLDEN=1 to write it"
        assert text == golden.read_text(), (
            f"{name} differs from tests/golden (if the change is intended: AMP_UPDATE_GOLDEN=1 "
            f".venv/bin/python -m pytest tests/test_golden.py, then review git diff tests/golden)")


def test_every_golden_file_belongs_to_a_case() -> None:
    """A renamed or dropped case leaves no stale golden file behind."""
    expected = {f"{case}.{kind}" for case in CASES for kind in ("report.json", "explain.txt")}
    assert {path.name for path in GOLDEN.iterdir()} == expected
