"""The test models: small, deterministic fp32 models built to test amp-rewriter end to end.

- ``cnn``, ``transformer_block``, ``control_flow``, ``custom_op``: hand-built ONNX graphs; each
  exposes ``build_model() -> onnx.ModelProto`` and runs as
  ``python -m testkit.models.<name> OUT.onnx``; ``python -m testkit.models OUT_DIR`` writes these
  four. ``many_weights``: a chain of Adds, one weight each (external-data layouts);
- ``torch_export``: real architectures exported by torch (BERT, GPT-2, MiniLM, ResNet, MobileNet);
- ``tf_graphs`` (TF1 GraphDefs), ``tf_saved_models`` (SavedModels), ``tf_training`` (TF1 training
  graphs on the digits data).

The ``python -m`` commands run from the checkout's root (testkit is not installed).

``BUILDERS`` maps an ONNX model's name to its builder (defaults give the canonical test model).
It is created on first access (PEP 562) rather than at import time: importing the
builder modules here would make ``python -m testkit.models.<name>`` warn that the module was
already imported by its package before runpy executed it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import onnx

MODEL_NAMES = ("cnn", "transformer_block", "control_flow", "custom_op")

__all__ = ["BUILDERS", "MODEL_NAMES"]


def __getattr__(name: str) -> Any:
    if name == "BUILDERS":
        builders: dict[str, Callable[[], onnx.ModelProto]] = {
            model_name: importlib.import_module(f"testkit.models.{model_name}").build_model
            for model_name in MODEL_NAMES
        }
        globals()["BUILDERS"] = builders  # cache: later lookups no longer reach __getattr__
        return builders
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
