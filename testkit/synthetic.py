"""Build a transformer-like fp32 ONNX graph of a chosen size, for converter benchmarks.

The graph is a chain of post-LayerNorm encoder blocks (multi-head self-attention followed by a
feed-forward layer) working on a [batch, 8, 16] activation. It exists to measure how converter
run time and memory grow with the number of nodes, so it has:

* every op class a mixed-precision converter has to decide about: MatMul, Add, Mul,
  LayerNormalization, Softmax, Erf, Relu, Transpose, Reshape, ReduceMean, Min, Exp, Neg;
* tiny tensors, so that a 100k-node model stays a few MB on disk and is quick to run;
* a unique name for every node and every tensor it produces, and per-block biases, so that
  no two nodes are the same;
* values that stay bounded however deep the chain is (post-LN keeps the residual stream
  normalised, and the Exp gate is exp(-m^2) <= 1), so the fp32 model runs without overflow.

The command line: ``python scripts/synthetic_graph.py 10000 out.onnx [--seed 0]``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
#: IR version 8 goes with opset 17; a newer one would be rejected by older onnxruntime builds.
IR_VERSION = 8

SEQUENCE_LENGTH = 8
HIDDEN_SIZE = 16
NUM_HEADS = 2
HEAD_SIZE = HIDDEN_SIZE // NUM_HEADS

#: Weight matrices are drawn from a small pool and shared between blocks: with one matrix per
#: MatMul a 100k-node model would carry ~20 MB of weights, which only slows the benchmark's I/O.
WEIGHT_POOL_SIZE = 4
MATRIX_ROLES = ("query", "key", "value", "attention_output", "ffn_in", "ffn_out")

#: A block whose index is a multiple of this gets the ReduceMean/Exp gate.
GATE_EVERY = 4

INPUT_NAME = "hidden_states_in"
OUTPUT_NAME = "hidden_states_out"


def _block_node_count(block_index: int) -> int:
    """Number of nodes `_GraphBuilder.add_block` emits for the block with this index.

    Kept next to the builder and checked against it at build time (see `build_synthetic_model`).
    """
    # Q/K/V: MatMul, Add, Reshape, Transpose each; then scores, scale, Softmax, context,
    # Transpose, Reshape; output MatMul + Add; residual Add; LayerNormalization.
    attention = 3 * 4 + 6 + 2 + 1 + 1
    gelu_or_relu = 5 if _uses_erf_gelu(block_index) else 1
    feed_forward = 2 + gelu_or_relu + 2 + 1 + 1
    gate = 6 if block_index % GATE_EVERY == 0 else 0
    return attention + feed_forward + gate


def _uses_erf_gelu(block_index: int) -> bool:
    """Even blocks use the exact (Erf) GELU, odd ones Relu, so both activation paths are present."""
    return block_index % 2 == 0


class _GraphBuilder:
    """Accumulates nodes and initializers and hands out unique names."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._add_shared_constants()

    # ---- constants -------------------------------------------------------------------------

    def _add_initializer(self, name: str, values: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(values, name=name))
        return name

    def _add_scalar(self, name: str, value: float) -> str:
        return self._add_initializer(name, np.array(value, dtype=np.float32))

    def _add_shared_constants(self) -> None:
        """Scalars, shapes and the weight pool that many blocks read."""
        self.attention_scale = self._add_scalar("attention_scale", 1.0 / math.sqrt(HEAD_SIZE))
        self.inv_sqrt2 = self._add_scalar("inv_sqrt2", 1.0 / math.sqrt(2.0))
        self.one = self._add_scalar("one", 1.0)
        self.half = self._add_scalar("half", 0.5)
        self.gate_cap = self._add_scalar("gate_cap", 16.0)
        # 0 in a Reshape target copies that input dimension, which keeps the batch dim symbolic.
        self.split_heads_shape = self._add_initializer(
            "split_heads_shape", np.array([0, 0, NUM_HEADS, HEAD_SIZE], dtype=np.int64)
        )
        self.merge_heads_shape = self._add_initializer(
            "merge_heads_shape", np.array([0, 0, HIDDEN_SIZE], dtype=np.int64)
        )
        std = 1.0 / math.sqrt(HIDDEN_SIZE)
        self.weight_pool: dict[str, list[str]] = {}
        for role in MATRIX_ROLES:
            self.weight_pool[role] = [
                self._add_initializer(
                    f"{role}_weight_{variant}",
                    self._rng.normal(0.0, std, size=(HIDDEN_SIZE, HIDDEN_SIZE)).astype(np.float32),
                )
                for variant in range(WEIGHT_POOL_SIZE)
            ]

    def _bias(self, name: str) -> str:
        return self._add_initializer(
            name, self._rng.normal(0.0, 0.02, size=(HIDDEN_SIZE,)).astype(np.float32)
        )

    def _layer_norm_params(self, prefix: str) -> tuple[str, str]:
        gamma = (1.0 + self._rng.normal(0.0, 0.02, size=(HIDDEN_SIZE,))).astype(np.float32)
        beta = self._rng.normal(0.0, 0.02, size=(HIDDEN_SIZE,)).astype(np.float32)
        return self._add_initializer(f"{prefix}_gamma", gamma), self._add_initializer(
            f"{prefix}_beta", beta
        )

    # ---- nodes -----------------------------------------------------------------------------

    def op(self, op_type: str, inputs: list[str], name: str, **attributes: Any) -> str:
        """Append one node named `name`; its single output is the tensor `name`."""
        self.nodes.append(helper.make_node(op_type, inputs, [name], name=name, **attributes))
        return name

    def _dense(self, x: str, prefix: str, role: str, block_index: int) -> str:
        weight = self.weight_pool[role][block_index % WEIGHT_POOL_SIZE]
        projected = self.op("MatMul", [x, weight], f"{prefix}_matmul")
        return self.op("Add", [projected, self._bias(f"{prefix}_bias")], f"{prefix}_add_bias")

    def _layer_norm(self, x: str, prefix: str) -> str:
        gamma, beta = self._layer_norm_params(prefix)
        return self.op("LayerNormalization", [x, gamma, beta], prefix, axis=-1, epsilon=1e-5)

    def _attention(self, x: str, prefix: str, block_index: int) -> str:
        heads = {}
        for role, perm in (("query", [0, 2, 1, 3]), ("key", [0, 2, 3, 1]), ("value", [0, 2, 1, 3])):
            projected = self._dense(x, f"{prefix}_{role}", role, block_index)
            split = self.op(
                "Reshape", [projected, self.split_heads_shape], f"{prefix}_{role}_split_heads"
            )
            # The key is transposed straight to [batch, heads, head_size, seq] so Q @ K needs no
            # extra op.
            heads[role] = self.op("Transpose", [split], f"{prefix}_{role}_transpose", perm=perm)
        scores = self.op("MatMul", [heads["query"], heads["key"]], f"{prefix}_scores")
        scaled = self.op("Mul", [scores, self.attention_scale], f"{prefix}_scaled_scores")
        probabilities = self.op("Softmax", [scaled], f"{prefix}_softmax", axis=-1)
        context = self.op("MatMul", [probabilities, heads["value"]], f"{prefix}_context")
        context = self.op("Transpose", [context], f"{prefix}_context_transpose", perm=[0, 2, 1, 3])
        merged = self.op("Reshape", [context, self.merge_heads_shape], f"{prefix}_merge_heads")
        projected = self._dense(merged, f"{prefix}_output", "attention_output", block_index)
        residual = self.op("Add", [x, projected], f"{prefix}_residual")
        return self._layer_norm(residual, f"{prefix}_layer_norm")

    def _activation(self, x: str, prefix: str, block_index: int) -> str:
        if not _uses_erf_gelu(block_index):
            return self.op("Relu", [x], f"{prefix}_relu")
        # Exact GELU spelled out the way exporters emit it: 0.5 * x * (1 + erf(x / sqrt(2))).
        scaled = self.op("Mul", [x, self.inv_sqrt2], f"{prefix}_gelu_div_sqrt2")
        erf = self.op("Erf", [scaled], f"{prefix}_gelu_erf")
        shifted = self.op("Add", [erf, self.one], f"{prefix}_gelu_add_one")
        gated = self.op("Mul", [x, shifted], f"{prefix}_gelu_mul_x")
        return self.op("Mul", [gated, self.half], f"{prefix}_gelu_mul_half")

    def _feed_forward(self, x: str, prefix: str, block_index: int) -> str:
        hidden = self._dense(x, f"{prefix}_in", "ffn_in", block_index)
        hidden = self._activation(hidden, prefix, block_index)
        hidden = self._dense(hidden, f"{prefix}_out", "ffn_out", block_index)
        residual = self.op("Add", [x, hidden], f"{prefix}_residual")
        return self._layer_norm(residual, f"{prefix}_layer_norm")

    def _gate(self, x: str, prefix: str) -> str:
        """Scale by exp(-min(mean^2, 16)) over the sequence: a bounded ReduceMean -> Exp path.

        The Min is an everyday clamp, and one of the ops onnxconverter-common keeps in fp32 by
        default, so the graph exercises both converters' block-list handling.
        """
        mean = self.op("ReduceMean", [x], f"{prefix}_reduce_mean", axes=[1], keepdims=1)
        squared = self.op("Mul", [mean, mean], f"{prefix}_square")
        capped = self.op("Min", [squared, self.gate_cap], f"{prefix}_cap")
        negated = self.op("Neg", [capped], f"{prefix}_neg")
        gate = self.op("Exp", [negated], f"{prefix}_exp")
        return self.op("Mul", [x, gate], f"{prefix}_apply")

    def add_block(self, x: str, block_index: int) -> str:
        """Append one encoder block reading `x`; return the name of its output tensor."""
        prefix = f"block{block_index}"
        x = self._attention(x, f"{prefix}_attention", block_index)
        x = self._feed_forward(x, f"{prefix}_ffn", block_index)
        if block_index % GATE_EVERY == 0:
            x = self._gate(x, f"{prefix}_gate")
        return x

    def add_filler(self, x: str, filler_index: int) -> str:
        """One extra node (Mul by one or Add of a bias, alternately) to hit the exact node count."""
        if filler_index % 2 == 0:
            return self.op("Mul", [x, self.one], f"filler{filler_index}_mul")
        return self.op(
            "Add", [x, self._bias(f"filler{filler_index}_bias")], f"filler{filler_index}_add"
        )


