"""The pipelines (ordered lists of pass names) and the loop that runs them.

Set AMP_REWRITER_LINT=1 to check the IR's invariants (`ir.lint`) after loading and after every
pass; the test suite always does. A broken invariant, or any unexpected exception inside a pass,
raises an error that names the pass (and the node it was working on).
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import AmpError
from ..ir import IRInvariantError, assert_sound, lint_enabled, nodes_created_by
from ..training import accumulation as accumulation_passes  # noqa: F401  (and accumulation's)
from ..training import passes as training_passes  # noqa: F401  (registers the training passes)
from ..training import weights as weight_passes  # noqa: F401  (and those of 16-bit weights)
from . import analysis, rewrite, structures  # noqa: F401  (importing them registers their passes)
from .base import REGISTRY, Pass, PassContext, PassResult

#: TensorFlow graphs: the decisions, Grappler's loop rule between them and the rewrite, the
#: rewrite. Fetch nodes and ref-variable reads are pinned by the TF loader.
_TF_PASSES = [
    "pin_front_end",
    "classify_ops",
    "recognize_tanh_gelu",
    "recognize_rms_norm",
    "apply_pattern_rules",
    "keep_index_math_fp32",
    "guard_constant_ranges",
    "propagate_precision",
    "match_recurrent_edges",
    "insert_casts",
    "fold_casts",
    "convert_constants",
]

#: A training plan's passes (training/passes.py), in the order they build on each other.
TRAINING_PASSES = [
    "pin_training_path",
    "move_waited_writes",
    "update_weights_in_fp32",
    "store_weights_in_low_precision",
    "create_loss_scale_state",
    "scale_gradient_seeds",
    "fold_unscale_into_optimizer",
    "accumulate_gradients",
    "unscale_gradients",
    "check_gradients_finite",
    "gate_variable_writes",
    "update_loss_scale",
    "release_step_results",
]

#: Analysis first (decisions only), then the rewrite.
PIPELINES: dict[str, list[str]] = {
    "onnx": [
        "drop_identity_casts",
        "pin_nodes",
        "pin_front_end",
        "classify_ops",
        "recognize_tanh_gelu",
        "recognize_rms_norm",
        "apply_pattern_rules",
        "recognize_rotary_angles",
        "find_attention_masks",
        "keep_index_math_fp32",
        "guard_constant_ranges",
        "propagate_precision",
        "convert_constant_inputs",
        "insert_casts",
        "rescale_rms_statistics",
        "reduce_rotary_angles",
        "saturate_masked_sums",
        "fold_casts",
        "convert_constants",
    ],
    "tf": ["pin_nodes", *_TF_PASSES],
    # A training step (amp_rewriter/training): the plan's fp32 path, then loss scaling built
    # by the format's TrainingOps, then the TF passes on the forward and backward passes.
    "tf-training": ["pin_nodes", *TRAINING_PASSES, *_TF_PASSES],
}

class PassError(Exception):
    """A pass failed unexpectedly (a bug, not bad input): names the pass and the node."""


def passes_of(pipeline: str | list[str]) -> list[Pass]:
    """The Pass objects of a pipeline name or a list of pass names."""
    names = PIPELINES[pipeline] if isinstance(pipeline, str) else pipeline
    unknown = [name for name in names if name not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown pass(es): {', '.join(unknown)}")
    return [REGISTRY[name] for name in names]


def run_pipeline(ctx: PassContext, pipeline: str | list[str],
                 on_pass: Callable[[str], None] | None = None) -> list[PassResult]:
    """Run the passes of `pipeline` in order; returns their results. `on_pass` is told each
    pass's name as it starts (a progress bar)."""
    lint = lint_enabled()
    if lint:
        assert_sound(ctx.model.graph, "loading")
    results = []
    for step in passes_of(pipeline):
        ctx.focus = None
        if on_pass is not None:
            on_pass(step.name)
        try:
            with nodes_created_by(step.name):
                results.append(step(ctx))
        except (AmpError, PassError, IRInvariantError):
            raise
        except Exception as exc:
            where = f" at node {ctx.focus.name!r} ({ctx.focus.op_type})" if ctx.focus else ""
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise PassError(f"pass {step.name} failed{where}: {type(exc).__name__}: "
                            f"{detail}") from exc
        if lint:
            assert_sound(ctx.model.graph, f"pass {step.name}")
    return results
