"""What a conversion buys and costs, for the report and the CLI's summary line.

- Activation bytes: every float tensor the converted model computes or takes as input (node
  outputs, casts included; constants excluded) is written once by its producer and read once per
  consumer (a graph output once by the caller); the share of those bytes that moves in low
  precision is what mixed precision saves in memory traffic. Shapes come from the format (ONNX:
  shape inference at the validation input sizes); tensors whose shape is unknown are counted, not
  guessed.
- Compute ops left fp32: the format's compute ops (`FormatRules.compute_ops`: MatMul, Conv,
  fused attention, ...) that run in fp32, and why (their decisions' kinds).
- Casts by reason: each cast the conversion inserted, by why one side stays fp32 (a graph input
  or output kept fp32, or the kind of decision that kept the producer or consumer fp32).

Format-neutral: it reads the IR after the passes (and the format's tensor list for the bytes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from .ir import FLOAT32, LOW_PRECISION_DTYPES, Model, Node, TypeGroup, decisions

#: Bytes per element of the float dtypes.
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def inserted_casts(model: Model) -> list[Node]:
    """The casts the conversion's passes added."""
    return [n for n in model.graph.walk_nodes()
            if n.op_type == "Cast" and n.created_by is not None]


def _is_low(node: Node) -> bool:
    return any(g.precision in LOW_PRECISION_DTYPES for g in node.type_groups)


def compute_ops_left_fp32(model: Model, compute_ops: frozenset[str]) -> dict[str, Any]:
    """How many of the format's compute ops stay fp32, by decision kind, with each one's reason."""
    total = 0
    fp32: list[dict[str, str]] = []
    for node in model.graph.walk_nodes():
        if node.qualified_op not in compute_ops or not node.float_groups():
            continue
        total += 1
        if _is_low(node):
            continue
        decided = next((g for g in node.type_groups if g.precision == FLOAT32), None)
        kind = (decided.kind if decided is not None else node.class_kind) or "n/a"
        reason = decided.reason if decided is not None else node.class_reason
        fp32.append({"name": node.name, "op": node.qualified_op, "kind": kind, "reason": reason})
    by_kind = Counter(entry["kind"] for entry in fp32)
    return {"total": total, "fp32": len(fp32), "fp32_by_kind": dict(sorted(by_kind.items())),
            "fp32_nodes": fp32}


#: How far `_why` follows propagation links back (a longer chain, or a cycle, reads as plain
#: propagation).
MAX_HOPS = 1000


class _Roots:
    """Each propagated decision's root (the rule the propagation started from), found once per
    group: the casts of a long chain share its links, and walking them again per cast made
    `casts_by_reason` quadratic in the chain length."""

    def __init__(self) -> None:
        #: group -> (root group, hops to it); hops above MAX_HOPS for a cycle.
        self._known: dict[TypeGroup, tuple[TypeGroup, int]] = {}

    def root(self, group: TypeGroup) -> tuple[TypeGroup, int]:
        """The decision `group`'s propagation started from, and how many links away it is."""
        known = self._known
        path: list[TypeGroup] = []
        on_path: set[TypeGroup] = set()
        current = group
        while current not in known:
            if current.kind != decisions.PROPAGATION or current.via is None:
                known[current] = (current, 0)
                break
            if current in on_path:  # a cycle: no root within reach
                known[current] = (current, MAX_HOPS + 1)
                break
            path.append(current)
            on_path.add(current)
            current = current.via
        root, hops = known[current]
        for link in reversed(path):
            if link not in known:
                hops = min(hops + 1, MAX_HOPS + 1)
                known[link] = (root, hops)
            else:
                root, hops = known[link]
        return known[group]


def _why(group: TypeGroup | None, node: Node, roots: _Roots | None = None) -> str:
    """A decision's kind, followed back through propagation to the rule that started it."""
    if group is None or not group.kind:
        return node.class_kind or "n/a"
    root, hops = (roots or _Roots()).root(group)
    if hops > MAX_HOPS or root is group or root.kind == group.kind:
        return group.kind
    return f"{group.kind} from {root.kind}"


def _cast_reason(cast: Node, roots: _Roots | None = None) -> str:
    """Why one side of an inserted cast is fp32 (or, between two low dtypes, that it is)."""
    source = cast.inputs[0]
    output = cast.outputs[0]
    assert source is not None and output is not None
    if output.dtype == FLOAT32:  # low -> fp32: the reader wants fp32
        if output.graph_output_uses:
            return "graph output kept fp32"
        for consumer, slot in output.uses:
            group = consumer.input_group[slot] if slot < len(consumer.input_group) else None
            return f"fp32 consumer ({_why(group, consumer, roots)})"
        return "fp32 consumer"
    if source.dtype == FLOAT32:  # fp32 -> low: the producer stays fp32
        if source.producer is None:
            return "graph input kept fp32" if source.const is None else "fp32 constant"
        producer = source.producer
        group = producer.output_group[source.producer_slot] \
            if source.producer_slot < len(producer.output_group) else None
        return f"fp32 producer ({_why(group, producer, roots)})"
    return f"{source.dtype} -> {output.dtype}"


