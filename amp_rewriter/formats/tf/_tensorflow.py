"""Imports TensorFlow for the package, quietly: the package's first import (see __init__)."""

from __future__ import annotations

import logging
import os
import sys

from ...errors import AmpError


def import_tensorflow() -> None:
    """Import TensorFlow with its start-up chatter kept off stderr; AmpError if it is missing.

    TensorFlow's C++ runtime writes its start-up notes (oneDNN, CUDA drivers) straight to file
    descriptor 2 before any log level applies, so fd 2 points at /dev/null during the import.
    """
    # 3: TensorFlow's own error lines too (e.g. "failed call to cuInit" on GPU-less machines);
    # failures reach the user as one AmpError line instead.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if os.environ.get("AMP_REWRITER_DEBUG"):
        import tensorflow  # noqa: F401
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            import tensorflow  # noqa: F401,F811
    except ImportError as exc:
        raise AmpError(f"TensorFlow models need TensorFlow ({exc}); install it with "
                       f"pip install -e '.[tensorflow]'") from None
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    # TensorFlow's Python log lines ("WARNING:tensorflow:..." when a SavedModel with reference
    # variables loads, absl's traceback for an unreadable fingerprint.pb it then ignores) are
    # not ours to print: what fails reaches the user as one AmpError line.
    for name in ("tensorflow", "absl"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


import_tensorflow()
