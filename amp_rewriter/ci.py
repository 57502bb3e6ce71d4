"""`check`'s findings where CI systems read them: text and JSON on stdout, a JUnit XML file
(what GitLab, Jenkins, Azure and GitHub's test-report actions show) and a Markdown summary (a
pull request's job summary, `$GITHUB_STEP_SUMMARY`).

JUnit: one test suite per model and in it one test case per rule class of its format
(`Format.check_rules`): a rule with no finding is a passing case (or a skipped one, when it
needs the fp32 model and none was given); each finding is a failing case of its own, named by
its rule and what it is about (node, constant or output), with the finding's message. The text
report of the model is the suite's system-out. Nothing in either file depends on the time or
the machine, so the same check gives the same bytes.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .cost import summary_line
from .report import CheckResult, CheckRule, to_json

#: The JUnit test suites' common name and the prefix of their class names.
JUNIT_NAME = "amp-rewriter check"

#: Characters XML 1.0 cannot hold, even escaped (node names may carry any byte).
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


@dataclass
class CheckedModel:
    """One model `check` read, as the user named it, with what it found."""

    path: str
    result: CheckResult
    #: The rule classes of the model's format.
    rules: tuple[CheckRule, ...]
    #: The fp32 model it was compared with (`--reference`), if any.
    reference: str | None = None


def text_lines(model: CheckedModel) -> list[str]:
    """The findings of one model as `check` prints them: notes, problems, outputs, cost."""
    result = model.result
    lines = [f"note: {note}" for note in result.notes]
    lines += [f"{problem['kind']}: {problem['message']}" for problem in result.problems]
    for output in result.outputs:
        emulated = output.get("emulated_ops")
        how = f" [emulated: {', '.join(emulated)}]" if emulated else ""
        lines.append(f"output {output['name']}: relative error "
                     f"{output['relative_error']:.3g}{how}")
    if result.cost is not None:
        lines.append(summary_line(result.cost))
    return lines


def verdict_line(models: Sequence[CheckedModel]) -> str:
    """`check: ok`, or how many problems (in how many models, when there are several)."""
    problems = sum(len(m.result.problems) for m in models)
    if not problems:
        return "check: ok" if len(models) == 1 else f"check: ok ({len(models)} models)"
    failed = sum(1 for m in models if not m.result.ok)
    where = "" if len(models) == 1 else f" in {failed} of {len(models)} models"
    return f"check: {problems} problem(s){where}"


def to_dict(models: Sequence[CheckedModel]) -> dict[str, Any]:
    """The JSON of a check: one model's findings (with its path), or for several models
    `{"ok": ..., "models": [...]}`."""
    entries = [{"model": m.path, **({"reference": m.reference} if m.reference else {}),
                **m.result.to_dict()} for m in models]
    if len(entries) == 1:
        return entries[0]
    return {"ok": all(m.result.ok for m in models), "models": entries}


def json_text(models: Sequence[CheckedModel]) -> str:
    """`to_dict` as JSON text."""
    return to_json(to_dict(models))


def _xml_text(text: str) -> str:
    return _NOT_XML.sub(lambda match: f"\\x{ord(match.group()):02x}", text)


def _subject(problem: dict[str, Any]) -> str:
    """What a finding is about: its node, constant or output (empty for a whole-model one)."""
    for key in ("node", "constant", "output"):
        if problem.get(key):
            return str(problem[key])
    return ""


def _cases(model: CheckedModel) -> list[tuple[str, CheckRule | None, list[dict[str, Any]]]]:
    """(rule kind, rule, its findings) for every rule class, then for any problem of a kind
    the format did not declare (never dropped)."""
    known = {rule.kind for rule in model.rules}
    cases: list[tuple[str, CheckRule | None, list[dict[str, Any]]]] = [
        (rule.kind, rule, [p for p in model.result.problems if p["kind"] == rule.kind])
        for rule in model.rules]
    others: dict[str, list[dict[str, Any]]] = {}
    for problem in model.result.problems:
        if problem["kind"] not in known:
            others.setdefault(problem["kind"], []).append(problem)
    cases += [(kind, None, found) for kind, found in others.items()]
    return cases


def junit_xml(models: Sequence[CheckedModel]) -> bytes:
    """The JUnit XML of a check (see the module docstring), UTF-8 with its declaration."""
    root = ET.Element("testsuites", name=JUNIT_NAME)
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for model in models:
        suite = ET.SubElement(root, "testsuite", name=_xml_text(model.path))
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        properties = ET.SubElement(suite, "properties")
        for name, value in (("target", model.result.target), ("backend", model.result.backend),
                            ("reference", model.reference or "")):
            if value:
                ET.SubElement(properties, "property", name=name, value=_xml_text(value))
        classname = _xml_text(f"{JUNIT_NAME}.{model.path}")
        for kind, rule, found in _cases(model):
            if not found:
                case = ET.SubElement(suite, "testcase", classname=classname, name=kind)
                counts["tests"] += 1
                if rule is not None and rule.needs_reference and not model.reference:
                    ET.SubElement(case, "skipped", message=f"{rule.description}: needs "
                                                           f"--reference (the fp32 model)")
                    counts["skipped"] += 1
                continue
            for problem in found:
                subject = _subject(problem)
                case = ET.SubElement(suite, "testcase", classname=classname,
                                     name=_xml_text(f"{kind}: {subject}" if subject else kind))
                failure = ET.SubElement(case, "failure", type=kind,
                                        message=_xml_text(problem["message"]))
                failure.text = _xml_text(json.dumps(problem, indent=2, default=str))
                counts["tests"] += 1
                counts["failures"] += 1
        out = ET.SubElement(suite, "system-out")
        out.text = _xml_text("\n".join(text_lines(model) + [verdict_line([model])]))
        for key, count in counts.items():
            suite.set(key, str(count))
            totals[key] += count
    for key, count in totals.items():
        root.set(key, str(count))
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"


def _cell(text: str) -> str:
    """Text for a Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("\\", "\\\\").replace("|", "\\|")


