"""The training rewrite on real TF1 training graphs trained on scikit-learn's digits."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from conftest import one_error_line, run_in_process  # noqa: E402

from amp_rewriter.errors import AmpError  # noqa: E402
from amp_rewriter.tf import LossScaleRule, check_tf_graph, rewrite_training_graph  # noqa: E402
from testkit.models.tf_training import (  # noqa: E402
    batch_norm_graph,
    build_training_graph,
    digits_data,
    integer_fill_graph,
    sparse_embedding_graph,
    train,
)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 200


@functools.cache
def _data():
    return digits_data()


@functools.cache
def _fp32_accuracy(model: str, optimizer: str) -> float:
    return train(build_training_graph(model, optimizer), steps=STEPS, data=_data())[1]


def _variables(session, graph) -> dict[str, np.ndarray]:
    """Every global variable (weights, optimizer slots, beta powers, global step)."""
    return {v.name: session.run(v) for v in graph.get_collection("variables")}


def _bad_batch(rows: slice = slice(0, 64)):
    x, y = _data()[0][:64].copy(), _data()[1][:64]
    x[rows.start + 1, 3] = np.inf  # inf input -> nan loss -> non-finite gradients
    return x, y


def _good_batch():
    return _data()[0][:64], _data()[1][:64]


def _step(session, result, batch) -> None:
    session.run(result.train_op, {"x:0": batch[0], "y:0": batch[1]})


def _state(session, result) -> tuple[float, int]:
    scale, good = session.run([result.loss_scale, result.good_steps])
    return float(scale), int(good)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_rewrites_train_as_well_as_fp32(model, optimizer, target):
    result = rewrite_training_graph(build_training_graph(model, optimizer), loss="loss",
                                    train_op="train", target=target)
    low = tf.float16 if target == "fp16" else tf.bfloat16
    matmuls = [op for op in result.graph.get_operations()
               if op.type in ("MatMul", "Conv2D", "Conv2DBackpropFilter")]
    assert matmuls and all(op.get_attr("T") == low for op in matmuls)
    losses, accuracy = train(result.graph, steps=STEPS, data=_data())
    assert np.all(np.isfinite(losses))
    assert accuracy >= _fp32_accuracy(model, optimizer) - 0.02
    assert accuracy > 0.85


def test_weights_optimizer_and_update_stay_fp32():
    result = rewrite_training_graph(build_training_graph("mlp", "adam"), target="fp16")
    assert (result.loss, result.train_op) == ("loss:0", "train")  # found without being named
    ops = {op.name: op for op in result.graph.get_operations()}
    variables = result.graph.get_collection("variables")
    assert all(v.dtype.base_dtype in (tf.float32, tf.int64) for v in variables)
    applies = [op for op in ops.values() if op.type == "ApplyAdam"]
    assert len(applies) == 4 and all(op.get_attr("T") == tf.float32 for op in applies)
    for op in applies:  # epsilon and learning rate come from fp32 constants, through no cast
        for tensor in op.inputs[5:9]:
            source = tensor.op
            while source.type in ("Switch", "Identity"):
                source = source.inputs[0].op
            assert source.type == "Const" and source.get_attr("dtype") == tf.float32
    loss = ops["loss"]
    assert loss.outputs[0].dtype == tf.float32
    assert ops["SparseSoftmaxCrossEntropyWithLogits/SparseSoftmaxCrossEntropyWithLogits"] \
        .get_attr("T") == tf.float32
    # each weight read gets one cast to fp16
    casts = [op for op in ops.values() if op.type == "Cast"
             and op.inputs[0].op.name == "model/w1/read"]
    assert len(casts) == 1 and casts[0].get_attr("DstT") == tf.float16
    training = result.report.training
    assert training["loss_scale_variable"] and training["good_steps_variable"]
    assert training["loss_scale_rule"]["initial_scale"] == 2.0 ** 15


def test_every_write_waits_for_one_gate_and_no_switch_carries_a_variable():
    result = rewrite_training_graph(build_training_graph("mlp", "adam", towers=2), loss="loss",
                                    target="fp16")
    ops = result.graph.get_operations()
    # the gate and the scaler's lazy reads switch bools only: no RefSwitch, no resource Switch
    switched = [op.inputs[0].dtype for op in ops if op.type in ("Switch", "RefSwitch")]
    assert switched and set(switched) == {tf.bool}
    gated = result.report.training["update_ops_gated"]
    assert len(gated) == 7  # 4 ApplyAdam, 2 beta powers, the global step
    waits = {name: {c.name for c in result.graph.get_operation_by_name(name).control_inputs
                    if c.name.startswith("amp_loss_scale/")} for name in gated}
    # the train op here is the global step's increment: it also waits for the scaler's update
    assert waits.pop("train") == {"amp_loss_scale/gate/apply", "amp_loss_scale/update/update"}
    assert set(map(frozenset, waits.values())) == {frozenset({"amp_loss_scale/gate/apply"})}
    assert {v.name for v in result.graph.get_collection("local_variables")} == {
        "amp_loss_scale/scale:0", "amp_loss_scale/good_steps:0"}
    assert result.report.training["variable_writes"] == {"assign": 2, "optimizer_update": 4,
                                                         "step_counter": 1}


@pytest.mark.parametrize("towers", [1, 2])
@pytest.mark.parametrize("resource", [False, True])
def test_nonfinite_step_changes_nothing_but_the_scale(towers, resource):
    graph = build_training_graph("mlp", "adam", towers=towers, resource=resource)
    result = rewrite_training_graph(graph, loss="loss", target="fp16", growth_interval=1000)
    # with two towers only the first tower's half of the batch is poisoned
    bad = _bad_batch(slice(0, 32) if towers == 2 else slice(0, 64))
    with tf.compat.v1.Session(graph=result.graph) as session:
        session.run("init")
        assert _state(session, result) == (2.0 ** 15, 0)
        _step(session, result, _good_batch())
        _step(session, result, _good_batch())
        assert _state(session, result) == (2.0 ** 15, 2)
        before = _variables(session, result.graph)
        _step(session, result, bad)
        after = _variables(session, result.graph)
        assert len(before) == 15  # 4 weights, 8 Adam slots, 2 beta powers, the global step
        for name in before:
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
        assert _state(session, result) == (2.0 ** 14, 0)
        for _ in range(30):  # training goes on and recovers
            _step(session, result, _good_batch())
        assert int(_variables(session, result.graph)["global_step:0"]) == 32
        assert _state(session, result) == (2.0 ** 14, 30)
        x_test, y_test = _data()[2], _data()[3]
        assert session.run("accuracy:0", {"x:0": x_test, "y:0": y_test}) > 0.5


@pytest.mark.parametrize("target, rule", [
    ("fp16", dict(initial_scale=8.0, growth_interval=3, min_scale=1.0)),
    # growing 2**126 by 4 would give inf (bf16 keeps fp32's range, so the gradients stay finite)
    ("bf16", dict(initial_scale=2.0 ** 126, growth_interval=2, growth_factor=4.0)),
    ("fp16", dict(initial_scale=3.0, growth_interval=4, backoff_factor=0.25, min_scale=0.5)),
    ("fp16", dict(initial_scale=64.0, growth_interval=3, hysteresis=2)),
])
def test_scale_and_counter_follow_the_rule(target, rule):
    result = rewrite_training_graph(build_training_graph("mlp", "sgd"), target=target,
                                    loss_scale="dynamic", **rule)
    config = LossScaleRule.from_spec("dynamic", target, **rule)
    steps = list(np.random.default_rng(len(str(rule))).random(40) < 0.7)
    steps[5:11] = [False] * 6  # a run of bad steps reaches the minimum
    expected = [(state.scale, state.good_steps) for state in config.run(steps)]
    with tf.compat.v1.Session(graph=result.graph) as session:
        session.run("init")
        for finite, (scale, good) in zip(steps, expected):
            batch = _good_batch() if finite else _bad_batch()
            _, flag = session.run([result.train_op, result.all_finite],
                                  {"x:0": batch[0], "y:0": batch[1]})
            assert bool(flag) == finite
            got_scale, got_good = _state(session, result)
            assert (got_scale, got_good) == (scale, good)
            assert np.isfinite(got_scale) and got_scale >= config.min_scale


def test_underflowing_gradients_learn_only_with_loss_scaling():
    graph = build_training_graph("mlp", "adam", loss_multiplier=1e-6)
    moved = {}
    for loss_scale in ("dynamic", "none"):
        result = rewrite_training_graph(graph, target="fp16", loss_scale=loss_scale)
        with tf.compat.v1.Session(graph=result.graph) as session:
            session.run("init")
            w1 = session.run("model/w1:0")
            for _ in range(5):
                _step(session, result, _good_batch())
            moved[loss_scale] = float(np.abs(session.run("model/w1:0") - w1).max())
    assert moved["dynamic"] > 1e-4
    assert moved["none"] == 0.0


def test_fp32_checkpoint_restores_and_saver_round_trips(tmp_path):
    graph = build_training_graph("mlp", "momentum")
    with tf.compat.v1.Session(graph=graph) as session:
        session.run("init")
        for _ in range(3):
            session.run("train", {"x:0": _good_batch()[0], "y:0": _good_batch()[1]})
        fp32_values = _variables(session, graph)
        with graph.as_default():
            fp32_checkpoint = tf.compat.v1.train.Saver().save(session, str(tmp_path / "fp32"))
    result = rewrite_training_graph(graph, target="fp16")
    with result.graph.as_default():
        saver = tf.compat.v1.train.Saver()
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=result.graph) as session:
        session.run(init)
        saver.restore(session, fp32_checkpoint)
        restored = _variables(session, result.graph)
        for name, value in fp32_values.items():
            np.testing.assert_array_equal(restored[name], value)
        for _ in range(3):
            _step(session, result, _good_batch())
        trained = _variables(session, result.graph)
        checkpoint = saver.save(session, str(tmp_path / "amp"))
    with tf.compat.v1.Session(graph=result.graph) as session:
        saver.restore(session, checkpoint)
        for name, value in _variables(session, result.graph).items():
            np.testing.assert_array_equal(value, trained[name])
        _step(session, result, _good_batch())  # the scaler initializes itself lazily
        assert _state(session, result) == (2.0 ** 15, 1)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "amp_rewriter", *args], capture_output=True,
                          text=True, cwd=ROOT)


def _export(graph, path: Path) -> Path:
    with graph.as_default():
        tf.compat.v1.train.export_meta_graph(str(path))
    return path


def test_cli_meta_round_trip_is_deterministic_and_trains(tmp_path):
    source = _export(build_training_graph("mlp", "adam", towers=2), tmp_path / "train.meta")
    original = source.read_bytes()
    outputs = []
    for name in ("a.meta", "b.meta"):
        run = _cli("convert", str(source), str(tmp_path / name), "--training",
                   "--loss", "loss", "--growth-interval", "100",
                   "--report", str(tmp_path / "report.json"))
        assert run.returncode == 0, run.stderr
        outputs.append((tmp_path / name).read_bytes())
    assert outputs[0] == outputs[1] and source.read_bytes() == original
    assert "loss scaling: dynamic" in run.stdout
    graph = tf.Graph()
    with graph.as_default():
        saver = tf.compat.v1.train.import_meta_graph(str(tmp_path / "a.meta"))
        train_op = tf.compat.v1.get_collection("train_op")[0]
    assert saver is not None
    losses, accuracy = train(graph, steps=100, train_op=train_op.name, data=_data())
    assert losses[-1] < losses[0] and accuracy > 0.8


def _linear_graph(dtype, optimizer) -> tf.Graph:
    """A one-layer regression graph whose variables and compute are all `dtype`."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(dtype, [None, 8], name="x")
        w = tf.compat.v1.get_variable("w", [8, 1], dtype)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)), name="loss")
        optimizer.minimize(loss, name="train")
    return graph


