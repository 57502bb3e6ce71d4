"""What onnxruntime's CPU provider does with the fused transformer ops in fp16 and bf16.

For every contrib op that onnxruntime's transformer optimizer emits (and a few more the op lists
classify), this builds a one-node model per dtype and opens it on CPUExecutionProvider, then
reads back the graph the session really runs (`optimized_model_filepath`):

- kernel:     the node is kept as it is: the CPU provider has a kernel for that dtype;
- casts:      the CPU provider found no kernel for that dtype and put Casts to fp32 around the
              node (its InsertCastTransformer also does this for contrib ops): it runs in fp32;
- decomposed: the op was replaced by its function body (standard ops), which then runs as they do;
- fails:      the session does not open (NOT_IMPLEMENTED): a model with this node cannot run.

The registry column is what onnxruntime's kernel registry (`get_all_opkernel_def`) lists for the
CPU provider's `T`. Where the session ran, the output is compared with the fp32 model's.

The table: `python scripts/ort_cpu_kernels.py [--json out.json]`.

amp_rewriter/op_lists/onnx.toml's ort-cpu profile and the validation's emulation
(amp_rewriter/formats/onnx/validate.py) rely on these facts; re-run when onnxruntime moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

MS = "com.microsoft"
B, S, H, HEADS = 2, 4, 16, 2
HEAD = H // HEADS

#: op -> (domain, inputs (name, "T" or an elem type, shape), outputs (name, "T" or type), attrs)
OPS: dict[str, tuple[str, list[tuple[str, str | int, list[int]]], list[tuple[str, str | int]],
                     dict[str, Any]]] = {
    "Attention": (MS, [("input", "T", [B, S, H]), ("weights", "T", [H, 3 * H]),
                       ("bias", "T", [3 * H])], [("output", "T")], {"num_heads": HEADS}),
    "MultiHeadAttention": (MS, [("query", "T", [B, S, H]), ("key", "T", [B, S, H]),
                                ("value", "T", [B, S, H])], [("output", "T")],
                           {"num_heads": HEADS}),
    # One sequence: with a past, GroupQueryAttention takes batch 1 when sequence_length > 1.
    "GroupQueryAttention": (MS, [("query", "T", [1, S, H]), ("key", "T", [1, S, H // 2]),
                                 ("value", "T", [1, S, H // 2]), ("past_key", "T", [1, 1, S, HEAD]),
                                 ("past_value", "T", [1, 1, S, HEAD]),
                                 ("seqlens_k", TensorProto.INT32, [1]),
                                 ("total_sequence_length", TensorProto.INT32, [])],
                            [("output", "T"), ("present_key", "T"), ("present_value", "T")],
                            {"num_heads": HEADS, "kv_num_heads": 1}),
    "SkipLayerNormalization": (MS, [("input", "T", [B, S, H]), ("skip", "T", [B, S, H]),
                                    ("gamma", "T", [H]), ("beta", "T", [H])], [("output", "T")],
                               {}),
    "SkipSimplifiedLayerNormalization": (MS, [("input", "T", [B, S, H]), ("skip", "T", [B, S, H]),
                                              ("gamma", "T", [H])], [("output", "T")], {}),
    "SimplifiedLayerNormalization": ("", [("X", "T", [B, S, H]), ("scale", "T", [H])],
                                     [("Y", "T")], {"axis": -1}),
    "EmbedLayerNormalization": (MS, [("input_ids", TensorProto.INT32, [B, S]),
                                     ("segment_ids", TensorProto.INT32, [B, S]),
                                     ("word_embedding", "T", [10, H]),
                                     ("position_embedding", "T", [S, H]),
                                     ("segment_embedding", "T", [2, H]),
                                     ("gamma", "T", [H]), ("beta", "T", [H])],
                                [("output", "T"), ("mask_index", TensorProto.INT32)], {}),
    "BiasGelu": (MS, [("A", "T", [B, S, H]), ("B", "T", [H])], [("C", "T")], {}),
    "FastGelu": (MS, [("X", "T", [B, S, H]), ("bias", "T", [H])], [("Y", "T")], {}),
    "Gelu": (MS, [("X", "T", [B, S, H])], [("Y", "T")], {}),
    "QuickGelu": (MS, [("X", "T", [B, S, H])], [("Y", "T")], {}),
    "BiasAdd": (MS, [("X", "T", [B, S, H]), ("bias", "T", [H]), ("skip", "T", [B, S, H])],
                [("Y", "T")], {}),
    "BiasSplitGelu": (MS, [("X", "T", [B, S, 2 * H]), ("bias", "T", [2 * H])], [("Y", "T")], {}),
    "RotaryEmbedding": (MS, [("input", "T", [B, S, H]), ("position_ids", TensorProto.INT64, [B, S]),
                             ("cos_cache", "T", [S, HEAD // 2]),
                             ("sin_cache", "T", [S, HEAD // 2])],
                        [("output", "T")], {"num_heads": HEADS}),
    "FusedMatMul": (MS, [("A", "T", [B, S, H]), ("B", "T", [H, H])], [("Y", "T")], {"alpha": 0.5}),
}
DTYPES = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


@dataclass
class Probe:
    """What the CPU provider did with one op in one dtype (see the module's outcomes)."""

    op: str
    dtype: str
    registry: str
    outcome: str
    detail: str = ""
    max_relative_error: float | None = None


def _elem_type(kind: str | int, elem_type: int) -> int:
    """An OPS entry's element type: `elem_type` for "T", else the type it names."""
    return elem_type if isinstance(kind, str) else kind


def build(op: str, elem_type: int) -> onnx.ModelProto:
    """A one-node model of `op` whose `T` tensors have `elem_type`."""
    domain, inputs, outputs, attrs = OPS[op]
    graph_inputs = [helper.make_tensor_value_info(name, _elem_type(kind, elem_type), shape)
                    for name, kind, shape in inputs]
    graph_outputs = [helper.make_tensor_value_info(name, _elem_type(kind, elem_type), None)
                     for name, kind in outputs]
    node = helper.make_node(op, [i[0] for i in inputs], [o[0] for o in outputs], name=op,
                            domain=domain, **attrs)
    graph = helper.make_graph([node], op, graph_inputs, graph_outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(MS, 1)])