def build_synthetic_model(num_nodes: int, seed: int = 0) -> onnx.ModelProto:
    """Build a deterministic transformer-like fp32 model with exactly `num_nodes` nodes.

    The model has one input ``hidden_states_in`` of shape [batch, 8, 16] (batch is symbolic)
    and one output ``hidden_states_out`` of the same shape. Blocks are added while they fit,
    then single Mul/Add nodes fill the remainder; the last node writes the graph output.
    The same (num_nodes, seed) always gives byte-identical serialized models.
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be at least 1, got {num_nodes}")
    builder = _GraphBuilder(seed)
    current = INPUT_NAME
    block_index = 0
    while len(builder.nodes) + _block_node_count(block_index) <= num_nodes:
        nodes_before = len(builder.nodes)
        current = builder.add_block(current, block_index)
        # Guards the hand-kept count in _block_node_count, which the size arithmetic relies on.
        assert len(builder.nodes) - nodes_before == _block_node_count(block_index)
        block_index += 1
    filler_index = 0
    while len(builder.nodes) < num_nodes:
        current = builder.add_filler(current, filler_index)
        filler_index += 1

    # Rename the final tensor to the graph output name (its producer is the last node).
    last_node = builder.nodes[-1]
    last_node.output[0] = OUTPUT_NAME

    batch_shape: list[str | int] = ["batch", SEQUENCE_LENGTH, HIDDEN_SIZE]
    graph = helper.make_graph(
        builder.nodes,
        f"synthetic_transformer_{num_nodes}",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, batch_shape)],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, batch_shape)],
        initializer=builder.initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="amp-rewriter-synthetic-graph",
        producer_version="1",
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model