def _fp16_adam_graph() -> tf.Graph:
    """Pure-fp16 training (fp16 variables, Adam): its epsilon is cast to fp16 and underflows."""
    return _linear_graph(tf.float16, tf.compat.v1.train.AdamOptimizer(1e-3))


def test_check_flags_optimizer_constants_that_underflow(tmp_path, capsys):
    bad = _export(_fp16_adam_graph(), tmp_path / "fp16_adam.meta")
    run = _cli("check", str(bad), "--report", str(tmp_path / "check.json"))
    assert run.returncode == 1
    assert "optimizer_constant_underflow" in run.stdout and "'epsilon'" in run.stdout
    result = check_tf_graph(bad)
    assert {p["kind"] for p in result.problems} >= {"optimizer_constant_underflow",
                                                   "low_precision_update"}
    # what convert --training writes passes (the CLI in this process: TensorFlow's import once)
    source = _export(build_training_graph("mlp", "adam"), tmp_path / "train.meta")
    code, _, err = run_in_process(capsys, "convert", source, tmp_path / "amp.meta", "--training")
    assert code == 0, err
    code, out, _ = run_in_process(capsys, "check", tmp_path / "amp.meta")
    assert code == 0, out


def _float64_graph() -> tf.Graph:
    return _linear_graph(tf.float64, tf.compat.v1.train.GradientDescentOptimizer(0.1))


