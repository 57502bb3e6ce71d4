"""The installed package's version, read from its metadata (pyproject.toml is the one place it
is written)."""

from __future__ import annotations

from importlib import metadata

#: The distribution name on the package index (and in the wheel's metadata).
DISTRIBUTION = "amp-rewriter"


def package_version() -> str:
    """The version pip installed; "0+unknown" when the package runs from a source tree that was
    never installed (no metadata to read)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "0+unknown"
