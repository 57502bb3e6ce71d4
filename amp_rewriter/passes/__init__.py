"""Passes over the IR: analysis/ decides precisions, rewrite/ applies them, structures/ holds
one module per structural rule (its recognition, plan and rewrite). Every pass is
registered by name (`REGISTRY`); pipelines are lists of those names (`PIPELINES`). Nothing here
imports onnx or tensorflow: a format's op names reach the passes through `FormatRules`."""

from .base import (
    REGISTRY,
    ConstantRecord,
    FormatRules,
    Pass,
    PassContext,
    PassResult,
    Pin,
    StoredRange,
)
from .pipeline import PIPELINES, PassError, run_pipeline

__all__ = ["REGISTRY", "ConstantRecord", "FormatRules", "Pass", "PassContext", "PassResult",
           "Pin", "PIPELINES", "PassError", "StoredRange", "run_pipeline"]