def _inference_graph() -> tf.Graph:
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 8], name="x")
        tf.nn.relu(tf.matmul(x, tf.ones([8, 2])), name="y")
    return graph


@pytest.mark.parametrize("case", ["no_gradients", "unknown_loss", "unknown_train_op",
                                  "no_float_ops", "bad_rule", "not_a_graph"])
def test_bad_training_input_exits_2_with_one_line(tmp_path, capsys, case):
    """The CLI's main in this process (a fresh interpreter per case cost 10 s of TensorFlow's
    import each); the first case also runs as `python -m amp_rewriter`."""
    path = tmp_path / "in.meta"
    args = []
    if case == "no_gradients":
        _export(_inference_graph(), path)
        args = ["--train-op", "y"]
    elif case == "no_float_ops":
        _export(_float64_graph(), path)
        args = ["--train-op", "train"]
    else:
        _export(build_training_graph("mlp", "sgd"), path)
        args = {"unknown_loss": ["--loss", "nope"], "unknown_train_op": ["--train-op", "nope"],
                "bad_rule": ["--backoff-factor", "2"], "not_a_graph": []}[case]
        if case == "not_a_graph":
            path.write_bytes(b"\x0a\xff\xff garbage")
    original = path.read_bytes()
    out = tmp_path / "out.meta"
    code, _, err = run_in_process(capsys, "convert", path, out, "--training", *args)
    assert code == 2
    one_error_line(err)
    if case == "no_gradients":
        run = _cli("convert", str(path), str(out), "--training", *args)
        assert run.returncode == 2 and one_error_line(run.stderr) == err.strip()
    assert not out.exists() and path.read_bytes() == original
    assert not list(tmp_path.glob(".*tmp*"))


