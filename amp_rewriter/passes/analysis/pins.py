"""Pins: nodes kept fp32 whatever the op lists say, by the user or by a front end's plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...ir import Node, decisions
from ..base import PassContext, register_pass

if TYPE_CHECKING:
    from ...node_patterns import NodePattern


def keep_node_match(pattern: NodePattern, node: Node) -> str | None:
    """What of `node` a --keep-node pattern matches whole: "" for its name, the module path for
    one of its scopes (a dynamo export's `model.encoder.layer.0`), None for nothing."""
    if pattern.fullmatch(node.name):
        return ""
    return next((scope for scope in node.scopes if pattern.fullmatch(scope)), None)


@register_pass("pin_nodes")
def pin_nodes(ctx: PassContext) -> tuple[int, list[str]]:
    """Pin nodes whose name, or one of whose module scopes, matches a --keep-node pattern (or
    keep_nodes in a config) to fp32."""
    patterns = ctx.options.keep_node_patterns
    if not patterns:
        return 0, []
    pinned = 0
    for node in ctx.model.graph.walk_nodes():
        for pattern in patterns:
            matched = keep_node_match(pattern, node)
            if matched is not None:
                where = f" (module {matched})" if matched else ""
                node.pin_reason = f"pinned to fp32 by --keep-node {pattern.pattern!r}{where}"
                node.pin_kind = decisions.USER_OVERRIDE
                pinned += 1
                break
    return pinned, []


@register_pass("pin_front_end")
def pin_front_end(ctx: PassContext) -> tuple[int, list[str]]:
    """Pin what a front end keeps fp32, with its reason and kind: a training plan's regions
    (optimizer path, loss, loss-scaling subgraph), `convert --auto`'s measured hazards."""
    if not ctx.pins:
        return 0, []
    pinned = 0
    for node in ctx.model.graph.walk_nodes():
        pin = ctx.pins.get(node.name)
        if pin is not None and not node.pin_reason:  # the user's --keep-node comes first
            node.pin_reason, node.pin_kind, node.pin_barrier = pin.reason, pin.kind, pin.barrier
            pinned += 1
    return pinned, []
