"""KV-cache eviction methods: when a sequence evicts, how many pairs, and which.

A method is a schedule plus a ranking, nothing else: the scheduler asks the
schedule how many pairs to drop before a sequence's next chunk and how long
that chunk may be; the runner asks the ranking which pairs each (layer, KV
head) keeps, then compacts the survivors (kernels/compact.py). Kernels never
know which method runs. Another rule (SnapKV, H2O, TOVA, StreamingLLM) is a
new subclass.

Every method keeps at most |kv| = `budget` pairs per KV head once the prompt
has been read, so a sequence needs blocks for |kv| pairs, not for its length.
Eviction always happens *before* a chunk is processed, so the cache never
holds more than |kv| pairs, even for a moment.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nanokv.sequence import Sequence

METHODS = ("full", "batchmax", "decode_only", "ed")


class KVMethod:
    """Full cache: never evicts. The base of the others."""
    name = "full"
    needs_scores = False      # whether attention must accumulate per-slot scores for it
    evicts_eagerly = False    # its algorithm evicts right after a chunk, not before the next

    def evict_count(self, seq: Sequence) -> int:
        """KV pairs per head to drop before seq's next chunk."""
        return 0

    def max_chunk(self, seq: Sequence, slots: int) -> int:
        """The most tokens seq's next chunk may process, holding `slots` pairs after eviction."""
        return seq.num_uncomputed_tokens

    def reserve_slots(self, seq: Sequence) -> int:
        """Slots to hold blocks for when seq is admitted (a full cache grows later as it decodes)."""
        return seq.num_tokens

    def steady_slots(self, seq: Sequence) -> int:
        """Slots seq keeps blocks for after an eviction: the rest go back to the pool."""
        return seq.num_kv_slots

    def keep_priority(self, scores: torch.Tensor, positions: torch.Tensor, current: int) -> torch.Tensor:
        raise NotImplementedError(f"{self.name} never evicts")


class Budgeted(KVMethod):
    """A method with a budget |kv| of pairs per KV head."""

    def __init__(self, budget: int, evict_every: int):
        self.budget, self.evict_every = budget, evict_every

    def steady_slots(self, seq: Sequence) -> int:
        return min(self.budget, seq.max_slots)

    def reserve_slots(self, seq: Sequence) -> int:
        return self.steady_slots(seq)

    def max_chunk(self, seq: Sequence, slots: int) -> int:
        return min(seq.num_uncomputed_tokens, self.budget - slots)


class BatchMax(Budgeted):
    """Algorithm 1 of Batch-Max: the prompt is read in blocks; whenever a head
    holds |kv| pairs, the p with the least average attention go."""
    name = "batchmax"
    needs_scores = True

    def evict_count(self, seq: Sequence) -> int:
        return self.evict_every if seq.num_kv_slots >= self.budget else 0

    def keep_priority(self, scores, positions, current):
        """Section 3.2: average attention, the summed probabilities over the number of
        queries that could see the key (current + 1 - its position)."""
        return scores / (current + 1 - positions).float()


class PromptFirst(Budgeted):
    """A method that reads the whole prompt with a full cache before it evicts."""

    def in_prompt(self, seq: Sequence) -> bool:
        return seq.num_computed_tokens < len(seq.prompt_token_ids)

    def max_chunk(self, seq: Sequence, slots: int) -> int:
        if self.in_prompt(seq):   # a chunk never runs past the prompt (also when recomputing)
            return len(seq.prompt_token_ids) - seq.num_computed_tokens
        return super().max_chunk(seq, slots)

    def reserve_slots(self, seq: Sequence) -> int:
        return max(len(seq.prompt_token_ids), self.steady_slots(seq))


class DecodeOnly(PromptFirst, BatchMax):
    """The paper's decoding-only compression: a full prefill, one eviction down to
    |kv| - p by the average-attention rule, then decoding exactly as Batch-Max."""
    name = "decode_only"

    def evict_count(self, seq: Sequence) -> int:
        if self.in_prompt(seq):
            return 0
        if seq.num_computed_tokens == len(seq.prompt_token_ids):   # the prompt just ended
            return max(seq.num_kv_slots - (self.budget - self.evict_every), 0)
        return super().evict_count(seq)


class ExtremeDecoding(PromptFirst):
    """Algorithm 2 (ED): a full prefill, then only the most recent pair is kept,
    again whenever the cache reaches |kv|. With |kv| = 2 it is the fastest any
    decoding-only method can be: the throughput upper bound Batch-Max is
    compared with.

    Algorithm 2 evicts right after the token that fills the cache; the engine
    does it before the next chunk, which attends to exactly the same pairs.
    Only the final cache differs, and kept_positions applies the pending
    eviction (evicts_eagerly)."""
    name = "ed"
    evicts_eagerly = True

    def evict_count(self, seq: Sequence) -> int:
        prompt_ended = seq.num_computed_tokens == len(seq.prompt_token_ids)
        if not self.in_prompt(seq) and (prompt_ended or seq.num_kv_slots >= self.budget):
            return seq.num_kv_slots - 1
        return 0

    def keep_priority(self, scores, positions, current):
        return positions.float()


def make_method(name: str, budget: int, evict_every: int, block_size: int) -> KVMethod:
    """The method for a request, or a ValueError naming what is wrong with its settings."""
    if name not in METHODS:
        raise ValueError(f"unknown kv_method {name!r}; use one of {', '.join(METHODS)}")
    if name == "full":
        return KVMethod()
    if not isinstance(budget, int) or not isinstance(evict_every, int) or evict_every < 1:
        raise ValueError(f"kv_budget and evict_every must be integers (evict_every >= 1), "
                         f"got {budget!r} and {evict_every!r}")
    if name == "ed":
        if budget < 2:
            raise ValueError(f"kv_budget for ed must be >= 2, got {budget}")
        return ExtremeDecoding(budget, evict_every)
    if budget < 2 * evict_every or budget % block_size:
        raise ValueError(f"kv_budget for {name} must be at least 2 * evict_every = {2 * evict_every} and a "
                         f"multiple of the block size {block_size}, got {budget}")
    return (BatchMax if name == "batchmax" else DecodeOnly)(budget, evict_every)
