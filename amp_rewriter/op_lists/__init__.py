"""Op lists: which class (allow / infer / deny / clear) an op has for a format, target and backend.

The lists are data (`onnx.toml` beside this file). `OpLists.load` merges the generic list for the
target with the backend profile and the user's overrides, remembering for every op where its class
came from, so `explain` can say why.

A backend profile (`BackendProfile`, a `[backends.NAME]` table of the format's TOML file or of a
`--config` file) is validated data: besides its op tables it names the runtime that runs the
format's models for it, that runtime's providers, the device, whether low precision is emulated
when measuring, and where kernel availability comes from. Every consumer (validation, `check`,
`--auto`, the host check) reads those fields; no code compares backend names.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def refuse_unknown_keys(table: dict, allowed: Iterable[str], where: str) -> None:
    """Raise AmpError naming `where` and every key of `table` that is not `allowed` (a typo in
    a config or list file must not be ignored)."""
    allowed = tuple(allowed)
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise AmpError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (expected "
                       f"{', '.join(allowed)})")


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
        refuse_unknown_keys(entry, RULE_KEYS, where)
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


#: Keys of a `[backends.NAME]` table.
PROFILE_KEYS = ("description", "format", "extends", "runtime", "providers", "provider_options",
                "device", "emulation", "kernel_source", "default_for", "reasons", *TARGETS)
#: Keys of a profile's per-target table (`[backends.NAME.fp16]`).
PROFILE_TARGET_KEYS = (*CLASSES, "no_kernel", "kernels", "no_kernel_from_opset",
                       "not_in_rewrites", "no_compute_advice")
#: What each profile field may hold.
#: The runtimes a profile may name, with how messages name them.
RUNTIMES = {"onnxruntime": "onnxruntime", "tensorflow": "TensorFlow"}
DEVICES = ("cpu", "cuda")
#: never: the runtime's low-precision kernels are measured as they are; fallback: natively on
#: the profile's providers when the runtime has them, else emulated on the CPU; always: emulated
#: (the runtime computes most low-precision ops in fp32 between casts, which would hide hazards).
EMULATIONS = ("never", "fallback", "always")
#: table: the profile's own kernel tables; registry: also the runtime's kernel registry for the
#: profile's device, op by op (TensorFlow).
KERNEL_SOURCES = ("table", "registry")


@dataclass(frozen=True)
class BackendProfile:
    """One backend profile: the op tables per target and how its runtime runs models."""

    name: str
    format: str
    description: str
    runtime: str
    device: str
    emulation: str
    kernel_source: str
    #: The runtime's providers in order of preference (onnxruntime's execution providers).
    providers: tuple[str, ...] = ()
    #: Options per provider, as the runtime takes them (onnxruntime: provider_options).
    provider_options: dict[str, dict[str, str]] = field(default_factory=dict)
    #: The targets for which the format uses this profile when the user names none.
    default_for: tuple[str, ...] = ()
    #: Per target: the class moves and kernel tables (keys of PROFILE_TARGET_KEYS).
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    #: Where it was declared (a file name), for messages.
    source: str = ""

    @classmethod
    def from_table(cls, name: str, table: object, source: str,
                   base: BackendProfile | None = None, fmt: str | None = None) -> BackendProfile:
        """Validate one `[backends.NAME]` table; an unknown key or a bad value raises AmpError
        naming `source` and the key. `base`: the profile it extends (its fields are the
        defaults, its per-target tables are replaced key by key, its reasons added to)."""
        where = f"{source}: [backends.{name}]"
        if not isinstance(table, dict):
            raise AmpError(f"{where} must be a table")
        refuse_unknown_keys(table, PROFILE_KEYS, where)
        fields: dict[str, Any] = ({} if base is None else {
            f: getattr(base, f) for f in ("format", "description", "runtime", "device",
                                          "emulation", "kernel_source", "providers",
                                          "provider_options")})
        fields["format"] = table.get("format", fields.get("format", fmt))
        if fmt is not None and fields["format"] != fmt:
            raise AmpError(f"{where}: format {fields['format']!r} in the {fmt} list file")
        allowed: tuple[tuple[str, tuple[str, ...] | None], ...] = (
            ("runtime", tuple(RUNTIMES)), ("device", DEVICES), ("emulation", EMULATIONS),
            ("kernel_source", KERNEL_SOURCES), ("format", None), ("description", None))
        for key, choices in allowed:
            value = table.get(key, fields.get(key))
            if value is None:
                raise AmpError(f"{where}: {key!r} is required"
                               + (f" ({', '.join(choices)})" if choices else ""))
            if not isinstance(value, str) or (choices is not None and value not in choices):
                raise AmpError(f"{where}: {key} {value!r} is not one of "
                               f"{', '.join(choices or ())}" if choices else
                               f"{where}: {key} must be a string")
            fields[key] = value
        fields["providers"] = tuple(_profile_strings(table, "providers", where,
                                                     list(fields.get("providers", ()))))
        fields["default_for"] = tuple(_profile_strings(table, "default_for", where, []))
        for target in fields["default_for"]:
            if target not in TARGETS:
                raise AmpError(f"{where}: default_for {target!r} is not a target "
                               f"({', '.join(TARGETS)})")
        options = table.get("provider_options", fields.get("provider_options", {}))
        if not isinstance(options, dict) or not all(
                isinstance(v, dict) and all(isinstance(x, str) for x in v.values())
                for v in options.values()):
            raise AmpError(f"{where}: provider_options must map each provider to a table of "
                           f"string options")
        fields["provider_options"] = options
        tables = {target: dict(base.tables.get(target, {})) if base else {}
                  for target in TARGETS}
        for target in TARGETS:
            given = table.get(target, {})
            if not isinstance(given, dict):
                raise AmpError(f"{where}: {target} must be a table")
            refuse_unknown_keys(given, PROFILE_TARGET_KEYS,
                                f"{source}: [backends.{name}.{target}]")
            for key in (*CLASSES, "no_kernel", "kernels"):
                if key in given:
                    _profile_strings(given, key, f"{where}.{target}", [])
            tables[target].update(given)
        reasons = dict(base.reasons) if base else {}
        given_reasons = table.get("reasons", {})
        if not isinstance(given_reasons, dict) or not all(
                isinstance(v, str) for v in given_reasons.values()):
            raise AmpError(f"{where}: reasons must map op names to strings")
        reasons.update(given_reasons)
        return cls(name, fields["format"], fields["description"], fields["runtime"],
                   fields["device"], fields["emulation"], fields["kernel_source"],
                   fields["providers"], fields["provider_options"], fields["default_for"],
                   tables, reasons, source)

    def summary(self) -> str:
        """The profile in one phrase, for help texts and messages."""
        return f"{self.name} ({self.description})"


def _profile_strings(table: dict, key: str, where: str, default: list[str]) -> list[str]:
    value = table.get(key, default)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AmpError(f"{where}: {key} must be a list of strings")
    return list(value)


@dataclass
class Overrides:
    """What the user changed: ops moved between classes, nodes pinned to fp32, pattern rules,
    and backend profiles of their own."""

    moves: dict[str, str] = field(default_factory=dict)  # op -> class
    keep_nodes: list[str] = field(default_factory=list)  # node names or regexes
    source: dict[str, str] = field(default_factory=dict)  # op -> "--deny" / "config x.toml"
    rules: list[PatternRule] = field(default_factory=list)
    #: Backend profiles a config file declares, by name.
    backends: dict[str, BackendProfile] = field(default_factory=dict)

    def move(self, op: str, op_class: str, source: str) -> None:
        if op_class not in CLASSES and op_class != FP32:
            raise AmpError(f"{source}: unknown op class {op_class!r} (expected one of "
                           f"{', '.join(CLASSES)})")
        self.moves[op] = op_class
        self.source[op] = source

    @classmethod
    def from_config(cls, path: str | Path, into: Overrides | None = None) -> Overrides:
        """Read a TOML file: `allow = [..]`, `infer`, `deny`, `clear`, `keep_nodes = [..]`,
        `[[rules]]` tables (see `PatternRule`) and `[backends.NAME]` profiles (see
        `BackendProfile`; `format` is required unless `extends` names a built-in profile).

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
        profiles = data.get("backends", {})
        if not isinstance(profiles, dict):
            raise AmpError(f"{path}: 'backends' must be a table of profiles ([backends.NAME])")
        for name, profile_table in profiles.items():
            overrides.backends[name] = _user_profile(name, profile_table, str(path))
        for key, entries in table.items():
            if key in ("rules", "backends") and table is data:
                continue
            if key == "keep_nodes":
                overrides.keep_nodes.extend(_str_list(entries, path, key))
            elif key in CLASSES:
                for op in _str_list(entries, path, key):
                    overrides.move(op, key, f"config {path.name}")
            elif key != "ops":
                raise AmpError(f"{path}: unknown key {key!r} (expected allow, infer, deny, "
                               f"clear, keep_nodes, rules, backends)")
        return overrides

    def keep_node_patterns(self) -> list[NodePattern]:
        """`--keep-node` entries as whole-name regexes (a plain name matches itself)."""
        return [NodePattern(entry) for entry in self.keep_nodes]


