"""Which sequences run in the next step, and how many tokens each.

Continuous batching: sequences join and leave the running set every step.
Each step fills a token budget: first one token per decoding sequence, then
chunks of unfinished prompts, then newly admitted prompts. A sequence is
admitted only when the pool has blocks for its whole prompt; when a decoding
sequence needs a block and none is free, the most recently admitted sequence
is preempted: its blocks are freed and it goes back to the front of the
waiting queue, to be recomputed from its tokens when there is room.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from nanokv.config import EngineConfig
from nanokv.kv_cache import BlockManager
from nanokv.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]   # tokens each sequence runs this step

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, eos_token_ids: set[int]):
        self.config = config
        self.blocks = blocks
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # in admission order: the last is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        budget = self.config.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != Status.RUNNING:   # preempted earlier in this loop
                continue
            if seq.num_uncomputed_tokens == 1 and not self._make_room_for_next_token(seq):
                continue                       # seq itself was preempted
            n = min(seq.num_uncomputed_tokens, budget)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            needed = self.blocks.blocks_for(seq.num_tokens)
            if not self.blocks.can_allocate(needed):
                break
            self.waiting.popleft()
            seq.block_table = self.blocks.allocate(needed)
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _make_room_for_next_token(self, seq: Sequence) -> bool:
        """Give seq a block for its next slot if it needs one, preempting newer sequences
        if the pool is empty. False if seq itself had to be preempted."""
        if seq.num_computed_tokens < len(seq.block_table) * self.blocks.block_size:
            return True
        while not self.blocks.can_allocate(1):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        seq.block_table += self.blocks.allocate(1)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, batch: ScheduledBatch, sampled: dict[int, int]) -> None:
        """Record the step: tokens computed, tokens sampled (seq_id -> token), finished sequences."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            token = sampled.get(seq.seq_id)
            if token is None:
                continue
            seq.output_token_ids.append(token)
            p = seq.params
            if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
                self.finish(seq, "stop")
            elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
                self.finish(seq, "length")

    def finish(self, seq: Sequence, reason: str) -> None:
        """End seq (also from outside: stop strings, abort) and return its blocks."""
        if seq.is_finished:
            return
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
            self.blocks.free(seq.block_table)
        else:
            self.waiting.remove(seq)
        seq.block_table = []
        seq.status = Status.FINISHED
        seq.finish_reason = reason