def feeds_for(op: str, np_dtype) -> dict[str, np.ndarray]:
    """Seeded random inputs for `build(op, ...)`, float ones in `np_dtype`."""
    rng = np.random.default_rng(0)
    feeds = {}
    for name, kind, shape in OPS[op][1]:
        if kind == "T":
            feeds[name] = rng.standard_normal(shape).astype(np_dtype)
        elif name == "input_ids":
            feeds[name] = rng.integers(0, 10, shape).astype(np.int32)
        elif name in ("segment_ids",):
            feeds[name] = rng.integers(0, 2, shape).astype(np.int32)
        elif name == "position_ids":
            feeds[name] = np.tile(np.arange(S), (B, 1)).astype(np.int64)
        elif name == "seqlens_k":
            feeds[name] = np.full(shape, 2 * S - 1, np.int32)
        elif name == "total_sequence_length":
            feeds[name] = np.array(2 * S, np.int32)
        else:
            raise ValueError(name)
    return feeds


def registry_types(op: str) -> str:
    """The types onnxruntime's CPU kernel registry lists for `op`'s `T`."""
    domain = OPS[op][0]
    types: set[str] = set()
    for kernel in ort.capi.onnxruntime_pybind11_state.get_all_opkernel_def():
        if kernel.provider == "CPUExecutionProvider" and kernel.op_name == op \
                and kernel.domain == domain:
            types.update(t[len("tensor("):-1] for t in kernel.type_constraints.get("T", []))
    return ", ".join(sorted(types)) or "none"


def session(model: onnx.ModelProto, optimized: Path) -> ort.InferenceSession:
    """A CPU session on `model` that writes the graph it really runs to `optimized`."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def probe(op: str, dtype: str, work: Path) -> Probe:
    """Open `op` in `dtype` on the CPU provider and classify what it runs."""
    model = build(op, DTYPES[dtype])
    optimized = work / f"{op}_{dtype}.onnx"
    registry = registry_types(op)
    try:
        sess = session(model, optimized)
    except Exception as exc:  # noqa: BLE001  (the failure is the finding)
        message = str(exc).strip().splitlines()[0]
        return Probe(op, dtype, registry, "fails", message.split(" : ")[-1][:120])
    ran = onnx.load(str(optimized))
    ops = [n.op_type for n in ran.graph.node]
    if op not in ops:
        outcome, detail = "decomposed", " ".join(sorted(set(ops)))
    elif "Cast" in ops:
        outcome, detail = "casts", f"{ops.count('Cast')} Casts inserted"
    else:
        outcome, detail = "kernel", ""
    result = Probe(op, dtype, registry, outcome, detail)
    if dtype == "fp16":
        try:
            result.max_relative_error = _error_vs_fp32(op, sess, work)
        except Exception as exc:  # noqa: BLE001  (opened but did not run: say why)
            result.detail += f" (run failed: {str(exc).strip().splitlines()[0][-80:]})"
    return result


def _error_vs_fp32(op: str, sess: ort.InferenceSession, work: Path) -> float:
    """max|fp16 run - fp32 run| / max|fp32 run| of the first output, on the same inputs."""
    feeds = feeds_for(op, np.float16)
    reference = session(build(op, TensorProto.FLOAT), work / f"{op}_fp32.onnx")
    expected = reference.run(None, {k: (v.astype(np.float32) if v.dtype == np.float16 else v)
                                    for k, v in feeds.items()})[0]
    got = sess.run(None, feeds)[0].astype(np.float32)
    scale = float(np.abs(expected).max()) or 1.0
    return float(np.abs(got - expected).max()) / scale
