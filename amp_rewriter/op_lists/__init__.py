"""Op lists: which class (allow / infer / deny / clear) an op has for a format, target and backend.

The lists are data (`onnx.toml` beside this file). `OpLists.load` merges the generic list for the
target with the backend profile and the user's overrides, remembering for every op where its class
came from, so `explain` can say why.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from ..errors import AmpError
from ..fileio import read_input_text
from ..ir import ALLOW, CLEAR, DENY, FP32, INFER, decisions
from ..node_patterns import NodePattern

CLASSES = (ALLOW, INFER, DENY, CLEAR)
TARGETS = ("fp16", "bf16")
_DATA_DIR = Path(__file__).parent


#: Keys of a `[[rules]]` entry in a config file.
RULE_KEYS = ("op", "feeds", "fed_by", "through", "name", "precision", "class")


@dataclass(frozen=True)
class PatternRule:
    """A user's structural rule: nodes of type `op` that feed (or are fed by) one of the given
    ops, optionally through others and with a matching name, get fp32 or an op class.

    In a config file::

        [[rules]]
        op = "MatMul"             # the op the rule applies to
        feeds = "Softmax"         # ...when one of its consumers is a Softmax (a list: any of them)
        through = ["Add", "Div"]  # ...looking through these ops between the two
        precision = "fp32"        # or: class = "allow" | "infer" | "deny" | "clear"
    """

    op: str
    feeds: frozenset[str] = frozenset()
    fed_by: frozenset[str] = frozenset()
    through: frozenset[str] = frozenset()
    name: NodePattern | None = None
    #: None: the rule pins the node to fp32; else the class it moves the node to.
    op_class: str | None = None
    source: str = ""

    def describe(self) -> str:
        """The rule in words, as the report and `explain` show it."""
        parts = [self.op]
        if self.name is not None:
            parts.append(f"named {self.name.pattern!r}")
        if self.feeds:
            parts.append(f"that feeds {'/'.join(sorted(self.feeds))}")
        if self.fed_by:
            parts.append(f"fed by {'/'.join(sorted(self.fed_by))}")
        if self.through:
            parts.append(f"through {'/'.join(sorted(self.through))}")
        action = f"class {self.op_class}" if self.op_class else "fp32"
        return f"pattern rule: {' '.join(parts)} -> {action}"

    @classmethod
    def from_entry(cls, entry: object, where: str) -> PatternRule:
        """Parse one `[[rules]]` table; a bad entry raises AmpError naming it."""
        if not isinstance(entry, dict):
            raise AmpError(f"{where}: each [[rules]] entry must be a table")
        unknown = sorted(set(entry) - set(RULE_KEYS))
        if unknown:
            raise AmpError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (expected "
                           f"{', '.join(RULE_KEYS)})")
        op = entry.get("op")
        if not isinstance(op, str) or not op:
            raise AmpError(f"{where}: 'op' (the op type the rule applies to) is required")

        def names(key: str) -> frozenset[str]:
            value = entry.get(key, [])
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise AmpError(f"{where}: {key!r} must be an op name or a list of op names")
            return frozenset(value)

        feeds, fed_by, through = names("feeds"), names("fed_by"), names("through")
        if not feeds and not fed_by and "name" not in entry:
            raise AmpError(f"{where}: a rule needs 'feeds', 'fed_by' or 'name' (for every "
                           f"{op}, use the op lists: deny = [\"{op}\"])")
        pattern = None
        if "name" in entry:
            if not isinstance(entry["name"], str):
                raise AmpError(f"{where}: 'name' must be a regex string")
            pattern = NodePattern(entry["name"], source=f"{where}: name")
        if ("precision" in entry) == ("class" in entry):
            raise AmpError(f"{where}: give exactly one of 'precision' (\"fp32\") and 'class'")
        op_class = None
        if "precision" in entry and entry["precision"] != "fp32":
            raise AmpError(f"{where}: precision {entry['precision']!r} is not supported "
                           f"(\"fp32\"; to let an op run low precision, give class = "
                           f"\"allow\")")
        if "class" in entry:
            op_class = entry["class"]
            if op_class not in CLASSES:
                raise AmpError(f"{where}: class {op_class!r} is not one of "
                               f"{', '.join(CLASSES)}")
        return cls(op, feeds, fed_by, through, pattern, op_class, where)


@dataclass
class Overrides:
    """What the user changed: ops moved between classes, nodes pinned to fp32, pattern rules."""

    moves: dict[str, str] = field(default_factory=dict)  # op -> class
    keep_nodes: list[str] = field(default_factory=list)  # node names or regexes
    source: dict[str, str] = field(default_factory=dict)  # op -> "--deny" / "config x.toml"
    rules: list[PatternRule] = field(default_factory=list)

    def move(self, op: str, op_class: str, source: str) -> None:
        if op_class not in CLASSES and op_class != FP32:
            raise AmpError(f"{source}: unknown op class {op_class!r} (expected one of "
                           f"{', '.join(CLASSES)})")
        self.moves[op] = op_class
        self.source[op] = source

    @classmethod
    def from_config(cls, path: str | Path, into: Overrides | None = None) -> Overrides:
        """Read a TOML file: `allow = [..]`, `infer`, `deny`, `clear`, `keep_nodes = [..]`, and
        `[[rules]]` tables (see `PatternRule`).

        The lists may also sit under an `[ops]` table; unknown keys are refused so typos surface.
        """
        overrides = into or cls()
        path = Path(path)
        if not path.exists():
            raise AmpError(f"{path}: config file not found")
        text = read_input_text(path, "config file")
        try:
            data = tomllib.loads(text)
        except (tomllib.TOMLDecodeError, RecursionError) as exc:
            raise AmpError(f"{path}: not a valid TOML config ({exc})") from None
        table = data.get("ops", data)
        if not isinstance(table, dict):
            raise AmpError(f"{path}: 'ops' must be a table ([ops]) of op lists")
        rule_entries = data.get("rules", [])
        if not isinstance(rule_entries, list):
            raise AmpError(f"{path}: 'rules' must be an array of tables ([[rules]])")
        for index, entry in enumerate(rule_entries, 1):
            overrides.rules.append(PatternRule.from_entry(entry, f"{path.name} rule {index}"))
        for key, entries in table.items():
            if key == "rules" and table is data:
                continue
            if key == "keep_nodes":
                overrides.keep_nodes.extend(_str_list(entries, path, key))
            elif key in CLASSES:
                for op in _str_list(entries, path, key):
                    overrides.move(op, key, f"config {path.name}")
            elif key != "ops":
                raise AmpError(f"{path}: unknown key {key!r} (expected allow, infer, deny, "
                               f"clear, keep_nodes, rules)")
        return overrides

    def keep_node_patterns(self) -> list[NodePattern]:
        """`--keep-node` entries as whole-name regexes (a plain name matches itself)."""
        return [NodePattern(entry) for entry in self.keep_nodes]


def _str_list(entries: object, path: Path, key: str) -> list[str]:
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise AmpError(f"{path}: {key} must be a list of strings")
    return list(entries)


@dataclass
class OpLists:
    """The merged op classes for one (format, target, backend)."""

    format: str
    target: str
    backend: str
    classes: dict[str, str]
    reasons: dict[str, str]
    #: Ops the backend has no low-precision kernel for (None: the backend runs every op).
    no_kernel: frozenset[str]
    #: When set, only these ops have a low-precision kernel on the backend.
    kernels: frozenset[str] | None = None
    #: When set, asked last: (op, type group name such as "T" or "T[1]") -> whether the backend
    #: has a kernel for the op with that group in the target dtype (a front end's kernel registry).
    kernel_check: Callable[[str, str | None], bool] | None = None
    #: Ops whose class the user set (overrides, config, environment lists): decision kind
    #: user_override instead of op_list.
    user_set: set[str] = field(default_factory=set)
    #: Ops a rewrite pass may not build in the target dtype on this backend, with the reason
    #: (measured slow or wrong there); the model's own nodes of that op are not affected.
    not_in_rewrites: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, fmt: str, target: str, backend: str,
             overrides: Overrides | None = None, opset: int | None = None) -> OpLists:
        """Merge generic lists, backend profile and overrides for `fmt`/`target`/`backend`.

        `opset` (ONNX: the model's default-domain opset) applies the profile's
        `no_kernel_from_opset` table: ops whose kernel for the target is gone from that opset on.
        """
        if target not in TARGETS:
            raise AmpError(f"unknown target {target!r} (expected fp16 or bf16)")
        data = _read_list_file(fmt)
        backends = data.get("backends", {})
        if backend not in backends:
            raise AmpError(f"unknown backend {backend!r} for {fmt} (expected one of "
                           f"{', '.join(sorted(backends))})")
        classes: dict[str, str] = {}
        reasons: dict[str, str] = {}
        generic_reasons = data.get("reasons", {})
        for op_class in CLASSES:
            for op in data[target].get(op_class, []):
                classes[op] = op_class
                reasons[op] = generic_reasons.get(op, f"{op_class} in the generic {target} list")
        profile = backends[backend].get(target, {})
        profile_reasons = backends[backend].get("reasons", {})
        for op_class in CLASSES:
            for op in profile.get(op_class, []):
                classes[op] = op_class
                reasons[op] = profile_reasons.get(op, f"{op_class} for backend {backend}")
        for op, why in profile_reasons.items():
            if op in classes and op not in profile.get(classes[op], []):
                reasons[op] = why
        kernels = frozenset(profile["kernels"]) if "kernels" in profile else None
        no_kernel = set(profile.get("no_kernel", []))
        if opset is not None:
            no_kernel |= {op for op, since in profile.get("no_kernel_from_opset", {}).items()
                          if opset >= since}
        lists = cls(fmt, target, backend, classes, reasons, frozenset(no_kernel), kernels,
                    not_in_rewrites=dict(profile.get("not_in_rewrites", {})))
        if overrides is not None:
            lists.apply_overrides(overrides)
        return lists

    def apply_overrides(self, overrides: Overrides) -> None:
        """Move ops between classes as the user asked."""
        for op, op_class in overrides.moves.items():
            self.set_class(op, op_class, f"{op_class} by user override ({overrides.source[op]})")

    def set_class(self, op: str, op_class: str, reason: str) -> None:
        """Put `op` in `op_class` because the user asked (an override, a config, a variable)."""
        self.classes[op] = op_class
        self.reasons[op] = reason
        self.user_set.add(op)

    def class_of(self, op: str) -> tuple[str, str]:
        """(class, reason) for an op; unlisted ops are fp32."""
        if op in self.classes:
            return self.classes[op], self.reasons[op]
        return FP32, f"{op} is on no list: unlisted ops stay fp32 and block propagation"

    def kind_of(self, op: str) -> str:
        """The decision kind behind `class_of(op)`: the user's override or the op lists."""
        return decisions.USER_OVERRIDE if op in self.user_set else decisions.OP_LIST

    def has_kernel(self, op: str, group: str | None = None) -> bool:
        """Whether the backend can run `op` (with type group `group`) in the target precision."""
        if op in self.no_kernel:
            return False
        if self.kernels is not None and op not in self.kernels:
            return False
        return self.kernel_check is None or self.kernel_check(op, group)

    def rewrite_refusal(self, ops: Iterable[str]) -> str | None:
        """Why a rewrite may not build `ops` in the target dtype on this backend (ops with no
        kernel, or ones the profile keeps out of rewrites, each with its reason), or None when
        it may."""
        refusals = []
        for op in dict.fromkeys(ops):
            if op in self.not_in_rewrites:
                refusals.append(f"{op}: {self.not_in_rewrites[op]}")
            elif not self.has_kernel(op):
                refusals.append(f"{op} has no {self.target} kernel on backend {self.backend}")
        return "; ".join(refusals) or None

    def listed(self, op_class: str) -> Iterable[str]:
        return sorted(op for op, c in self.classes.items() if c == op_class)


_LIST_CACHE: dict[str, dict] = {}


def _read_list_file(fmt: str) -> dict:
    if fmt not in _LIST_CACHE:
        path = _DATA_DIR / f"{fmt}.toml"
        _LIST_CACHE[fmt] = tomllib.loads(path.read_text())
    return _LIST_CACHE[fmt]


def backends_for(fmt: str) -> list[str]:
    """Backend profile names available for a format."""
    return sorted(_read_list_file(fmt).get("backends", {}))
