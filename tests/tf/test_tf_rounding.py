"""TensorFlow's lowering of a stochastic rounding Cast (formats/tf/rounding.py) gives what the
numpy reference (`ir.rounding.stochastic_round`) gives for the same random bits, bit for bit, and
the same bits again for the same key."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from amp_rewriter.formats.tf.emit import emit_graphdef  # noqa: E402
from amp_rewriter.formats.tf.load import load_graphdef  # noqa: E402
from amp_rewriter.formats.tf.rounding import RANDOM_BITS_OP, lower_rounding_casts  # noqa: E402
from amp_rewriter.ir import BFLOAT16, FLOAT16, IRError, Model, lint, present  # noqa: E402
from amp_rewriter.ir.dtypes import NUMPY_DTYPES  # noqa: E402
from amp_rewriter.ir.rounding import ROUNDING_ATTR, STOCHASTIC, stochastic_round  # noqa: E402
from amp_rewriter.passes.rewrite.building import array_constant, new_node  # noqa: E402

v1 = tf.compat.v1


def _rounding_graph(dtype: str, key: tuple[int, int]) -> Model:
    """x (a float32 placeholder) -> a stochastic Cast to `dtype` keyed by `key` -> `rounded`."""
    graph = tf.Graph()
    with graph.as_default():
        v1.placeholder(tf.float32, [None], name="x")
    model = load_graphdef(graph.as_graph_def(), ["x"])
    x = present(model.graph.nodes[0].outputs[0])
    key_value = array_constant(model, model.graph, "key", np.asarray(key, np.int64))
    cast = new_node(model, model.graph, "rounded", "Cast", [x, key_value], "rounded_out", dtype,
                    None, op_class="fp32", reason="test", order=1,
                    attrs={"to": dtype, ROUNDING_ATTR: STOCHASTIC})
    model.graph.append_node(cast)
    identity = new_node(model, model.graph, "result", "Identity", [present(cast.outputs[0])],
                        None, dtype, None, op_class="fp32", reason="test", order=2)
    model.graph.append_node(identity)
    return model


def _values(dtype: str) -> np.ndarray:
    rng = np.random.default_rng(0)
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(NUMPY_DTYPES[dtype])
    with np.errstate(over="ignore"):
        big = float(ml_dtypes.finfo(NUMPY_DTYPES[dtype]).max)
        special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, big * 1.0001, 1e-4, 2.5e-8,
                            1e-30, 1e-45, -3e-39]).astype(np.float32)
    return np.concatenate([
        every.astype(np.float32)[::7], rng.uniform(-3, 3, 3000).astype(np.float32),
        (rng.uniform(-1, 1, 3000) * 2.0**-14).astype(np.float32),
        (rng.uniform(-1, 1, 1000) * 2.0**-126).astype(np.float32), special])


@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16])
def test_lowered_cast_matches_the_reference_bit_for_bit(dtype):
    model = _rounding_graph(dtype, (1234, 5))
    with pytest.raises(IRError, match="only once lowered"):
        emit_graphdef(model)
    assert lower_rounding_casts(model) == 1
    assert lint(model.graph) == []
    graph_def = emit_graphdef(model)
    random_op = next(nd.name for nd in graph_def.node if nd.op == RANDOM_BITS_OP)
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    x = _values(dtype)
    with v1.Session(graph=graph) as session:
        out, bits = session.run(["result:0", f"{random_op}:0"], {"x:0": x})
        again = session.run("result:0", {"x:0": x})
    expected = stochastic_round(x, bits, dtype)
    assert out.dtype == expected.dtype
    nan = np.isnan(x)  # NaN stays NaN (its payload is the cast's business)
    assert np.array_equal(np.isnan(out.astype(np.float32)), nan)
    assert np.array_equal(out[~nan].view(np.uint16), expected[~nan].view(np.uint16))
    assert np.array_equal(again.view(np.uint16), out.view(np.uint16))  # same key, same draw
