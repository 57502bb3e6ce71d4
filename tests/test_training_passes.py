"""The training plan and passes on tiny IR graphs, without TensorFlow (testkit/training_ir.py):
each pass does its one job, the IR stays sound after every one, and the scaler update the passes
write computes exactly `LossScaleRule.step`."""

from __future__ import annotations

import numpy as np
import pytest

from amp_rewriter.ir import decisions, lint
from amp_rewriter.passes import PassError, run_pipeline
from amp_rewriter.passes.pipeline import PIPELINES, TRAINING_PASSES
from amp_rewriter.training import LossScaleRule, ScalerState
from amp_rewriter.training.passes import LOSS_REASON, OPTIMIZER_REASON, OUTSIDE_REASON
from amp_rewriter.training.plan import VariableWrite
from testkit.training_ir import evaluate, model_node, tiny_step


@pytest.fixture(autouse=True)
def _lint_after_every_pass(monkeypatch):
    monkeypatch.setenv("AMP_REWRITER_LINT", "1")


def test_the_training_pipeline_runs_the_training_passes_first():
    assert PIPELINES["tf-training"][1:1 + len(TRAINING_PASSES)] == TRAINING_PASSES


def test_a_sound_plan_has_no_problems_and_a_broken_one_says_what_is_wrong():
    step = tiny_step()
    assert step.plan.problems() == []
    plan = step.plan
    plan.writes.append(VariableWrite(step.nodes["mm0"], "optimizer_update"))
    plan.frontier[0].readers.append((step.nodes["train"], 0))
    problems = plan.problems()
    assert any("inside the forward or backward pass" in p for p in problems)
    assert any("train input 0 does not read" in p for p in problems)


@pytest.mark.parametrize("towers", [1, 2])
def test_each_pass_does_its_job_and_the_ir_stays_sound(towers):
    step = tiny_step(towers=towers)
    ctx = step.context(LossScaleRule(growth_interval=3))
    results = {r.name: r for r in run_pipeline(ctx, TRAINING_PASSES)}  # lint after each
    training, nodes = ctx.training, step.nodes
    assert training is not None and lint(step.model.graph) == []
    # seeds: Fill reads one * scale
    for tower in range(towers):
        scaled = nodes[f"fill{tower}"].inputs[1]
        assert scaled.producer.op_type == "Mul"
        assert scaled.producer.inputs[1] is training.scale
    # every gradient is unscaled where it leaves the backward pass, before the tower sum
    reader = nodes["sum"] if towers > 1 else nodes["apply"]
    unscaled = [v.producer for v in reader.inputs
                if v is not None and v.producer is not None and v.producer.op_type == "Mul"]
    assert len(unscaled) == towers == results["unscale_gradients"].changed
    assert all(m.inputs[1].producer.op_type == "Reciprocal" for m in unscaled)
    # one flag over the unscaled gradients and the sum of them
    flag = training.all_finite.producer
    assert flag.op_type == "AllFinite" and len(flag.inputs) == towers + (towers > 1)
    # every write waits for the gate on it; the step waits for the update
    gate = training.gate
    assert gate.inputs == [training.all_finite]
    assert all(gate in w.node.control_inputs for w in step.plan.writes)
    assert training.update in nodes["train"].control_inputs
    # the state's initializers join the graph's initializer group
    assert {n.name for n in nodes["init"].control_inputs} >= {
        s.initializer.name for s in training.states()}
    assert all(n.pin_reason and not n.type_groups for n in training.added)


def test_results_and_control_outputs_stop_waiting_for_the_gated_writes():
    # a TF2 function's shape: a return value waits for a write, the caller waits for the
    # control outputs (a write among them)
    step = tiny_step()
    graph, nodes = step.model.graph, step.nodes
    returned = model_node(graph, "returned", "Identity", [step.plan.loss], ["float32"],
                        waits=[nodes["count"]])
    graph.add_output(returned.outputs[0])
    graph.set_control_output("apply", nodes["apply"])
    graph.set_control_output("step", nodes["train"])
    step.plan.results, step.plan.caller_waits = [returned.outputs[0]], True
    ctx = step.context(LossScaleRule())
    results = {r.name: r for r in run_pipeline(ctx, TRAINING_PASSES)}
    settled = ctx.training.settled
    assert settled.op_type == "Settle" and ctx.training.gate in settled.control_inputs
    assert {nodes["apply"], nodes["count"]} <= set(settled.control_inputs)
    assert returned.control_inputs == [settled]
    assert set(graph.control_outputs) == {"step"}
    train_waits = set(nodes["train"].control_inputs)
    assert settled in train_waits and not train_waits & {nodes["apply"], nodes["count"]}
    assert results["release_step_results"].changed == 3  # returned, train, one control output


