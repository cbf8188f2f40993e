"""Runs one scheduled batch through the model: flat tensors in, sampled tokens out.

This is the one place where attention metadata is built. It also owns the model,
the KV cache tensors, the host tier (host_tier.py), the sampler and the eviction surgery
(evict.py), and runs the profiling passes the pool is sized by (memory.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from itertools import accumulate, chain

import numpy as np
import torch

import kernels
from models import AttentionMetadata, Decoder, KVCache
from nanokv.config import EngineConfig
from nanokv.engine import evict, memory
from nanokv.engine.block_table import BlockTables
from nanokv.engine.cuda_graphs import DecodeGraphs
from nanokv.engine.head_pages import HeadTables
from nanokv.engine.host_tier import HostTier
from nanokv.engine.offload_costs import rank_0_link_and_device
from nanokv.engine.press_window import PressWindow
from nanokv.engine.sampler import SampledTokens, Sampler, prompt_logprobs
from nanokv.engine.scheduler import ScheduledBatch
from nanokv.engine.sequence import (EVERY_NEED, PROMPT_LOGPROBS, SCORES, SEEDED, UNEVEN, Sequence,
                                     step_needs)
from nanokv.engine.timing import StepClock
from nanokv.eviction import AverageAttention, KVMethod
from nanokv.sampling_params import SamplingParams



def on_device(device: torch.device):
    """Make device the current CUDA device inside (Triton launches, graph capture and the
    memory statistics use the current one); nothing to do for a CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@dataclass
