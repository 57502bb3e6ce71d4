"""Rules decided by the graph's structure rather than by op type: one module per rule, holding
its recognition (an analysis pass), its plan and, where it has one, its rewrite pass.

- `tanh_gelu`: the cube of a tanh-GELU runs in low precision although Pow is a deny op.
- `rms_norm`: an RMS norm keeps its statistics fp32 without being a barrier; where the backend
has the kernels, its mean square runs in fp16 on a rescaled row.
- `rotary_angles`: a rotary embedding's angle runs in fp16, reduced modulo 2*pi in integers.
- `attention_masks`: additive masks beyond the target's range: construction fp32, the masked
sums saturated before their Softmax.
- `index_math`: float arithmetic computing shapes, lengths or indices stays fp32.
- `pattern_rules`: the user's `[[rules]]` from the config.

`matching` holds the small facts about values and nodes the rules match on. Op names reach the
rules through the format's `FormatRules` (roles, index slots, ...).
"""

from . import (
    attention_masks,
    index_math,
    matching,
    pattern_rules,
    rms_norm,
    rotary_angles,
    tanh_gelu,
)

__all__ = ["attention_masks", "index_math", "matching", "pattern_rules", "rms_norm",
           "rotary_angles", "tanh_gelu"]
