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
from nanokv.eviction.rankings import HeldPairs
from nanokv.kv_cache import KVCache
from nanokv.sampling import Sampler
from nanokv.scheduler import Eviction, ScheduledBatch
from nanokv.sequence import PromptLogprob, Sequence

LOGPROB_SLICE = 512   # prompt rows turned into vocabulary logits at a time


@dataclass
class Timings:
    """Where the runner's time went (bench.py): seconds and steps per phase."""
    prefill_s: float = 0.0   # steps with a prompt chunk (mixed steps count here)
    decode_s: float = 0.0    # steps of decodes only
    evict_s: float = 0.0
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
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=device),
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
            context_lens=torch.tensor([n], dtype=torch.int32, device=device),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
            max_query_len=n, max_context_len=n, accumulate_scores=True)
        positions = torch.arange(n, device=device)
        hidden = self.model(torch.zeros(n, dtype=torch.long, device=device), positions, scratch, meta)
        self.model.compute_logits(hidden[-self.config.max_num_seqs:])

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Flatten the batch into the step's tensors, decodes first (AttentionMetadata),
        and note which rows get logits."""
        step = StepInputs()
        ids, positions, slots, cu_seqlens, context_lens = [], [], [], [0], []
        bs = self.block_size
        order = sorted(zip(batch.seqs, batch.num_new_tokens), key=lambda seq_n: seq_n[1] != 1)   # stable
        for seq, n in order:
            start, first_slot = seq.num_computed_tokens, seq.num_kv_slots
            ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)   # true positions, also after eviction
            slots += (seq.block_table[i // bs] * bs + i % bs for i in range(first_slot, first_slot + n))
            cu_seqlens.append(cu_seqlens[-1] + n)
            context_lens.append(first_slot + n)
            if seq.prompt_logprobs is not None:   # rows predicting a prompt token
                last = min(start + n, len(seq.prompt_token_ids) - 1)
                step.logprob_rows += range(cu_seqlens[-2], cu_seqlens[-2] + last - start)
                step.logprob_targets += ((seq, i + 1) for i in range(start, last))
            if start + n == seq.num_tokens:   # the chunk reaches the end: sample the next token
                step.sample_rows.append(cu_seqlens[-1] - 1)
                step.sampled_seqs.append(seq)
        score_from = [seq.method.score_from(seq) for seq, _ in order]
        width = max(len(seq.block_table) for seq in batch.seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq, _ in order]

        def tensor(x, dtype):
            return torch.tensor(x, dtype=dtype, device=self.device)
        step.input_ids, step.positions = tensor(ids, torch.long), tensor(positions, torch.long)
        step.meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.long), cu_seqlens_q=tensor(cu_seqlens, torch.int32),
            context_lens=tensor(context_lens, torch.int32), block_tables=tensor(tables, torch.int32),
            max_query_len=max(batch.num_new_tokens), max_context_len=max(context_lens),
            num_decodes=batch.num_new_tokens.count(1),
            accumulate_scores=any(seq.method.needs_scores for seq in batch.seqs),
            score_from=tensor(score_from, torch.int32), decode_workspace=self.decode_workspace)
        if kernels.BACKEND == "cpu":   # the gathers and masks every layer shares, built once
            meta = step.meta
            meta.cpu_plan = make_plan(meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                                      self.kv_cache.k.shape[2], self.block_size, self.dtype,
                                      meta.accumulate_scores)
        return step

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
        meta = step.meta
        if self.graphs is not None and meta.max_query_len == 1 and self.graphs.fits(len(batch)):
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
        order). The sequences of one rule, size and count are ranked together, as one batch."""
        groups = defaultdict(list)
        for eviction in evictions:
            groups[eviction.seq.method.rule, eviction.num_slots, eviction.num_evicted].append(eviction.seq)
        for (_, num_slots, num_evicted), seqs in groups.items():
            tables = self._tables(seqs, num_slots)
            keep = self._survivors(seqs, tables, num_slots, num_evicted)
            for seq, table, kept in zip(seqs, tables, keep):
                kernels.compact_kv(self.kv_cache.per_slot, table, kept)
                if seq.method.windowed:   # its scores restart: the next window counts from zero
                    self.kv_cache.scores[:, table] = 0.0

    def _tables(self, seqs: list[Sequence], num_slots: int) -> torch.Tensor:
        """[S, nb]: the blocks holding each sequence's first num_slots slots."""
        nb = -(-num_slots // self.block_size)
        return torch.tensor([seq.block_table[:nb] for seq in seqs], dtype=torch.long, device=self.device)

    def _survivors(self, seqs: list[Sequence], tables: torch.Tensor, num_slots: int,
                   num_evicted: int) -> torch.Tensor:
        """[S, L, H, num_slots - num_evicted] ascending slot indices each head keeps, by the
        sequences' common rule: a stable ascending sort evicts the lowest first, ties by slot
        (= by position)."""
        positions = self.read_slots(self.kv_cache.positions, tables, num_slots)
        if num_evicted == 0:
            return torch.arange(num_slots, device=self.device).expand(positions.shape)
        current = torch.tensor([seq.num_computed_tokens - 1 for seq in seqs], device=self.device)
        held = HeldPairs(positions, self.read_slots(self.kv_cache.scores, tables, num_slots),
                         current=current[:, None, None, None], keys=lambda: self._keys(tables, num_slots))
        priority = seqs[0].method.keep_priority(held)
        return priority.argsort(dim=-1, stable=True)[..., num_evicted:].sort(dim=-1).values

    def _keys(self, tables: torch.Tensor, n: int) -> torch.Tensor:
        """[S, L, H, n, D]: the keys of the first n slots, dequantized if the cache is quantized."""
        scales = self.kv_cache.kv_scales
        return dequantize(self.read_slots(self.kv_cache.k, tables, n),
                          None if scales is None else self.read_slots(scales, tables, n)[..., 0])

    def read_slots(self, per_slot: torch.Tensor, tables: torch.Tensor, n: int) -> torch.Tensor:
        """The first n slots of S sequences (tables [S, nb]) from a per-slot buffer
        [L, blocks, H, bs, ...] -> [S, L, H, n, ...]."""
        pages = per_slot[:, tables]                                   # [L, S, nb, H, bs, ...]
        return pages.movedim(0, 1).transpose(2, 3).flatten(3, 4)[:, :, :, :n]

    def kept_positions(self, seq: Sequence) -> torch.Tensor:
        """The original positions of the pairs seq holds at the end, per layer and KV head:
        [L, H, n]. A method whose algorithm evicts right after a chunk (ED) still has that
        eviction pending here (the engine evicts before the next chunk): it is applied."""
        n = seq.num_kv_slots
        tables = self._tables([seq], n)
        pending = seq.method.evict_count(seq) if seq.method.evicts_eagerly else 0
        keep = self._survivors([seq], tables, n, pending)
        return self.read_slots(self.kv_cache.positions, tables, n).gather(-1, keep)[0].cpu()
