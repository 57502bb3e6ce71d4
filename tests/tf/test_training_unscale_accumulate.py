"""Optimizer-aware unscaling (`unscale=`, `--unscale`) and gradient accumulation (`accumulate=`,
`--accumulate`) on TF1 training graphs (the TF2 hook's are in test_tf2_weights.py)."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from amp_rewriter.errors import AmpError  # noqa: E402
from amp_rewriter.tf import rewrite_training_graph  # noqa: E402
from testkit.models.tf_training import batches, build_training_graph, digits_data  # noqa: E402

v1 = tf.compat.v1
ONE_THREAD = v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)


def _train(result, feeds, fetch=()):
    """Run the train op on each feed; returns the trainable variables and what `fetch` gave."""
    seen = []
    with v1.Session(graph=result.graph, config=ONE_THREAD) as session:
        session.run("init")
        for x, y in feeds:
            seen.append(session.run([result.train_op, *fetch], {"x:0": x, "y:0": y})[1:])
        values = {v.name: session.run(v)
                  for v in result.graph.get_collection("trainable_variables")}
    return values, seen


def _unscaling_muls(result) -> int:
    return sum(1 for op in result.graph.get_operations() if op.type == "Mul"
               and op.name.startswith("amp_loss_scale/unscale/unscaled"))


def test_sgd_with_the_scale_folded_into_the_learning_rate_is_bit_identical():
    x, y, _, _ = digits_data()
    feeds = list(batches(x, y, 64, 100))
    graph = build_training_graph("mlp", "sgd")
    folded = rewrite_training_graph(graph, loss_scale=1024, unscale="optimizer")
    multiplied = rewrite_training_graph(graph, loss_scale=1024, unscale="gradients")
    assert _unscaling_muls(multiplied) == 4 and _unscaling_muls(folded) == 0
    assert folded.report.training["unscale"]["folded"][0]["multiplier"] == 2.0 ** -10
    a, _ = _train(folded, feeds)
    b, _ = _train(multiplied, feeds)
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    assert rewrite_training_graph(graph, loss_scale=1024).report.training["unscale"][
        "where"] == "optimizer"  # auto: exact, and plain SGD keeps no state


@pytest.mark.parametrize("optimizer, loss_scale, why", [
    ("sgd", 1000, "not a power of two"), ("adam", 1024, "keeps optimizer state"),
    ("sgd", None, "dynamic")])
def test_auto_keeps_the_gradients_multiply_where_folding_would_change_something(
        optimizer, loss_scale, why):
    result = rewrite_training_graph(build_training_graph("mlp", optimizer),
                                    loss_scale=loss_scale)
    unscale = result.report.training["unscale"]
    assert unscale["where"] == "gradients" and why in unscale["reason"]
    assert _unscaling_muls(result) == 4


def test_folding_is_refused_where_it_cannot_be_done():
    with pytest.raises(AmpError, match="--unscale optimizer: the loss scale is dynamic"):
        rewrite_training_graph(build_training_graph("mlp", "sgd"), unscale="optimizer")
    with pytest.raises(AmpError, match="--unscale must be auto, gradients or optimizer"):
        rewrite_training_graph(build_training_graph("mlp", "sgd"), unscale="weights")


def test_a_window_with_an_inf_is_skipped_whole_and_the_scale_halves_once():
    x, y, _, _ = digits_data()
    feeds = list(batches(x, y, 64, 12))
    feeds[5] = (feeds[5][0].copy(), feeds[5][1])
    feeds[5][0][3, 2] = np.inf  # the second micro-step of the second window
    result = rewrite_training_graph(build_training_graph("mlp", "momentum", resource=True),
                                    accumulate=4, growth_interval=2)
    sums = result.report.training["accumulators"]
    assert len(sums) == 4
    state = [result.loss_scale, result.good_steps, result.micro_step, "model/w1/Read/"
             "ReadVariableOp:0", "global_step/Read/ReadVariableOp:0"]
    with v1.Session(graph=result.graph, config=ONE_THREAD) as session:
        session.run("init")
        states = []
        for step, (xb, yb) in enumerate(feeds):
            # the sums the step leaves in the accumulators (before a window's end resets them)
            _, *accumulated = session.run([result.train_op, *sums], {"x:0": xb, "y:0": yb})
            assert all(np.all(np.isfinite(a)) for a in accumulated), step
            scale, good, micro, w1, applied = session.run(state)
            assert np.all(np.isfinite(w1))
            states.append((float(scale), int(good), int(micro), int(applied), w1))
    # window 1 applies; window 2 (inf at its second micro-step) is skipped: the weights stay,
    # the scale halves once at its end; window 3 applies; the counters count windows
    assert [s[:4] for s in states[3::4]] == [(32768.0, 1, 0, 1), (16384.0, 0, 0, 1),
                                             (16384.0, 1, 0, 2)]
    assert [s[2] for s in states[:4]] == [1, 2, 3, 0]
    assert all(np.array_equal(s[4], states[3][4]) for s in states[3:8])
    assert not np.array_equal(states[11][4], states[7][4])


def test_accumulating_four_micro_batches_steps_like_one_batch_of_four_times_the_size():
    x, y, _, _ = digits_data()
    feeds = list(batches(x, y, 64, 6))
    micro = [(xb[i:i + 16], yb[i:i + 16]) for xb, yb in feeds for i in range(0, 64, 16)]
    # a small learning rate: at 0.5 fp16's rounding of the two forms' forward passes already
    # moves the weights by 1e-2 (as much as bf16 against fp16 does)
    graph = build_training_graph("mlp", "sgd", learning_rate=0.1)
    start, _ = _train(rewrite_training_graph(graph, loss_scale=1024), [])
    whole, _ = _train(rewrite_training_graph(graph, loss_scale=1024), feeds)
    windows, _ = _train(rewrite_training_graph(graph, loss_scale=1024, accumulate=4), micro)
    for name in whole:
        assert np.abs(whole[name] - start[name]).max() > 1e-3, name  # six steps moved it
        np.testing.assert_allclose(windows[name], whole[name], rtol=0, atol=1e-4)


def test_bad_accumulate_and_unscale_flags_are_one_line_errors(tmp_path, capsys):
    from conftest import one_error_line, run_in_process

    graph = build_training_graph("mlp", "sgd")
    path = tmp_path / "step.meta"
    with graph.as_default():
        v1.train.export_meta_graph(str(path))
    for flags, message in ((["--accumulate", "0"], "--accumulate must be an integer from 1"),
                           (["--unscale", "optimizer"], "--unscale optimizer: the loss scale "
                                                        "is dynamic")):
        code, _, err = run_in_process(capsys, "convert", path, tmp_path / "out.meta",
                                      "--training", *flags)
        assert code == 2 and message in one_error_line(err), err
        assert not (tmp_path / "out.meta").exists()