def casts_by_reason(model: Model) -> dict[str, int]:
    """The inserted casts counted by `_cast_reason`."""
    roots = _Roots()
    counts = Counter(_cast_reason(cast, roots) for cast in inserted_casts(model))
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def inserted_cast_entries(model: Model) -> list[dict[str, str]]:
    """Each inserted cast with the pass that inserted it and `_cast_reason`, in graph order:
    the report's `cost.inserted_casts`, which `explain` reads for a cast's name."""
    roots = _Roots()
    return [{"name": cast.name, "inserted_by": cast.created_by or "",
             "to": (cast.outputs[0].dtype or "") if cast.outputs[0] is not None else "",
             "reason": _cast_reason(cast, roots)} for cast in inserted_casts(model)]


def bytes_moved(tensors: Iterable[tuple[str | None, tuple[int, ...] | None, int, int]]
                ) -> dict[str, Any]:
    """Activation traffic, low precision vs fp32, from (dtype, shape or None, accesses, values)
    per type of float activation: `values` activations of that type, accessed `accesses` times
    in all (each: one write by its producer plus one read per consumer)."""
    low = wide = unknown = 0
    for dtype, shape, accesses, values in tensors:
        if dtype not in ITEMSIZE:
            continue
        if shape is None:
            unknown += values
            continue
        elements = 1
        for dim in shape:
            elements *= dim
        moved = elements * ITEMSIZE[dtype] * accesses
        if dtype in LOW_PRECISION_DTYPES:
            low += moved
        else:
            wide += moved
    total = low + wide
    return {"low_precision": low, "fp32": wide,
            "low_precision_share": round(low / total, 4) if total else None,
            "values_without_shape": unknown}


def summary_line(cost: Mapping[str, Any]) -> str:
    """One line for the CLI: byte share, compute ops left fp32 and why, casts by reason."""
    parts = []
    moved = cost.get("activation_bytes")
    if moved and moved.get("low_precision_share") is not None:
        total = moved["low_precision"] + moved["fp32"]
        parts.append(f"{moved['low_precision_share']:.0%} of {_megabytes(total)} activation "
                     f"traffic in low precision")
    compute = cost["compute_ops"]
    # A conversion knows why each compute op stayed fp32 (its decision's kind); a model that
    # `check` reads only shows which ops they are.
    left = compute["fp32_by_kind"] if "fp32_by_kind" in compute else compute["fp32_by_op"]
    why = ", ".join(f"{kind} {count}" for kind, count in left.items())
    parts.append(f"compute ops fp32 {compute['fp32']}/{compute['total']}"
                 + (f" ({why})" if why else ""))
    if "casts_by_reason" in cost:
        casts = cost["casts_by_reason"]
        parts.append("casts: " + (", ".join(f"{count} {reason}" for reason, count in casts.items())
                                  if casts else "none"))
    else:
        parts.append(f"casts: {cost['casts']} to or from low precision")
    return "cost: " + "; ".join(parts)


def model_cost(nodes: Iterable[tuple[str, bool, bool, bool]], compute_ops: frozenset[str],
               activation_bytes: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a model (not a conversion: `check` reads it as it is) runs in low precision, from
    (op, float data, low precision, cast to or from low precision) per node: the compute ops
    left fp32 by op type, the low-precision nodes and the casts; `activation_bytes` as
    `bytes_moved` gives it, where the format can infer the shapes."""
    total = nodes_low = nodes_float = casts = 0
    fp32_by_op: Counter[str] = Counter()
    for op, floating, low, cast in nodes:
        nodes_float += floating
        nodes_low += low
        casts += cast
        if op in compute_ops and floating:
            total += 1
            if not low:
                fp32_by_op[op] += 1
    cost: dict[str, Any] = {
        "compute_ops": {"total": total, "fp32": sum(fp32_by_op.values()),
                        "fp32_by_op": dict(sorted(fp32_by_op.items()))},
        "float_nodes": nodes_float, "low_precision_nodes": nodes_low, "casts": casts}
    if activation_bytes is not None:
        cost["activation_bytes"] = activation_bytes
    return cost


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.3g} MB" if count >= 1e5 else f"{count / 1e3:.3g} kB"
