"""The prefix cache: which blocks hold which full blocks of earlier sequences.

A full block is identified by its tokens and everything before them: its key is
(parent, tokens), the parent being the entry of the block before it, or for a
sequence's first block the root, what else shapes the contents (the model and
the KV-cache dtype). Python's dict hashes the key, chained block to block
through the parent, and compares it exactly on a hit: the tokens and the
parent's identity, so a collision can never serve wrong K/V. Each entry has a
serial number that is never reused: when a block is reclaimed, the entries that
named it as their parent can no longer be reached, even once its id holds
other tokens. Like BlockManager, it only keeps books: it never touches tensors.

A block enters when the step that fills it is scheduled (pending until the step
has run), so a sequence that shares it can be admitted in that same step: every
layer stores the step's K/V before it attends. A copy, made before the step,
takes computed blocks only.

With a host tier, an entry whose device block is reclaimed moves to a host block
(spill, the block manager copies it) instead of being forgotten, and comes back
to a device block on a hit (restore); the chain of serials is unchanged, so the
blocks after it stay reachable.
"""
from __future__ import annotations

from itertools import count
from typing import NamedTuple


class Hit(NamedTuple):
    block: int     # a device block, or a host block if on_host
    serial: int
    on_host: bool


class PrefixCache:
    def __init__(self, block_size: int, root: tuple):
        self.block_size = block_size
        self.root = root                             # (model, KV-cache dtype)
        self.index: dict[tuple, Hit] = {}            # (parent, tokens) -> where its block is
        self.keys: dict[int, tuple] = {}            # device block -> its key
        self.host_keys: dict[int, tuple] = {}       # host block -> its key
        self.pending: set[int] = set()               # entered, filled by the step being scheduled
        self._serials = count()

    def holds(self, block: int) -> bool:
        return block in self.keys

    def holds_host(self, block: int) -> bool:
        return block in self.host_keys

    def match(self, token_ids: list[int], max_tokens: int, computed: bool = False) -> list[Hit]:
        """The longest run of cached full blocks that starts token_ids and covers at most
        max_tokens tokens; computed: none still pending."""
        hits, parent, bs = [], self.root, self.block_size
        for start in range(0, max_tokens - bs + 1, bs):
            entry = self.index.get((parent, tuple(token_ids[start:start + bs])))
            if entry is None or (computed and not entry.on_host and entry.block in self.pending):
                break
            hits.append(entry)
            parent = entry.serial
        return hits

    def add(self, serials: list[int], block_table: list[int], token_ids: list[int], num_computed: int) -> None:
        """Enter the full blocks of a sequence that will have num_computed tokens computed;
        serials (the entries holding its full blocks so far) grows to match. A block whose
        tokens another block holds already stays out: the sequence's next block gets that
        entry as its parent."""
        bs = self.block_size
        for i in range(len(serials), num_computed // bs):
            key = (serials[-1] if serials else self.root, tuple(token_ids[i * bs:(i + 1) * bs]))
            if key not in self.index:
                self.index[key] = Hit(block_table[i], next(self._serials), False)
                self.keys[block_table[i]] = key
                self.pending.add(block_table[i])
            serials.append(self.index[key].serial)

    def forget(self, block: int) -> None:
        """The block is reclaimed for other contents (or was never filled: a failed step)."""
        del self.index[self.keys.pop(block)]

    def forget_host(self, block: int) -> None:
        """The host block is reclaimed for other contents."""
        del self.index[self.host_keys.pop(block)]

    def spill(self, block: int, host_block: int) -> None:
        """The device block is reclaimed; its contents are copied to host_block, where the entry now is."""
        key = self.keys.pop(block)
        self.index[key] = Hit(host_block, self.index[key].serial, True)
        self.host_keys[host_block] = key

    def restore(self, host_block: int, block: int) -> None:
        """The entry comes back from host_block to the device block, copied before the step:
        pending until then."""
        key = self.host_keys.pop(host_block)
        self.index[key] = Hit(block, self.index[key].serial, False)
        self.keys[block] = key
        self.pending.add(block)

    def commit(self) -> None:
        """The scheduled step ran: its blocks hold what their keys say."""
        self.pending.clear()

    def forget_pending(self) -> None:
        """The scheduled step did not run: its blocks hold nothing."""
        for block in self.pending:
            self.forget(block)
        self.pending.clear()
