"""Imports TensorFlow for the package, quietly: the package's first import (see __init__); and
imports graphs into TensorFlow, with its import errors as one line (`imported_graph`)."""

from __future__ import annotations

import logging
import os
from typing import Any

from ...errors import AmpError, first_line
from ...quiet import native_stderr_silenced


def import_tensorflow() -> None:
    """Import TensorFlow with its start-up chatter kept off stderr; AmpError if it is missing.

    TensorFlow's C++ runtime writes its start-up notes (oneDNN, CUDA drivers) straight to file
    descriptor 2 before any log level applies, so fd 2 points at /dev/null during the import.
    """
    # 3: TensorFlow's own error lines too (e.g. "failed call to cuInit" on GPU-less machines);
    # failures reach the user as one AmpError line instead.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        with native_stderr_silenced():
            import tensorflow  # noqa: F401
    except ImportError as exc:
        raise AmpError(f"TensorFlow models need TensorFlow ({exc}); install it with "
                       f"pip install -e '.[tensorflow]'") from None
    # TensorFlow's Python log lines ("WARNING:tensorflow:..." when a SavedModel with reference
    # variables loads, absl's traceback for an unreadable fingerprint.pb it then ignores) are
    # not ours to print: what fails reaches the user as one AmpError line.
    for name in ("tensorflow", "absl"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


import_tensorflow()

import tensorflow as tf  # noqa: E402  (after the quiet import above)


def imported_graph(graph_def: Any, what: str, error: type[AmpError] = AmpError) -> tf.Graph:
    """A fresh tf.Graph holding `graph_def` (a GraphDef, or a MetaGraphDef with its collections
    and devices). Whatever TensorFlow's importer refuses (an input naming no node, mismatched
    dtypes, a device string it cannot parse) raises `error` saying that `what` does not import."""
    graph = tf.Graph()
    try:
        with graph.as_default():
            if isinstance(graph_def, tf.compat.v1.MetaGraphDef):
                tf.compat.v1.train.import_meta_graph(graph_def, clear_devices=False)
            else:
                tf.compat.v1.import_graph_def(graph_def, name="")
    except Exception as exc:  # noqa: BLE001  (ValueError, TypeError, InvalidArgumentError, ...)
        raise error(f"{what} does not import into TensorFlow: {first_line(exc)}") from None
    return graph
