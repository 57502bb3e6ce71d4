"""Decisions and reasons as a JSON report, and `explain` over it."""

from __future__ import annotations

import json
import marshal
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, overload

from .cost import casts_by_reason, compute_ops_left_fp32, inserted_cast_entries
from .errors import AmpError
from .fileio import read_input_text
from .ir import FLOAT_DTYPES, LOW_PRECISION_DTYPES, Node, short_name
from .packed import PackedRecords
from .passes.base import PassContext, PassResult
from .precision_map import PrecisionMap, precision_map

#: Report precisions that count as low precision (a node with several groups may be "mixed").
LOW_PRECISION_NAMES = ("fp16", "bf16", "mixed", "low")


def _as_text(value: Any) -> str:
    """JSON for what json cannot write: names that are not valid UTF-8 (protobuf hands them over
    as bytes) are shown with \\xNN escapes for their bad bytes."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def to_json(data: Any) -> str:
    """A report or check result as JSON text (indented, one trailing newline)."""
    return json.dumps(data, indent=2, sort_keys=False, default=_as_text) + "\n"


def json_pieces(data: Any) -> Iterator[str]:
    """`to_json(data)` in pieces, made as they are read: lists in `data` that are `Streamed`
    are read an item at a time, so the whole text (or every item) is never in memory."""
    # json's encoder with an indent is its Python one, which writes any list subclass by
    # iterating it.
    yield from json.JSONEncoder(indent=2, default=_as_text).iterencode(data)
    yield "\n"


class Streamed(list[Any]):  # json writes only lists (and subclasses) as arrays
    """A sequence that json writes as an array by iterating it (its items made one at a time,
    such as the report's node entries); as a list it is empty."""

    def __init__(self, items: Sequence[Any]):
        super().__init__()
        self.items = items

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


#: One node's entry, compact: (name, op, precision, class, kind, reason, graph or None,
#: op-list reason or None, groups), each group (group, precision, kind, reason, via node or
#: None, via group or None); `NodeEntries` stores it packed.
NodeRecord = tuple


def node_record(node: Node, graph_name: str) -> NodeRecord:
    """One node's precision, class and reasons for the report, as a compact record."""
    decided = [g for g in node.type_groups if g.precision is not None]
    dtypes = {g.precision for g in decided}
    if not decided:
        has_float = any(v is not None and v.dtype in FLOAT_DTYPES
                        for v in node.outputs + node.inputs)
        low = any(v is not None and v.dtype in LOW_PRECISION_DTYPES for v in node.outputs)
        precision = ("low" if low else "fp32") if has_float else "n/a"
        reason = node.class_reason or "no float tensors"
        kind = node.class_kind
    elif len(dtypes) == 1:
        precision = short_name(next(iter(dtypes))) or ""
        reason, kind = decided[0].reason, decided[0].kind
    else:
        precision = "mixed"
        reason = "; ".join(f"{g.name}: {g.reason}" for g in decided)
        kind = decided[0].kind
    groups = tuple((g.name, short_name(g.precision), g.kind, g.reason,
                    g.via.node.name if g.via is not None else None,
                    g.via.name if g.via is not None else None) for g in decided)
    class_reason = node.class_reason if node.class_reason and node.class_reason != reason \
        else None
    return (node.name, node.qualified_op, precision, node.op_class, kind, reason,
            graph_name if graph_name != "main" else None, class_reason, groups)


def _entry(record: NodeRecord | dict[str, Any]) -> dict[str, Any]:
    """A record as the dict the report's JSON holds (a dict entry is returned as it is)."""
    if isinstance(record, dict):
        return record
    name, op, precision, op_class, kind, reason, graph, class_reason, groups = record
    entry: dict[str, Any] = {"name": name, "op": op, "precision": precision, "class": op_class,
                             "kind": kind, "reason": reason}
    if graph is not None:
        entry["graph"] = graph
    if groups:
        entry["groups"] = [_group_entry(group) for group in groups]
    if class_reason is not None:
        entry["class_reason"] = class_reason
    return entry


def _group_entry(group: tuple) -> dict[str, Any]:
    name, precision, kind, reason, via_node, via_group = group
    entry: dict[str, Any] = {"group": name, "precision": precision, "kind": kind,
                             "reason": reason}
    if via_node is not None:  # the decision this one followed; explain walks these links
        entry["via"] = {"node": via_node, "group": via_group}
    return entry


class _TextTable(dict[str, int]):
    """Text -> its number in a packed table (`texts`), numbering a text the first time it is
    looked up."""

    def __init__(self, texts: PackedRecords):
        super().__init__()
        self.texts = texts

    def __missing__(self, text: str) -> int:
        number = self[text] = len(self.texts)
        self.texts.append(text)
        return number


def _with_text_ids(record: tuple, table: Any) -> tuple:
    """`record` with each text (or text number) replaced by `table[text]`, None and the
    nesting of its groups kept; but names of nodes stay (the node's own, which no other node
    has, and the neighbours its groups followed, nearly as many: in the table they would only
    cost an entry each)."""
    name, op, precision, op_class, kind, reason, graph, class_reason, groups = record
    return (name, table[op], table[precision], table[op_class], table[kind],
            table[reason], None if graph is None else table[graph],
            None if class_reason is None else table[class_reason],
            tuple([(table[g_name], table[g_precision], table[g_kind], table[g_reason],
                    via_node, None if via_group is None else table[via_group])
                   for g_name, g_precision, g_kind, g_reason, via_node, via_group in groups]))


#: Records per packed block of `NodeEntries`.
_ENTRIES_PER_BLOCK = 256


class NodeEntries(Sequence[dict[str, Any]]):
    """The report's node entries, read as the dicts the JSON holds. Each read builds a fresh
    dict, so change an entry through `update`, not the dict.

    The entries are stored packed (`PackedRecords`) rather than as a Python object per node: a
    conversion's report outlives its IR, and per-node objects made while the IR was alive (the
    names it read from the model) would sit scattered through the IR's memory and keep the
    system from getting it back once the IR is freed (about 230 MB at 100k nodes). Records
    given together (`NodeEntries(records)`, as `build_report` does) keep each distinct text
    but node names once, in a packed table, and refer to it by number: their reasons repeat
    from node to node.
    """

    def __init__(self, records: Iterable[NodeRecord | dict[str, Any]] = ()):
        # Compressed: the records of neighbouring nodes share most of their bytes.
        self._records = PackedRecords(_ENTRIES_PER_BLOCK, compress=True)
        self._changed: dict[int, dict[str, Any]] = {}
        self._texts = PackedRecords(_ENTRIES_PER_BLOCK)
        self._text_cache: list[str] | None = None
        # Only while these records are packed: it refers to the caller's strings.
        text_ids = _TextTable(self._texts)
        for record in records:
            self.append(record if isinstance(record, dict) else _with_text_ids(record, text_ids))
        self._records.seal()
        self._texts.seal()

    def _texts_by_number(self) -> list[str]:
        if self._text_cache is None:  # decoded once, when first read
            self._text_cache = [self._texts[i] for i in range(len(self._texts))]
        return self._text_cache

    def append(self, record: NodeRecord | dict[str, Any]) -> None:
        """Add an entry: a `node_record` or a dict as the JSON holds it."""
        self._records.append(record)

    def _record(self, index: int) -> NodeRecord | dict[str, Any]:
        changed = self._changed.get(index)
        if changed is not None:
            return changed
        record = self._records[index]
        if isinstance(record, dict):  # handed out as a copy, as if decoded afresh
            return marshal.loads(marshal.dumps(record))
        if isinstance(record, tuple) and isinstance(record[1], int):  # texts by number
            record = _with_text_ids(record, self._texts_by_number())
        return record

    def __len__(self) -> int:
        return len(self._records)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return [_entry(self._record(i)) for i in range(len(self))[index]]
        if not -len(self) <= index < len(self):
            raise IndexError("node entry index out of range")
        return _entry(self._record(index % len(self)))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (_entry(self._record(i)) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (NodeEntries, list)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"NodeEntries({len(self)} nodes)"

    def extend(self, entries: Iterable[dict[str, Any]]) -> None:
        """Append entries (another report's, when reports are merged)."""
        for entry in entries:
            self.append(entry)

    def update(self, index: int, **fields: Any) -> None:
        """Change fields of entry `index`."""
        entry = _entry(self._record(index))
        entry.update(fields)
        self._changed[index] = entry


@dataclass
class Report:
    """What a conversion decided and changed."""

    target: str
    backend: str
    summary: dict[str, Any]
    nodes: NodeEntries
    constants: list[dict[str, Any]] = field(default_factory=list)
    passes: list[dict[str, Any]] = field(default_factory=list)
    validation: dict[str, Any] | None = None
    #: The training rewrite's names and loss-scaling rule (TF training graphs only).
    training: dict[str, Any] | None = None
    #: Variables stored in low precision (TF SavedModels).
    weights: dict[str, Any] | None = None
    #: Things the user likely did not mean (an override naming no op), shown by the CLI.
    warnings: list[str] = field(default_factory=list)
    #: `--optimize`: the model type, onnxruntime's version and the ops its fusions added.
    optimizer: dict[str, Any] | None = None
    #: What the conversion buys and costs (`amp_rewriter.cost`): activation bytes moved in low
    #: precision vs fp32, compute ops left fp32 and why, casts by reason.
    cost: dict[str, Any] | None = None
    #: Structural rules applied: attention masks (with the saturation added), tanh-GELU cubes,
    #: index math kept fp32, the user's pattern rules; each with its nodes and reason.
    structures: list[dict[str, Any]] = field(default_factory=list)
    #: `convert --auto`'s search: calibration, runs, pinned nodes and what each contributed.
    auto: dict[str, Any] | None = None
    #: The host check behind a warning that low precision may run slower here than fp32
    #: (`amp_rewriter.host`): the CPU flags looked for and found.
    host: dict[str, Any] | None = None
    #: The converted graph's cells for `convert --plot` (asked for with
    #: `Options.precision_map`); not part of the JSON.
    precision_map: PrecisionMap | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(replace(self, nodes=NodeEntries(), precision_map=None))
        data["nodes"] = list(self.nodes)
        return _without_absent_parts(data)

    def to_json(self) -> str:
        return to_json(self.to_dict())

    def json_pieces(self) -> Iterator[str]:
        """`to_json()` in pieces, each node entry made as it is written (at a million nodes the
        whole text and entries would take gigabytes)."""
        data = asdict(replace(self, nodes=NodeEntries(), constants=[], precision_map=None))
        data["nodes"], data["constants"] = Streamed(self.nodes), Streamed(self.constants)
        return json_pieces(_without_absent_parts(data))

    def node(self, name: str) -> dict[str, Any] | None:
        return next((n for n in self.nodes if n["name"] == name), None)


def _without_absent_parts(data: dict[str, Any]) -> dict[str, Any]:
    for key in ("validation", "training", "optimizer", "cost", "weights", "auto", "host"):
        if data[key] is None:
            del data[key]
    del data["precision_map"]
    return data


def build_report(ctx: PassContext, original_nodes: Sequence[Node], results: list[PassResult],
                 graph_name: Callable[[Node], str], *, with_constants: bool = True) -> Report:
    """Summarise a conversion: every original node's decision (each under the name of its graph,
    `graph_name`) plus the counts users ask for. Without `with_constants` the report's
    constants are left for the caller to fill (`constant_entries(ctx.constants)`) once the IR
    has gone: a million-node graph has 100k or more of them."""
    low = 0
    compute: dict[str, list[int]] = {}

    def records() -> Iterator[NodeRecord]:
        nonlocal low
        for node in original_nodes:
            record = node_record(node, graph_name(node))
            op, precision = record[1], record[2]
            low += precision in LOW_PRECISION_NAMES
            # Float compute only: a MatMul of integers (precision n/a) is not what it counts.
            if op in ctx.rules.compute_ops and precision != "n/a":
                counts = compute.setdefault(op, [0, 0])
                counts[0] += precision in LOW_PRECISION_NAMES
                counts[1] += 1
            yield record

    entries = NodeEntries(records())
    kept = sum(1 for c in ctx.constants if c.action == "kept_fp32")
    # Casts only: a set of every node would take ~100 MB at a million nodes.
    final_casts = [n for n in ctx.model.graph.walk_nodes() if n.op_type == "Cast"]
    new_casts = sum(1 for n in final_casts if n.created_by is not None)
    kept_casts: set[Node] = {n for n in final_casts if n.created_by is None}
    original_casts = [n for n in original_nodes if n.op_type == "Cast"]
    summary = {
        "nodes": len(entries),
        "low_precision_nodes": low,
        # What decides the speed-up: the float matrix products, convolutions, ... (the format's
        # compute ops) in low precision, per op type as [low precision, all].
        "compute_ops": sum(total for _, total in compute.values()),
        "low_precision_compute_ops": sum(low for low, _ in compute.values()),
        "compute_ops_by_type": dict(sorted(compute.items())),
        "casts_inserted": new_casts,
        "casts_removed": sum(1 for n in original_casts if n not in kept_casts),
        "constants_converted": sum(1 for c in ctx.constants
                                   if c.action in ("converted", "clamped")),
        "constants_kept_fp32": kept,
        "constants_clamped": sum(1 for c in ctx.constants if c.action == "clamped"),
        "values_flushed_to_zero": sum(c.flushed_to_zero for c in ctx.constants
                                      if c.action in ("converted", "clamped")),
    }
    cost = {"compute_ops": compute_ops_left_fp32(ctx.model, ctx.rules.compute_ops),
            "casts_by_reason": casts_by_reason(ctx.model),
            "inserted_casts": inserted_cast_entries(ctx.model)}
    cells = (precision_map(ctx.model, ctx.rules.compute_ops, graph_name)
             if ctx.options.precision_map else None)
    return Report(ctx.options.target, ctx.options.backend or "", summary, entries,
                  constant_entries(ctx.constants) if with_constants else [],
                  [{"name": r.name, "changed": r.changed, "notes": r.notes} for r in results],
                  cost=cost, structures=[asdict(s) for s in ctx.structures],
                  precision_map=cells)


def constant_entries(records: Iterable[Any]) -> list[dict[str, Any]]:
    """The report's entries of a conversion's constant records (`PassContext.constants`)."""
    # Flat records: their fields, no deep copy (`dataclasses.asdict` copies every value).
    return [{name: getattr(record, name) for name in record.__slots__} for record in records]


def load_report(path: str | Path) -> Report:
    """Read a report written by `convert --report`."""
    if not Path(path).exists():
        raise AmpError(f"{path}: no such report")
    text = read_input_text(path, "report")
    try:
        data = json.loads(text)
        _check_report_shape(data)
        return Report(data["target"], data["backend"], data["summary"],
                      NodeEntries(data["nodes"]),
                      data.get("constants", []), data.get("passes", []), data.get("validation"),
                      training=data.get("training"), optimizer=data.get("optimizer"),
                      cost=data.get("cost"), weights=data.get("weights"),
                      structures=data.get("structures", []), auto=data.get("auto"),
                      warnings=data.get("warnings", []), host=data.get("host"))
    except _ReportShapeError as exc:
        raise AmpError(f"{path}: not an amp-rewriter report ({exc})") from None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise AmpError(f"{path}: not an amp-rewriter report ({exc.__class__.__name__})") from None


def find_nodes(report: Report, node_name: str) -> list[dict[str, Any]]:
    """The report entries named `node_name`, or `GRAPH/NODE` (a node of one function or body:
    the same name may stand in several)."""
    exact = [entry for entry in report.nodes if entry["name"] == node_name]
    if exact:
        return exact
    return [entry for entry in report.nodes
            if "graph" in entry and f"{entry['graph']}/{entry['name']}" == node_name]


class _ReportShapeError(Exception):
    """What of a report JSON is not as `convert --report` writes it."""


def _check_report_shape(data: Any) -> None:
    """The fields `explain` reads, with their types: a hand-edited or foreign JSON file is
    refused in one line instead of failing half-way through the explanation."""
    def need(mapping: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
        if not isinstance(mapping, dict) or not isinstance(mapping.get(key), kind):
            raise _ReportShapeError(f"{where} has no {key!r} of the right type")
        return mapping[key]

    need(data, "target", str, "the report")
    need(data, "backend", str, "the report")
    need(data, "summary", dict, "the report")
    for index, node in enumerate(need(data, "nodes", list, "the report")):
        for key in ("name", "op", "class", "precision", "reason"):
            need(node, key, str, f"node {index}")
        groups = node.get("groups", [])
        if not isinstance(groups, list):
            raise _ReportShapeError(f"node {index} has no list of type groups")
        for group in groups:
            for key in ("group", "precision", "reason"):
                need(group, key, str, f"a type group of node {index}")
            via = group.get("via")
            if via is not None and not (isinstance(via, dict) and isinstance(via.get("node"), str)
                                        and isinstance(via.get("group"), str)):
                raise _ReportShapeError(f"a type group of node {index} has a malformed 'via'")


def explain_text(report: Report, node_name: str) -> str:
    """Human-readable answer to "why does this node run in this precision?".

    A name that several graphs use (a SavedModel's functions often share `Identity`, `NoOp`)
    gets every match, each under its graph, and the `GRAPH/NODE` form that picks one.
    """
    entries = find_nodes(report, node_name)
    inserted = [cast for cast in (report.cost or {}).get("inserted_casts", [])
                if cast["name"] == node_name]
    if not entries and inserted:
        return "\n".join(f"{cast['name']} (Cast to {cast['to']}): inserted by pass "
                         f"{cast['inserted_by']}\n  reason:    {cast['reason']}"
                         for cast in inserted)
    if not entries:
        close = [n["name"] for n in report.nodes if node_name.lower() in n["name"].lower()][:5]
        hint = f" (did you mean: {', '.join(close)})" if close else ""
        raise AmpError(f"no node named {node_name!r} in the report{hint}")
    if len(entries) == 1:
        return _explain_entry(report, entries[0])
    graphs = [entry.get("graph", "main") for entry in entries]
    lines = [f"{node_name}: {len(entries)} nodes have this name, one in each of these graphs; "
             f"name one as GRAPH/NODE (e.g. {graphs[0]}/{entries[0]['name']})"]
    for graph, entry in zip(graphs, entries):
        lines.append("")
        lines.append(f"in {graph}:")
        lines.append(_explain_entry(report, entry))
    return "\n".join(lines)


def _explain_entry(report: Report, entry: dict[str, Any]) -> str:
    lines = [f"{entry['name']} ({entry['op']})"]
    if "graph" in entry:
        lines.append(f"  graph:     {entry['graph']}")
    lines += [f"  class:     {entry['class']}",
              f"  precision: {entry['precision']}  [target {report.target}, "
              f"backend {report.backend}]",
              f"  decided by: {entry.get('kind') or 'n/a'}",
              f"  reason:    {entry['reason']}"]
    if entry.get("class_reason"):
        lines.append(f"  op list:   {entry['class_reason']}")
    for group in entry.get("groups", []):
        if len(entry.get("groups", [])) > 1:
            lines.append(f"  type group {group['group']}: {group['precision']} "
                         f"[{group.get('kind') or 'n/a'}] - {group['reason']}")
        for step in _chain(report, entry.get("graph"), group):
            lines.append(f"    because {step}")
    return "\n".join(lines)


def _chain(report: Report, graph: str | None, group: dict, limit: int = 12) -> list[str]:
    """Follow `via` links back to the decision that started the propagation (a link names a
    node of the same graph, or of an enclosing one for a control-flow body)."""
    by_graph: dict[tuple[str | None, str], dict] = {}
    by_name: dict[str, dict] = {}
    for node in report.nodes:
        by_graph.setdefault((node.get("graph"), node["name"]), node)
        by_name.setdefault(node["name"], node)
    steps: list[str] = []
    seen: set[tuple[str, str]] = set()
    link = group.get("via")
    while link and (link["node"], link["group"]) not in seen and len(steps) < limit:
        seen.add((link["node"], link["group"]))
        found = by_graph.get((graph, link["node"])) or by_name.get(link["node"])
        if found is None:
            break
        node = found
        graph = node.get("graph")
        source = next((g for g in node.get("groups", []) if g["group"] == link["group"]), None)
        if source is None:
            break
        steps.append(f"{node['name']} ({node['op']}, {source['group']}): {source['precision']} "
                     f"[{source.get('kind') or 'n/a'}] - {source['reason']}")
        link = source.get("via")
    return steps


@dataclass(frozen=True)
class CheckRule:
    """One class of finding `check` looks for: a problem's `kind`, what passing it means, and
    whether it can be checked only against the fp32 model (`--reference`)."""

    kind: str
    description: str
    needs_reference: bool = False


@dataclass
class CheckResult:
    """What `check` found in a converted model; no problems means it passes."""

    target: str
    problems: list[dict] = field(default_factory=list)
    outputs: list[dict] = field(default_factory=list)
    #: Findings that do not fail the check (shown, and kept in the JSON).
    notes: list[str] = field(default_factory=list)
    #: The backend whose deny lists were applied.
    backend: str = ""
    #: What the model runs in low precision (`cost.model_cost`): compute ops, casts and, where
    #: the format's shape inference gives them, activation bytes; None when it could not be read.
    cost: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        data = {"ok": self.ok, "target": self.target, "backend": self.backend,
                "problems": self.problems, "outputs": self.outputs, "notes": self.notes}
        if self.cost is not None:
            data["cost"] = self.cost
        return data
