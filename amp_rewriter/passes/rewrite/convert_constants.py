"""Fold casts of constants into converted constants, once each, with the range checked.

A cast whose input is a float32 initializer or Constant output becomes a low-precision initializer.
Values below the target's smallest subnormal flush to zero (counted in the report); values beyond
its finite range only convert with `--clamp` (saturated), otherwise the cast stays and the constant
keeps its exact fp32 value. Fill values of constant-filling ops (the format's
`constant_fill_attrs`, e.g. ONNX ConstantOfShape) convert with their op.
"""

from __future__ import annotations

import numpy as np

from ...ir import FLOAT32, LOW_PRECISION_DTYPES, LazyTensor, Node, Value, convert_array
from ..base import ConstantRecord, PassContext, register_pass
from .building import CAST, remove_everywhere


def _converted_tensor(tensor: LazyTensor, dtype: str, clamp: bool, name: str,
                      ctx: PassContext) -> LazyTensor | None:
    """The converted constant, or None when it overflows and clamping is off."""
    result = ctx.range_check(tensor, dtype)
    if result.overflowed and not clamp:
        if not any(r.name == name and r.action == "kept_fp32" for r in ctx.constants):
            ctx.constants.append(ConstantRecord(name, "kept_fp32", tensor.size,
                                                result.overflowed, result.flushed_to_zero,
                                                "overflows; cast kept"))
        return None
    action = "clamped" if result.overflowed else "converted"
    ctx.constants.append(ConstantRecord(name, action, tensor.size, result.overflowed,
                                        result.flushed_to_zero))
    if tensor.streams:  # a weight in a file: converted chunk by chunk when the output is written
        return tensor.converted(dtype, clamp)
    # A compact tensor (its last value repeating) converts as its stored values, and stays so.
    array = np.asarray(tensor.stored() if tensor.compact else tensor.numpy(), dtype=np.float32)
    converted = convert_array(array, dtype, clamp)
    del array
    if tensor.compact:
        return LazyTensor.repeating_last(dtype, tensor.shape, converted)
    tensor.release()

    def load() -> np.ndarray:  # the same conversion again, once the emitter dropped the values
        values = convert_array(np.asarray(tensor.numpy(), dtype=np.float32), dtype, clamp)
        tensor.release()
        return values

    return LazyTensor(dtype, tuple(converted.shape), load, array=converted,
                      reloadable=tensor.handle is not None)


def _convert_fill_value(node: Node, attr: str, ctx: PassContext) -> bool:
    """Convert a constant-filling op's fill value with its output; True when it did."""
    value = node.outputs[0]
    if value is None or value.dtype not in LOW_PRECISION_DTYPES or value.original_dtype != FLOAT32:
        return False
    fill = node.attrs.get(attr)
    if fill is None:  # the default fill is a float32 zero
        fill = LazyTensor(FLOAT32, (1,), lambda: np.zeros(1, np.float32))
    node.set_attr(attr, _converted_tensor(fill, value.dtype, True, f"{node.name}.{attr}",
                                          ctx))
    return True


@register_pass("convert_constants")
def convert_constants(ctx: PassContext) -> tuple[int, list[str]]:
    """Replace Cast(constant) with a converted constant; convert constant-filling ops' values."""
    clamp = ctx.options.clamp
    fill_attrs = ctx.rules.constant_fill_attrs
    converted = 0
    #: Constant nodes whose value was replaced by a converted copy, removed once all are done.
    dropped: list[Node] = []
    for graph in list(ctx.model.graph.walk_graphs()):
        dead: list[Node] = []
        for node in graph.nodes:
            ctx.focus = node
            if node.op_type in fill_attrs and node.outputs and node.outputs[0] is not None:
                converted += _convert_fill_value(node, fill_attrs[node.op_type], ctx)
                continue
            if node.op_type != CAST or node.inputs[0] is None:
                continue
            source, output = node.inputs[0], node.outputs[0]
            assert output is not None
            if (source.const is None or source.dtype != FLOAT32
                    or output.dtype not in LOW_PRECISION_DTYPES or output.graph_output_uses):
                continue
            if source.overridable:
                continue  # a caller may feed another value: the cast must stay a runtime cast
            new_tensor = _converted_tensor(source.const, output.dtype, clamp, source.name, ctx)
            if new_tensor is None:
                continue
            only_user = source.uses == [(node, 0)] and not source.graph_output_uses
            home = source.graph  # same scope as the original, so every reader can still see it
            node.set_input(0, None)
            if only_user:  # the converted copy takes the original's name and place
                name = source.name
                if source.producer is not None:
                    dropped.append(source.producer)
                    del home.values[source.name]
                else:
                    home.remove_initializer(source)
            else:
                name = ctx.model.unique_name(f"{source.name}_{output.dtype}")
            constant = Value(name, home, output.dtype, new_tensor.shape)
            constant.const = new_tensor
            constant.origin = source
            home.add_initializer(constant, replacing=source if only_user else None)
            output.replace_all_uses_with(constant)
            dead.append(node)
            converted += 1
        graph.remove_nodes(dead)
        for node in dead:
            if node.handle is None:
                # A cast a pass made: nothing reports it, so it goes now (the cyclic collector
                # is paused during a conversion; at a million nodes these are ~140 MB).
                node.release()
    remove_everywhere(ctx.model, dropped)
    return converted, []
