"""Schedules: when a sequence evicts, how many pairs, and what it reserves.

A schedule never chooses *which* pairs go (that is the ranking's job,
rankings.py). Eviction always happens *before* a chunk is processed, so under
`prefill` and `decode` the cache never holds more than |kv| = `budget` pairs
per head, even for a moment. A schedule reads a sequence's counters only
(Progress), never the engine's Sequence itself.
"""
from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """The counters of a sequence a schedule reads (nanokv/engine/sequence.py keeps them)."""
    num_prompt_tokens: int
    num_tokens: int             # prompt and output so far
    num_computed_tokens: int    # run through the model
    num_uncomputed_tokens: int
    num_kv_slots: int           # KV pairs held per head
    max_slots: int              # the most tokens it will ever feed


class Schedule:
    """Never evicts: the full cache, and the base of the others."""
    name = "full"
    evicts_eagerly = False    # its algorithm evicts right after a chunk, not before the next

    def __init__(self, budget: int = 0, evict_every: int = 0):
        self.budget, self.evict_every = budget, evict_every

    def evict_count(self, seq: Progress) -> int:
        """KV pairs per head to drop before seq's next chunk."""
        return 0

    def early_count(self, seq: Progress) -> int:
        """KV pairs per head seq may drop now, before it must, to evict in the same step as
        others (EvictionSettings.evict_together)."""
        return 0

    def max_chunk(self, seq: Progress, slots: int) -> int:
        """The most tokens seq's next chunk may process, holding `slots` pairs after eviction."""
        return seq.num_uncomputed_tokens

    def reserve_slots(self, seq: Progress) -> int:
        """Slots to hold blocks for when seq is admitted (a full cache grows later as it decodes)."""
        return seq.num_tokens

    def steady_slots(self, seq: Progress) -> int:
        """Slots seq keeps blocks for after an eviction: the rest go back to the pool."""
        return seq.num_kv_slots

    def next_eviction(self, seq: Progress) -> int | None:
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

    def early_count(self, seq):
        """Decoding, down to what an eviction leaves: the next one then comes p tokens on, in
        step with those it joined. A prompt's chunks already end where it must evict."""
        return 0 if in_prompt(seq) else max(seq.num_kv_slots - (self.budget - self.evict_every), 0)

    def max_chunk(self, seq, slots):
        return min(seq.num_uncomputed_tokens, self.budget - slots)

    def steady_slots(self, seq):
        return min(self.budget, seq.max_slots)

    def reserve_slots(self, seq):
        return self.steady_slots(seq)

    def next_eviction(self, seq):
        return seq.num_computed_tokens + self.budget - seq.num_kv_slots


def in_prompt(seq: Progress) -> bool:
    return seq.num_computed_tokens < seq.num_prompt_tokens


def prompt_just_ended(seq: Progress) -> bool:
    return seq.num_computed_tokens == seq.num_prompt_tokens


class PromptFirst(Prefill):
    """A schedule that reads the whole prompt with a full cache before it evicts."""

    def max_chunk(self, seq, slots):
        if in_prompt(seq):   # a chunk never runs past the prompt (also when recomputing)
            return seq.num_prompt_tokens - seq.num_computed_tokens
        return super().max_chunk(seq, slots)

    def reserve_slots(self, seq):
        return max(seq.num_prompt_tokens, self.steady_slots(seq))


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
        prompt = seq.num_prompt_tokens
        if in_prompt(seq) and prompt > self.budget - self.evict_every:
            return prompt
        return super().next_eviction(seq)


class Once(PromptFirst):
    """A full prefill, one compression to |kv|, then no more eviction: the cache grows
    while decoding (SnapKV's setting). Admission reserves the prompt, then |kv| plus
    the tokens it will feed."""
    name = "once"

    early_count = Schedule.early_count   # it evicts once, when the prompt ends

    def evict_count(self, seq):
        return max(seq.num_kv_slots - self.budget, 0) if prompt_just_ended(seq) else 0

    def max_chunk(self, seq, slots):
        if in_prompt(seq):
            return super().max_chunk(seq, slots)
        return seq.num_uncomputed_tokens

    def steady_slots(self, seq):
        prompt = seq.num_prompt_tokens
        return min(self.budget, prompt) + seq.max_slots - prompt

    def next_eviction(self, seq):
        prompt = seq.num_prompt_tokens
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
    early_count = Schedule.early_count   # its evictions keep one pair: none joins another's

    def evict_count(self, seq):
        if not in_prompt(seq) and (prompt_just_ended(seq) or seq.num_kv_slots >= self.budget):
            return seq.num_kv_slots - 1
        return 0

    def next_eviction(self, seq):
        return seq.num_prompt_tokens if in_prompt(seq) else super().next_eviction(seq)


SCHEDULES = {s.name: s for s in (Prefill, Decode, Once)}
