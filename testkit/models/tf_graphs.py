"""Small, deterministic TF1 GraphDefs for amp-rewriter's TensorFlow path (one per Grappler rule).

They cover what tests/tf/test_tf_graphdef.py builds: Conv2D/MatMul/Relu/Identity, Sqrt/Log/Exp/Pow,
FusedBatchNorm (V1 and V3), IdentityN/AddN, existing Casts (retargeted and no-op ones with control
edges), a ref variable (VariableV2), a tf.compat.v1 while loop (with a constant inside the loop
frame), an attention-style mask beyond fp16's range, and divisions by a tiny (`x / 1e-9`) and by a
normal constant (RealDiv).

    from testkit.models.tf_graphs import BUILDERS
    graph_def, outputs = BUILDERS["conv_matmul"]()

Every builder returns `(GraphDef, outputs)`: a fresh graph whose weights come from its own seeded
generator, so the serialized bytes (`SerializeToString(deterministic=True)`) are the same on every
call, in any order, in any process (same TensorFlow version). `meta_graph_with_saver()` returns a
MetaGraphDef with a ref variable, a Saver and an `outputs` collection, like a TF1 `.meta` file.

Run `python -m testkit.models.tf_graphs OUT_DIR` to write every graph as OUT_DIR/<name>.pb.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator

import numpy as np

from testkit.models._common import output_dir_argument

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

v1 = tf.compat.v1

GraphAndOutputs = tuple["tf.compat.v1.GraphDef", list[str]]


class _Weights:
    """Seeded N(0, scale^2) float32 arrays, one generator per graph."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def __call__(self, *shape: int, scale: float = 0.3) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)


def _build(fn: Callable[[], None]) -> tf.compat.v1.GraphDef:
    graph = tf.Graph()
    with graph.as_default():
        fn()
    return graph.as_graph_def()


@contextlib.contextmanager
def _control_flow_v1() -> Iterator[None]:
    """tf.compat.v1.while_loop builds Enter/Merge/Switch/NextIteration/Exit only with v2 off."""
    was_v2 = tf.compat.v1.control_flow_v2_enabled()
    v1.disable_control_flow_v2()
    try:
        yield
    finally:
        if was_v2:
            v1.enable_control_flow_v2()


def conv_matmul(seed: int = 0) -> GraphAndOutputs:
    """Conv2D (allow) -> Relu, Identity, Reshape (clear) -> MatMul (allow) -> fetch Identity."""
    w = _Weights(seed)

    def model():
        x = v1.placeholder(tf.float32, [None, 8, 8, 3], name="x")
        c = tf.nn.conv2d(x, w(3, 3, 3, 4), 1, "SAME", name="conv")
        r = tf.nn.relu(c, name="relu")
        i = tf.identity(r, name="ident")
        f = tf.reshape(i, [-1, 256], name="flat")
        m = tf.matmul(f, w(256, 5, scale=0.05), name="mm")
        tf.identity(m, name="y")

    return _build(model), ["y"]


def sqrt_log_infer(seed: int = 1) -> GraphAndOutputs:
    """Sqrt/Abs between allow ops, Log fed by fp32 only, Sigmoid after an allow op."""
    w = _Weights(seed)

    def model():
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        a = tf.matmul(x, w(8, 8), name="mm1")
        s = tf.sqrt(tf.abs(a, name="abs"), name="sqrt")
        tf.identity(tf.matmul(s, w(8, 8), name="mm2"), name="y1")
        lg = tf.math.log(tf.abs(x) + 1.0, name="log_in")
        tf.identity(lg, name="y2")
        sig = tf.sigmoid(tf.matmul(x, w(8, 8), name="mm3"), name="sig")
        tf.math.log(sig, name="log_out")

    return _build(model), ["y1", "y2", "log_out"]


def exp_pow_deny(seed: int = 2) -> GraphAndOutputs:
    """Exp and Pow (deny) spreading through clear/infer ops until an allow op."""
    w = _Weights(seed)

    def model():
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        e = tf.exp(x * 0.1, name="exp")
        r = tf.nn.relu(e, name="relu")
        s = tf.sqrt(r, name="sqrt")
        m = tf.matmul(s, w(8, 8), name="mm")
        t = tf.tanh(m, name="tanh")
        p = tf.pow(tf.abs(x, name="abs_p"), 2.0, name="pow")
        q = tf.sigmoid(p, name="sig")
        tf.identity(tf.matmul(t, w(8, 8), name="mm2") + tf.matmul(q, w(8, 8), name="mm3"),
                    name="y")

    return _build(model), ["y"]


def reduce_sum_exp(seed: int = 3) -> GraphAndOutputs:
    """Sum (deny in Grappler's fp16 list) then Exp after a MatMul."""
    w = _Weights(seed)

    def model():
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        m = tf.matmul(x, w(8, 8), name="mm")
        s = tf.reduce_sum(m, axis=1, name="sum")
        tf.identity(tf.exp(s * 0.01, name="exp"), name="y")

    return _build(model), ["y"]


