"""Rewrite passes: they apply the decisions to the graph (dtypes, casts, constants)."""

from . import convert_constants, fold_casts, insert_casts

__all__ = ["convert_constants", "fold_casts", "insert_casts"]
