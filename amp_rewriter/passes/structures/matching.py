"""Small facts about values and nodes that the structural rules match on.
"""

from __future__ import annotations

import numpy as np

from ...ir import ALLOW, FLOAT_DTYPES, Node, Value, decisions


def constant_data(value: Value | None) -> np.ndarray | None:
    """The values of a constant input, or None when it is not a constant."""
    tensor = value.known_constant if value is not None else None
    return None if tensor is None else np.asarray(tensor.numpy(), dtype=np.float64)


def scalar(value: Value | None) -> float | None:
    """The value of a one-element constant input of rank 0 or 1, or None. (A one-element
    constant of higher rank may raise the rank of what it is broadcast with: a rule that
    rebuilds the computation without it would lose that.)"""
    data = constant_data(value)
    return float(data.reshape(-1)[0]) if data is not None and data.size == 1 \
        and data.ndim <= 1 else None


def positive_constant(value: Value | None) -> bool:
    """Whether `value` is a constant whose every element is finite and positive."""
    data = constant_data(value)
    return data is not None and data.size > 0 and bool(np.all(np.isfinite(data) & (data > 0)))


def only_consumer(value: Value | None) -> tuple[Node, int] | None:
    """The one node reading `value`, or None when it has several readers or is a graph output."""
    if value is None or value.graph_output_uses or len(value.uses) != 1:
        return None
    return value.uses[0]


def other_input(node: Node, slot: int) -> Value | None:
    """For a two-input op, the input that is not `slot`."""
    if len(node.inputs) != 2:
        return None
    return node.inputs[1 - slot]


def is_float(value: Value | None) -> bool:
    """Whether `value` held a float dtype in the original model."""
    return value is not None and value.original_dtype in FLOAT_DTYPES


def heavy(node: Node) -> bool:
    """Whether `node` is a heavy compute op (allow-class by the op lists, not by a user's move):
    its outputs are activations."""
    return node.op_class == ALLOW and node.class_kind != decisions.USER_OVERRIDE
