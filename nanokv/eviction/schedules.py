"""Schedules: when a sequence evicts, how many pairs, and what it reserves.

A schedule never chooses *which* pairs go (that is the ranking's job,
nanokv/eviction/rankings.py). Eviction always happens *before* a chunk is
processed, so under `prefill` and `decode` the cache never holds more than
|kv| = `budget` pairs per head, even for a moment.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanokv.sequence import Sequence


class Schedule:
    """Never evicts: the full cache, and the base of the others."""
    name = "full"
    evicts_eagerly = False    # its algorithm evicts right after a chunk, not before the next

    def __init__(self, budget: int = 0, evict_every: int = 0):
        self.budget, self.evict_every = budget, evict_every

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

    def next_eviction(self, seq: Sequence) -> int | None:
        """The position before which seq evicts next (None: never), seen from its next chunk,
        its pending eviction already applied: where a windowed ranking's window ends, and
        how far a fresh sequence may reuse cached blocks."""
        return None


class Prefill(Schedule):
    """Algorithm 1 of Batch-Max: the prompt is read in chunks; whenever a head holds
    |kv| pairs, p go before the next chunk; the same while decoding. Admission
    reserves |kv| pairs, not the prompt."""
    name = "prefill"

    def evict_count(self, seq):
        return self.evict_every if seq.num_kv_slots >= self.budget else 0

    def max_chunk(self, seq, slots):
        return min(seq.num_uncomputed_tokens, self.budget - slots)

    def steady_slots(self, seq):
        return min(self.budget, seq.max_slots)

    def reserve_slots(self, seq):
        return self.steady_slots(seq)

    def next_eviction(self, seq):
        return seq.num_computed_tokens + self.budget - seq.num_kv_slots


def in_prompt(seq: Sequence) -> bool:
    return seq.num_computed_tokens < len(seq.prompt_token_ids)


def prompt_just_ended(seq: Sequence) -> bool:
    return seq.num_computed_tokens == len(seq.prompt_token_ids)


class PromptFirst(Prefill):
    """A schedule that reads the whole prompt with a full cache before it evicts."""

    def max_chunk(self, seq, slots):
        if in_prompt(seq):   # a chunk never runs past the prompt (also when recomputing)
            return len(seq.prompt_token_ids) - seq.num_computed_tokens
        return super().max_chunk(seq, slots)

    def reserve_slots(self, seq):
        return max(len(seq.prompt_token_ids), self.steady_slots(seq))


class Decode(PromptFirst):
    """The paper's decoding-only compression: a full prefill, one eviction down to
    |kv| - p, then decoding exactly as `prefill`."""
    name = "decode"

    def evict_count(self, seq):
        if in_prompt(seq):
            return 0
        if prompt_just_ended(seq):
            return max(seq.num_kv_slots - (self.budget - self.evict_every), 0)
        return super().evict_count(seq)

    def next_eviction(self, seq):
        prompt = len(seq.prompt_token_ids)
        if in_prompt(seq) and prompt > self.budget - self.evict_every:
            return prompt
        return super().next_eviction(seq)


class Once(PromptFirst):
    """A full prefill, one compression to |kv|, then no more eviction: the cache grows
    while decoding (SnapKV's setting). Admission reserves the prompt, then |kv| plus
    the tokens it will feed."""
    name = "once"

    def evict_count(self, seq):
        return max(seq.num_kv_slots - self.budget, 0) if prompt_just_ended(seq) else 0

    def max_chunk(self, seq, slots):
        if in_prompt(seq):
            return super().max_chunk(seq, slots)
        return seq.num_uncomputed_tokens

    def steady_slots(self, seq):
        prompt = len(seq.prompt_token_ids)
        return min(self.budget, prompt) + seq.max_slots - prompt

    def next_eviction(self, seq):
        prompt = len(seq.prompt_token_ids)
        return prompt if in_prompt(seq) and prompt > self.budget else None


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

    def evict_count(self, seq):
        if not in_prompt(seq) and (prompt_just_ended(seq) or seq.num_kv_slots >= self.budget):
            return seq.num_kv_slots - 1
        return 0

    def next_eviction(self, seq):
        return len(seq.prompt_token_ids) if in_prompt(seq) else super().next_eviction(seq)


SCHEDULES = {s.name: s for s in (Prefill, Decode, Once)}
