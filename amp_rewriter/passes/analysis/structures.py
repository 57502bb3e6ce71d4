"""Rules decided by the graph's structure rather than by op type.

- `recognize_tanh_gelu`: the cube in tanh-GELU, 0.5*x*(1 + tanh(c2*(x + c1*x^3))), runs in low
  precision although Pow is a deny op: where x^3 overflows to +-inf, every later step keeps the
  sign (c1, c2 > 0) and tanh(+-inf) = +-1 is the limit fp32 reaches too.
- `recognize_rms_norm`: an RMS normalisation, x * 1/sqrt(mean(x^2) + eps), keeps its statistics
  fp32 (the square overflows fp16 beyond 256) without being a barrier: the residual stream it
  reads and the scaling step run in low precision, with one cast of x into the statistics and
  one of the per-row scale out of them. Where the backend has the kernels, it plans
  (`RescalePlan`) the mean square in fp16 on the row divided by 2^-7 of its largest |x|, which
  `rescale_rms_statistics` builds after the painting: only one value per row stays fp32.
- `recognize_rotary_angles`: a rotary embedding's angle (integer positions times constant
  frequencies, read only by Cos and Sin) runs in fp16, reduced modulo 2*pi in integers by
  `reduce_rotary_angles` after the painting, where an fp16 product would be off by radians.
- `keep_index_math_fp32`: float arithmetic that computes a shape, length or index (from integers
  and constants, feeding a Cast to an integer, a comparison, Floor/Ceil or a shape input) stays
  fp32: fp16 holds integers exactly only up to 2048.
- `apply_pattern_rules`: the user's `[[rules]]` from the config (op, what it feeds or is fed by).

Op names reach these passes through the format's `FormatRules` (roles, index slots, ...).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ...ir import (
    ALLOW,
    DENY,
    FLOAT16,
    FLOAT32,
    FLOAT_DTYPES,
    FP32,
    INFER,
    Graph,
    Node,
    TypeGroup,
    Value,
    decisions,
    short_name,
)
from ...ir.dtypes import FINITE_MAX, SMALLEST_NORMAL
from ..base import (
    INVERSE_FLOOR,
    FormatRules,
    PassContext,
    RescalePlan,
    RotaryPlan,
    StructureRecord,
    register_pass,
)
from .classify import set_class

# -- tanh-GELU's cube -------------------------------------------------------------------------


def _constant(value: Value | None) -> np.ndarray | None:
    """The values of a constant input, or None when it is not a constant."""
    tensor = value.known_constant if value is not None else None
    return None if tensor is None else np.asarray(tensor.numpy(), dtype=np.float64)


def _scalar(value: Value | None) -> float | None:
    """The value of a one-element constant input of rank 0 or 1, or None. (A one-element
    constant of higher rank may raise the rank of what it is broadcast with: a rule that
    rebuilds the computation without it would lose that.)"""
    data = _constant(value)
    return float(data.reshape(-1)[0]) if data is not None and data.size == 1 \
        and data.ndim <= 1 else None


def _positive_constant(value: Value | None) -> bool:
    data = _constant(value)
    return data is not None and data.size > 0 and bool(np.all(np.isfinite(data) & (data > 0)))


def _only_consumer(value: Value | None) -> tuple[Node, int] | None:
    """The one node reading `value`, or None when it has several readers or is a graph output."""
    if value is None or value.graph_output_uses or len(value.uses) != 1:
        return None
    return value.uses[0]


def _other_input(node: Node, slot: int) -> Value | None:
    """For a two-input op, the input that is not `slot`."""
    if len(node.inputs) != 2:
        return None
    return node.inputs[1 - slot]


def tanh_gelu_cube(node: Node, rules: FormatRules) -> str | None:
    """Why `node` is the cube of a tanh-GELU whose overflow is harmless, or None when it is not.

    The pattern, by structure: Pow(x, 3) -> Mul(., c1) -> Add(x, .) -> Mul(., c2) -> Tanh, with
    c1, c2 positive constants and each intermediate read only by the next step.
    """
    if rules.role(node.op_type) != "pow" or len(node.inputs) != 2:
        return None
    base = node.inputs[0]
    if _scalar(node.inputs[1]) != 3.0:
        return None
    step = _only_consumer(node.outputs[0] if node.outputs else None)
    if step is None or rules.role(step[0].op_type) != "mul" \
            or not _positive_constant(_other_input(*step)):
        return None
    step = _only_consumer(step[0].outputs[0])
    if step is None or rules.role(step[0].op_type) != "add" or _other_input(*step) is not base:
        return None
    step = _only_consumer(step[0].outputs[0])
    if step is None or rules.role(step[0].op_type) != "mul" \
            or not _positive_constant(_other_input(*step)):
        return None
    step = _only_consumer(step[0].outputs[0])
    if step is None or rules.role(step[0].op_type) != "tanh":
        return None
    return (f"the cube of tanh-GELU (-> {step[0].name}): where x^3 overflows to +-inf in low "
            f"precision, the positive scales and the add keep its sign and tanh(+-inf) = +-1, "
            f"the limit fp32 reaches; elsewhere x^3 stays in range")


@register_pass("recognize_tanh_gelu")
def recognize_tanh_gelu(ctx: PassContext) -> tuple[int, list[str]]:
    """Let the cube of a tanh-GELU (a deny-list Pow) run in low precision (see tanh_gelu_cube)."""
    found = 0
    for node in ctx.model.graph.walk_nodes():
        ctx.focus = node
        if node.op_class in (FP32, ALLOW) or node.class_kind == decisions.USER_OVERRIDE:
            continue
        why = tanh_gelu_cube(node, ctx.rules)
        if why is None:
            continue
        set_class(ctx, node, INFER, why, decisions.STRUCTURE)
        ctx.structures.append(StructureRecord("tanh_gelu_cube", [node.name], why))
        found += 1
    return found, []


# -- RMS normalisation ------------------------------------------------------------------------

def _producer(value: Value | None, role: str, rules: FormatRules) -> Node | None:
    node = value.producer if value is not None else None
    return node if node is not None and rules.role(node.op_type) == role else None


def _same_tensor(value: Value | None, x: Value, rules: FormatRules) -> bool:
    """Whether `value` is `x` or a cast of `x` to its own dtype (an export's `.to(float32)`)."""
    if value is x:
        return True
    cast = _producer(value, "cast", rules)
    return (cast is not None and bool(cast.inputs) and cast.inputs[0] is x and value is not None
            and value.original_dtype == x.original_dtype)


def _mean_square_of(value: Value | None, x: Value, rules: FormatRules) -> bool:
    """Whether `value` is mean(x^2): ReduceMean/Mean of Pow(x, 2), x*x or Square(x)."""
    mean = _producer(value, "mean", rules)
    if mean is None or not mean.inputs:
        return False
    square = mean.inputs[0].producer if mean.inputs[0] is not None else None
    if square is None:
        return False
    role = rules.role(square.op_type)
    if role == "pow" and len(square.inputs) == 2:
        return _scalar(square.inputs[1]) == 2.0 and _same_tensor(square.inputs[0], x, rules)
    if role == "mul" and len(square.inputs) == 2:
        return all(_same_tensor(v, x, rules) for v in square.inputs)
    return role == "square" and bool(square.inputs) and _same_tensor(square.inputs[0], x, rules)


def _epsilon_of_shifted_mean(value: Value | None, x: Value, rules: FormatRules) -> float | None:
    """eps when `value` is mean(x^2) + eps with a positive constant eps (either order)."""
    add = _producer(value, "add", rules)
    if add is None or len(add.inputs) != 2:
        return None
    for slot in (0, 1):
        eps = _scalar(add.inputs[1 - slot])
        if eps is not None and eps > 0 and _mean_square_of(add.inputs[slot], x, rules):
            return eps
    return None


def _epsilon_of_root(value: Value | None, x: Value, rules: FormatRules) -> float | None:
    """eps when `value` is sqrt(mean(x^2) + eps) with a positive constant eps."""
    root = _producer(value, "sqrt", rules)
    if root is None or not root.inputs:
        return None
    return _epsilon_of_shifted_mean(root.inputs[0], x, rules)


def _epsilon_of_inverse_root(value: Value | None, x: Value, rules: FormatRules) -> float | None:
    """eps when `value` is 1/sqrt(mean(x^2) + eps): Reciprocal(Sqrt(.)), 1 / Sqrt(.) or
    Rsqrt(mean(x^2) + eps)."""
    node = value.producer if value is not None else None
    if node is None or not node.inputs:
        return None
    role = rules.role(node.op_type)
    if role == "reciprocal":
        return _epsilon_of_root(node.inputs[0], x, rules)
    if role == "div" and len(node.inputs) == 2 and _scalar(node.inputs[0]) == 1.0:
        return _epsilon_of_root(node.inputs[1], x, rules)
    if role == "rsqrt":
        return _epsilon_of_shifted_mean(node.inputs[0], x, rules)
    return None


def rms_norm_scaling(node: Node, rules: FormatRules) -> tuple[Value, float] | None:
    """(x, eps) when `node` is the scaling step of an RMS norm of x, or None.

    The step is x * 1/sqrt(mean(x^2) + eps) (a Mul with the inverse root as either input) or
    x / sqrt(mean(x^2) + eps), with a positive constant eps.
    """
    role = rules.role(node.op_type)
    if role not in ("mul", "div") or len(node.inputs) != 2 or any(v is None for v in node.inputs):
        return None
    candidates = [(0, 1), (1, 0)] if role == "mul" else [(0, 1)]
    for data_slot, scale_slot in candidates:
        x, scale = node.inputs[data_slot], node.inputs[scale_slot]
        assert x is not None
        eps = _epsilon_of_inverse_root(scale, x, rules) if role == "mul" else \
            _epsilon_of_root(scale, x, rules)
        if eps is not None:
            return x, eps
    return None


def scaling_fits(eps: float, dtype: str) -> bool:
    """Whether the per-row scale of an RMS norm with this eps is a normal number of `dtype`:
    sqrt(mean(x^2) + eps) lies in [sqrt(eps), max|x|] and its inverse in [1/max|x|, 1/sqrt(eps)],
    so eps decides both ends (an x that fits the dtype bounds the other)."""
    root = eps ** 0.5
    return root >= SMALLEST_NORMAL[dtype] and 1.0 / root <= FINITE_MAX[dtype]


def _rms_norm_reasons(eps: float, dtype: str, rescaled: bool, whole: bool = False,
                      backend_refusal: str | None = None) -> tuple[str, str | None]:
    """Why the statistics stay fp32, and why the scaling step runs low (None: it stays fp32).
    `rescaled`: whether the mean square runs in low precision on a rescaled row; `whole`:
    the inverse root too (see rescale_rms; only where the scaling step runs low);
    `backend_refusal`: why the backend rules the rescaled form out, where it does."""
    if rescaled and whole:
        statistics = (f"the statistics of an RMS norm (eps {eps:g}) run in {short_name(dtype)} "
                      f"on the row divided by 2^-7 of its largest |x| (s; at least "
                      f"8*sqrt(eps)): 1/sqrt(mean(x^2) + eps) = 1/s * 1/sqrt(mean((x/s)^2) + "
                      f"(sqrt(eps)/s)^2), every term below 18800 and the mean accumulated in "
                      f"fp32 by the reduction, so no fp32 tensor is left")
    elif rescaled:
        statistics = (f"the statistics of an RMS norm (eps {eps:g}) stay fp32 on one value per "
                      f"row (+eps, root, inverse); the mean square runs in "
                      f"{short_name(dtype)} on the row divided by 2^-7 of its largest |x| "
                      f"(each square below 18500: no overflow; the largest above 14000, so the "
                      f"mean stays normal and what underflows is negligible), accumulated in "
                      f"fp32 by the reduction and scaled back in fp32")
    else:
        statistics = (f"the statistics of an RMS norm (eps {eps:g}) stay fp32: the square "
                      f"overflows fp16 once |x| > 256, so the norm reads its low-precision input "
                      f"through one cast; the residual stream stays low")
        if backend_refusal is not None:
            statistics += f" (no rescaled fp16 form on this backend: {backend_refusal})"
    if not scaling_fits(eps, dtype):
        return statistics + (f"; the scaling stays fp32 too, since 1/sqrt(eps) = {eps ** -0.5:.3g}"
                             f" is outside {short_name(dtype)}'s normal range"), None
    return statistics, (f"the scaling step of an RMS norm (eps {eps:g}) runs in "
                        f"{short_name(dtype)}: its per-row scale lies within [1/max|x|, "
                        f"1/sqrt(eps) = {eps ** -0.5:.3g}], a normal {short_name(dtype)} number, "
                        f"and the normalised output is bounded by sqrt(row length)")


def _square_and_mean(members: list[Node], rules: FormatRules) -> tuple[Node, Node] | None:
    """The square and the mean of an RMS norm's statistics (members from _statistics_nodes)."""
    for mean in members:
        if rules.role(mean.op_type) == "mean" and mean.inputs and mean.inputs[0] is not None:
            square = mean.inputs[0].producer
            if square is not None and any(square is m for m in members):
                return square, mean
    return None


def _chain_to_mean(step: Node, x: Value, mean: Node, rules: FormatRules) -> list[Node] | None:
    """The nodes between the mean and a scaling step x * 1/sqrt(mean + eps) (the inverse, the
    root when separate, +eps; nearest the step first) when each is read only by the next and
    the mean only by +eps: the statistic is then a chain that can be rebuilt as a whole."""
    if rules.role(step.op_type) != "mul" or len(step.inputs) != 2:
        return None
    value = step.inputs[1] if step.inputs[0] is x else step.inputs[0]
    chain: list[Node] = []
    averaged = mean.outputs[0] if mean.outputs else None
    while value is not averaged:
        node = value.producer if value is not None else None
        if node is None or value is None or len(value.uses) != 1 or value.graph_output_uses \
                or len(chain) == 3 or not node.inputs:
            return None
        role = rules.role(node.op_type)
        if role == "add":
            value = next((v for v in node.inputs if _scalar(v) is None), None)
        elif role == "div":
            value = node.inputs[1] if len(node.inputs) == 2 else None
        elif role in ("reciprocal", "sqrt", "rsqrt"):
            value = node.inputs[0]
        else:
            return None
        chain.append(node)
    if averaged is None or len(averaged.uses) != 1 or averaged.graph_output_uses:
        return None
    return chain


def rescale_applies(ctx: PassContext, mean: Node) -> bool:
    """Whether the mean square of an RMS norm has a rescaled low-precision form here: fp16
    (bf16's range holds any square), a format that names the ops, and a mean that keeps the
    reduced axes (the row's scale then broadcasts against the row)."""
    return (ctx.target_dtype == FLOAT16 and bool(ctx.rules.rescale_ops)
            and mean.attrs.get("keepdims", 1) != 0)


def rescale_refusal(ctx: PassContext, mean: Node) -> str | None:
    """Why the backend rules out the rescaled form (an op of it with no kernel, or one measured
    slow or wrong there), or None when a rewrite may build every op of it."""
    return ctx.lists.rewrite_refusal((*ctx.rules.rescale_ops.values(), mean.op_type))


def _statistics_nodes(step: Node, x: Value) -> list[Node]:
    """The nodes between x and the scaling step (the square, mean, +eps, root, inverse), and it."""
    found: list[Node] = [step]
    stack = [v for v in step.inputs if v is not None and v is not x]
    seen: set[int] = set()
    while stack:
        value = stack.pop()
        node = value.producer
        if node is None or id(node) in seen or value.const is not None:
            continue
        seen.add(id(node))
        found.append(node)
        stack.extend(v for v in node.inputs if v is not None and v is not x)
    return found


@register_pass("recognize_rms_norm")
def recognize_rms_norm(ctx: PassContext) -> tuple[int, list[str]]:
    """Keep an RMS norm's statistics fp32 without making them a barrier: they are pinned (not
    deny), so the painting runs the residual stream around them in low precision; the norm's
    input is cast up once for the square, and the per-row scale (a small tensor) is cast down
    for the scaling step, which runs low where eps keeps the scale in range (see scaling_fits)."""
    found = 0
    #: ids of the nodes an RMS norm pinned: two norms may share a square or a mean, and the
    #: second still needs its own +eps, root and inverse pinned.
    claimed: set[int] = set()
    for node in list(ctx.model.graph.walk_nodes()):
        ctx.focus = node
        if node.pin_reason or node.class_kind == decisions.USER_OVERRIDE:
            continue
        match = rms_norm_scaling(node, ctx.rules)
        if match is None:
            continue
        x, eps = match
        members = _statistics_nodes(node, x)
        if any((m.pin_reason and id(m) not in claimed)
               or m.class_kind == decisions.USER_OVERRIDE for m in members):
            continue
        parts = _square_and_mean(members, ctx.rules)
        applies = parts is not None and rescale_applies(ctx, parts[1])
        refusal = rescale_refusal(ctx, parts[1]) if applies and parts is not None else None
        rescaled = applies and refusal is None
        # Only a step that runs low reads the inverse in low precision.
        chain = _chain_to_mean(node, x, parts[1], ctx.rules) \
            if rescaled and parts and scaling_fits(eps, ctx.target_dtype) \
            and INVERSE_FLOOR * eps ** 0.5 <= FINITE_MAX[ctx.target_dtype] else None
        why, scaling_why = _rms_norm_reasons(eps, ctx.target_dtype, rescaled, chain is not None,
                                             backend_refusal=refusal)
        for member in members:
            if member is node and scaling_why is not None:
                low_class = member.op_class if member.op_class in (ALLOW, INFER) else INFER
                set_class(ctx, member, low_class, scaling_why, decisions.STRUCTURE)
                continue
            if id(member) in claimed:
                continue  # shared with a norm recognised before: pinned with its reason
            if member.op_class in (FP32, DENY):
                set_class(ctx, member, INFER, why, decisions.STRUCTURE)
            member.pin_reason, member.pin_kind, member.pin_barrier = why, decisions.STRUCTURE, False
            claimed.add(id(member))
        record = StructureRecord("rms_norm", [m.name for m in members],
                                 why if scaling_why is None else f"{why}; {scaling_why}")
        ctx.structures.append(record)
        if rescaled and parts is not None:
            ctx.rescales.append(RescalePlan(x, parts[0], parts[1], record, eps,
                                            node if chain else None, chain or []))
        found += 1
    return found, []


# -- rotary angles ----------------------------------------------------------------------------

#: Integer dtypes of the positions a rotary angle's reduction reads (int32 widened first).
_POSITION_DTYPES = frozenset({"int64", "int32"})


def _periodic_readers(angle: Value, rules: FormatRules) -> list[Node] | None:
    """The nodes that read `angle`: periodic ops (Cos, Sin) and the ops carrying it to them with
    its values unchanged or only selected (`rules.carry_ops`, float outputs); None when anything
    else reads it or what they carry (another op or slot, a graph output, a nested graph)."""
    readers: list[Node] = []
    seen: set[int] = set()
    stack = [angle]
    while stack:
        value = stack.pop()
        if value.graph_output_uses:
            return None
        for node, slot in value.uses:
            if node.graph is not angle.graph:
                return None
            if id(node) in seen:
                continue
            seen.add(id(node))
            readers.append(node)
            if node.op_type in rules.periodic_ops:
                continue
            carried = [v for v in node.outputs if v is not None]
            if slot not in rules.carry_ops.get(node.op_type, ()) \
                    or not all(_is_float(v) for v in carried):
                return None
            stack.extend(carried)
    return readers if any(n.op_type in rules.periodic_ops for n in readers) else None


def rotary_angle(node: Node, rules: FormatRules
                 ) -> tuple[Value, Value, list[Node], Node] | None:
    """(integer positions, frequencies, readers, the positions' cast) when `node` is a rotary
    embedding's angle: integer positions cast to fp32 times constant frequencies (finite, none
    above 1 in magnitude, not all zero), read only by Cos and Sin (`_periodic_readers`)."""
    if rules.role(node.op_type) != "mul" or len(node.inputs) != 2 or len(node.outputs) != 1 \
            or node.outputs[0] is None or node.outputs[0].original_dtype != FLOAT32:
        return None
    for slot in (0, 1):
        floats, frequencies = node.inputs[slot], node.inputs[1 - slot]
        cast = floats.producer if floats is not None else None
        positions = cast.inputs[0] if cast is not None and cast.inputs else None
        if cast is None or rules.role(cast.op_type) != "cast" or positions is None \
                or positions.dtype not in _POSITION_DTYPES or floats is None \
                or floats.dtype != FLOAT32 or frequencies is None \
                or frequencies.dtype != FLOAT32:
            continue
        values = _constant(frequencies)  # read last: most products are not rotary angles
        if values is None:
            continue
        largest = float(np.max(np.abs(values))) if values.size else 0.0
        if not np.all(np.isfinite(values)) or not 0.0 < largest <= 1.0:
            continue
        readers = _periodic_readers(node.outputs[0], rules)
        return (positions, frequencies, readers, cast) if readers is not None else None
    return None


@register_pass("recognize_rotary_angles")
def recognize_rotary_angles(ctx: PassContext) -> tuple[int, list[str]]:
    """Run a rotary embedding's angle, and the Cos and Sin reading it, in fp16 without its
    rounding error: the product of positions and frequencies becomes an allow op, and
    `reduce_rotary_angles` computes it modulo 2*pi in int64 once the painting has put it in fp16
    (to within 2^-10 rad at any position below 2^24). Painted as an ordinary product, an fp16
    angle is off by up to 1 rad at position 2048; kept fp32, it leaves fp32 tensors and casts.
    Only for fp16 (a bf16 angle in [-pi, pi) would be off by 2^-7 rad: those stay as painted)
    and where the backend runs the periodic ops in it."""
    rules = ctx.rules
    if ctx.target_dtype != FLOAT16 or not rules.integer_ops or not rules.periodic_ops:
        return 0, []
    missing = sorted({op for op in rules.integer_ops.values() if not ctx.op_available(op)})
    found = 0
    for node in list(ctx.model.graph.nodes):
        ctx.focus = node
        match = rotary_angle(node, rules)
        if match is not None and missing:
            return 0, [f"rotary angles are left to the painting: the model's format version "
                       f"has no {', '.join(missing)} to reduce them with"]
        if match is None:
            continue
        positions, frequencies, readers, cast = match
        members = [node, *readers, cast]  # the cast goes too: a pin on it counts
        if any(m.pin_reason or m.class_kind == decisions.USER_OVERRIDE
               or id(m) in ctx.user_rule_nodes for m in members):
            continue
        periodic = [m for m in readers if m.op_type in rules.periodic_ops]
        if not all(m.op_class in (ALLOW, INFER) and any(g.paintable for g in m.float_groups())
                   for m in periodic):
            continue  # the backend keeps Cos/Sin fp32: the angle is left as it is
        why = (f"rotary angle (integer positions {short_name(positions.dtype)} x constant "
               f"frequencies, read only by {', '.join(sorted({m.op_type for m in periodic}))}): "
               f"reduced modulo 2*pi in int64 and run in fp16 within [-pi, pi), off by at most "
               f"2^-10 rad for positions below 2^24 (an fp16 product is off by up to 1 rad at "
               f"position 2048)")
        set_class(ctx, node, ALLOW, why, decisions.STRUCTURE)
        record = StructureRecord("rotary_angle", [m.name for m in (node, *periodic)], why)
        ctx.structures.append(record)
        ctx.rotaries.append(RotaryPlan(positions, node, frequencies, record))
        found += 1
    return found, []


# -- index math -------------------------------------------------------------------------------


def _is_float(value: Value | None) -> bool:
    return value is not None and value.original_dtype in FLOAT_DTYPES


def heavy(node: Node) -> bool:
    """Whether `node` is a heavy compute op (allow-class by the op lists, not by a user's move):
    its outputs are activations."""
    return node.op_class == ALLOW and node.class_kind != decisions.USER_OVERRIDE


def index_math_values(graph: Graph, rules: FormatRules) -> set[int]:
    """ids of the float values of the main graph computed without a heavy (allow-class) op, a
    table lookup (an embedding row is data) or a control-flow op: from graph inputs, constants
    and integers (shapes, positions, lengths, boolean masks) through light arithmetic."""
    known: set[int] = set()
    for value in list(graph.inputs) + list(graph.initializers.values()):
        if _is_float(value):
            known.add(id(value))
    for node in graph.nodes:
        if node.subgraphs or heavy(node):
            continue
        if node.op_type in rules.lookup_ops and _is_float(node.inputs[0] if node.inputs
                                                         else None):
            continue  # an embedding row: data
        inputs = [v for v in node.inputs if v is not None]
        if not inputs and node.op_type not in rules.constant_fill_attrs \
                and not (node.outputs and node.outputs[0] is not None
                         and node.outputs[0].const is not None):
            continue  # random ops and the like
        if all(id(v) in known or not _is_float(v) for v in inputs):
            for out in node.outputs:
                if out is not None and _is_float(out):
                    known.add(id(out))
    return known


def _index_seeds(graph: Graph, rules: FormatRules) -> Iterator[tuple[Node, int]]:
    """(node, input slot) where a float value is used as a shape, size, index or integer."""
    index_ops = {op for op, _slot in rules.index_slots}
    for node in graph.nodes:
        op = node.op_type
        if op in rules.metadata_ops or node.subgraphs:
            continue
        # Cheapest first: most nodes turn floats into floats and take no index (at a million
        # nodes each test here costs a tenth of a second).
        if op in rules.rounding_ops or op in index_ops:
            outputs = [v for v in node.outputs if v is not None]
            to_integers = bool(outputs) and not any(_is_float(v) for v in outputs)
        else:
            dtypes = [v.original_dtype for v in node.outputs if v is not None]
            if not dtypes or not FLOAT_DTYPES.isdisjoint(dtypes):
                continue
            to_integers = True
        for slot, value in enumerate(node.inputs):
            if _is_float(value) and (to_integers or op in rules.rounding_ops
                                     or (op, slot) in rules.index_slots):
                yield node, slot


@register_pass("keep_index_math_fp32")
def keep_index_math_fp32(ctx: PassContext) -> tuple[int, list[str]]:
    """Keep fp32 the float arithmetic that computes shapes, lengths or indices.

    Walks back from every float input that becomes an integer or a shape (Cast to an integer
    type, comparisons, Floor/Ceil/Round, the format's index slots) through the float values
    computed without a heavy op or a lookup (`index_math_values`): fp16 represents integers
    exactly only up to 2048 (bf16: 256), so a length, position or bucket computed there could
    round to a neighbour. A comparison or rounding of activations (downstream of a MatMul or
    Conv) is not index math and is left alone.
    """
    graph = ctx.model.graph
    rules = ctx.rules
    seeds = list(_index_seeds(graph, rules))
    if not seeds:  # a graph without shape arithmetic (most of a large export) ends here
        return 0, []
    index_math = index_math_values(graph, rules)
    follow = rules.follow_producer_inputs
    pinned = 0
    visited: set[int] = set()
    for seed_node, slot in seeds:
        ctx.focus = seed_node
        seed = seed_node.inputs[slot]
        if seed is None or id(seed) not in index_math or seed.const is not None:
            continue
        use = f"{seed_node.name} ({seed_node.op_type})"
        why = (f"computes a shape, length or index (used by {use}), without a heavy op: "
               f"kept fp32, which holds integers exactly up to 2^24 ({ctx.options.target}: "
               f"{2048 if ctx.options.target == 'fp16' else 256})")
        names: list[str] = []
        group = seed_node.input_group[slot] if slot < len(seed_node.input_group) else None
        if group is not None and group.name not in follow.get(seed_node.op_type, ()) \
                and id(seed_node) not in ctx.user_rule_nodes:
            pinned += _pin(group, why, names)
        stack = [seed]
        while stack:
            value = stack.pop()
            producer = value.producer
            if producer is None or id(producer) in visited or producer.graph is not graph:
                continue
            visited.add(id(producer))
            if id(producer) in ctx.user_rule_nodes:
                continue  # the user's pattern rule decided this node
            for g in producer.type_groups:
                pinned += _pin(g, why, names)
            stack.extend(v for v in producer.inputs
                         if v is not None and id(v) in index_math and v.const is None)
        if names:
            ctx.structures.append(StructureRecord("index_math", names, why))
    return pinned, []


def _pin(group: TypeGroup, why: str, names: list[str]) -> int:
    """Keep a paintable float group fp32 for the index-math rule; 1 when it changed."""
    if not group.paintable or group.dtype != FLOAT32:
        return 0
    group.paintable = False
    group.reason, group.kind = why, decisions.STRUCTURE
    if group.node.name not in names:
        names.append(group.node.name)
    return 1


# -- the user's pattern rules -----------------------------------------------------------------


def _neighbours(node: Node, downstream: bool, through: frozenset[str]) -> Iterator[Node]:
    """The consumers (or producers) of `node`, looking through the `through` ops."""
    seen: set[int] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if downstream:
            nexts = [c for v in current.outputs if v is not None for c, _ in v.uses]
        else:
            nexts = [v.producer for v in current.inputs if v is not None and v.producer]
        for other in nexts:
            if other is None or id(other) in seen:
                continue
            seen.add(id(other))
            yield other
            if other.op_type in through or other.qualified_op in through:
                stack.append(other)


@register_pass("apply_pattern_rules")
def apply_pattern_rules(ctx: PassContext) -> tuple[int, list[str]]:
    """Apply the config's `[[rules]]`: nodes of an op type that feed (or are fed by) given ops,
    optionally through others and by name, get a precision or an op class."""
    rules = ctx.options.overrides.rules
    if not rules:
        return 0, []
    changed = 0
    hits: dict[int, list[str]] = {}
    for node in ctx.model.graph.walk_nodes():
        ctx.focus = node
        if node.pin_reason:
            continue  # --keep-node, or a front end's pin (TF fetch nodes): stays as pinned
        for index, rule in enumerate(rules):
            if node.op_type != rule.op and node.qualified_op != rule.op:
                continue
            if rule.name is not None and not rule.name.fullmatch(node.name):
                continue
            if rule.feeds and not any(n.op_type in rule.feeds or n.qualified_op in rule.feeds
                                      for n in _neighbours(node, True, rule.through)):
                continue
            if rule.fed_by and not any(n.op_type in rule.fed_by or n.qualified_op in rule.fed_by
                                       for n in _neighbours(node, False, rule.through)):
                continue
            reason = f"{rule.describe()} ({rule.source})"
            set_class(ctx, node, rule.op_class or FP32, reason, decisions.USER_OVERRIDE)
            ctx.user_rule_nodes.add(id(node))
            hits.setdefault(index, []).append(node.name)
            changed += 1
            break  # the first matching rule wins
    for index, names in sorted(hits.items()):
        ctx.structures.append(StructureRecord("pattern_rule", names, rules[index].describe()))
    notes = [f"{rules[i].describe()}: {len(names)} node(s)" for i, names in sorted(hits.items())]
    return changed, notes
