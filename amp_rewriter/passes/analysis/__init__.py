"""Analysis passes: they decide precisions and record why, and never edit the graph."""

from . import classify, constant_ranges, pins, propagate, recurrent_edges

__all__ = ["classify", "constant_ranges", "pins", "propagate", "recurrent_edges"]
