"""What every pass sees (`PassContext`) and returns (`PassResult`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..ir import BFLOAT16, FLOAT16, Model
from ..op_lists import OpLists

TARGET_DTYPES = {"fp16": FLOAT16, "bf16": BFLOAT16}


@dataclass
class ConversionOptions:
    """User options that passes read (the op lists carry the rest)."""

    target: str = "fp16"
    backend: str = "ort-cuda"
    keep_io_types: bool = True
    clamp: bool = False
    keep_nodes: list[re.Pattern[str]] = field(default_factory=list)


@dataclass
class ConstantRecord:
    """One constant the conversion looked at, for the report."""

    name: str
    action: str  # "converted" | "kept_fp32" | "clamped"
    elements: int
    overflowed: int = 0
    flushed_to_zero: int = 0
    detail: str = ""


@dataclass
class PassContext:
    """The model being rewritten plus everything a pass may read or record."""

    model: Model
    lists: OpLists
    options: ConversionOptions
    constants: list[ConstantRecord] = field(default_factory=list)
    casts_inserted: int = 0
    casts_removed: int = 0
    #: (id of a LazyTensor, dtype) -> its range check, shared by the passes that need it.
    range_checks: dict = field(default_factory=dict)

    @property
    def target_dtype(self) -> str:
        return TARGET_DTYPES[self.options.target]


@dataclass
class PassResult:
    """What a pass changed: a count and short notes for the log and report."""

    name: str
    changed: int
    notes: list[str] = field(default_factory=list)