def test_without_results_release_changes_nothing():
    ctx = tiny_step().context(LossScaleRule())
    results = {r.name: r for r in run_pipeline(ctx, TRAINING_PASSES)}
    assert results["release_step_results"].changed == 0 and ctx.training.settled is None


def test_pins_keep_the_loss_and_optimizer_path_fp32_after_earlier_pins():
    step = tiny_step(towers=2)
    step.nodes["apply"].pin_reason = "pinned to fp32 by --keep-node 'apply_w'"
    ctx = step.context(LossScaleRule())
    run_pipeline(ctx, ["pin_training_path"])
    nodes = step.nodes
    assert nodes["sum"].pin_reason == OPTIMIZER_REASON
    assert nodes["apply"].pin_reason.startswith("pinned to fp32 by --keep-node")
    assert step.plan.loss.producer.pin_reason == LOSS_REASON
    assert nodes["step_counter"].pin_reason == OUTSIDE_REASON
    assert nodes["mm0"].pin_reason == "" and nodes["grad1"].pin_reason == ""
    assert nodes["sum"].pin_kind == decisions.PIN


def test_a_write_the_backward_pass_waits_for_moves_behind_the_step():
    step = tiny_step(batch_norm=True)
    moving, fill = step.nodes["moving"], step.nodes["fill0"]
    ctx = step.context(LossScaleRule(mode="none"))
    results = run_pipeline(ctx, TRAINING_PASSES)
    assert moving not in fill.control_inputs and moving in step.nodes["train"].control_inputs
    # no loss scale: nothing else changes
    assert [r.name for r in results if r.changed] == ["pin_training_path", "move_waited_writes"]
    assert not ctx.training.added


def test_a_fixed_scale_checks_and_gates_but_keeps_no_state():
    step = tiny_step()
    ctx = step.context(LossScaleRule(mode="fixed", initial_scale=1024.0))
    run_pipeline(ctx, TRAINING_PASSES)
    training = ctx.training
    assert not training.states() and training.update is None
    assert float(evaluate(training.scale, {})) == 1024.0
    assert training.all_finite.producer in step.nodes["train"].control_inputs


@pytest.mark.parametrize("rule", [
    LossScaleRule(growth_interval=3),
    LossScaleRule(initial_scale=2.0 ** 126, growth_interval=2, growth_factor=4.0),
    LossScaleRule(initial_scale=3.0, growth_interval=4, backoff_factor=0.25, min_scale=0.5),
    LossScaleRule(initial_scale=64.0, growth_interval=3, hysteresis=3),
])
def test_the_written_update_is_the_step_function(rule):
    step = tiny_step()
    ctx = step.context(rule)
    run_pipeline(ctx, TRAINING_PASSES)
    training = ctx.training
    writes = {state.name: state.writes[0].inputs[0] for state in training.states()}
    steps = [bool(s) for s in np.random.default_rng(7).random(200) < 0.7]
    state = rule.initial_state()
    for finite in steps:
        leaves = {training.scale: np.float32(state.scale),
                  training.good_steps.value: np.int32(state.good_steps),
                  training.all_finite: np.bool_(finite)}
        if training.bad_steps is not None:
            leaves[training.bad_steps.value] = np.int32(state.bad_steps)
        written = ScalerState(
            float(evaluate(writes["scale"], leaves)), int(evaluate(writes["good_steps"], leaves)),
            int(evaluate(writes["bad_steps"], leaves)) if "bad_steps" in writes else 0)
        state = rule.step(state, finite)
        assert written == state
    assert len({s.scale for s in rule.run(steps)}) > 1  # the sequence moved the scale


def test_a_training_pass_without_a_plan_is_a_pass_error():
    step = tiny_step()
    ctx = step.context(LossScaleRule())
    ctx.training = None
    with pytest.raises(PassError, match="pass scale_gradient_seeds failed.*without a training"):
        run_pipeline(ctx, ["scale_gradient_seeds"])
