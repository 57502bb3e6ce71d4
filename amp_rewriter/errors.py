"""Errors that the CLI turns into one-line messages and exit codes."""

from __future__ import annotations


class AmpError(Exception):
    """A problem with the user's input or options (exit code 2).

    The message is a single line meant for the user; the CLI prints it without a traceback.
    """

    exit_code = 2


class CheckFailed(AmpError):
    """A `check` or `--validate` found a problem in a converted model (exit code 1)."""

    exit_code = 1


class ConvertedModelFailed(CheckFailed):
    """The converted model (not the fp32 one, not the inputs) cannot be loaded or run: a
    validation failure (exit code 1), which formats raise from their validators."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): what a
    one-line error quotes of a library's failure."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
