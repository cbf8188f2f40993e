"""Each running sequence's block table, kept where a step can gather it at once.

A sequence's block table is the list of KV blocks that hold its pairs, in order. The
scheduler grows and cuts it as a Python list; every change is mirrored into the
sequence's row of one preallocated array (BlockTables), so the runner builds a step's
page tables from a single gather of its sequences' rows instead of flattening a list
per sequence every step (runner.prepare).
"""
from __future__ import annotations

import numpy as np

OFFLOADED = -1   # the id of a block whose pairs are in the host tier (Sequence.offloaded)


class BlockTables:
    """One row of block ids per running sequence: [num_rows, max_blocks] int32. Only a row's
    first len(table) entries mean anything; the rest are stale (the kernels read a head's
    pages only up to its length, and every stale id is a real block's)."""

    def __init__(self, num_rows: int, max_blocks: int):
        self.ids = np.zeros((num_rows, max_blocks), dtype=np.int32)
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def new(self, blocks: list[int]) -> BlockTable:
        """A table holding blocks, in a row of its own until release."""
        table = BlockTable(self, self._free_rows.pop())
        table.extend(blocks)
        return table

    def release(self, table: BlockTable) -> list[int]:
        """Give table's row back; returns the device blocks it held (for the block manager to free)."""
        blocks = [block for block in table.ids if block != OFFLOADED]
        self._free_rows.append(table.row)
        table.tables, table.row, table.ids = None, -1, []   # last_row stays
        return blocks


class BlockTable:
    """A sequence's block ids: a list for the scheduler, mirrored in its row of BlockTables
    (a waiting sequence's is empty and has no row)."""
    __slots__ = ("tables", "row", "ids", "changed_from", "last_row")

    def __init__(self, tables: BlockTables | None = None, row: int = -1):
        self.tables, self.row, self.last_row = tables, row, row   # last_row: its row, also after release
        self.ids: list[int] = []
        self.changed_from = 0   # the first entry changed since tensor parallelism's last step (workers.py)

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self):
        return iter(self.ids)

    def extend(self, blocks: list[int]) -> None:
        start = len(self.ids)
        if start + len(blocks) > self.tables.ids.shape[1]:
            raise RuntimeError(f"a block table of {start + len(blocks)} blocks is longer than the "
                               f"{self.tables.ids.shape[1]} that max_model_len needs")
        self.ids += blocks
        self.tables.ids[self.row, start:start + len(blocks)] = blocks
        self.changed_from = min(self.changed_from, start)

    def offload(self, stop: int) -> list[int]:
        """The blocks before column stop leave the device (their pairs go to the host tier):
        returns those that had not yet, marked OFFLOADED in the list from now on. The row keeps
        their ids: stale entries must be real blocks' (the runner stages pages there)."""
        start = self.ids.count(OFFLOADED)
        gone = self.ids[start:stop]
        self.ids[start:stop] = [OFFLOADED] * len(gone)
        return gone

    def cut(self, num_kept: int) -> list[int]:
        """Keep the first num_kept blocks; returns the others."""
        dropped = self.ids[num_kept:]
        del self.ids[num_kept:]
        self.changed_from = min(self.changed_from, num_kept)
        return dropped
