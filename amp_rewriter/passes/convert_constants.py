"""Fold casts of constants into converted constants, once each, with the range checked.

A cast whose input is a float32 initializer or Constant output becomes a low-precision initializer.
Values below the target's smallest subnormal flush to zero (counted in the report); values beyond
its finite range only convert with `--clamp` (saturated), otherwise the cast stays and the constant
keeps its exact fp32 value.
"""

from __future__ import annotations

import numpy as np

from ..ir import FLOAT32, LOW_PRECISION_DTYPES, Graph, LazyTensor, Value
from .base import ConstantRecord, PassContext, PassResult
from .constant_ranges import cached_range_check, convert_array
from .fold_casts import _remove_nodes


def _converted_tensor(tensor: LazyTensor, dtype: str, clamp: bool, name: str,
                      ctx: PassContext) -> LazyTensor | None:
    """The converted constant, or None when it overflows and clamping is off."""
    array = np.asarray(tensor.numpy(), dtype=np.float32)
    result = cached_range_check(ctx, tensor, dtype)
    if result.overflowed and not clamp:
        ctx.constants.append(ConstantRecord(name, "kept_fp32", tensor.size, result.overflowed,
                                            result.flushed_to_zero, "overflows; cast kept"))
        return None
    converted = convert_array(array, dtype, clamp)
    action = "clamped" if result.overflowed else "converted"
    ctx.constants.append(ConstantRecord(name, action, tensor.size, result.overflowed,
                                        result.flushed_to_zero))
    return LazyTensor(dtype, tuple(converted.shape), lambda: converted)


def convert_constants(ctx: PassContext) -> PassResult:
    """Replace Cast(constant) with a converted constant; convert ConstantOfShape fill values."""
    clamp = ctx.options.clamp
    converted = 0
    dropped: set[int] = set()  # Constant nodes whose value was replaced by a converted copy
    for graph in ctx.model.graph.walk_graphs():
        dead: set[int] = set()
        for node in graph.nodes:
            if node.op_type == "ConstantOfShape" and node.outputs[0] is not None:
                value = node.outputs[0]
                fill = node.attrs.get("value")
                if value.dtype in LOW_PRECISION_DTYPES and value.original_dtype == FLOAT32:
                    if fill is None:  # the default fill is a float32 zero
                        fill = LazyTensor(FLOAT32, (1,), lambda: np.zeros(1, np.float32))
                    new = _converted_tensor(fill, value.dtype, True, f"{node.name}.value", ctx)
                    node.attrs["value"] = new
                    converted += 1
                continue
            if node.op_type != "Cast" or node.inputs[0] is None:
                continue
            source, output = node.inputs[0], node.outputs[0]
            if (source.const is None or source.dtype != FLOAT32
                    or output.dtype not in LOW_PRECISION_DTYPES or output.graph_output_uses):
                continue
            if source.is_graph_input and ctx.model.initializers_overridable:
                continue  # a caller may feed another value: the cast must stay a runtime cast
            new_tensor = _converted_tensor(source.const, output.dtype, clamp, source.name, ctx)
            if new_tensor is None:
                continue
            only_user = source.uses == [(node, 0)] and not source.graph_output_uses
            home = source.graph  # same scope as the original, so every reader can still see it
            if only_user:
                _drop_constant(source, dropped)
                name = source.name
            else:
                name = ctx.model.unique_name(f"{source.name}_{output.dtype}")
            constant = Value(name, home, output.dtype, new_tensor.shape)
            constant.const = new_tensor
            constant.origin = source
            home.values[name] = constant
            home.initializers[name] = constant
            if not ctx.model.initializers_overridable:  # IR < 4: initializers are inputs too
                constant.is_graph_input = True
                if only_user and source in home.inputs:
                    home.inputs[home.inputs.index(source)] = constant
                else:
                    home.inputs.append(constant)
            for consumer, slot in output.uses:
                consumer.inputs[slot] = constant
                constant.uses.append((consumer, slot))
            output.uses = []
            if (node, 0) in source.uses:
                source.uses.remove((node, 0))
            node.inputs[0] = None
            dead.add(id(node))
            converted += 1
        if dead:
            ctx.casts_removed += _remove_nodes(graph, dead)
    if dropped:
        for graph in ctx.model.graph.walk_graphs():
            graph.nodes = [n for n in graph.nodes if id(n) not in dropped]
    return PassResult("convert_constants", converted)


def _drop_constant(value: Value, dropped: set[int]) -> None:
    """Forget a constant whose only reader is being replaced by its converted copy."""
    value.uses = []
    value.graph.values.pop(value.name, None)
    value.graph.initializers.pop(value.name, None)
    if value.producer is not None:  # a Constant node: removed once every graph is done
        dropped.add(id(value.producer))