def test_api_errors_name_the_problem():
    with pytest.raises(AmpError, match="no such node"):
        rewrite_training_graph(build_training_graph("mlp", "sgd"), loss="missing")
    with pytest.raises(AmpError, match="no gradients"):
        rewrite_training_graph(_inference_graph(), train_op="y")


def _poisoned(x: np.ndarray) -> np.ndarray:
    x = x.copy()
    x[1, 3] = np.inf
    return x


def _skips_bad_step_then_trains(graph: tf.Graph):
    """A bad step changes no global variable; 20 good steps lower the loss, with no NaN."""
    result = rewrite_training_graph(graph, loss="loss", train_op="train", target="fp16")
    xb, yb = _good_batch()
    with tf.compat.v1.Session(graph=result.graph) as session:
        session.run(tf.compat.v1.variables_initializer(result.graph.get_collection("variables")))
        before = _variables(session, result.graph)
        names = {op.name for op in graph.get_operations()}
        bad = ({"x:0": xb, "y:0": yb, "poison:0": np.float32(np.inf)} if "poison" in names
               else {"x:0": _poisoned(xb), "y:0": yb})
        _, finite = session.run([result.train_op, result.all_finite], bad)
        assert not finite
        for name, value in _variables(session, result.graph).items():
            np.testing.assert_array_equal(value, before[name], err_msg=name)
        losses = [session.run([result.train_op, "loss:0"], {"x:0": xb, "y:0": yb})[1]
                  for _ in range(20)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    return result


def test_integer_fill_inside_a_gradient_is_not_a_seed():
    _skips_bad_step_then_trains(integer_fill_graph())


@pytest.mark.parametrize("resource", [False, True])
def test_sparse_gradients_with_adam(resource):
    _skips_bad_step_then_trains(sparse_embedding_graph(resource))


def test_batch_norm_moving_averages_are_gated():
    result = _skips_bad_step_then_trains(batch_norm_graph())
    assert result.report.training["updates_moved_after_backward_pass"] == [
        "Assign", "AssignSubVariableOp"]
