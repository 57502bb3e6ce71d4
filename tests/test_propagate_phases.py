"""Each phase of propagate_precision on its own: a tiny graph is loaded and classified, then one
phase runs on a `Painting` prepared by the phases before it, and the test asserts which groups it
moved and the kind of each decision."""

from __future__ import annotations

import numpy as np
import pytest

from amp_rewriter.formats.onnx.load import load_onnx  # noqa: E402
from amp_rewriter.formats.onnx.rules import ONNX_RULES  # noqa: E402
from amp_rewriter.ir import FLOAT32, IRError, RangeCheck, decisions  # noqa: E402
from amp_rewriter.op_lists import OpLists  # noqa: E402
from amp_rewriter.options import Options  # noqa: E402
from amp_rewriter.passes import REGISTRY, PassContext, StoredRange  # noqa: E402
from amp_rewriter.passes.analysis import propagate  # noqa: E402
from amp_rewriter.passes.analysis.group_graph import GroupGraph  # noqa: E402
from testkit.builder import GraphBuilder  # noqa: E402


def painting(model, target: str = "fp16", backend: str = "ort-cuda",
             stored_ranges: dict[str, StoredRange] | None = None, **options
             ) -> propagate.Painting:
    """A Painting after loading, pinning, classification and the constant-range guard."""
    opts = Options(target=target, backend=backend, **options)
    ir_model = load_onnx(model)
    lists = OpLists.load("onnx", target, backend, opts.overrides)
    ctx = PassContext(ir_model, lists, opts, ONNX_RULES, stored_ranges=stored_ranges or {})
    for name in ("pin_nodes", "classify_ops", "guard_constant_ranges"):
        REGISTRY[name](ctx)
    return propagate.Painting(GroupGraph(ir_model.graph), ctx)


def group(p: propagate.Painting, node: str):
    """The first fp32 type group of the named node."""
    return next(g for g in p.graph.vertices if g.node.name == node)


def run_until(p: propagate.Painting, phase) -> int:
    """Run the phases before `phase`, then `phase`; returns what `phase` moved."""
    for earlier in propagate.PHASES[:propagate.PHASES.index(phase)]:
        earlier(p)
    return phase(p)


def chain(*ops: str, target_input: str = "x"):
    """x -> op1 -> op2 -> ... -> y, MatMul ops with their own weights."""
    b = GraphBuilder()
    value = b.input(target_input, [2, 4])
    for i, op in enumerate(ops):
        if op == "MatMul":
            value = b.op("MatMul", value, b.weight(f"w{i}", [4, 4]), name=f"n{i}_{op}")
        else:
            value = b.op(op, value, name=f"n{i}_{op}")
    b.output(value)
    return b.build()


def test_seed_allow_paints_allow_ops_and_keeps_those_without_kernel_out():
    p = painting(chain("MatMul", "Relu"))
    assert run_until(p, propagate.seed_allow) == 1
    assert p.is_low(group(p, "n0_MatMul")) and group(p, "n0_MatMul").kind == decisions.OP_LIST
    assert not p.is_low(group(p, "n1_Relu"))

    p = painting(chain("MatMul"), target="bf16", backend="ort-cpu")  # no bf16 CPU MatMul
    assert propagate.seed_allow(p) == 0
    assert group(p, "n0_MatMul").kind == decisions.BACKEND_KERNEL


def test_a_painting_refuses_groups_decided_before_it():
    # The painting keeps its state in the groups' decision fields: decisions already there
    # would read as its own, so it refuses to start from them.
    p = painting(chain("MatMul", "Relu"))
    for phase in propagate.PHASES:
        phase(p)
    propagate.commit(p)
    with pytest.raises(IRError, match="undecided"):
        propagate.Painting(p.graph, p.ctx)


def test_seed_allow_records_a_user_override_as_such():
    p = painting(chain("Relu", "Tanh"), allow=["Tanh"])
    propagate.seed_allow(p)
    assert group(p, "n1_Tanh").kind == decisions.USER_OVERRIDE


def test_spread_deny_reaches_infer_and_clear_ops_up_to_an_allow_op():
    # Exp (deny) -> Relu (clear) -> Tanh (infer) -> MatMul (allow) -> Tanh (infer)
    p = painting(chain("Exp", "Relu", "Tanh", "MatMul", "Tanh"))
    run_until(p, propagate.spread_deny)
    assert {g.node.name for g in p.deny} == {"n0_Exp", "n1_Relu", "n2_Tanh"}
    assert group(p, "n0_Exp").kind == decisions.OP_LIST
    assert group(p, "n2_Tanh").kind == decisions.PROPAGATION
    assert group(p, "n2_Tanh").via is group(p, "n1_Relu")
    assert group(p, "n4_Tanh") not in p.deny


def test_spread_deny_starts_at_a_constant_that_does_not_fit():
    b = GraphBuilder()
    x = b.input("x", [2, 4])
    h = b.op("MatMul", x, b.weight("w", [4, 4]), name="mm")
    masked = b.op("Add", h, b.const("mask", np.full((2, 4), -3.4e38, np.float32)), name="add")
    b.output(b.op("Softmax", masked, name="softmax"))
    p = painting(b.build())
    run_until(p, propagate.spread_deny)
    assert group(p, "add") in p.deny
    assert group(p, "add").kind == decisions.CONSTANT_RANGE
    assert group(p, "softmax") in p.deny


