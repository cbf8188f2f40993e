"""Each head's own pages, once an uneven method has evicted.

Before its first eviction, and under every method but an uneven one (kvcompress), the heads
of a sequence hold the same pairs, in the pages of its blocks (KVCache.pages of its block
table). After an uneven eviction each (layer, KV head) has its own pages and length. They
live on the device in one table with a row per block-table row (HeadTables), so a step or
an eviction gathers its sequences' rows in one index, whichever evicted when; the host keeps
per sequence only the numbers that size the gather (OwnPages): a bound of its widest head's
pages, made exact once the eviction's widths reach the host behind the step (nothing waits).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

import kernels
from models import KVCache


class Landing:
    """Device values on their way to the host (kernels.to_host), read once they are there."""

    def __init__(self, values: torch.Tensor):
        (self.host,), self.ready = kernels.to_host((values,))

    def values(self) -> list[int] | None:
        """None while the copy has not landed: never waits for it."""
        return self.host.tolist() if self.ready is None or self.ready.query() else None


@dataclass
class OwnPages:
    """A sequence's part of HeadTables, on the host."""
    row: int      # its row: its block table's, where it was last written
    width: int    # the row's columns that mean anything: its widest head's pages, or more
    slots: int    # num_kv_slots when the row was written: every head has taken num_kv_slots - slots pairs since
    kept: tuple[torch.Tensor, torch.Tensor] | None = None   # its row, while swapped out (the row is not its own)
    # Its widest head's pages after an eviction, on their way: where they land, its index there,
    # and the width written then (what the width grew by since bounds what the heads grew by).
    exact: tuple[Landing, int, int] | None = None

    def landed(self) -> OwnPages:
        """Itself, its width made exact (to what evictions since may have added) if that has
        reached the host."""
        if self.exact is not None:
            landing, index, written = self.exact
            widths = landing.values()
            if widths is not None:
                self.width, self.exact = widths[index] + self.width - written, None
        return self


class HeadTables:
    """tables [rows, L, Hkv, W] int32: each head's pages, room for what it reads until the next
    eviction; lens [rows, L, Hkv] int32: the pairs each head held when the row was written. W
    grows to the widest row written."""

    def __init__(self, num_rows: int, cache: KVCache):
        shape, device = (num_rows, cache.num_layers, cache.num_kv_heads), cache.k.device
        self.tables = torch.zeros(*shape, 0, dtype=torch.int32, device=device)
        self.lens = torch.zeros(shape, dtype=torch.int32, device=device)

    @staticmethod
    def rows(owns: list[OwnPages], num_slots: list[int]) -> tuple[np.ndarray, int]:
        """The host's part of reading the rows of owns when their sequences hold num_slots: the
        rows and the pairs each head has taken since [2, S] (for gather), and the widest row's width."""
        owns = [own.landed() for own in owns]
        return (np.array([[own.row for own in owns], [n - own.slots for own, n in zip(owns, num_slots)]]),
                max(own.width for own in owns))

    def gather(self, rows: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows (HeadTables.rows, on the device) [S, L, Hkv, width] (a narrower row's extra
        columns name pages it never reads) and each head's pairs [S, L, Hkv]."""
        return self.tables[rows[0], :, :, :width], self.lens[rows[0]] + rows[1][:, None, None].to(torch.int32)

    def write(self, rows: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, owns: list[OwnPages] = (),
              widths: torch.Tensor | None = None) -> None:
        """Rows rows [S] (on the device) := tables [S, L, Hkv, w] and lens [S, L, Hkv] (int32); each
        of owns (theirs, on the host) gets width w, made exact by its entry of widths [S] (the
        device's, if given) once they land (unless an earlier eviction's have yet to: those first)."""
        w = tables.shape[-1]
        if w > self.tables.shape[-1]:
            grown = torch.zeros(*self.tables.shape[:3], max(w, 2 * self.tables.shape[-1]), dtype=torch.int32,
                                device=self.tables.device)
            grown[..., :self.tables.shape[-1]] = self.tables
            self.tables = grown
        self.tables[rows, :, :, :w] = tables
        self.lens[rows] = lens
        landing = None if widths is None else Landing(widths)
        for i, own in enumerate(owns):
            if landing is None or own.exact is None:
                own.exact = None if landing is None else (landing, i, w)
            own.width = w

    def keep_aside(self, own: OwnPages | None) -> None:
        """A copy of own's row, for while its sequence is swapped out and another may take the row
        (None: a sequence with no own pages)."""
        if own is not None:
            own.kept = self.tables[own.row, :, :, :own.width].clone(), self.lens[own.row].clone()

    def put_back(self, own: OwnPages | None, row: int, moved: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """own's row kept aside, written at row (its sequence's new block table's), its pages
        through moved (their blocks' new places); None: nothing to put back."""
        if own is None:
            return
        tables, lens = own.kept
        own.row, own.kept = row, None
        self.write(kernels.from_host(np.array([row]), self.lens.device), moved(tables)[None], lens[None], [own])
