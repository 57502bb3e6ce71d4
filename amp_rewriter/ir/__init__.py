"""A small, format-neutral graph IR for precision rewriting (nothing here imports onnx or
tensorflow). See `core` for the objects and their mutators, `lint` for the invariants."""

from . import decisions
from .core import (
    ALLOW,
    CLEAR,
    DENY,
    FP32,
    INFER,
    Graph,
    IRError,
    Model,
    Node,
    TypeGroup,
    Value,
    ValueNames,
    nodes_created_by,
    present,
    unique_name,
)
from .dtypes import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    FLOAT64,
    FLOAT_DTYPES,
    LOW_PRECISION_DTYPES,
    TARGET_DTYPES,
    short_name,
)
from .lint import IRInvariantError, assert_sound, lint, lint_enabled
from .tensors import LazyTensor, RangeCheck, check_range, convert_array

__all__ = ["ALLOW", "CLEAR", "DENY", "FP32", "INFER", "Graph", "IRError", "Model", "Node",
           "TypeGroup", "Value", "ValueNames", "nodes_created_by", "present", "unique_name",
           "BFLOAT16", "FLOAT16",
           "FLOAT32", "FLOAT64", "FLOAT_DTYPES", "LOW_PRECISION_DTYPES", "TARGET_DTYPES",
           "short_name", "decisions", "IRInvariantError", "assert_sound", "lint", "lint_enabled",
           "LazyTensor",
           "RangeCheck", "check_range", "convert_array"]
