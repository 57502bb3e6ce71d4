"""16-bit weights (`weights=`, `--weights`): stored in fp16/bf16 (checkpoints too), updated in
fp32 and rounded back stochastically (reproducible, keyed by seed, variable and step) or to
nearest. The long runs: scripts/training_weights.py (digits) and examples/tf2_weights_sum.py."""

from __future__ import annotations

import functools

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from conftest import one_error_line, run_in_process  # noqa: E402

from amp_rewriter.errors import AmpError  # noqa: E402
from amp_rewriter.tf import check_tf_graph, rewrite_training_graph  # noqa: E402
from testkit.models.tf_training import (  # noqa: E402
    build_training_graph,
    classic_sum_graph,
    digits_data,
    train,
)

v1 = tf.compat.v1


def _sum_after(result, steps: int, resource: bool) -> np.ndarray:
    with v1.Session(graph=result.graph) as session:
        session.run("init")
        for _ in range(steps):
            session.run(result.train_op, {"x:0": [[1.0]]})
        return session.run("w/Read/ReadVariableOp:0" if resource else "w:0")


@pytest.mark.parametrize("resource, weights", [(False, "fp16"), (True, "bf16")])
def test_small_updates_add_up_with_stochastic_rounding_and_stall_to_nearest(resource, weights):
    # from 0.25, 1e-4 is below half an fp16 (and bf16) unit: round-to-nearest never moves
    graph = functools.partial(classic_sum_graph, copies=400, start=0.25, resource=resource)
    steps, expected = 200, 0.25 + 200 * 1e-4

    def run(**options):
        result = rewrite_training_graph(graph(), loss="loss", train_op="train",
                                        loss_scale=1024, **options)
        return result, _sum_after(result, steps, resource)

    result, stochastic = run(weights=weights)
    assert stochastic.dtype == {"fp16": np.float16, "bf16": tf.bfloat16.as_numpy_dtype}[weights]
    assert abs(float(stochastic.astype(np.float64).mean()) - expected) < 0.002
    assert result.report.training["variables_stored_16bit"] == {
        "w": {"fp16": "float16", "bf16": "bfloat16"}[weights]}
    _, again = run(weights=weights)
    assert np.array_equal(again.view(np.uint16), stochastic.view(np.uint16))  # reproducible
    _, reseeded = run(weights=weights, rounding_seed=7)
    assert not np.array_equal(reseeded.view(np.uint16), stochastic.view(np.uint16))
    _, nearest = run(weights=weights, rounding="nearest")
    assert np.all(nearest.astype(np.float32) == 0.25)
    _, master = run()
    assert master.dtype == np.float32 and abs(float(master.mean()) - expected) < 1e-5


def test_checkpoints_hold_half_the_bytes_and_restore(tmp_path):
    graph = build_training_graph("mlp", "momentum")
    x, y = digits_data()[0][:64], digits_data()[1][:64]
    sizes = {}
    for weights in (None, "fp16"):
        result = rewrite_training_graph(graph, weights=weights)
        with result.graph.as_default():
            saver = v1.train.Saver()
        with v1.Session(graph=result.graph) as session:
            session.run("init")
            for _ in range(3):
                session.run(result.train_op, {"x:0": x, "y:0": y})
            path = saver.save(session, str(tmp_path / f"ckpt_{weights}"))
            before = {v.name: session.run(v) for v in result.graph.get_collection("variables")}
        reader = tf.train.load_checkpoint(path)
        dtypes = reader.get_variable_to_dtype_map()
        sizes[weights] = sum(reader.get_tensor(name).nbytes for name in dtypes
                             if name.startswith("model/") and "Momentum" not in name)
        if weights:
            assert {dtypes[n] for n in dtypes if n.startswith("model/")
                    and "Momentum" not in n} == {tf.float16}
            assert {dtypes[n] for n in dtypes if "Momentum" in n} == {tf.float32}  # slots
            with v1.Session(graph=result.graph) as session:
                saver.restore(session, path)
                for v in result.graph.get_collection("variables"):
                    np.testing.assert_array_equal(session.run(v), before[v.name])
    assert sizes["fp16"] * 2 == sizes[None]


@functools.cache
def _fp32_accuracy() -> float:
    return train(build_training_graph("mlp", "momentum"), steps=150, data=digits_data())[1]


