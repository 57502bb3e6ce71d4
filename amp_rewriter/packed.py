"""Records kept marshalled in blocks rather than as a Python object each.

A conversion of a million nodes keeps a record or two per node beyond the IR (the report's node
entries, the names of the nodes an emitter encoded). As objects they would take several times
their bytes, and, made while the IR lives, they would sit among its memory and keep the system
from getting it back once the IR is freed. Packed, a block of them is one run of bytes in one
shared buffer.
"""

from __future__ import annotations

import bisect
import marshal
import zlib
from array import array
from typing import Any


class PackedRecords:
    """A list of marshallable records (tuples, dicts, strings, numbers) that keeps them in
    blocks of `per_block`, marshalled (and with `compress` compressed) back to back in one
    buffer. Reading in order decodes each block once; records appended since the last full
    block are held as they are until `seal` packs them (a sealed partial block starts the next
    one afresh)."""

    def __init__(self, per_block: int, compress: bool = False):
        self.per_block = per_block
        self.compress = compress
        self._blocks = bytearray()
        #: Where each block starts in `_blocks`, and how many records lie before each.
        self._block_starts = array("Q", [0])
        self._ends = [0]
        self._pending: list[Any] = []
        self._decoded: tuple[int, list[Any]] = (-1, [])

    def append(self, record: Any) -> None:
        """Add a record (packed with its block once the block is full)."""
        self._pending.append(record)
        if len(self._pending) >= self.per_block:
            self.seal()

    def seal(self) -> None:
        """Pack the records appended since the last block."""
        if not self._pending:
            return
        data = marshal.dumps(self._pending)
        self._blocks += zlib.compress(data, 1) if self.compress else data
        self._block_starts.append(len(self._blocks))
        self._ends.append(self._ends[-1] + len(self._pending))
        self._pending = []

    def __len__(self) -> int:
        return self._ends[-1] + len(self._pending)

    def __getitem__(self, index: int) -> Any:
        """Record `index` (0 <= index < len): the object appended while its block is pending,
        else a decoded copy shared with the other reads of its block."""
        sealed = self._ends[-1]
        if index >= sealed:
            return self._pending[index - sealed]
        first, block = self._block_of(index)
        return block[index - first]

    def between(self, first: int, last: int) -> list[Any]:
        """Records `first` to `last` - 1 (as `self[i]` gives each), read a block at a time."""
        records: list[Any] = []
        index = first
        while index < last:
            sealed = self._ends[-1]
            if index >= sealed:
                records += self._pending[index - sealed:last - sealed]
                break
            block_first, block = self._block_of(index)
            taken = block[index - block_first:last - block_first]
            records += taken
            index += len(taken)
        return records

    def _block_of(self, index: int) -> tuple[int, list[Any]]:
        """The sealed block that holds record `index`: its first record's index and its records
        (decoded once for consecutive reads of one block)."""
        block = bisect.bisect_right(self._ends, index) - 1
        if self._decoded[0] != block:
            start, end = self._block_starts[block], self._block_starts[block + 1]
            with memoryview(self._blocks)[start:end] as data:
                self._decoded = (block, marshal.loads(zlib.decompress(data) if self.compress
                                                      else data))
        return self._ends[block], self._decoded[1]
