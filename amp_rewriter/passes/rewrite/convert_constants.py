"""Store constants in the precision their readers run in, once each, with the range checked.

Two passes: `convert_constant_inputs`, before the casts are placed, stores an initializer that
every reader wants in one low-precision dtype in that dtype, in place (no cast is made for it
at all); `convert_constants`, after them, folds the casts of constants that are left.

A cast whose input is a float32 initializer or Constant output becomes a low-precision initializer.
Values below the target's smallest subnormal flush to zero (counted in the report); values beyond
its finite range only convert with `--clamp` (saturated), otherwise the cast stays and the constant
keeps its exact fp32 value. Fill values of constant-filling ops (the format's
`constant_fill_attrs`, e.g. ONNX ConstantOfShape) convert with their op.
"""

from __future__ import annotations

import numpy as np

from ...ir import FLOAT32, LOW_PRECISION_DTYPES, Graph, LazyTensor, Node, Value, convert_array
from ...ir.rounding import NEAREST, rounding_of
from ..base import ConstantRecord, PassContext, register_pass
from .building import CAST, remove_everywhere
from .insert_casts import required_dtype


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
    if tensor.compact:  # converts as its stored values, the last repeating, and stays so
        stored = np.asarray(tensor.stored(), dtype=np.float32)
        return LazyTensor.repeating_last(dtype, tensor.shape, convert_array(stored, dtype, clamp))
    # Converted when the emitter writes it (a file's weight chunk by chunk), not now: a
    # million-node graph's weights converted up front would sit beside the IR at its peak.
    return tensor.converted(dtype, clamp)


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


def _planned_nodes(ctx: PassContext) -> set[Node]:
    """The nodes a rewrite after the casts works on (RMS rescales, rotary angles,
    mask saturations): the constants they read keep the cast those rewrites expect."""
    return {node for plans in ctx.plans.values() for plan in plans
            for node in plan.planned_nodes()}


def _one_low_dtype(value: Value) -> str | None:
    """The low-precision dtype every reader of `value` wants, where they all want one."""
    wanted = None
    for consumer, slot in value.uses:
        needed = required_dtype(value, consumer, slot)
        if needed not in LOW_PRECISION_DTYPES or (wanted is not None and needed != wanted):
            return None
        wanted = needed
    return wanted


def _convert_read_initializers(graph: Graph, ctx: PassContext, planned: set[Node]) -> int:
    converted = 0
    # The order insert_casts would make these casts in, and convert_constants fold them.
    for source in [*graph.inputs, *graph.initializers.values()]:
        tensor = source.known_constant
        if (tensor is None or source.producer is not None
                or source.dtype != FLOAT32 or not source.uses or source.graph_output_uses
                or graph.initializers.get(source.name) is not source):
            continue
        dtype = _one_low_dtype(source)
        # The model's own casts of it: fold_casts and convert_constants decide those.
        if dtype is None or any(consumer.op_type == CAST or consumer in planned
                                for consumer, _ in source.uses):
            continue
        ctx.focus = source.uses[0][0]
        # Overflowing without --clamp: the cast convert_constants keeps, with its record.
        if ctx.range_check(tensor, dtype).overflowed and not ctx.options.clamp:
            continue
        new_tensor = _converted_tensor(tensor, dtype, ctx.options.clamp, source.name, ctx)
        assert new_tensor is not None
        # In place: the value keeps its readers, name and place, and its original dtype says
        # what the input held (a new value per weight, with its use list, would cost hundreds
        # of bytes a weight at the conversion's peak).
        source.const = new_tensor
        source.dtype = dtype
        converted += 1
    return converted


@register_pass("convert_constant_inputs")
def convert_constant_inputs(ctx: PassContext) -> tuple[int, list[str]]:
    """Store an initializer every reader wants in one low-precision dtype in that dtype, before
    the casts are placed: the cast insert_casts would make, and convert_constants would fold
    into the same converted constant, is never made (a million-node graph has hundreds of
    thousands of weights: as casts, gigabytes and seconds). What a rewrite plan reads, the
    model's own casts of constants, Constant nodes and shared constants go the usual way."""
    planned = _planned_nodes(ctx)
    converted = sum(_convert_read_initializers(graph, ctx, planned)
                    for graph in list(ctx.model.graph.walk_graphs()))
    return converted, []


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
            if node.op_type != CAST or node.inputs[0] is None \
                    or rounding_of(node.attrs) != NEAREST:
                continue
            source, output = node.inputs[0], node.outputs[0]
            assert output is not None
            # An initializer a caller may feed is no known constant: its cast stays a runtime cast.
            tensor = source.known_constant
            if (tensor is None or source.dtype != FLOAT32
                    or output.dtype not in LOW_PRECISION_DTYPES or output.graph_output_uses):
                continue
            new_tensor = _converted_tensor(tensor, output.dtype, clamp, source.name, ctx)
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
            if node.created_by is not None:
                # A cast a pass made: nothing reports it, so it goes now (the cyclic collector
                # is paused during a conversion; at a million nodes these are ~140 MB).
                node.release()
    remove_everywhere(ctx.model, dropped)
    return converted, []
