"""Runs one scheduled batch through the model: flat tensors in, sampled tokens out.

This is the one place where attention metadata is built. It also owns the
model, the KV cache tensors and the sampler.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from kernels.attention_cpu import make_plan
from kernels.kv_store import dequantize
from nanokv.attention import AttentionMetadata
import kernels
from models import Decoder
from nanokv.config import EngineConfig, ModelConfig
from nanokv.cuda_graphs import DecodeGraphs
from nanokv.eviction.pages import plan_page_eviction, repage
from nanokv.eviction.rankings import HeldPairs
from nanokv.kv_cache import KVCache
from nanokv.sampling import Sampler
from nanokv.scheduler import Eviction, ScheduledBatch
from nanokv.sequence import HeadPages, PromptLogprob, Sequence

LOGPROB_SLICE = 512   # prompt rows turned into vocabulary logits at a time


@dataclass
class Timings:
    """Where the runner's time went (bench.py): seconds and steps per phase."""
    prefill_s: float = 0.0   # steps with a prompt chunk (mixed steps count here)
    decode_s: float = 0.0    # steps of decodes only
    evict_s: float = 0.0
    host_s: float = 0.0      # building the step's inputs (prepare): the host's share of every step
    prefill_steps: int = 0
    decode_steps: int = 0


