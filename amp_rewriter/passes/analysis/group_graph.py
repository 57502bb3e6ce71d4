"""The graph the precision analysis works on: fp32 type groups joined producer -> consumer."""

from __future__ import annotations

from collections.abc import Sequence

from ...ir import FLOAT32, Graph, TypeGroup, Value


class GroupGraph:
    """Producer -> consumer edges between the fp32 type groups of a model, across subgraph
    boundaries (captured values, If/Loop/Scan bodies)."""

    def __init__(self, graph: Graph):
        self.vertices: list[TypeGroup] = []
        owner_of_use: dict[tuple[Graph, int], TypeGroup] = {}
        self.owner_of_def: dict[Value, TypeGroup] = {}
        for node in graph.walk_nodes():
            for group in node.type_groups:
                if group.fixed or group.dtype != FLOAT32:
                    continue
                self.vertices.append(group)
                for sub, index in group.inner_uses:
                    owner_of_use[(sub, index)] = group
                for value in group.inner_defs:
                    self.owner_of_def[value] = group
        # Plain loops and local names: this runs once per conversion over every group and
        # edge (seconds at a million nodes).
        succ: dict[TypeGroup, Sequence[TypeGroup]] = {}
        pred: dict[TypeGroup, list[TypeGroup]] = {g: [] for g in self.vertices}
        for group in self.vertices:
            # `defined_values`, inlined: a call and a filtered copy per group cost a quarter
            # of this loop (measured at 200k nodes).
            node = group.node
            values: list[Value | None] = [node.outputs[s] for s in group.output_slots]
            values += group.inner_defs
            targets: list[TypeGroup] = []
            for defined in values:
                if defined is None:
                    continue
                for consumer, slot in defined.uses:
                    target = consumer.input_group[slot]
                    if target is not None and target in pred and target not in targets:
                        targets.append(target)
                for sub, index in defined.graph_output_uses:
                    target = owner_of_use.get((sub, index))
                    if target is not None and target not in targets:
                        targets.append(target)
            succ[group] = tuple(targets)
            for target in targets:
                pred[target].append(group)
        # Tuples: at a million groups lists' spare room would cost ~100 MB more, at the
        # conversion's peak.
        self.succ = succ
        self.pred: dict[TypeGroup, Sequence[TypeGroup]] = {g: tuple(p) for g, p in pred.items()}

    @staticmethod
    def defined_values(group: TypeGroup) -> list[Value]:
        """Values whose dtype this group decides: its outputs and its body-side definitions."""
        node = group.node
        values = [node.outputs[s] for s in group.output_slots]
        return [v for v in values if v is not None] + list(group.inner_defs)

    def producer_group(self, value: Value) -> TypeGroup | None:
        """The group that decides `value`'s dtype (None for graph inputs and constants)."""
        if value.producer is not None:
            return value.producer.output_group[value.producer_slot]
        return self.owner_of_def.get(value)