def test_fp16_weights_and_slots_train_as_well_as_fp32_and_pass_check(tmp_path):
    result = rewrite_training_graph(build_training_graph("mlp", "momentum"), weights="fp16",
                                    slots="fp16")
    stored = result.report.training["variables_stored_16bit"]
    assert stored["model/w1"] == stored["model/w1/Momentum"] == "float16"
    _, accuracy = train(result.graph, steps=150, data=digits_data())
    assert accuracy >= _fp32_accuracy() - 0.02
    path = tmp_path / "fp16_weights.meta"
    with result.graph.as_default():
        v1.train.export_meta_graph(str(path))
    found = check_tf_graph(path)
    assert not [p for p in found.problems if p["kind"] == "low_precision_update"]


def test_bad_update_options_are_one_line_errors(tmp_path, capsys):
    graph = classic_sum_graph(copies=4)
    with pytest.raises(AmpError, match="--weights must be fp16, bf16 or fp32"):
        rewrite_training_graph(graph, weights="fp8")
    with pytest.raises(AmpError, match="--rounding applies to 16-bit weights"):
        rewrite_training_graph(graph, rounding="nearest")
    path = tmp_path / "sum.meta"
    with graph.as_default():
        v1.train.export_meta_graph(str(path))
    code, _, err = run_in_process(capsys, "convert", path, tmp_path / "out.meta", "--training",
                                  "--weights", "fp16", "--rounding", "down")
    assert code == 2 and "--rounding must be stochastic or nearest" in one_error_line(err)
    assert not (tmp_path / "out.meta").exists()


def _swallowed(graph, tmp_path, **options) -> list[dict]:
    """check's swallowed-update problems on `graph` rewritten with `options` (None: as is)."""
    if options:
        graph = rewrite_training_graph(graph, loss="loss", train_op="train", **options).graph
    path = tmp_path / "step.meta"
    with graph.as_default():
        v1.train.export_meta_graph(str(path))
    return [p for p in check_tf_graph(path).problems if p["kind"] == "swallowed_update"]


@pytest.mark.parametrize("resource", [False, True])
def test_check_flags_weights_rounded_to_nearest_below_half_an_ulp(resource, tmp_path):
    # 1e-4 steps on weights about 0.25: half an fp16 ulp there is 1.2e-4
    graph = classic_sum_graph(copies=4, start=0.25, resource=resource)
    found = _swallowed(graph, tmp_path, loss_scale=1024, weights="fp16", rounding="nearest")
    assert len(found) == 1 and found[0]["variable"] == "w", found
    assert "below half an ulp (0.000122) of its typical value 0.25" in found[0]["message"]
    # stochastic rounding, fp32 master weights, or a step above half an ulp: nothing
    assert not _swallowed(graph, tmp_path, loss_scale=1024, weights="fp16")
    assert not _swallowed(graph, tmp_path, loss_scale=1024)
    assert not _swallowed(classic_sum_graph(copies=4, start=0.25, update=2e-4),
                          tmp_path, loss_scale=1024, weights="fp16", rounding="nearest")
    # bf16 has 3 fewer mantissa bits: 1e-4 is swallowed on weights of 0.05 already
    assert _swallowed(classic_sum_graph(copies=4, start=0.05, resource=resource), tmp_path,
                      weights="bf16", rounding="nearest", target="bf16")


def test_check_estimates_the_weights_of_a_random_initializer(tmp_path):
    # glorot-uniform weights of the MLP (about 0.1) and momentum's steps lr / (1 - 0.9)
    fine = _swallowed(build_training_graph("mlp", "momentum"), tmp_path, weights="fp16",
                      rounding="nearest")
    assert not fine
    tiny = _swallowed(build_training_graph("mlp", "momentum", learning_rate=1e-6), tmp_path,
                      weights="fp16", rounding="nearest")
    assert {p["variable"] for p in tiny} == {"model/w1", "model/w2"}, tiny


def test_digits_runs_train_16bit_weights_within_two_points_at_half_the_bytes():
    """What scripts/training_weights.py checks, on one model for 60 steps."""
    from testkit.models.tf_training import digits_data, train_and_measure

    data = digits_data()
    fp32, fp16, bf16 = (train_and_measure("mlp", "adam", weights, 60, data)
                        for weights in (None, "fp16", "bf16"))
    assert fp16["checkpoint_weight_dtypes"] == ["float16"]
    assert bf16["checkpoint_weight_dtypes"] == ["bfloat16"]
    assert 2 * fp16["checkpoint_weight_bytes"] == fp32["checkpoint_weight_bytes"]
    assert 2 * bf16["checkpoint_weight_bytes"] == fp32["checkpoint_weight_bytes"]
    assert fp16["test_accuracy"] >= fp32["test_accuracy"] - 2, (fp32, fp16)
    assert bf16["test_accuracy"] >= fp32["test_accuracy"] - 2, (fp32, bf16)
