"""Rules of TensorFlow's graph model that the generic passes do not know about (no TF import).

- `match_recurrent_edges`: a TF1 while loop carries a value from NextIteration back into Merge;
  both ends must have one dtype. As Grappler's ForceColorMatchOnRecurrentEdges: if any Merge fed
  by a NextIteration stays fp32, that NextIteration and all its Merges stay fp32; otherwise the
  NextIteration follows the Merges into low precision.
"""

from __future__ import annotations

from ..ir import FLOAT32, TypeGroup
from .base import PassContext, PassResult


def match_recurrent_edges(ctx: PassContext) -> PassResult:
    """Make each NextIteration and the Merge nodes it feeds agree on one dtype."""
    target = ctx.target_dtype
    changed = 0
    for node in ctx.model.graph.walk_nodes():
        if node.op_type not in ("NextIteration", "RefNextIteration") or not node.outputs:
            continue
        group = node.output_group[0]
        if group is None or group.precision is None:
            continue  # not a float loop variable
        merges: list[TypeGroup] = []
        for consumer, slot in node.outputs[0].uses:
            g = consumer.input_group[slot]
            if consumer.op_type in ("Merge", "RefMerge") and g is not None \
                    and g.precision is not None:
                merges.append(g)
        if not merges:
            continue
        stays_fp32 = [m for m in merges if m.precision != target]
        if stays_fp32:
            culprit = stays_fp32[0]
            for g in [group] + merges:
                if g.precision != FLOAT32:
                    g.precision = FLOAT32
                    g.via = culprit
                    g.reason = (f"loop back edge {node.name} -> {culprit.node.name}: NextIteration "
                                f"and its Merge nodes must agree, and {culprit.node.name} stays "
                                f"fp32")
                    changed += 1
        elif group.precision != target:
            group.precision = target
            group.via = merges[0]
            group.reason = (f"loop back edge: follows Merge {merges[0].node.name} into "
                            f"{ctx.options.target}")
            changed += 1
    return PassResult("match_recurrent_edges", changed)
