"""The tanh-GELU rule.

`recognize_tanh_gelu`: the cube in tanh-GELU, 0.5*x*(1 + tanh(c2*(x + c1*x^3))), runs in low
  precision although Pow is a deny op: where x^3 overflows to +-inf, every later step keeps the
  sign (c1, c2 > 0) and tanh(+-inf) = +-1 is the limit fp32 reaches too.
"""

from __future__ import annotations

from ...ir import ALLOW, FP32, INFER, Node, decisions
from ..analysis.classify import set_class
from ..base import FormatRules, PassContext, StructureRecord, register_pass
from .matching import only_consumer, other_input, positive_constant, scalar


def tanh_gelu_cube(node: Node, rules: FormatRules) -> str | None:
    """Why `node` is the cube of a tanh-GELU whose overflow is harmless, or None when it is not.

    The pattern, by structure: Pow(x, 3) -> Mul(., c1) -> Add(x, .) -> Mul(., c2) -> Tanh, with
    c1, c2 positive constants and each intermediate read only by the next step.
    """
    if rules.role(node.op_type) != "pow" or len(node.inputs) != 2:
        return None
    base = node.inputs[0]
    if scalar(node.inputs[1]) != 3.0:
        return None
    step = only_consumer(node.outputs[0] if node.outputs else None)
    if step is None or rules.role(step[0].op_type) != "mul" \
            or not positive_constant(other_input(*step)):
        return None
    step = only_consumer(step[0].outputs[0])
    if step is None or rules.role(step[0].op_type) != "add" or other_input(*step) is not base:
        return None
    step = only_consumer(step[0].outputs[0])
    if step is None or rules.role(step[0].op_type) != "mul" \
            or not positive_constant(other_input(*step)):
        return None
    step = only_consumer(step[0].outputs[0])
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
