"""Which sequences run in the next step, how many tokens each, and who evicts.

Continuous batching: sequences join and leave the running set every step. A step is
scheduled before the tokens of the one before it are read (LLM.step): a sequence's last
token may be pending, on the device; it is counted, its value read later (advance, then
record). Each step fills a token budget: first the running sequences (one token per decoding
sequence, or the next chunk of an unfinished prompt), then newly admitted prompts. A
decoding sequence is planned in full once for the steps until its next eviction, block or
last token: those are one token each (Scheduler._plain_until). Admission reserves blocks for
what a sequence can hold at its peak: its prompt with a full cache, only its budget |kv|
when it evicts as it reads the prompt (nanokv/eviction/). A decoding sequence that evicts
together evicts early in a step where another of its method must (KVMethod.cohort): each
step of evictions costs the same launches, so the fewer the better. When a sequence needs a
block and none is free, the most recently admitted sequence is preempted: its blocks are
freed and it goes back to the front of the waiting queue. With a host tier (preemption_mode
"swap", or "auto" where moving its blocks is quicker than recomputing its tokens:
offload_costs.py), its blocks are first copied there, as they are, and copied back when it
is admitted again; otherwise (or with no room there) it is recomputed from its tokens. With
decode_from_host, a short pool first moves the full blocks of the oldest running sequences
that never evict to the host tier, and they decode on from there (models/host_stream.py).

Prefix caching (prefix_cache.py): a sequence is admitted with the
longest run of cached full blocks that starts its tokens already computed, as
far as its method allows (KVMethod.reusable_tokens). A sequence that never
evicts shares those blocks, and enters its own full blocks into the cache in
the step that fills them (or, filled by a sampled token, once the token is
read); one that evicts writes into its blocks (compaction, scores), so it takes
a copy of computed ones and enters nothing. A block is written once, by the
sequence that fills it: a shared block is never modified.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanokv.config import EngineConfig
from nanokv.engine.block_manager import BlockManager
from nanokv.engine.block_table import OFFLOADED, BlockTables
from nanokv.engine.offload_costs import SwapCost
from nanokv.engine.prefix_cache import Hit
from nanokv.engine.sampler import FAILED
from nanokv.engine.sequence import Sequence, Status, Swap


@dataclass
class Eviction:
    """Before this step's forward pass, seq drops num_evicted of its num_slots pairs per head;
    after the step it gives back its blocks beyond the first num_blocks_kept."""
    seq: Sequence
    num_evicted: int
    num_slots: int
    num_blocks_kept: int


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)   # tokens each sequence runs this step
    evictions: list[Eviction] = field(default_factory=list)
    # Block copies before the step, in this order: to the host tier (device block, host block),
    # from it (host block, device block), then cached blocks into sequences' own.
    saves: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swapped_out: list[Sequence] = field(default_factory=list)   # their own page tables are kept aside
    resumed: list[Swap] = field(default_factory=list)   # swapped back in: their own page tables follow
    preempted: set[int] = field(default_factory=set)    # seq ids: none is admitted again in the same step
    planned_in_full: list[int] = field(default_factory=list)   # of seqs, those not planned ahead (_plain_until)

    def __len__(self) -> int:
        return len(self.seqs)

    def save(self, pairs: list[tuple[int, int]]) -> None:
        """Queue copies of a sequence's device blocks to the host tier. The runner makes every
        save before any load or copy, so a block this step fills must not be saved in it: the
        save would read what was there before."""
        filled = {device for _, device in self.loads} | {device for _, device in self.copies}
        assert not filled.intersection(device for device, _ in pairs), "a step saves a block it fills first"
        self.saves += pairs


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, eos_token_ids: set[int],
                 swap_cost: SwapCost | None = None, num_staging: int = 0):
        """swap_cost: what preemption_mode "auto" weighs; num_staging: how many offloaded blocks a
        step can stage (decode_from_host)."""
        self.config, self.swap_cost, self.num_staging = config, swap_cost, num_staging
        self.blocks = blocks
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # in admission order: the last is preempted first
        self.block_tables = BlockTables(config.max_num_seqs, blocks.blocks_for(config.max_model_len))
        self.num_preemptions = 0
        self.num_swaps = 0                  # preemptions that swapped (the others recomputed)
        self.num_offloaded = 0              # blocks of running sequences moved to the host tier (decode_from_host)
        self.host_copies = [0, 0]           # blocks copied to the host tier and back from it
        self.host_hits = 0                  # cached blocks found in the host tier

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        running = Status.RUNNING   # an enum's member is slow to look up
        evicting = self._evicting_cohorts()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not running:   # preempted earlier in this loop
                continue
            joining = bool(evicting) and seq.method.together and seq.method.cohort in evicting   # (mostly empty)
            if seq.num_tokens <= seq.plain_until and not joining:   # one decoded token, planned ahead (_plain_until)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(1)
                budget -= 1
            else:
                budget -= self._plan(seq, budget, batch, joining)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # preempted in this step, or with a token still pending (its tokens are not all known)
            room = None if seq.seq_id in batch.preempted or seq.num_pending else self._room_for(seq, budget)
            if room is None:
                break
            self.waiting.popleft()
            self._admit(seq, *room, batch)
            self.running.append(seq)
            budget -= self._plan(seq, budget, batch)
        # Blocks to copy were held so that no allocation above reclaimed them; none happens
        # between here and the runner's copy at the start of the step.
        self.blocks.free([cached for cached, _ in batch.copies])
        self.blocks.release_host([host for host, _ in batch.loads])
        batch.saves += self.blocks.take_spills()
        self.host_copies[0] += len(batch.saves)
        self.host_copies[1] += len(batch.loads)
        return batch

    def _evicting_cohorts(self) -> set[tuple]:
        """The cohorts (KVMethod.cohort) of which a decoding sequence must evict before its next
        step, when some sequence would join them (evict_together). Not a prompt's evictions: one
        read in chunks evicts at every chunk, and those joining would evict at every step."""
        if not any(seq.method.together for seq in self.running):
            return set()
        return {seq.method.cohort for seq in self.running
                if seq.num_computed_tokens >= seq.num_prompt_tokens and seq.method.schedule.evict_count(seq)}

    def _room_for(self, seq: Sequence, budget: int) -> tuple[list[Hit], int] | None:
        """The cached blocks seq starts with and the number of blocks to allocate for it; None
        if the pool cannot take it now. A cached block no one holds counts as free until seq
        takes it; one that copies holds its sources while its own blocks are allocated, so it
        copies fewer rather than wait. A block cached in the host tier takes a device block.
        A sequence swapped out comes back when the pool also has what _plan will then ask for
        its next step (of at most budget tokens), so it is never preempted by its own step."""
        if seq.swapped is not None:
            needed = max(len(seq.swapped.host), self.blocks.blocks_for(seq.method.schedule.reserve_slots(seq)))
            *_, room = self._step_room(seq, budget, held=needed)
            step = self.blocks.blocks_for(room)
            return ([], needed) if self.blocks.can_allocate(max(needed, step)) else None
        hits = self._cached_prefix(seq)
        shares = seq.method.shares_blocks
        shared = sum(not hit.on_host for hit in hits) if shares else 0
        needed = self.blocks.blocks_for(seq.method.schedule.reserve_slots(seq)) - shared
        taken = sum(self._unheld(hit) for hit in hits)
        while hits and not shares and not self.blocks.can_allocate(needed + taken):
            taken -= self._unheld(hits.pop())
        return (hits, needed) if self.blocks.can_allocate(needed + taken) else None

    def _unheld(self, hit: Hit) -> bool:
        """A cached device block no one holds: free to allocate until a sequence takes it."""
        return not hit.on_host and self.blocks.ref_counts[hit.block] == 0

    def _cached_prefix(self, seq: Sequence) -> list[Hit]:
        """The cached blocks seq may start with. At least one token is left to compute (its
        logits are sampled from); with prompt_logprobs, every position."""
        if self.blocks.cache is None or seq.prompt_logprobs is not None:
            return []
        limit = min(seq.method.reusable_tokens(seq), seq.num_tokens - 1)
        return self.blocks.cache.match(seq.token_ids, limit, computed=not seq.method.shares_blocks)

    def _admit(self, seq: Sequence, hits: list[Hit], needed: int, batch: ScheduledBatch) -> None:
        seq.status, seq.num_kept_inputs = Status.RUNNING, 0   # layer inputs are kept by block table row
        seq.plain_until = -1   # planned in full until its first decode: it may have been preempted since
        if seq.swapped is not None:   # as it was: the runner copies its blocks back before the step
            own = self.blocks.allocate(needed)
            seq.block_table = self.block_tables.new(own)
            out, seq.swapped = seq.swapped, None
            batch.loads += zip(out.host, own)
            batch.resumed.append(Swap(seq, out.host, own[:len(out.host)], out.device))
            return
        on_host = [hit.block for hit in hits if hit.on_host]
        self.blocks.hold_host(on_host)
        self.host_hits += len(on_host)
        self.blocks.share([hit.block for hit in hits if not hit.on_host])
        own = self.blocks.allocate(needed)
        if seq.method.shares_blocks:   # a cached block in the host tier comes back into one of its own
            fresh, table = iter(own), []
            for hit in hits:
                table.append(next(fresh) if hit.on_host else hit.block)
                if hit.on_host:
                    batch.loads.append((hit.block, table[-1]))
                    self.blocks.cache.restore(hit.block, table[-1])
            seq.block_table = self.block_tables.new(table + list(fresh))
            seq.prefix_serials = [hit.serial for hit in hits]
        else:   # a copy of its own, made by the runner
            seq.block_table = self.block_tables.new(own)
            for hit, block in zip(hits, own):
                (batch.loads if hit.on_host else batch.copies).append((hit.block, block))
        seq.num_computed_tokens = seq.num_kv_slots = len(hits) * self.blocks.block_size
        seq.num_cached_tokens = min(seq.num_computed_tokens, len(seq.prompt_token_ids))

    def _step_room(self, seq: Sequence, budget: int, held: int | None = None,
                   joining: bool = False) -> tuple[int, int, int, int, int]:
        """What seq's next step of at most budget tokens takes, holding `held` blocks (None: its
        block table's), joining others' eviction or not: the one count admission and planning
        share. (evict, slots, n, kept, room): the eviction before it, the slots left after that,
        the tokens it runs, the blocks it keeps after an eviction and the slots it needs blocks
        for. A plain tuple: this runs for every sequence at every step, where building a
        NamedTuple costs about as much as the count itself."""
        schedule = seq.method.schedule
        evict = schedule.evict_count(seq) or (schedule.early_count(seq) if joining else 0)
        slots = seq.num_kv_slots - evict
        n = min(budget, schedule.max_chunk(seq, slots))
        room = slots + n
        if not evict:
            return 0, slots, n, 0, room   # kept: what an eviction leaves, and none comes
        # What it keeps after an eviction: the chunk's slots, and at least its steady size.
        kept = self.blocks.blocks_for(max(room, schedule.steady_slots(seq)))
        if seq.method.uneven and self.config.tensor_parallel_size > 1:
            # Split over ranks, one rank's heads may keep every page they hold and still need their
            # room for new pairs (evict.py, _choose_pages): the blocks it holds and that room.
            held = len(seq.block_table) if held is None else held
            room = max(room, min((held + kept - slots // self.blocks.block_size) * self.blocks.block_size,
                                 self.config.max_model_len))
        return evict, slots, n, kept, room

    def _plan(self, seq: Sequence, budget: int, batch: ScheduledBatch, joining: bool = False) -> int:
        """Plan seq's next chunk in full (a decode planned ahead, schedule puts in the batch itself):
        put it, and the eviction before it or one it joins, in the batch; returns its length, 0 if
        seq had to be preempted for lack of blocks or its pending token is its last."""
        if seq.num_tokens > seq.max_slots:   # max_tokens or max_model_len reached: its pending token is its last
            return 0
        evict, slots, n, kept, room = self._step_room(seq, budget, joining=joining)
        if not self._make_room(seq, room, batch):
            return 0
        if evict:
            batch.evictions.append(Eviction(seq, evict, seq.num_kv_slots, kept))
            seq.num_kv_slots = slots   # the runner compacts before the forward pass
        else:
            seq.plain_until = self._plain_until(seq, n)
        batch.planned_in_full.append(len(batch.seqs))
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        if self.blocks.cache is not None:
            self._enter_full_blocks(seq, min(seq.num_computed_tokens + n, seq.num_tokens - seq.num_pending))
        return n

    def _plain_until(self, seq: Sequence, n: int) -> int:
        """The token count up to which seq's steps are each one decoded token that needs no
        eviction, no block and is not its last, as its step of n tokens now is (-1 if it is not):
        its tokens, computed tokens and pairs held grow by one a step, so its schedule's next
        eviction, its blocks' slots and max_slots bound how far. A step after that (or one it
        joins others' eviction in) is planned in full."""
        if n != 1 or seq.num_uncomputed_tokens != 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
            return -1
        ahead = min(len(seq.block_table.ids) * self.blocks.block_size - seq.num_kv_slots - 1,
                    seq.max_slots - seq.num_tokens)
        end = seq.method.schedule.next_eviction(seq)
        if end is not None:
            ahead = min(ahead, end - seq.num_computed_tokens - 1)
        return seq.num_tokens + ahead

    def _enter_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Enter seq's full blocks of its first num_tokens tokens, known and computed by the step
        launched last, into the prefix cache (a block its pending token fills: when it is read)."""
        if num_tokens // self.blocks.block_size > len(seq.prefix_serials) and seq.method.shares_blocks:
            self.blocks.cache.add(seq.prefix_serials, seq.block_table.ids, seq.token_ids, num_tokens)

    def _make_room(self, seq: Sequence, num_slots: int, batch: ScheduledBatch) -> bool:
        """Give seq blocks for num_slots slots, preempting newer sequences if the pool is
        empty. False if seq itself had to be preempted."""
        missing = self.blocks.blocks_for(num_slots) - len(seq.block_table.ids)
        if missing <= 0:
            return True
        while not self.blocks.can_allocate(missing):
            if self.config.decode_from_host and self._offload_oldest(batch):
                continue
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        seq.block_table.extend(self.blocks.allocate(missing))
        return True

    def _offload_oldest(self, batch: ScheduledBatch) -> bool:
        """Move the full blocks of the oldest decoding sequence that never evicts and still has
        some on the device to the host tier, as many as it and the staging have room for; it decodes on from
        there (the runner streams them back, layer by layer). False if none could move."""
        staged = sum(len(seq.offloaded) for seq in self.running)
        room = min(self.blocks.num_host_free, self.num_staging - staged)
        loading = {swap.seq for swap in batch.resumed}   # its blocks fill only after the step's saves
        for seq in self.running:
            full = min(seq.num_kv_slots // self.blocks.block_size, len(seq.offloaded) + room)
            if seq.method.shares_blocks and seq.num_computed_tokens >= seq.num_prompt_tokens \
                    and full > len(seq.offloaded) and seq not in loading:
                device = seq.block_table.offload(full)
                host = self.blocks.allocate_host(len(device))
                batch.save(list(zip(device, host)))
                seq.offloaded += host
                self.blocks.free(device)
                self.num_offloaded += len(device)
                return True
        return False

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Take seq out of the running set: its blocks go to the host tier when it swaps and
        there is room, else it will be recomputed. Admission reserved its peak, so seq was
        admitted in an earlier step: its blocks hold its K/V."""
        self.running.remove(seq)
        blocks = self.block_tables.release(seq.block_table)   # the blocks after those offloaded
        if self._swaps(seq, len(blocks)):
            host = self.blocks.allocate_host(len(blocks))
            seq.swapped = Swap(seq, seq.offloaded + host, [OFFLOADED] * len(seq.offloaded) + blocks)
            batch.save(list(zip(blocks, host)))
            batch.swapped_out.append(seq)
            self.num_swaps += 1
        else:
            self.blocks.release_host(seq.offloaded)
            seq.prefix_serials, seq.own_pages = [], None
            seq.num_computed_tokens = seq.num_kv_slots = 0
        seq.offloaded = []
        self.blocks.free(blocks)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        batch.preempted.add(seq.seq_id)
        self.num_preemptions += 1

    def _swaps(self, seq: Sequence, num_blocks: int) -> bool:
        mode = self.config.preemption_mode
        return mode != "recompute" and num_blocks <= self.blocks.num_host_free and (
            mode == "swap" or self.swap_cost.pays(num_blocks, seq.num_computed_tokens))

    def advance(self, batch: ScheduledBatch, sampled: list[Sequence]) -> None:
        """Record the step just launched: tokens computed, blocks emptied by eviction, and a
        token pending for each sequence in sampled (its value is read a step later: record)."""
        if self.blocks.cache is not None:
            self.blocks.cache.commit()   # the blocks the step fills are computed before any later step reads them
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            seq.num_kv_slots += n
        for eviction in batch.evictions:   # compacted: the blocks beyond those it keeps go back
            self.blocks.free(eviction.seq.block_table.cut(eviction.num_blocks_kept))
        for seq in sampled:
            seq.num_pending += 1

    def record(self, sampled: list[Sequence], tokens: list[int]) -> list[tuple[Sequence, str]]:
        """The pending tokens of a step, read: each becomes its sequence's next output token,
        unless the sequence finished since (a stop seen a step later, an abort), then it is
        dropped. Returns the sequences now done, with why; the caller finishes them."""
        done, cache, running = [], self.blocks.cache, Status.RUNNING   # an enum's member is slow to look up
        for seq, token in zip(sampled, tokens):
            seq.num_pending -= 1
            if seq.is_finished or token == FAILED:   # a row that failed: the caller ends it
                continue
            outputs = seq.output_token_ids
            outputs.append(token)
            if cache is not None and seq.status is running:
                self._enter_full_blocks(seq, seq.num_computed_tokens)
            p, grammar = seq.params, seq.grammar
            if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids \
                    or (grammar is not None and grammar.take(token, len(outputs) - 1)):
                done.append((seq, "stop"))   # (a grammar that takes no more: its match is complete)
            elif seq.num_prompt_tokens + len(outputs) > seq.max_slots:   # max_tokens or max_model_len reached
                done.append((seq, "length"))
        if cache is not None:
            cache.commit()   # what was entered here is computed: its step was launched
        return done

    def finish(self, seq: Sequence, reason: str) -> None:
        """End seq (when done, on a stop string, on abort) and return its blocks."""
        if seq.is_finished:
            return
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
            self.blocks.free(self.block_tables.release(seq.block_table))
            self.blocks.release_host(seq.offloaded)
            seq.offloaded = []
        else:
            self.waiting.remove(seq)
            if seq.swapped is not None:
                self.blocks.release_host(seq.swapped.host)
                seq.swapped = None
        seq.status = Status.FINISHED
        seq.finish_reason = reason
