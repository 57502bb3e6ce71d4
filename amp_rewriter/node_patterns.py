"""`--keep-node` patterns: regexes matched against whole node names, in linear time.

Python's `re` backtracks: `(a|aa)*b` against a node name of a few dozen `a`s does not return in
any useful time, and a pattern comes from the user while the names come from the model. RE2
(google-re2) matches in time linear in the name's length whatever the pattern, so matching can
neither hang nor need a timeout. What RE2 leaves out (backreferences, lookaround) is refused with
one line when the pattern is compiled.
"""

from __future__ import annotations

import re2

from .errors import AmpError

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # RE2 would print its own error line on stderr besides ours


def _utf8(text: str | bytes) -> bytes:
    # Protobuf hands a name that is not valid UTF-8 over as bytes, and names decoded with
    # surrogate escapes carry surrogates: either matches as its bytes.
    if isinstance(text, bytes):
        return text
    return text.encode("utf-8", "surrogatepass")


class NodePattern:
    """One `--keep-node` entry: a node name or a regex (RE2 syntax) that must match the whole
    name."""

    __slots__ = ("pattern", "_compiled")

    def __init__(self, pattern: str, source: str = "--keep-node"):
        self.pattern = pattern
        try:
            self._compiled = re2.compile(_utf8(pattern), _OPTIONS)
        except re2.error as exc:
            detail = exc.args[0] if exc.args else exc
            if isinstance(detail, bytes):
                detail = detail.decode("utf-8", "replace")
            raise AmpError(f"{source} {pattern!r}: not a valid regex ({detail}; backreferences "
                           f"and lookaround are not supported)") from None

    def fullmatch(self, name: str | bytes) -> bool:
        """Whether the pattern matches all of `name`."""
        return self._compiled.fullmatch(_utf8(name)) is not None

    def __repr__(self) -> str:
        return f"NodePattern({self.pattern!r})"