def _user_profile(name: str, table: object, source: str) -> BackendProfile:
    """A config file's profile, on top of the built-in one it `extends`."""
    base = None
    if isinstance(table, dict) and "extends" in table:
        base_name = table["extends"]
        found = [profile for fmt in _list_formats()
                 for profile_name, profile in builtin_profiles(fmt).items()
                 if profile_name == base_name]
        if not found:
            raise AmpError(f"{source}: [backends.{name}]: extends {base_name!r}, which is no "
                           f"built-in profile")
        base = found[0]
    return BackendProfile.from_table(name, table, source, base)


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
    #: The backend's profile: its tables and how its runtime runs models.
    profile: BackendProfile
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
        data = read_list_file(fmt)
        backend_profile = find_profile(fmt, backend, overrides)
        classes: dict[str, str] = {}
        reasons: dict[str, str] = {}
        generic_reasons = data.get("reasons", {})
        for op_class in CLASSES:
            for op in data[target].get(op_class, []):
                classes[op] = op_class
                reasons[op] = generic_reasons.get(op, f"{op_class} in the generic {target} list")
        profile = backend_profile.tables.get(target, {})
        profile_reasons = backend_profile.reasons
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
        lists = cls(fmt, target, backend, classes, reasons, frozenset(no_kernel),
                    backend_profile, kernels,
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
_PROFILE_CACHE: dict[str, dict[str, BackendProfile]] = {}


def read_list_file(fmt: str) -> dict:
    """The built-in op list of format `fmt` (op_lists/<fmt>.toml) as parsed TOML, read once and
    shared: copy it before changing anything in it."""
    if fmt not in _LIST_CACHE:
        path = _DATA_DIR / f"{fmt}.toml"
        _LIST_CACHE[fmt] = tomllib.loads(path.read_text())
    return _LIST_CACHE[fmt]


def _list_formats() -> list[str]:
    """The formats with a list file beside this module."""
    return sorted(path.stem for path in _DATA_DIR.glob("*.toml"))


#: Keys of a list file's `[format]` table: how the format's models are recognised.
FORMAT_KEYS = ("library", "suffixes", "directory_files")


@dataclass(frozen=True)
class FormatDeclaration:
    """A format as its list file declares it: the library its in-memory models come from, the
    suffixes of its model files, and the files that make a directory one model (a SavedModel's
    saved_model.pb). Its code is the package `amp_rewriter.formats.<name>`."""

    name: str
    library: str
    suffixes: tuple[str, ...]
    directory_files: tuple[str, ...] = ()

    @property
    def package(self) -> str:
        return f"{__package__.rsplit('.', 1)[0]}.formats.{self.name}"


def format_declarations() -> dict[str, FormatDeclaration]:
    """Every format with a list file beside this module, from its `[format]` table (a bad key
    names the file and the key)."""
    declared = {}
    for fmt in _list_formats():
        table = read_list_file(fmt).get("format", {})
        refuse_unknown_keys(table, FORMAT_KEYS, f"{fmt}.toml [format]")
        declared[fmt] = FormatDeclaration(fmt, table["library"], tuple(table["suffixes"]),
                                          tuple(table.get("directory_files", ())))
    return declared


def builtin_profiles(fmt: str) -> dict[str, BackendProfile]:
    """The backend profiles of `fmt`'s list file, validated (a bad key names file and key)."""
    if fmt not in _PROFILE_CACHE:
        source = f"{fmt}.toml"
        _PROFILE_CACHE[fmt] = {
            name: BackendProfile.from_table(name, table, source, fmt=fmt)
            for name, table in read_list_file(fmt).get("backends", {}).items()}
    return _PROFILE_CACHE[fmt]


def profiles(fmt: str, overrides: Overrides | None = None) -> dict[str, BackendProfile]:
    """Every backend profile of `fmt`: the built-in ones, then the user's config's (which may
    replace one of the same name)."""
    found = dict(builtin_profiles(fmt))
    if overrides is not None:
        found.update({name: profile for name, profile in overrides.backends.items()
                      if profile.format == fmt})
    return found


def find_profile(fmt: str, backend: str, overrides: Overrides | None = None) -> BackendProfile:
    """The profile `backend` names for `fmt`; an unknown name raises AmpError listing the
    profiles there are."""
    available = profiles(fmt, overrides)
    if backend not in available:
        raise AmpError(f"unknown backend {backend!r} for {fmt} (expected one of "
                       f"{', '.join(sorted(available))})")
    profile = available[backend]
    runtimes = read_list_file(fmt).get("runtimes", [])
    if profile.runtime not in runtimes:
        raise AmpError(f"backend {backend} ({profile.source}) runs on {profile.runtime}; {fmt} "
                       f"models run on {', '.join(runtimes)}")
    return profile


def default_backend(fmt: str, target: str) -> str:
    """The built-in profile `fmt` uses for `target` when the user names none (the profile whose
    `default_for` lists the target)."""
    for name, profile in builtin_profiles(fmt).items():
        if target in profile.default_for:
            return name
    raise AmpError(f"no backend profile of {fmt} is the default for {target}")


def backend_help() -> str:
    """The `--backend` help text: every built-in profile per format, with its defaults."""
    parts = []
    for fmt in _list_formats():
        names = []
        for name, profile in builtin_profiles(fmt).items():
            default = ""
            if set(profile.default_for) == set(TARGETS):
                default = " (default)"
            elif profile.default_for:
                default = f" (default for {'/'.join(profile.default_for)})"
            names.append(f"{name}{default}")
        parts.append(f"{read_list_file(fmt).get('title', fmt)} {', '.join(names)}")
    return (f"the backend profile: whose kernels the op lists assume, and the runtime that "
            f"--validate, --auto and check run on: {'; '.join(parts)}; or a [backends.NAME] "
            f"profile of the --config file")