def add_between_allow(seed: int = 4) -> GraphAndOutputs:
    """An Add between two MatMuls (low) and an Add on the input alone (fp32)."""
    w = _Weights(seed)

    def model():
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        a = tf.add(tf.matmul(x, w(8, 8), name="mm1"), w(8), name="add_mid")
        tf.identity(tf.matmul(a, w(8, 8), name="mm2"), name="y")
        tf.identity(tf.add(x, 1.0, name="add_alone"), name="y2")

    return _build(model), ["y", "y2"]


def fused_batch_norm_v1(seed: int = 5) -> GraphAndOutputs:
    """Conv2D -> FusedBatchNorm (V1, built with tf.raw_ops) -> Relu -> Conv2D."""
    w = _Weights(seed)

    def model():
        x = v1.placeholder(tf.float32, [2, 8, 8, 3], name="x")
        c = tf.nn.conv2d(x, w(3, 3, 3, 4), 1, "SAME", name="conv")
        bn = tf.raw_ops.FusedBatchNorm(
            x=c, scale=np.full(4, 1.5, np.float32), offset=np.zeros(4, np.float32),
            mean=w(4), variance=np.ones(4, np.float32), epsilon=1e-3, is_training=False,
            name="bn")
        r = tf.nn.relu(bn[0], name="relu")
        tf.identity(tf.nn.conv2d(r, w(3, 3, 4, 2), 1, "SAME", name="conv2"), name="y")

    return _build(model), ["y"]


def fused_batch_norm_v3(seed: int = 6) -> GraphAndOutputs:
    """The same with tf.compat.v1.nn.fused_batch_norm (FusedBatchNormV3 in TF 2.x)."""
    w = _Weights(seed)

    def model():
        x = v1.placeholder(tf.float32, [2, 8, 8, 3], name="x")
        c = tf.nn.conv2d(x, w(3, 3, 3, 4), 1, "SAME", name="conv")
        y, _, _ = v1.nn.fused_batch_norm(c, np.full(4, 1.5, np.float32), np.zeros(4, np.float32),
                                         mean=w(4), variance=np.ones(4, np.float32),
                                         is_training=False, name="bn")
        r = tf.nn.relu(y, name="relu")
        tf.identity(tf.nn.conv2d(r, w(3, 3, 4, 2), 1, "SAME", name="conv2"), name="y")

    return _build(model), ["y"]


def identity_n_add_n(seed: int = 7) -> GraphAndOutputs:
    """AddN (one T for N inputs) and IdentityN (a list attribute: one group per element)."""
    w = _Weights(seed)

    def model():
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        m1 = tf.matmul(x, w(8, 8), name="mm1")
        m2 = tf.matmul(x, w(8, 8), name="mm2")
        s = tf.math.add_n([m1, m2, m1], name="addn")
        a, b = tf.identity_n([s, x], name="idn")
        tf.identity(tf.matmul(a, w(8, 8), name="mm3"), name="y")
        tf.identity(b, name="b_out")

    return _build(model), ["y", "b_out"]


def existing_casts(seed: int = 8) -> GraphAndOutputs:
    """An int32 -> float Cast feeding a MatMul (retargeted when outputs may change dtype)."""
    w = _Weights(seed)

    def model():
        i = v1.placeholder(tf.int32, [4, 8], name="i")
        f = tf.cast(i, tf.float32, name="to_float")
        tf.matmul(f, w(8, 8), name="mm")

    return _build(model), ["mm"]


def noop_cast_control_edges(seed: int = 9) -> GraphAndOutputs:
    """A float -> float Cast and a converted constant that are targets of control edges."""
    w = _Weights(seed)

    def model():
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        same = tf.raw_ops.Cast(x=x, DstT=tf.float32, name="noop_cast")
        wa = tf.constant(w(8, 8), name="w")
        wb = tf.constant(w(8, 8), name="w2")
        with tf.control_dependencies([same.op, wa.op]):
            m = tf.matmul(x, wb, name="mm")
        tf.identity(m, name="y")
        tf.identity(tf.sqrt(tf.abs(same)), name="y2")
        tf.identity(tf.matmul(x, wa, name="mm_w"), name="y3")

    return _build(model), ["y", "y2", "y3"]


def ref_variable(seed: int = 10) -> GraphAndOutputs:
    """A VariableV2 read through its ref Identity (`w/read`), which stays fp32."""
    w = _Weights(seed)

    def model():
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        var = v1.Variable(w(8, 8), name="w", use_resource=False)
        tf.identity(tf.matmul(x, var, name="mm"), name="y")

    return _build(model), ["y"]


