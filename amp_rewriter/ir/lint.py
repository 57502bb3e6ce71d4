"""Structural checks of the IR: both ends of every edge (data and control) agree, nodes are in
topological order."""

from __future__ import annotations

import os

from .core import Graph, Node, Value

#: Set (to anything but 0) to check the IR after loading and after every pass, and what
#: emitters rely on (the tests set it).
LINT_ENV = "AMP_REWRITER_LINT"


def lint_enabled() -> bool:
    """Whether AMP_REWRITER_LINT asks for IR checks after every pass."""
    return os.environ.get(LINT_ENV, "") not in ("", "0")


class IRInvariantError(Exception):
    """`lint` found the IR broken; the message names who broke it and the first problems."""


def lint(graph: Graph) -> list[str]:
    """Structural problems in a graph and its nested graphs; [] when sound.

    Checked: every input slot is listed in its value's uses and every use points back at a live
    input slot; every output knows its producer and slot; graph outputs and their
    `graph_output_uses` agree; a node reads only values produced before it in its own graph or
    defined in an enclosing one; control edges join live nodes of one graph, the earlier one
    first (a loop's back edge aside), and both ends list them; control outputs are live nodes
    of their graph; node and value registrations point at the right graph; type groups name
    existing slots.
    """
    problems: list[str] = []
    live: set[Node] = set()
    graphs = list(graph.walk_graphs())
    for g in graphs:
        live.update(g.nodes)
    visible: dict[Graph, set[Value]] = {}
    for g in graphs:
        outer = visible.get(g.parent, set()) if g.parent is not None else set()
        defined = set(outer) | set(g.inputs) | set(g.initializers.values())
        earlier: set[Node] = set()
        for node in g.nodes:
            _lint_node(node, g, defined, live, problems)
            _lint_control_edges(node, g, earlier, live, problems)
            earlier.add(node)
            for value in node.outputs:
                if value is not None:
                    defined.add(value)
        visible[g] = defined
        for name, node in g.control_outputs.items():
            if node not in live or node.graph is not g:
                problems.append(f"graph {g.name}: control output {name!r} is {node.name}, which "
                                f"is not a node of the graph")
        for index, value in enumerate(g.outputs):
            if (g, index) not in value.graph_output_uses:
                problems.append(f"graph {g.name}: output {index} ({value.name}) missing from its "
                                f"graph_output_uses")
        for value in g.values.values():
            for sub, index in value.graph_output_uses:
                if index >= len(sub.outputs) or sub.outputs[index] is not value:
                    problems.append(f"{value.name}: lists output {index} of graph {sub.name}, "
                                    f"which is another value")
        for name, value in g.initializers.items():
            if value.name != name or g.values.get(name) is not value:
                problems.append(f"graph {g.name}: initializer {name!r} not registered as a value")
    return problems


def _lint_node(node: Node, graph: Graph, defined: set[Value], live: set[Node],
               problems: list[str]) -> None:
    if node.graph is not graph:
        problems.append(f"{node.name}: sits in graph {graph.name} but points at another graph")
    for slot, value in enumerate(node.inputs):
        if value is None:
            continue
        if (node, slot) not in value.uses:
            problems.append(f"{node.name}: input {slot} missing from uses of {value.name}")
        if value.producer is not None and value not in defined and not value.loop_back:
            problems.append(f"{node.name}: input {value.name} used before it is produced")
    for slot, value in enumerate(node.outputs):
        if value is None:
            continue
        if value.producer is not node or value.producer_slot != slot:
            problems.append(f"{node.name}: output {slot} ({value.name}) names another producer")
        if value.graph.values.get(value.name) is not value:
            problems.append(f"{node.name}: output {value.name} not registered in its graph")
        for consumer, use_slot in value.uses:
            if consumer not in live:
                problems.append(f"{value.name}: used by {consumer.name}, which is not in the "
                                f"graph")
            elif use_slot >= len(consumer.inputs) or consumer.inputs[use_slot] is not value:
                problems.append(f"{value.name}: uses list {consumer.name} input {use_slot}, "
                                f"which reads something else")
    for group in node.type_groups:
        if any(s >= len(node.inputs) for s in group.input_slots) or \
                any(s >= len(node.outputs) for s in group.output_slots):
            problems.append(f"{node.name}: type group {group.name} names a slot it does not have")


def _lint_control_edges(node: Node, graph: Graph, earlier: set[Node], live: set[Node],
                        problems: list[str]) -> None:
    for waited in node.control_inputs:
        if waited not in live or waited.graph is not graph:
            problems.append(f"{node.name}: waits for {waited.name}, which is not a node of its "
                            f"graph")
        elif waited not in earlier and not any(v is not None and v.loop_back
                                                   for v in waited.outputs):
            problems.append(f"{node.name}: waits for {waited.name}, which runs after it")
        if not any(user is node for user in waited.control_users):
            problems.append(f"{node.name}: waits for {waited.name}, whose control_users miss it")
    for user in node.control_users:
        if user not in live:
            problems.append(f"{node.name}: control user {user.name} is not in the graph")
        elif not any(waited is node for waited in user.control_inputs):
            problems.append(f"{node.name}: lists control user {user.name}, which does not wait "
                            f"for it")


def assert_sound(graph: Graph, after: str) -> None:
    """Raise IRInvariantError naming `after` (a pass or loader) when `lint` finds problems."""
    problems = lint(graph)
    if problems:
        shown = "; ".join(problems[:3])
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise IRInvariantError(f"IR broken after {after}: {shown}{more}")
