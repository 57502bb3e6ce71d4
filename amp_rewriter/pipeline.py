"""The ordered list of passes for a conversion, and the loop that runs them."""

from __future__ import annotations

from typing import Callable

from .passes.base import PassContext, PassResult
from .passes.classify import classify_ops
from .passes.constant_ranges import guard_constant_ranges
from .passes.convert_constants import convert_constants
from .passes.fold_casts import fold_casts
from .passes.insert_casts import insert_casts
from .passes.propagate import propagate_precision
from .passes.tf_rules import match_recurrent_edges

Pass = Callable[[PassContext], PassResult]

#: Analysis first (decisions only), then the rewrite. Each pass returns what it changed.
CONVERSION_PIPELINE: list[Pass] = [
    classify_ops,
    guard_constant_ranges,
    propagate_precision,
    insert_casts,
    fold_casts,
    convert_constants,
]

#: TensorFlow graphs and function bodies: the same passes, plus Grappler's loop rule between the
#: decisions and the rewrite (fetch nodes and ref-variable reads are marked by the loader and kept
#: fp32 by classify_ops).
TF_PIPELINE: list[Pass] = [
    classify_ops,
    guard_constant_ranges,
    propagate_precision,
    match_recurrent_edges,
    insert_casts,
    fold_casts,
    convert_constants,
]


def run_pipeline(ctx: PassContext, passes: list[Pass] | None = None) -> list[PassResult]:
    """Run `passes` (the conversion pipeline by default) in order; returns their results."""
    return [p(ctx) for p in (CONVERSION_PIPELINE if passes is None else passes)]
