"""Analysis passes: they decide precisions and record why, and never edit the graph."""

from . import (
    attention_masks,
    classify,
    constant_ranges,
    pins,
    propagate,
    recurrent_edges,
    structures,
)

__all__ = ["attention_masks", "classify", "constant_ranges", "pins", "propagate",
           "recurrent_edges", "structures"]
