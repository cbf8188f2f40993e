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
"""
from __future__ import annotations

from itertools import count


class PrefixCache:
    def __init__(self, block_size: int, root: tuple):
        self.block_size = block_size
        self.root = root                             # (model, KV-cache dtype)
        self.index: dict[tuple, tuple[int, int]] = {}   # (parent, tokens) -> (block, serial)
        self.keys: dict[int, tuple] = {}            # block -> its key
        self._serials = count()

    def holds(self, block: int) -> bool:
        return block in self.keys

    def match(self, token_ids: list[int], max_tokens: int) -> list[tuple[int, int]]:
        """(block, serial) of the longest run of cached full blocks that starts token_ids
        and covers at most max_tokens tokens."""
        hits, parent, bs = [], self.root, self.block_size
        for start in range(0, max_tokens - bs + 1, bs):
            entry = self.index.get((parent, tuple(token_ids[start:start + bs])))
            if entry is None:
                break
            hits.append(entry)
            parent = entry[1]
        return hits

    def add(self, serials: list[int], block_table: list[int], token_ids: list[int], num_computed: int) -> None:
        """Enter a sequence's full blocks computed since the last call; serials (the entries
        holding its full blocks so far) grows to match. A block another block already holds
        stays out: the sequence's next block gets that entry as its parent."""
        bs = self.block_size
        for i in range(len(serials), num_computed // bs):
            key = (serials[-1] if serials else self.root, tuple(token_ids[i * bs:(i + 1) * bs]))
            if key not in self.index:
                self.index[key] = (block_table[i], next(self._serials))
                self.keys[block_table[i]] = key
            serials.append(self.index[key][1])

    def forget(self, block: int) -> None:
        """The block is reclaimed for other contents."""
        del self.index[self.keys.pop(block)]