def test_a_stored_tensor_out_of_range_keeps_its_readers_fp32_through_carrying_ops():
    # "read" stands for a node whose output a front end knows from storage (a SavedModel
    # variable's read); its values do not fit fp16, and the MatMul reads them through a
    # Reshape (a carrying op). With the range fitting, the MatMul goes fp16.
    b = GraphBuilder()
    x = b.input("x", [2, 4])
    stored = b.op("Relu", b.input("v", [4, 4]), name="read")
    w = b.op("Reshape", stored, b.const("shape", np.array([4, 4], np.int64)), name="reshape")
    b.output(b.op("MatMul", x, w, name="mm"))
    model = b.build()
    huge = StoredRange("dense/kernel", RangeCheck(overflowed=3, flushed_to_zero=0, nonzero=16),
                       16)
    p = painting(model, stored_ranges={"read": huge})
    run_until(p, propagate.spread_deny)
    assert group(p, "mm") in p.deny and group(p, "reshape") in p.deny
    assert group(p, "reshape").kind == decisions.CONSTANT_RANGE
    assert "variable 'dense/kernel' has 3 value(s) beyond" in group(p, "reshape").reason
    assert group(p, "mm").forced_deny.endswith("read through reshape (Reshape)")
    assert p.ctx.constants[0].name == "dense/kernel" and p.ctx.constants[0].elements == 16

    fits = StoredRange("dense/kernel", RangeCheck(overflowed=0, flushed_to_zero=0, nonzero=16),
                       16)
    p = painting(model, stored_ranges={"read": fits})
    run_until(p, propagate.seed_allow)
    assert p.is_low(group(p, "mm"))


def test_fill_between_allow_paints_only_what_lies_between_two_allow_ops():
    p = painting(chain("MatMul", "Tanh", "MatMul", "Tanh"))
    assert run_until(p, propagate.fill_between_allow) == 1
    assert p.is_low(group(p, "n1_Tanh"))
    assert not p.is_low(group(p, "n3_Tanh"))  # after the last allow op: nothing to gain


def test_infer_after_allow_only_for_bf16():
    model = chain("MatMul", "Tanh")
    p = painting(model, target="fp16")
    assert run_until(p, propagate.infer_after_allow) == 0
    p = painting(model, target="bf16")
    assert run_until(p, propagate.infer_after_allow) == 1
    assert p.is_low(group(p, "n1_Tanh"))


def test_spread_through_clear_both_ways():
    p = painting(chain("Relu", "MatMul", "Relu"))
    assert run_until(p, propagate.spread_through_clear) == 2
    assert {g.node.name for g in p.allow_in_order()} == {"n0_Relu", "n1_MatMul", "n2_Relu"}


def test_drop_without_kernel_sends_unsupported_groups_back():
    # On ort-cuda bf16, Log has no kernel: painted between allow ops, then dropped.
    p = painting(chain("MatMul", "Log", "MatMul"), target="bf16")
    for phase in propagate.PHASES[:propagate.PHASES.index(propagate.drop_without_kernel)]:
        phase(p)
    log = group(p, "n1_Log")
    p.paint(log, decisions.PROPAGATION, "painted by an earlier phase")  # as if one had
    assert propagate.drop_without_kernel(p) == 1
    assert not p.is_low(log) and log.kind == decisions.BACKEND_KERNEL


def test_retarget_existing_casts_when_every_consumer_runs_low():
    b = GraphBuilder()
    x = b.input("x", [2, 4])
    h = b.op("MatMul", x, b.weight("w1", [4, 4]), name="mm1")
    c = b.op("Cast", h, name="cast", to=1)
    b.output(b.op("MatMul", c, b.weight("w2", [4, 4]), name="mm2"))
    p = painting(b.build())
    assert run_until(p, propagate.retarget_existing_casts) == 1
    out = next(g for g in p.graph.vertices if g.node.name == "cast" and g.output_slots)
    assert p.is_low(out) and out.kind == decisions.EXISTING_CAST


def test_follow_producers_reads_the_producers_dtype():
    b = GraphBuilder()
    x = b.input("x", [2, 4])
    h = b.op("MatMul", x, b.weight("w", [4, 4]), name="mm")
    b.output(b.op("Shape", h, name="shape"), dtype=np.int64, shape=[2])
    b.output(h)
    p = painting(b.build())
    assert run_until(p, propagate.follow_producers) == 1
    assert group(p, "shape").kind == decisions.TYPE_GROUP


def test_follow_data_group_paints_constant_parameters_with_their_node():
    b = GraphBuilder()
    x = b.input("x", [1, 2, 4, 4])
    c = b.op("Conv", x, b.weight("w", [2, 2, 1, 1]), name="conv")
    bn = b.op("BatchNormalization", c, b.const("s", np.ones(2)), b.const("bias", np.zeros(2)),
              b.const("m", np.zeros(2)), b.const("v", np.ones(2)), name="bn")
    b.output(b.op("Conv", bn, b.weight("w2", [2, 2, 1, 1]), name="conv2"))
    p = painting(b.build())
    assert run_until(p, propagate.follow_data_group) == 2  # scale/bias (T1), mean/var (T2)
    for params in (g for g in p.graph.vertices if g.node.name == "bn" and not g.output_slots):
        assert p.is_low(params) and params.kind == decisions.TYPE_GROUP


def test_commit_gives_every_group_a_precision_kind_and_reason():
    p = painting(chain("Exp", "MatMul", "Tanh"))
    for phase in propagate.PHASES:
        phase(p)
    propagate.commit(p)
    for g in p.graph.vertices:
        assert g.precision is not None and g.kind in decisions.ALL_KINDS and g.reason, g
    assert group(p, "n2_Tanh").precision == FLOAT32
    assert group(p, "n2_Tanh").kind == decisions.PROPAGATION


@pytest.mark.parametrize("phase", propagate.PHASES, ids=lambda f: f.__name__)
def test_every_phase_has_a_docstring(phase):
    assert phase.__doc__