@dataclass
class StepInputs:
    """One step's flat inputs, and which rows of its hidden states get logits."""
    input_ids: torch.Tensor = None
    positions: torch.Tensor = None
    meta: AttentionMetadata = None
    sample_rows: list[int] = field(default_factory=list)           # last row of chunks that end a sequence
    sampled_seqs: list[Sequence] = field(default_factory=list)
    logprob_rows: list[int] = field(default_factory=list)          # rows predicting a prompt token
    logprob_targets: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, prompt index)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: Decoder, dtype: torch.dtype, device: torch.device,
                 kv_dtype: torch.dtype):
        """dtype: the model's; kv_dtype: the KV cache's (dtype, or int8 / fp8 for a quantized cache)."""
        self.config, self.device, self.dtype, self.kv_dtype = config, device, dtype, kv_dtype
        self.block_size = config.block_size
        self.model = model
        if kernels.BACKEND == "cpu":
            model.prepack_linears()
        model_config = model.config
        # Flash-decoding's split partials, allocated before the memory profile counts what is in use.
        self.decode_workspace = None
        if kernels.BACKEND == "triton":
            self.decode_workspace = kernels.decode_workspace_for(
                config.max_num_seqs, model_config.num_heads, model_config.num_kv_heads, model_config.head_dim,
                config.max_model_len, device)
        num_blocks = self._num_kv_blocks(model_config, kv_dtype)
        self.kv_cache = KVCache(model_config, num_blocks, config.block_size, kv_dtype, device)
        self.sampler = Sampler(device, config.seed)
        self.timings: Timings | None = None   # set to Timings() to measure (syncs the device)
        self.graphs = None   # CUDA graphs need the Triton kernels: the references synchronise
        if device.type == "cuda" and kernels.BACKEND == "triton" and not config.enforce_eager:
            self.graphs = DecodeGraphs(self.model, self.kv_cache, self.decode_workspace, config.max_num_seqs,
                                       -(-config.max_model_len // config.block_size), config.max_model_len)

    def _num_kv_blocks(self, model_config: ModelConfig, dtype: torch.dtype) -> int:
        """The pool size: given exactly, or from a size in GB, or (CUDA) from free memory."""
        cfg = self.config
        per_block = KVCache.bytes_per_block(model_config, cfg.block_size, dtype)
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        elif cfg.kv_cache_gb is not None:
            num_blocks = int(cfg.kv_cache_gb * 1e9) // per_block
        elif self.device.type == "cuda":
            num_blocks = self._profile_free_memory() // per_block
        else:
            num_blocks = int(1e9) // per_block   # CPU default: 1 GB
        max_len = cfg.max_model_len
        if num_blocks * cfg.block_size < max_len:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {cfg.block_size} = {num_blocks * cfg.block_size} "
                f"tokens) cannot hold one sequence of max_model_len={max_len}: "
                "give more memory (kv_cache_gb / num_kv_blocks) or a smaller max_model_len")
        return num_blocks

    def _profile_free_memory(self) -> int:
        """Bytes left for the KV cache after a forward pass at the largest step size."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.profile_forward()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_reserved()
        budget = total * self.config.gpu_memory_utilization - used_by_others - torch.cuda.max_memory_allocated()
        return max(int(budget), 0)

    @torch.inference_mode()
    def profile_forward(self) -> None:
        """The most memory one step can need: one prefill of max_num_batched_tokens,
        through a scratch cache just big enough for it."""
        n, bs, device = self.config.max_num_batched_tokens, self.block_size, self.device
        num_blocks = -(-n // bs)
        scratch = KVCache(self.model.config, num_blocks, bs, self.kv_dtype, device)
        tables = scratch.pages(torch.arange(num_blocks, device=device)[None])
        lens = torch.full(tables.shape[:3], n, dtype=torch.int32, device=device)
        meta = AttentionMetadata(
            slot_mapping=self._slot_mapping(tables, lens, [n]),
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
            context_lens=lens.transpose(0, 1).contiguous(), block_tables=tables.transpose(0, 1).contiguous(),
            max_query_len=n, max_context_len=n, accumulate_scores=True)
        positions = torch.arange(n, device=device)
        hidden = self.model(torch.zeros(n, dtype=torch.long, device=device), positions, scratch, meta)
        self.model.compute_logits(hidden[-self.config.max_num_seqs:])

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Flatten the batch into the step's tensors, decodes first (AttentionMetadata),
        and note which rows get logits."""
        step = StepInputs()
        ids, positions, cu_seqlens = [], [], [0]
        order = sorted(zip(batch.seqs, batch.num_new_tokens), key=lambda seq_n: seq_n[1] != 1)   # stable
        for seq, n in order:
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)   # true positions, also after eviction
            cu_seqlens.append(cu_seqlens[-1] + n)
            if seq.prompt_logprobs is not None:   # rows predicting a prompt token
                last = min(start + n, len(seq.prompt_token_ids) - 1)
                step.logprob_rows += range(cu_seqlens[-2], cu_seqlens[-2] + last - start)
                step.logprob_targets += ((seq, i + 1) for i in range(start, last))
            if start + n == seq.num_tokens:   # the chunk reaches the end: sample the next token
                step.sample_rows.append(cu_seqlens[-1] - 1)
                step.sampled_seqs.append(seq)
        seqs, num_new = [seq for seq, _ in order], [n for _, n in order]
        tables, lens, max_context_len = self._step_pages(seqs, num_new)
        methods = [seq.method for seq in seqs]

        def tensor(x, dtype):
            return torch.tensor(x, dtype=dtype, device=self.device)
        step.input_ids, step.positions = tensor(ids, torch.long), tensor(positions, torch.long)
        step.meta = AttentionMetadata(
            slot_mapping=self._slot_mapping(tables, lens, num_new), cu_seqlens_q=tensor(cu_seqlens, torch.int32),
            context_lens=lens.transpose(0, 1).contiguous(), block_tables=tables.transpose(0, 1).contiguous(),
            max_query_len=max(num_new), max_context_len=max_context_len, num_decodes=num_new.count(1),
            accumulate_scores=any(m.needs_scores for m in methods),
            score_from=tensor([m.score_from(seq) for m, seq in zip(methods, seqs)], torch.int32),
            square_scores=tensor([m.squares_scores for m in methods], torch.bool)
            if any(m.squares_scores for m in methods) else None,
            score_skip=tensor([m.score_skip for m in methods], torch.int32) if any(m.score_skip for m in methods)
            else None,
            decode_workspace=self.decode_workspace)
        if kernels.BACKEND == "cpu":   # every layer's gathers and masks, built once for the step
            meta = step.meta
            meta.cpu_plan = make_plan(meta.block_tables, meta.cu_seqlens_q, meta.context_lens, self.block_size,
                                      self.dtype, meta.accumulate_scores)
        return step

    def _step_pages(self, seqs: list[Sequence], num_new: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Each head's pages [B, L, Hkv, W] and length this step [B, L, Hkv], and a host-side
        bound of the lengths. A head's pages are its sequence's blocks' (KVCache.pages), or
        its own once an uneven method has evicted (Sequence.head_pages)."""
        widths = [len(seq.block_table) for seq in seqs]
        widths += [seq.head_pages.tables.shape[-1] for seq in seqs if seq.head_pages is not None]
        width = max(widths)
        blocks = torch.tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs],
                              dtype=torch.int32, device=self.device)
        tables = self.kv_cache.pages(blocks)
        lens = [seq.num_kv_slots + n for seq, n in zip(seqs, num_new)]
        bound = max(lens)
        lens = torch.tensor(lens, dtype=torch.int32, device=self.device)[:, None, None].repeat(1, *tables.shape[1:3])
        for b, (seq, n) in enumerate(zip(seqs, num_new)):
            own = seq.head_pages
            if own is not None:
                tables[b, :, :, :own.tables.shape[-1]] = own.tables
                lens[b] = own.lens + (seq.num_kv_slots + n - own.slots)
                bound = max(bound, own.tables.shape[-1] * self.block_size)
        return tables, lens, bound

    def _slot_mapping(self, tables: torch.Tensor, lens: torch.Tensor, num_new: list[int]) -> torch.Tensor:
        """[L, T, Hkv] int64: where each new token's pair goes in every head, the last
        num_new[b] of the head's lens [B, L, Hkv] slots, through its pages tables [B, L, Hkv, W]."""
        B, L, H = lens.shape
        device = self.device
        n = torch.tensor(num_new, device=device)
        seq = torch.repeat_interleave(torch.arange(B, device=device), n)          # [T]: each row's sequence
        j = torch.arange(len(seq), device=device) - (n.cumsum(0) - n)[seq]        # its index in the chunk
        index = lens[seq] - (n[seq] - j)[:, None, None]                             # [T, L, H]: its slot per head
        pages = tables[seq[:, None, None], torch.arange(L, device=device)[None, :, None],
                       torch.arange(H, device=device)[None, None, :], index // self.block_size]
        return (pages.long() * self.block_size + index % self.block_size).transpose(0, 1).contiguous()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> dict[int, int]:
        """Copy cached blocks, evict, then one forward pass; returns seq_id -> sampled token for the
        sequences whose chunk reached their end."""
        start = self._clock()
        if batch.copies:
            cached, own = zip(*batch.copies)
            self.kv_cache.copy_blocks(list(cached), list(own))
        self.evict(batch.evictions)
        evicted = self._clock()
        step = self.prepare(batch)
        if self.timings is not None:
            self.timings.host_s += self._clock() - evicted
        meta = step.meta
        if self.graphs is not None and meta.max_query_len == 1 and self.graphs.fits(meta):
            hidden = self.graphs.run(step.input_ids, step.positions, meta)
        else:
            hidden = self.model(step.input_ids, step.positions, self.kv_cache, meta)
        if step.logprob_rows:
            self._record_prompt_logprobs(hidden, step)
        sampled = {}
        if step.sample_rows:
            seqs = step.sampled_seqs
            logits = self.model.compute_logits(hidden[step.sample_rows])
            tokens = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
            sampled = dict(zip((s.seq_id for s in seqs), tokens.tolist()))
        if self.timings is not None:
            self._record_time(start, evicted, self._clock(), decode=meta.max_query_len == 1)
        return sampled

    def _clock(self) -> float:
        if self.timings is None:
            return 0.0
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def _record_time(self, start: float, evicted: float, end: float, decode: bool) -> None:
        t = self.timings
        t.evict_s += evicted - start
        if decode:
            t.decode_s, t.decode_steps = t.decode_s + end - evicted, t.decode_steps + 1
        else:
            t.prefill_s, t.prefill_steps = t.prefill_s + end - evicted, t.prefill_steps + 1

    def _record_prompt_logprobs(self, hidden: torch.Tensor, step: StepInputs) -> None:
        """Score each prompt token by the logits of the row before it, a slice at a time
        (a full [rows, vocab] matrix for a long chunk would be large)."""
        for at in range(0, len(step.logprob_rows), LOGPROB_SLICE):
            rows = step.logprob_rows[at:at + LOGPROB_SLICE]
            targets = step.logprob_targets[at:at + LOGPROB_SLICE]
            logprobs = self.model.compute_logits(hidden[rows]).log_softmax(dim=-1)
            token_ids = torch.tensor([seq.prompt_token_ids[i] for seq, i in targets], device=self.device)
            chosen = logprobs.gather(1, token_ids[:, None])[:, 0].tolist()
            top_logprob, top_token = logprobs.max(dim=-1)
            for (seq, i), lp, tok, tlp in zip(targets, chosen, top_token.tolist(), top_logprob.tolist()):
                seq.prompt_logprobs[i] = PromptLogprob(lp, tok, tlp)

    def evict(self, evictions: list[Eviction]) -> None:
        """Drop each eviction's pairs from every (layer, KV head) of its sequence and compact
        the survivors into the first slots (in their old order, so slot order stays position
        order). The sequences of one rule, size and count are ranked together, as one batch;
        an uneven method's, one at a time (_evict_pages)."""
        groups = defaultdict(list)
        for eviction in evictions:
            if eviction.seq.method.uneven:
                self._evict_pages(eviction)
            else:
                groups[eviction.seq.method.rule, eviction.num_slots, eviction.num_evicted].append(eviction.seq)
        for (_, num_slots, num_evicted), seqs in groups.items():
            tables = self._tables(seqs, num_slots)
            keep = self._survivors(seqs, tables, num_slots, num_evicted)
            for seq, table, kept in zip(seqs, tables, keep):
                kernels.compact_kv(self.kv_cache.per_slot, table, kept)
                if seq.method.windowed:   # its scores restart: the next window counts from zero
                    self.kv_cache.scores[table] = 0.0

    def _tables(self, seqs: list[Sequence], num_slots: int) -> torch.Tensor:
        """[S, L, Hkv, nb]: each head's pages holding the sequences' first num_slots slots."""
        nb = -(-num_slots // self.block_size)
        return self.kv_cache.pages(torch.tensor([seq.block_table[:nb] for seq in seqs], device=self.device))

    def _held(self, seqs: list[Sequence], tables: torch.Tensor, n: int, lens: torch.Tensor | None = None) -> HeldPairs:
        current = torch.tensor([seq.num_computed_tokens - 1 for seq in seqs], device=self.device)
        return HeldPairs(self.read_slots(self.kv_cache.positions, tables, n),
                         self.read_slots(self.kv_cache.scores, tables, n), current=current[:, None, None, None],
                         keys=lambda: self._keys(tables, n), lens=lens)

    def _survivors(self, seqs: list[Sequence], tables: torch.Tensor, num_slots: int,
                   num_evicted: int) -> torch.Tensor:
        """[S, L, H, num_slots - num_evicted] ascending slot indices each head keeps, by the
        sequences' common rule: a stable ascending sort evicts the lowest first, ties by slot
        (= by position)."""
        if num_evicted == 0:
            return torch.arange(num_slots, device=self.device).expand(len(seqs), *tables.shape[1:3], -1)
        priority = seqs[0].method.keep_priority(self._held(seqs, tables, num_slots))
        return priority.argsort(dim=-1, stable=True)[..., num_evicted:].sort(dim=-1).values

    def _head_pages(self, seq: Sequence, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An uneven method's pages [L, Hkv, W] and pairs per head [L, Hkv] when it holds
        num_slots slots (per head on average): its blocks' pages until its first eviction."""
        own = seq.head_pages
        if own is None:
            tables = self._tables([seq], num_slots)[0]
            return tables, torch.full(tables.shape[:2], num_slots, device=self.device)
        return own.tables, own.lens.long() + (num_slots - own.slots)

    def _evict_pages(self, eviction: Eviction) -> None:
        """KV-Compress: the sequence's heads go down to num_slots - num_evicted pairs each on
        average by giving up whole pages, chosen across all heads and layers by the ranking
        (nanokv/eviction/pages.py); each head's survivors move to the front of its pages
        (MoveCache), and its pages in blocks the sequence gives back after this step move
        into the blocks it keeps, whose unused pages are shared out among the heads."""
        seq, num_slots = eviction.seq, eviction.num_slots
        tables, lens = self._head_pages(seq, num_slots)
        L, H, width = tables.shape
        bs = self.block_size
        priority = seq.method.keep_priority(self._held([seq], tables[None], width * bs, lens[None]))[0]
        held_pages = -(-lens // bs)
        target = (num_slots - eviction.num_evicted) * L * H // bs
        keep, kept_lens, evicted = plan_page_eviction(priority, lens, max(int(held_pages.sum()) - target, 0), bs,
                                                      seq.method.floor_pages(bs))
        kernels.compact_kv(self.kv_cache.per_slot, tables, keep, kept_lens)
        if seq.method.windowed:   # its scores restart (KVC-full's keep accumulating)
            self.kv_cache.scores[tables[torch.arange(width, device=self.device) < held_pages[..., None]]] = 0.0
        staying = self.kv_cache.pages(torch.tensor(seq.block_table[:eviction.num_blocks_kept], device=self.device))
        tables, src, dst = repage(tables, held_pages - evicted, staying.flatten())
        for buffer in self.kv_cache.per_slot:
            buffer[dst.long()] = buffer[src.long()]
        seq.head_pages = HeadPages(tables, kept_lens.int(), seq.num_kv_slots)

    def _keys(self, tables: torch.Tensor, n: int) -> torch.Tensor:
        """[S, L, H, n, D]: the keys of the first n slots, dequantized if the cache is quantized."""
        scales = self.kv_cache.kv_scales
        return dequantize(self.read_slots(self.kv_cache.k, tables, n),
                          None if scales is None else self.read_slots(scales, tables, n)[..., 0])

    @staticmethod
    def read_slots(per_slot: torch.Tensor, tables: torch.Tensor, n: int) -> torch.Tensor:
        """The first n slots of each head, through its pages tables [S, L, H, nb], from a
        per-slot buffer [num_pages, bs, ...] -> [S, L, H, n, ...]."""
        return per_slot[tables.long()].flatten(3, 4)[:, :, :, :n]

    def kept_positions(self, seq: Sequence) -> torch.Tensor:
        """The original positions of the pairs seq holds at the end, per layer and KV head:
        [L, H, n], -1 after a head's last pair when heads hold different numbers. A method
        whose algorithm evicts right after a chunk (ED) still has that eviction pending here
        (the engine evicts before the next chunk): it is applied."""
        n = seq.num_kv_slots
        if seq.method.uneven:
            tables, lens = self._head_pages(seq, n)
            positions = self.read_slots(self.kv_cache.positions, tables[None], tables.shape[-1] * self.block_size)[0]
            slot = torch.arange(positions.shape[-1], device=self.device)
            return positions.masked_fill(slot >= lens[..., None], -1)[..., :int(lens.max())].cpu()
        tables = self._tables([seq], n)
        pending = seq.method.evict_count(seq) if seq.method.evicts_eagerly else 0
        keep = self._survivors([seq], tables, n, pending)
        return self.read_slots(self.kv_cache.positions, tables, n).gather(-1, keep)[0].cpu()