def _code(text: str) -> str:
    """Inline code that survives backticks in the text."""
    fence = "``" if "`" in text else "`"
    return f"{fence} {text} {fence}" if fence == "``" else f"`{text}`"


def markdown_summary(models: Sequence[CheckedModel]) -> str:
    """A Markdown summary for a pull request: the verdict first, then per model its cost line,
    its findings (a table), its outputs against the fp32 model and its notes."""
    ok = all(m.result.ok for m in models)
    if ok:
        verdict = "✅ amp-rewriter check: passed" + (f" ({len(models)} models)"
                                                    if len(models) > 1 else "")
    else:
        verdict = f"❌ amp-rewriter check: failed ({verdict_line(models).removeprefix('check: ')})"
    lines = [f"## {verdict}", ""]
    for model in models:
        result = model.result
        state = "passed" if result.ok else f"{len(result.problems)} problem(s)"
        against = f", against {_code(model.reference)}" if model.reference else ""
        lines += [f"### {_code(model.path)}: {state}", "",
                  f"{result.target}, backend {result.backend or 'default'}{against}", ""]
        if result.cost is not None:
            lines += [_code(summary_line(result.cost)), ""]
        if result.problems:
            lines += ["| rule | where | finding |", "| --- | --- | --- |"]
            lines += [f"| {_cell(p['kind'])} | {_cell(_subject(p)) or '-'} | "
                      f"{_cell(p['message'])} |" for p in result.problems]
            lines.append("")
        if result.outputs:
            lines += ["| output | relative error | max abs error |", "| --- | ---: | ---: |"]
            lines += [f"| {_cell(o['name'])} | {o['relative_error']:.3g} | "
                      f"{o['max_abs_error']:.3g} |" for o in result.outputs]
            lines.append("")
        if result.notes:
            lines += [f"<details><summary>{len(result.notes)} note(s)</summary>", ""]
            lines += [f"- {_cell(note)}" for note in result.notes]
            lines += ["", "</details>", ""]
    return "\n".join(lines).rstrip("\n") + "\n"