def while_loop_v1(seed: int = 11) -> GraphAndOutputs:
    """A tf.compat.v1.while_loop (Enter/Merge/Switch/NextIteration/Exit) around MatMul + Tanh, with
    a constant inside the loop frame."""
    w = _Weights(seed)

    def model():
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        weight = tf.constant(w(8, 8), name="w")

        def body(i, h):
            scaled = tf.matmul(h, weight, name="mm") * tf.constant(0.5, name="half")
            return i + 1, tf.tanh(tf.matmul(scaled, weight, name="mm2"), name="act")

        _, h = v1.while_loop(lambda i, h: i < 3, body, [tf.constant(0), x], name="loop")
        tf.identity(h, name="y")

    with _control_flow_v1():
        return _build(model), ["y"]


def fp16_mask(seed: int = 12) -> GraphAndOutputs:
    """A -1e9 attention-style mask (beyond fp16's range) added to MatMul scores, then Softmax."""
    w = _Weights(seed)

    def model():
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        mask = np.where(np.tril(np.ones((4, 8))) > 0, 0.0, -1e9).astype(np.float32)
        scores = tf.add(tf.matmul(x, w(8, 8), name="mm"), mask, name="masked")
        tf.identity(tf.nn.softmax(scores, name="probs"), name="y")

    return _build(model), ["y"]


def divisions(seed: int = 13) -> GraphAndOutputs:
    """RealDiv by a tiny constant (`x / 1e-9`: 1e-9 flushes to zero in fp16) and by 4.0."""
    w = _Weights(seed)

    def model():
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        m = tf.matmul(x, w(8, 8), name="mm")
        tiny = tf.math.truediv(m, tf.constant(1e-9, name="tiny"), name="div_tiny")
        normal = tf.math.truediv(m, tf.constant(4.0, name="four"), name="div_normal")
        tf.identity(tf.matmul(tiny * 1e-9, w(8, 8), name="mm_tiny"), name="y_tiny")
        tf.identity(tf.matmul(normal, w(8, 8), name="mm_normal"), name="y_normal")

    return _build(model), ["y_tiny", "y_normal"]


def mlp_relu(seed: int = 14) -> GraphAndOutputs:
    """MatMul -> Relu, the smallest graph that converts (fp16 on tf-cpu)."""
    w = _Weights(seed)

    def model():
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        tf.identity(tf.nn.relu(tf.matmul(x, w(8, 8), name="mm"), name="relu"), name="y")

    return _build(model), ["y"]


def two_matmuls_relu(seed: int = 15) -> GraphAndOutputs:
    """MatMul -> Relu -> MatMul (for Grappler list variables and overrides)."""
    w = _Weights(seed)

    def model():
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        r = tf.nn.relu(tf.matmul(x, w(8, 8), name="mm"), name="relu")
        tf.identity(tf.matmul(r, w(8, 8), name="mm2"), name="y")

    return _build(model), ["y"]


#: Every GraphDef builder by name, in a stable order.
BUILDERS: dict[str, Callable[[], GraphAndOutputs]] = {
    "conv_matmul": conv_matmul,
    "sqrt_log_infer": sqrt_log_infer,
    "exp_pow_deny": exp_pow_deny,
    "reduce_sum_exp": reduce_sum_exp,
    "add_between_allow": add_between_allow,
    "fused_batch_norm_v1": fused_batch_norm_v1,
    "fused_batch_norm_v3": fused_batch_norm_v3,
    "identity_n_add_n": identity_n_add_n,
    "existing_casts": existing_casts,
    "noop_cast_control_edges": noop_cast_control_edges,
    "ref_variable": ref_variable,
    "while_loop_v1": while_loop_v1,
    "fp16_mask": fp16_mask,
    "divisions": divisions,
    "mlp_relu": mlp_relu,
    "two_matmuls_relu": two_matmuls_relu,
}


def meta_graph_with_saver(seed: int = 16, use_resource: bool = False) -> tf.compat.v1.MetaGraphDef:
    """A TF1 MetaGraphDef: a ref variable (get_variable), MatMul -> Relu -> `y`, `y` in an
    `outputs` collection, a Saver (saver_def and save/restore ops).

    `use_resource=True` makes the variable a resource one (VarHandleOp), what get_variable
    gives by default under TensorFlow 2.
    """
    w = _Weights(seed)
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [4, 8], name="x")
        var = v1.get_variable("w", initializer=w(8, 8), use_resource=use_resource)
        y = tf.identity(tf.nn.relu(tf.matmul(x, var, name="mm")), name="y")
        v1.add_to_collection("outputs", y)
        saver = v1.train.Saver()
        return saver.export_meta_graph()


def main(argv: list[str] | None = None) -> int:
    """`python -m testkit.models.tf_graphs OUT_DIR`: write each graph there."""
    args = sys.argv[1:] if argv is None else argv
    out = output_dir_argument(args, "python -m testkit.models.tf_graphs OUT_DIR")
    if out is None:
        return 2
    for name, builder in BUILDERS.items():
        graph_def, outputs = builder()
        (out / f"{name}.pb").write_bytes(graph_def.SerializeToString(deterministic=True))
        print(f"{name}: outputs {', '.join(outputs)}")
    (out / "meta_graph_with_saver.meta").write_bytes(
        meta_graph_with_saver().SerializeToString(deterministic=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
