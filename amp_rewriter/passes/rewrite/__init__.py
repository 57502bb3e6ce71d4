"""Rewrite passes: they apply the decisions to the graph (dtypes, casts, constants)."""

from . import (
    convert_constants,
    fold_casts,
    insert_casts,
    rescale_rms,
    rotary_angles,
    saturate_masks,
)

__all__ = ["convert_constants", "fold_casts", "insert_casts", "rescale_rms", "rotary_angles",
           "saturate_masks"]