class StepInputs:
    """One step's flat inputs, and which rows of its hidden states get logits."""
    input_ids: torch.Tensor = None
    positions: torch.Tensor = None
    meta: AttentionMetadata = None
    sample_rows: list[int] = field(default_factory=list)           # last row of chunks that end a sequence
    sample_index: torch.Tensor | None = None                       # sample_rows (None: every row, in order)
    sampled_seqs: list[Sequence] = field(default_factory=list)
    logprob_rows: list[int] = field(default_factory=list)          # rows predicting a prompt token
    logprob_targets: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, prompt index)
    needs: int = EVERY_NEED                                        # its sequences' (step_needs)
    decode: tuple[np.ndarray, ...] | None = None   # a decode's positions, lengths, block-table rows (_advanced)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: Decoder, dtype: torch.dtype, device: torch.device,
                 kv_dtype: torch.dtype):
        """dtype: the model's; kv_dtype: the KV cache's (dtype, or int8 / fp8 for a quantized cache)."""
        self.config, self.device, self.dtype, self.kv_dtype = config, device, dtype, kv_dtype
        self.block_size, self.model = config.block_size, model
        if kernels.packs_weights(device):
            model.prepack_linears()
        model_config = model.config
        self.uses_graphs = kernels.captures_graphs(device) and not config.enforce_eager
        with on_device(device):
            self.link_and_device = rank_0_link_and_device(config, model, device, dtype)
            # Flash-decoding's split partials and the presses' layer inputs, allocated before the memory
            # profile counts what is in use.
            self.decode_workspace = kernels.decode_workspace_for(config.max_num_seqs, model_config.num_heads,
                model_config.num_kv_heads, model_config.head_dim, device, quantized=kv_dtype != dtype)
            self.press_window = PressWindow(model, config.press_window, config.max_num_seqs, device)
            num_blocks = memory.pool_blocks(config, model_config, kv_dtype, device, self.uses_graphs,
                                            self.profile_forward)
            num_blocks = model.shard.min(num_blocks, device)   # block ids are the same on every rank
            self.kv_cache = KVCache(model_config, num_blocks, config.block_size, kv_dtype, device)
            self.host_tier = HostTier(config, model, self.kv_cache, dtype, kv_dtype, self.link_and_device)
            self.head_tables = HeadTables(config.max_num_seqs, self.kv_cache)
            self.evictor = evict.Evictor(self.kv_cache, self.head_tables, self.press_window, model.shard)
            self.sampler = Sampler(device, config.seed)
            self.last_sampled: SampledTokens | None = None   # what the sequences with a token pending feed next
            self.last_step: StepInputs | None = None         # the step prepared last (_advanced)
            # A decode's next step is made from its arrays (_advanced) unless a step may need each sequence
            # read: for its traffic with the host tier, a press's layer inputs, LongRoPE's rows.
            self.advances = not (config.decode_from_host or self.host_tier.input_positions or self.press_window.window
                                 or model.long_rope)
            self.graphs = None
            if self.uses_graphs:
                self.graphs = DecodeGraphs(self.model, self.kv_cache, self.decode_workspace, config.max_num_seqs,
                                           -(-config.max_model_len // config.block_size), config.max_model_len)

    @torch.inference_mode()
    def profile_forward(self, lengths: list[int]) -> None:
        """One step that reads prompts of the given lengths whole, through a scratch cache just
        big enough for them, with eviction scores, prompt logprobs and top-p sampling on: the
        most memory a step of that many tokens can need. The pool is left alone."""
        bs = self.block_size
        blocks = [-(-n // bs) for n in lengths]
        scratch = KVCache(self.model.config, sum(blocks), bs, self.kv_dtype, self.device)
        tables = BlockTables(len(lengths), max(blocks))
        starts = [sum(blocks[:i]) for i in range(len(blocks))]
        scored = KVMethod(ranking=AverageAttention())
        seqs = [Sequence(-1, [0] * n, SamplingParams(), method=scored, prompt_logprobs=[None] * n,
                         block_table=tables.new(list(range(start, start + nb))))
                for n, start, nb in zip(lengths, starts, blocks)]
        step = self.prepare(ScheduledBatch(seqs, list(lengths)), scratch)
        hidden = self.model(step.input_ids, step.positions, scratch, step.meta)
        prompt_logprobs(self.model.compute_logits, hidden, step.logprob_rows, step.logprob_targets)
        rows = hidden[-self.config.max_num_seqs:]
        params = [SamplingParams(top_p=0.9)] * len(rows)   # sorts the vocabulary
        Sampler(self.device, 0)(self.model.compute_logits(rows), params, [None] * len(rows))

    def prepare(self, batch: ScheduledBatch, cache: KVCache | None = None) -> StepInputs:
        """Flatten the batch into the step's tensors, decodes first (AttentionMetadata),
        and note which rows get logits. cache: the pool the pages are in (the runner's).
        Per sequence only the numbers that differ are read; the rest is numpy, which reaches the
        device in one copy (kernels.from_host_many), and torch. A decode of the sequences the last
        step decoded is made from the last step's arrays (_advanced)."""
        if cache is None:
            self.last_step = self._advanced(batch)
            if self.last_step is not None:
                return self.last_step
        seqs, num_new = batch.seqs, batch.num_new_tokens
        if max(num_new) > 1:   # decodes first, in order: flash-decoding takes the leading one-query rows
            order = [i for i, n in enumerate(num_new) if n == 1] + [i for i, n in enumerate(num_new) if n > 1]
            seqs, num_new = [seqs[i] for i in order], [num_new[i] for i in order]
        starts = [seq.num_computed_tokens for seq in seqs]
        cu_seqlens = list(accumulate(num_new, initial=0))
        step = StepInputs(needs=step_needs(seqs))
        ends = [i for i, (seq, start, n) in enumerate(zip(seqs, starts, num_new)) if start + n == seq.num_tokens]
        step.sampled_seqs = [seqs[i] for i in ends]            # the chunk reaches the end: sample the next token
        step.sample_rows = [cu_seqlens[i + 1] - 1 for i in ends]
        scoring = [i for i, seq in enumerate(seqs) if seq.prompt_logprobs is not None] \
            if step.needs & PROMPT_LOGPROBS else []
        for i in scoring:   # rows predicting a prompt token
            seq, start = seqs[i], starts[i]
            last = min(start + num_new[i], seq.num_prompt_tokens - 1)
            step.logprob_rows += range(cu_seqlens[i], cu_seqlens[i] + last - start)
            step.logprob_targets += ((seq, j + 1) for j in range(start, last))
        n = np.array(num_new)
        row_seq = np.repeat(np.arange(len(seqs)), n)                      # [T]: each row's sequence
        from_end = np.repeat(np.array(cu_seqlens[1:]), n) - np.arange(cu_seqlens[-1])   # 1 for a chunk's last row
        # A decode of a token still on its way to the host (pending) feeds it from last_sampled; 0 until then.
        pending = [i for i, seq in enumerate(seqs) if seq.num_pending]
        positions = np.array(starts)[row_seq] + n[row_seq] - from_end   # true positions, also after eviction
        host = dict(positions=positions, cu_seqlens=np.array(cu_seqlens, dtype=np.int32))   # the step's copy
        if len(pending) < cu_seqlens[-1]:   # some row feeds a token the host has
            host["ids"] = self._input_ids(seqs, starts, num_new, len(ends) == len(seqs) == cu_seqlens[-1])
        if len(ends) < len(row_seq):   # not every row is sampled
            host["sample_rows"] = np.array(step.sample_rows, dtype=np.int64)
        scores = bool(step.needs & SCORES)
        if scores:
            methods = [seq.method for seq in seqs]
            host["score_from"] = np.array([m.score_from(seq) for m, seq in zip(methods, seqs)], dtype=np.int32)
            if any(m.squares_scores for m in methods):
                host["square_scores"] = np.array([m.squares_scores for m in methods], dtype=np.bool_)
            if any(m.score_skip for m in methods):
                host["score_skip"] = np.array([m.score_skip for m in methods], dtype=np.int32)
        if pending:
            self._pending_rows([seqs[i] for i in pending], [cu_seqlens[i] for i in pending], host)
        own_width, max_context_len, rows = self._page_rows(seqs, n, row_seq, from_end, host, step.needs & UNEVEN)
        on_device = kernels.from_host_many(host, self.device)
        pool = cache or self.kv_cache
        tables, lens = self._step_pages(on_device, own_width, pool)
        step.input_ids = self._feed_pending(on_device) if pending else on_device["ids"]
        step.positions, step.sample_index = on_device["positions"], on_device.get("sample_rows")
        step.meta = AttentionMetadata(
            slot_mapping=self._slot_mapping(on_device, tables, lens, pool),
            cu_seqlens_q=on_device["cu_seqlens"], context_lens=lens,
            page_tables=tables, max_query_len=max(num_new), max_context_len=max_context_len,
            num_decodes=num_new.count(1), accumulate_scores=scores, score_from=on_device.get("score_from"),
            square_scores=on_device.get("square_scores"), score_skip=on_device.get("score_skip"),
            decode_workspace=self.decode_workspace,
            host_stream=None if cache is not None else self.host_tier.stream(
                seqs, starts, num_new, cu_seqlens, tables, lambda at, owners: self._rope_rows(at, seqs, owners)),
            rope_rows=self._rope_rows(positions, seqs, row_seq),
            kept_inputs=self.press_window.writes(seqs, starts, num_new, cu_seqlens) if cache is None else None)
        if cache is None:
            if self.advances and len(seqs) == len(row_seq) == len(ends) and (own_width is None or rows is None):
                step.decode = positions, host["lens"], rows   # rows None: every head has pages of its own
            self.last_step = step
        return step

    def _advanced(self, batch: ScheduledBatch) -> StepInputs | None:
        """The step after a decode (StepInputs.decode) of the same sequences, fed the tokens it
        sampled: its inputs one position further, each new pair's block found in the block
        tables' rows, or, where every head has pages of its own (an uneven method once evicted),
        its pages as they were. Only the sequences planned in full are read (a block added, pairs
        evicted: their lengths; the pages are made again), and for windowed scores each one's
        first query that counts. None when the step is not such a one, or some sequence of an
        uneven method is planned in full."""
        last, sampled = self.last_step, self.last_sampled
        if last is None or last.decode is None or sampled is None or sampled.seqs is not last.sampled_seqs \
                or batch.seqs != sampled.seqs or max(batch.num_new_tokens) > 1 \
                or (batch.planned_in_full and last.needs & UNEVEN):   # its heads' own pages may be new
            return None
        (positions, lens, rows), seqs, meta = last.decode, batch.seqs, last.meta
        lens = lens + 1
        if batch.planned_in_full:
            lens[batch.planned_in_full] = [seqs[i].num_kv_slots + 1 for i in batch.planned_in_full]
        host = dict(positions=positions + 1)
        if rows is None:   # every head has pages of its own, with room for its pairs until its next eviction
            max_context_len, pages_again = max(int(lens.max()), meta.page_tables.shape[-1] * self.block_size), False
        else:
            max_context_len, ids = int(lens.max()), seqs[0].block_table.tables.ids
            width = -(-max_context_len // self.block_size)
            host["first_slots"] = self.kv_cache.first_slots(ids, rows, lens - 1)
            pages_again = bool(batch.planned_in_full) or width != meta.page_tables.shape[-1]
            if pages_again:
                host.update(lens=lens, blocks=ids[rows, :width])
        if last.needs & SCORES:
            host["score_from"] = np.array([seq.method.score_from(seq) for seq in seqs], dtype=np.int32)
        on_device = kernels.from_host_many(host, self.device)
        tables, context_lens = self._step_pages(on_device, None, self.kv_cache) if pages_again \
            else (meta.page_tables, meta.context_lens + 1)
        step = StepInputs(sampled.on_device, on_device["positions"], sample_rows=last.sample_rows, sampled_seqs=seqs,
                          needs=last.needs, decode=(host["positions"], lens, rows))
        step.meta = replace(meta, slot_mapping=self._slot_mapping(on_device, tables, context_lens, self.kv_cache),
                            context_lens=context_lens, page_tables=tables, max_context_len=max_context_len,
                            score_from=on_device.get("score_from", meta.score_from))
        return step

    @staticmethod
    def _input_ids(seqs: list[Sequence], starts: list[int], num_new: list[int], decodes: bool) -> np.ndarray:
        """The step's token ids, 0 where a pending token goes (_feed_pending); decodes: one row a
        sequence, its last token."""
        if decodes:
            return np.array([0 if seq.num_pending else seq.output_token_ids[-1] if seq.output_token_ids
                             else seq.prompt_token_ids[-1] for seq in seqs], dtype=np.int64)
        return np.fromiter(chain.from_iterable([0] if seq.num_pending else seq.tokens(start, k)
                                               for seq, start, k in zip(seqs, starts, num_new)),
                           dtype=np.int64, count=sum(num_new))

    def _rope_rows(self, positions: np.ndarray, seqs: list[Sequence], owners: np.ndarray) -> torch.Tensor | None:
        """Each token's row of the RoPE table (owners: the index of its sequence in seqs) where
        some row is not the token's position (LongRoPE's long prompts), else None."""
        if not self.model.long_rope:
            return None
        rows = self.model.rope_rows(positions, np.array([seq.num_prompt_tokens for seq in seqs])[owners])
        return None if rows is None else kernels.from_host(rows, self.device)

    def _pending_rows(self, seqs: list[Sequence], rows: list[int], host: dict[str, np.ndarray]) -> None:
        """Where the pending tokens of seqs, sampled by the step launched last, are among its
        tokens (host["pending_from"]) and, unless the step is those rows, where they go in the
        step's (host["pending_to"]). A step of the same decodes as the last, in its order,
        feeds its tokens as they are: neither."""
        last = self.last_sampled
        if "ids" in host or seqs != last.seqs:   # (a sequence equals itself alone)
            row_of = {seq: row for row, seq in enumerate(last.seqs)}
            host["pending_from"] = np.array([row_of[seq] for seq in seqs], dtype=np.int64)
            if "ids" in host:
                host["pending_to"] = np.array(rows, dtype=np.int64)

    def _feed_pending(self, on_device: dict[str, torch.Tensor]) -> torch.Tensor:
        """The step's token ids with the pending tokens in place (_pending_rows)."""
        tokens = self.last_sampled.on_device
        if "pending_from" in on_device:
            tokens = tokens[on_device["pending_from"]]
        if "ids" not in on_device:
            return tokens
        on_device["ids"][on_device["pending_to"]] = tokens
        return on_device["ids"]

    def _page_rows(self, seqs: list[Sequence], num_new: np.ndarray, row_seq: np.ndarray, from_end: np.ndarray,
                   host: dict[str, np.ndarray], uneven: bool) -> tuple[int | None, int, np.ndarray | None]:
        """The host's part of the step's pages: each sequence's length this step (host["lens"]),
        the blocks of those whose heads read their blocks' pages (host["blocks"], KVCache.batch_pages
        makes the pages), and which do not (host["own"]): once an uneven method has evicted, each
        head has pages of its own, in a row of HeadTables (host["own_rows"]; the widest row's width
        returned, None where none has); a host-side bound of the lengths; and the sequences' rows of
        the block tables (None where every head has pages of its own). Row t of the step
        (of sequence row_seq[t]) writes its pair from_end[t] slots from its sequence's end: where
        none has pages of its own, that slot in its block's first page (host["first_slots"]:
        KVCache.first_slots); else row_seq and from_end (for the gather of _slot_mapping). uneven:
        whether any of seqs has an uneven method (only such a method's heads have pages of their own)."""
        lens = np.array([seq.num_kv_slots for seq in seqs]) + num_new
        host["lens"], bound = lens.astype(np.int32), int(lens.max())
        width = -(-bound // self.block_size)
        own = [b for b, seq in enumerate(seqs) if seq.own_pages is not None] if uneven else []
        own_width = rows = None
        if own:
            host["own_rows"], own_width = self.head_tables.rows([seqs[b].own_pages for b in own], lens[own].tolist())
            width, bound = max(width, own_width), max(bound, own_width * self.block_size)
            host["own"] = np.array(own, dtype=np.int64)
        if len(own) < len(seqs):
            rows = np.fromiter((seq.block_table.row for seq in seqs), dtype=np.intp, count=len(seqs))
            blocks = seqs[0].block_table.tables.ids[rows, :width]
            if blocks.shape[1] < width:   # a head of its own holds more pages than a block table can
                blocks = np.pad(blocks, ((0, 0), (0, width - blocks.shape[1])))
            host["blocks"] = blocks
        if not own:   # the slot each row's pair goes to, in its block
            host["first_slots"] = self.kv_cache.first_slots(blocks, row_seq, lens[row_seq] - from_end)
        elif len(row_seq) > len(seqs):   # prompt chunks: not every row's pair goes to its sequence's last slot
            host.update(row_seq=row_seq, from_end=from_end)
        return own_width, bound, rows

    def _step_pages(self, on_device: dict[str, torch.Tensor], own_width: int | None,
                    cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's pages [L, B, Hkv, W] and length this step [L, B, Hkv] (_page_rows)."""
        if own_width is not None:
            own_tables, own_lens = self.head_tables.gather(on_device["own_rows"], own_width)
            if "blocks" not in on_device:   # every head has pages of its own: they are the step's tables
                return own_tables.transpose(0, 1), own_lens.transpose(0, 1)
        tables = cache.batch_pages(on_device["blocks"])
        lens = on_device["lens"][None, :, None].expand(tables.shape[:3]).contiguous()
        if own_width is not None:   # heads with pages of their own: all of them put in place at once
            tables[:, on_device["own"], :, :own_width] = own_tables.transpose(0, 1)
            lens[:, on_device["own"]] = own_lens.transpose(0, 1)
        return tables, lens

    def _slot_mapping(self, on_device: dict[str, torch.Tensor], tables: torch.Tensor, lens: torch.Tensor,
                      cache: KVCache) -> torch.Tensor:
        """[L, T, Hkv] int64: where each new token's pair goes in every head, the last num_new[b]
        of the head's lens [L, B, Hkv] slots. Where every head reads its blocks' pages, from
        their layout (KVCache.token_slots); else through each head's pages tables [L, B, Hkv, W],
        row t from_end[t] slots from the end of sequence row_seq[t] (_page_rows)."""
        if "first_slots" in on_device:
            return cache.token_slots(on_device["first_slots"])
        return kernels.head_slots(tables, lens, self.block_size, on_device.get("row_seq"), on_device.get("from_end"))

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, clock: StepClock | None = None) -> SampledTokens | None:
        """Copy cached blocks, evict, then one forward pass; returns the tokens sampled for the
        sequences whose chunk reached their end, on their way to the host (None on a worker of
        a split model: rank 0 samples). clock: laps the phases (LLM.timing)."""
        clock = clock or StepClock(None, self.device)
        with on_device(self.device):
            self._swap(batch)
            clock.lap("swap")
            if batch.copies:   # (cached, own) pairs
                self.kv_cache.copy_blocks(*(list(blocks) for blocks in zip(*batch.copies)))
            self.evictor.evict(batch.evictions)
            clock.lap("evict")
            step = self.prepare(batch)
            clock.lap("prepare")
            meta = step.meta
            if self.graphs is not None and meta.max_query_len == 1 and meta.host_stream is None \
                    and meta.rope_rows is None and meta.kept_inputs is None and self.graphs.fits(meta):
                hidden = self.graphs.run(step.input_ids, step.positions, meta)
            else:
                hidden = self.model(step.input_ids, step.positions, self.kv_cache, meta)
            if self.model.shard.rank:   # a worker of a split model: rank 0 samples
                return None
            sampled_rows = hidden if step.sample_index is None else hidden[step.sample_index]
            logits = self.model.compute_logits(sampled_rows) if step.sample_rows else None
            clock.lap("forward")
            seqs, sampled = step.sampled_seqs, (None, {}, None)
            if logits is not None:
                generators = [s.generator for s in seqs] if step.needs & SEEDED else [None] * len(seqs)
                tokens = self.sampler(logits, [s.params for s in seqs], generators, seqs, self.last_sampled, step.needs)
                sampled = (tokens, dict(self.sampler.errors), logits)
            prompt = prompt_logprobs(self.model.compute_logits, hidden, step.logprob_rows, step.logprob_targets)
            self.last_sampled = SampledTokens(seqs, *sampled, prompt, step.needs)
            clock.lap("sample")
            return self.last_sampled

    def _swap(self, batch: ScheduledBatch) -> None:
        """Blocks to the host tier (preempted sequences', spilled cached ones), then back from it
        (resuming sequences', cached ones hit there): a device block may be both, one block's
        going out, another's coming in. A sequence's own page tables (an uneven method's) and press
        window are kept aside while it is out; the tables follow its blocks when it resumes."""
        if batch.saves:
            device, host = zip(*batch.saves)
            self.host_tier.cache.save(list(host), list(device))
        if batch.loads:
            host, device = zip(*batch.loads)
            self.host_tier.cache.load(list(host), list(device))
        for seq in batch.swapped_out:
            self.press_window.keep_aside(seq)
            self.head_tables.keep_aside(seq.own_pages)
        for swap in batch.resumed:
            self.press_window.put_back(swap.seq)
            self.head_tables.put_back(swap.seq.own_pages, swap.seq.block_table.row, lambda tables, swap=swap:
                                      self.kv_cache.move_pages(tables, swap.device_before, swap.device))

    @torch.inference_mode()
    def kept_positions(self, seq: Sequence) -> torch.Tensor:
        """[L, H, n]: the original positions of the pairs seq holds at the end (evict.py)."""
        with on_device(self.device):
            return self.evictor.kept_positions(seq)
