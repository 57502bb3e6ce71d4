"""TensorFlow inputs that ended in "unexpected <Exception>" (issue 35, item 5): a training graph
TensorFlow's importer refuses (a dangling input, a dtype mismatch, a device string it cannot
parse), a growth interval past the int32 step counter, a SavedModel whose assets hold a symlink
loop. Each is now one line naming the problem, exit 2, nothing written. In-process CLI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

tf = pytest.importorskip("tensorflow")

from conftest import one_error_line  # noqa: E402
from conftest import run_in_process as run  # noqa: E402
from test_outputs import snapshot  # noqa: E402

from testkit.models.tf_saved_models import export_tf1_simple_save  # noqa: E402
from testkit.models.tf_training import build_training_graph  # noqa: E402


@pytest.fixture(scope="module")
def training_meta(tmp_path_factory) -> bytes:
    graph = build_training_graph("mlp", "sgd")
    with graph.as_default():
        return tf.compat.v1.train.export_meta_graph().SerializeToString()


def _broken(meta_bytes: bytes, case: str) -> bytes:
    meta = tf.compat.v1.MetaGraphDef()
    meta.ParseFromString(meta_bytes)
    node = next(nd for nd in meta.graph_def.node if nd.op == "MatMul")
    if case == "device_garbage":
        node.device = "garbage"
    elif case == "dangling_input":
        node.input[0] = "no_such_node:0"
    elif case == "dtype_mismatch":
        node.attr["T"].type = tf.int32.as_datatype_enum
    return meta.SerializeToString()


@pytest.mark.parametrize("case, args, message", [
    ("device_garbage", [], "the training graph does not import into TensorFlow: Unknown "
                           "attribute 'garbage'"),
    ("dangling_input", [], "the training graph does not import into TensorFlow: Node"),
    ("dtype_mismatch", [], "the training graph does not import into TensorFlow: Input 0"),
    ("", ["--growth-interval", str(10**23)], "the growth interval must be an integer from 1 "
                                              "to 2147483647"),
    ("", ["--hysteresis", str(2**31)], "hysteresis must be an integer from 1 to 2147483647"),
])
def test_training_graphs_tensorflow_refuses_are_one_line(tmp_path: Path, capsys, training_meta,
                                                         case, args, message) -> None:
    source = tmp_path / "train.meta"
    source.write_bytes(_broken(training_meta, case) if case else training_meta)
    before = snapshot(tmp_path)
    code, _, err = run(capsys, "convert", source, tmp_path / "out.meta", "--training", *args)
    assert code == 2
    line = one_error_line(err)
    assert message in line and "unexpected" not in line, line
    assert snapshot(tmp_path) == before


def test_a_savedmodel_with_a_symlink_loop_in_its_assets_is_refused(tmp_path: Path,
                                                                   capsys) -> None:
    saved = export_tf1_simple_save(tmp_path / "saved")
    (saved / "assets").mkdir(exist_ok=True)
    os.symlink("loop_b", saved / "assets" / "loop_a")
    os.symlink("loop_a", saved / "assets" / "loop_b")
    before = snapshot(tmp_path)
    for args in (["convert", saved, tmp_path / "out"], ["check", saved]):
        code, _, err = run(capsys, *args)
        assert code == 2
        line = one_error_line(err)
        assert "assets/loop_a is a symlink that cannot be resolved" in line, line
    assert snapshot(tmp_path) == before
