"""The user's pattern rules.

`apply_pattern_rules`: the user's `[[rules]]` from the config (op, what it feeds or is fed by).
"""

from __future__ import annotations

from collections.abc import Iterator

from ...ir import FP32, Node, decisions
from ..analysis.classify import set_class
from ..base import PassContext, StructureRecord, register_pass


def _neighbours(node: Node, downstream: bool, through: frozenset[str]) -> Iterator[Node]:
    """The consumers (or producers) of `node`, looking through the `through` ops."""
    seen: set[Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if downstream:
            nexts = [c for v in current.outputs if v is not None for c, _ in v.uses]
        else:
            nexts = [v.producer for v in current.inputs if v is not None and v.producer]
        for other in nexts:
            if other is None or other in seen:
                continue
            seen.add(other)
            yield other
            if other.op_type in through or other.qualified_op in through:
                stack.append(other)


@register_pass("apply_pattern_rules")
def apply_pattern_rules(ctx: PassContext) -> tuple[int, list[str]]:
    """Apply the config's `[[rules]]`: nodes of an op type that feed (or are fed by) given ops,
    optionally through others and by name, get a precision or an op class."""
    rules = ctx.options.overrides.rules
    if not rules:
        return 0, []
    changed = 0
    hits: dict[int, list[str]] = {}
    for node in ctx.model.graph.walk_nodes():
        ctx.focus = node
        if node.pin_reason:
            continue  # --keep-node, or a front end's pin (TF fetch nodes): stays as pinned
        for index, rule in enumerate(rules):
            if node.op_type != rule.op and node.qualified_op != rule.op:
                continue
            if rule.name is not None and not rule.name.fullmatch(node.name):
                continue
            if rule.feeds and not any(n.op_type in rule.feeds or n.qualified_op in rule.feeds
                                      for n in _neighbours(node, True, rule.through)):
                continue
            if rule.fed_by and not any(n.op_type in rule.fed_by or n.qualified_op in rule.fed_by
                                       for n in _neighbours(node, False, rule.through)):
                continue
            reason = f"{rule.describe()} ({rule.source})"
            set_class(ctx, node, rule.op_class or FP32, reason, decisions.USER_OVERRIDE)
            ctx.user_rule_nodes.add(node)
            hits.setdefault(index, []).append(node.name)
            changed += 1
            break  # the first matching rule wins
    for index, names in sorted(hits.items()):
        ctx.structures.append(StructureRecord("pattern_rule", names, rules[index].describe()))
    notes = [f"{rules[i].describe()}: {len(names)} node(s)" for i, names in sorted(hits.items())]
    return changed, notes
