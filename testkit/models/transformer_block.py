"""One BERT-style encoder layer (post-LayerNorm), exported the way HuggingFace graphs look.

Inputs: ``hidden`` float32 [B,S,64] and ``attention_mask`` int64 [B,S] (symbolic B, S).
Output: ``out`` float32 [B,S,64].

The additive mask is built exactly like HuggingFace BERT::

    m = Cast(attention_mask, FLOAT); m = Unsqueeze(m, [1, 2])   # [B,1,1,S]
    m = Sub(1.0, m); m = Mul(m, -3.4028234663852886e38)          # float32 min

float32 min overflows to -inf in fp16, which is the classic way a naive fp16 cast
turns masked attention rows into NaN.

Run ``python -m testkit.models.transformer_block OUT.onnx`` to write the model.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from testkit.models._common import (
    finish_model,
    float_initializer,
    int64_initializer,
    normal_weights,
    seeded_rng,
    write_model_cli,
)

HIDDEN = 64
NUM_HEADS = 4
HEAD_DIM = HIDDEN // NUM_HEADS
FFN_DIM = 4 * HIDDEN
#: float32 min, the value HuggingFace uses for masked positions (torch.finfo(torch.float32).min).
FLOAT32_MIN = -3.4028234663852886e38
LAYER_NORM_EPSILON = 1e-12


def build_model(seed: int = 1) -> onnx.ModelProto:
    """Build the encoder-layer test model; ``seed`` fixes the weights."""
    rng = seeded_rng(seed)
    # std 0.02-0.1 keeps the pre-LayerNorm activations O(1), like a trained BERT.
    initializers = [
        float_initializer("mask.one", np.array(1.0)),
        float_initializer("mask.min_value", np.array(FLOAT32_MIN)),
        int64_initializer("mask.unsqueeze_axes", [1, 2]),
        int64_initializer("attn.split_heads_shape", [0, 0, NUM_HEADS, HEAD_DIM]),
        int64_initializer("attn.merge_heads_shape", [0, 0, HIDDEN]),
        float_initializer("attn.scale", np.array(math.sqrt(HEAD_DIM))),
    ]
    for projection in ("query", "key", "value", "output"):
        initializers.append(
            float_initializer(
                f"attn.{projection}.weight", normal_weights(rng, (HIDDEN, HIDDEN), 0.08)
            )
        )
        initializers.append(
            float_initializer(f"attn.{projection}.bias", normal_weights(rng, (HIDDEN,), 0.02))
        )
    initializers += [
        float_initializer("attn_norm.gamma", 1.0 + normal_weights(rng, (HIDDEN,), 0.05)),
        float_initializer("attn_norm.beta", normal_weights(rng, (HIDDEN,), 0.02)),
        float_initializer("ffn.in.weight", normal_weights(rng, (HIDDEN, FFN_DIM), 0.08)),
        float_initializer("ffn.in.bias", normal_weights(rng, (FFN_DIM,), 0.02)),
        float_initializer("gelu.sqrt2", np.array(math.sqrt(2.0))),
        float_initializer("gelu.one", np.array(1.0)),
        float_initializer("gelu.half", np.array(0.5)),
        float_initializer("ffn.out.weight", normal_weights(rng, (FFN_DIM, HIDDEN), 0.05)),
        float_initializer("ffn.out.bias", normal_weights(rng, (HIDDEN,), 0.02)),
        float_initializer("ffn_norm.gamma", 1.0 + normal_weights(rng, (HIDDEN,), 0.05)),
        float_initializer("ffn_norm.beta", normal_weights(rng, (HIDDEN,), 0.02)),
    ]

    def node(op: str, inputs: list[str], output: str, **attrs: Any) -> onnx.NodeProto:
        # The output name doubles as the node name: unique, and readable in reports.
        return helper.make_node(op, inputs, [output], name=output, **attrs)

    def linear(prefix: str, x: str) -> list[onnx.NodeProto]:
        return [
            node("MatMul", [x, f"{prefix}.weight"], f"{prefix}/matmul"),
            node("Add", [f"{prefix}/matmul", f"{prefix}.bias"], f"{prefix}/add"),
        ]

    nodes = [
        node("Cast", ["attention_mask"], "mask/cast", to=TensorProto.FLOAT),
        node("Unsqueeze", ["mask/cast", "mask.unsqueeze_axes"], "mask/unsqueeze"),
        node("Sub", ["mask.one", "mask/unsqueeze"], "mask/invert"),
        node("Mul", ["mask/invert", "mask.min_value"], "mask/additive"),
    ]
    for projection, perm in (
        ("query", [0, 2, 1, 3]),
        ("key", [0, 2, 3, 1]),
        ("value", [0, 2, 1, 3]),
    ):
        prefix = f"attn.{projection}"
        nodes += linear(prefix, "hidden")
        nodes += [
            node("Reshape", [f"{prefix}/add", "attn.split_heads_shape"], f"{prefix}/split_heads"),
            # Key goes straight to [B,H,D,S] so that Q @ K needs no extra transpose.
            node("Transpose", [f"{prefix}/split_heads"], f"{prefix}/transpose", perm=perm),
        ]
    nodes += [
        node("MatMul", ["attn.query/transpose", "attn.key/transpose"], "attn/scores"),
        node("Div", ["attn/scores", "attn.scale"], "attn/scaled_scores"),
        node("Add", ["attn/scaled_scores", "mask/additive"], "attn/masked_scores"),
        node("Softmax", ["attn/masked_scores"], "attn/probs", axis=-1),
        node("MatMul", ["attn/probs", "attn.value/transpose"], "attn/context"),
        node("Transpose", ["attn/context"], "attn/context_transpose", perm=[0, 2, 1, 3]),
        node("Reshape", ["attn/context_transpose", "attn.merge_heads_shape"], "attn/merge_heads"),
        *linear("attn.output", "attn/merge_heads"),
        node("Add", ["attn.output/add", "hidden"], "attn/residual"),
        node(
            "LayerNormalization",
            ["attn/residual", "attn_norm.gamma", "attn_norm.beta"],
            "attn_norm/out",
            axis=-1,
            epsilon=LAYER_NORM_EPSILON,
        ),
        *linear("ffn.in", "attn_norm/out"),
        # Exact (erf) GELU, written out the way torch.onnx exports nn.GELU().
        node("Div", ["ffn.in/add", "gelu.sqrt2"], "gelu/div"),
        node("Erf", ["gelu/div"], "gelu/erf"),
        node("Add", ["gelu/erf", "gelu.one"], "gelu/add_one"),
        node("Mul", ["ffn.in/add", "gelu/add_one"], "gelu/mul"),
        node("Mul", ["gelu/mul", "gelu.half"], "gelu/out"),
        *linear("ffn.out", "gelu/out"),
        node("Add", ["ffn.out/add", "attn_norm/out"], "ffn/residual"),
    ]
    nodes.append(
        helper.make_node(
            "LayerNormalization",
            ["ffn/residual", "ffn_norm.gamma", "ffn_norm.beta"],
            ["out"],
            name="ffn_norm/out",
            axis=-1,
            epsilon=LAYER_NORM_EPSILON,
        )
    )
    graph = helper.make_graph(
        nodes,
        "transformer_block",
        inputs=[
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["B", "S", HIDDEN]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "S"]),
        ],
        outputs=[helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", "S", HIDDEN])],
        initializer=initializers,
    )
    return finish_model(graph)


#: The block's nodes that build the additive mask from ``attention_mask``: a stack builds it once.
MASK_NODES = ("mask/cast", "mask/unsqueeze", "mask/invert", "mask/additive")


def build_stack(layers: int, seed: int = 1) -> onnx.ModelProto:
    """``layers`` copies of the block, one feeding the next (a deep encoder, as ALBERT shares its
    weights across layers: the model stays small however deep). The mask is built once; every
    other node and activation of layer i is renamed ``layer.i/NAME``, the last output stays
    ``out``."""
    block = build_model(seed)
    shared = {init.name for init in block.graph.initializer} | {"attention_mask"}
    nodes = [n for n in block.graph.node if n.name in MASK_NODES]
    shared |= {name for n in nodes for name in n.output}
    previous = "hidden"
    for layer in range(layers):
        prefix = f"layer.{layer}/"
        last = layer == layers - 1

        def renamed(
            name: str, prefix: str = prefix, previous: str = previous, last: bool = last
        ) -> str:
            if name == "hidden":
                return previous
            if name in shared or not name:
                return name
            if name == "out" and last:
                return name
            return prefix + name

        for original in block.graph.node:
            if original.name in MASK_NODES:
                continue
            copy = onnx.NodeProto()
            copy.CopyFrom(original)
            copy.name = prefix + original.name
            copy.input[:] = [renamed(name) for name in original.input]
            copy.output[:] = [renamed(name) for name in original.output]
            nodes.append(copy)
        previous = renamed("out")
    graph = helper.make_graph(
        nodes,
        f"transformer_stack_{layers}",
        list(block.graph.input),
        list(block.graph.output),
        list(block.graph.initializer),
    )
    return finish_model(graph)


if __name__ == "__main__":
    raise SystemExit(write_model_cli(build_model))
