"""The graph the precision analysis works on: fp32 type groups joined producer -> consumer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from ...ir import FLOAT32, Graph, TypeGroup, Value


class GroupGraph:
    """Producer -> consumer edges between the fp32 type groups of a model, across subgraph
    boundaries (captured values, If/Loop/Scan bodies)."""

    def __init__(self, graph: Graph):
        self.vertices: list[TypeGroup] = []
        owner_of_use: dict[tuple[int, int], TypeGroup] = {}
        self.owner_of_def: dict[int, TypeGroup] = {}
        for node in graph.walk_nodes():
            for group in node.type_groups:
                if group.fixed or group.dtype != FLOAT32:
                    continue
                self.vertices.append(group)
                for sub, index in group.inner_uses:
                    owner_of_use[(id(sub), index)] = group
                for value in group.inner_defs:
                    self.owner_of_def[id(value)] = group
        members = set(self.vertices)
        # Lists while the edges are found, then tuples: at a million groups the lists' spare
        # room and the empty ones cost ~100 MB more, at the conversion's peak.
        self.succ: dict[TypeGroup, Sequence[TypeGroup]] = {g: [] for g in self.vertices}
        self.pred: dict[TypeGroup, Sequence[TypeGroup]] = {g: [] for g in self.vertices}
        for group in self.vertices:
            seen: set[int] = set()
            for value in self.defined_values(group):
                for consumer, slot in value.uses:
                    target = consumer.input_group[slot]
                    if target in members and id(target) not in seen:
                        self._link(group, target, seen)
                for sub, index in value.graph_output_uses:
                    target = owner_of_use.get((id(sub), index))
                    if target is not None and id(target) not in seen:
                        self._link(group, target, seen)
        for edges in (self.succ, self.pred):
            for group, linked in edges.items():
                edges[group] = tuple(linked)

    def _link(self, producer: TypeGroup, consumer: TypeGroup, seen: set[int]) -> None:
        seen.add(id(consumer))
        cast(list, self.succ[producer]).append(consumer)
        cast(list, self.pred[consumer]).append(producer)

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
        return self.owner_of_def.get(id(value))
