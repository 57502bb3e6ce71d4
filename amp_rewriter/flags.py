"""Dataclass fields that declare their command-line flag beside their default: the option classes
(`options.py`) and the loss-scale rule (`training/rule.py`) are declared once, and the CLI's
parser is built from them (`options.cli_flags`)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def flag_field(default: Any, flag: str, help: str, *, metavar: str | None = None,
               kind: str = "value", type: Any = str, negation: str | None = None) -> Any:
    """A dataclass field with its command-line flag. kind: value (one value), list (repeatable),
    comma (one comma-separated value), switch (on with `flag`, off with `negation`)."""
    cli = {"flag": flag, "help": help, "metavar": metavar, "kind": kind, "type": type,
           "negation": negation}
    if isinstance(default, list):
        return field(default_factory=list, metadata={"cli": cli})
    return field(default=default, metadata={"cli": cli})
