"""Runs one scheduled batch through the model: flat tensors in, sampled tokens out.

This is the one place where attention metadata is built. It also owns the model,
the KV cache tensors, the sampler and the eviction surgery (evict.py), and runs
the profiling passes the pool is sized by (memory.py).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

import kernels
from models import AttentionMetadata, Decoder, KVCache
from nanokv.config import EngineConfig
from nanokv.engine import evict, memory
from nanokv.engine.cuda_graphs import DecodeGraphs
from nanokv.engine.sampler import Sampler
from nanokv.engine.scheduler import ScheduledBatch
from nanokv.engine.sequence import PromptLogprob, Sequence
from nanokv.eviction import AverageAttention, KVMethod
from nanokv.sampling_params import SamplingParams

LOGPROB_SLICE = 512       # prompt rows turned into vocabulary logits at a time


def on_device(device: torch.device):
    """Make device the current CUDA device inside (Triton launches, graph capture and the
    memory statistics use the current one); nothing to do for a CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


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
        if kernels.packs_weights(device):
            model.prepack_linears()
        model_config = model.config
        self.uses_graphs = kernels.captures_graphs(device) and not config.enforce_eager
        with on_device(device):
            # Flash-decoding's split partials, allocated before the memory profile counts what is in use.
            self.decode_workspace = kernels.decode_workspace_for(
                config.max_num_seqs, model_config.num_heads, model_config.num_kv_heads, model_config.head_dim, device)
            num_blocks = memory.pool_blocks(config, model_config, kv_dtype, device, self.uses_graphs,
                                            self.profile_forward)
            self.kv_cache = KVCache(model_config, num_blocks, config.block_size, kv_dtype, device)
            self.evictor = evict.Evictor(self.kv_cache)
            self.sampler = Sampler(device, config.seed)
            self.timings: Timings | None = None   # set to Timings() to measure (syncs the device)
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
        starts = [sum(blocks[:i]) for i in range(len(blocks))]
        scored = KVMethod(ranking=AverageAttention())
        seqs = [Sequence(-1, [0] * n, SamplingParams(), method=scored, block_table=list(range(start, start + nb)),
                         prompt_logprobs=[None] * n) for n, start, nb in zip(lengths, starts, blocks)]
        step = self.prepare(ScheduledBatch(seqs, list(lengths)), scratch)
        hidden = self.model(step.input_ids, step.positions, scratch, step.meta)
        self._record_prompt_logprobs(hidden, step)
        rows = hidden[-self.config.max_num_seqs:]
        params = [SamplingParams(top_p=0.9)] * len(rows)   # sorts the vocabulary
        Sampler(self.device, 0)(self.model.compute_logits(rows), params, [None] * len(rows))

    def prepare(self, batch: ScheduledBatch, cache: KVCache | None = None) -> StepInputs:
        """Flatten the batch into the step's tensors, decodes first (AttentionMetadata),
        and note which rows get logits. cache: the pool the pages are in (the runner's)."""
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
        tables, lens, max_context_len = self._step_pages(seqs, num_new, cache or self.kv_cache)
        methods = [seq.method for seq in seqs]

        def tensor(x, dtype):
            return torch.tensor(x, dtype=dtype, device=self.device)
        step.input_ids, step.positions = tensor(ids, torch.long), tensor(positions, torch.long)
        step.meta = AttentionMetadata(
            slot_mapping=self._slot_mapping(tables, lens, num_new), cu_seqlens_q=tensor(cu_seqlens, torch.int32),
            context_lens=lens, page_tables=tables,
            max_query_len=max(num_new), max_context_len=max_context_len, num_decodes=num_new.count(1),
            accumulate_scores=any(m.needs_scores for m in methods),
            score_from=tensor([m.score_from(seq) for m, seq in zip(methods, seqs)], torch.int32),
            square_scores=tensor([m.squares_scores for m in methods], torch.bool)
            if any(m.squares_scores for m in methods) else None,
            score_skip=tensor([m.score_skip for m in methods], torch.int32) if any(m.score_skip for m in methods)
            else None,
            decode_workspace=self.decode_workspace)
        meta = step.meta   # the CPU backend's gathers and masks for every layer, built once for the step
        meta.cpu_plan = kernels.plan_step(meta.page_tables, meta.cu_seqlens_q, meta.context_lens, self.block_size,
                                          self.dtype, meta.accumulate_scores)
        return step

    def _step_pages(self, seqs: list[Sequence], num_new: list[int],
                    cache: KVCache) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Each head's pages [L, B, Hkv, W] and length this step [L, B, Hkv], and a host-side
        bound of the lengths. A head's pages are its sequence's blocks' (KVCache.batch_pages),
        or its own once an uneven method has evicted (Sequence.head_pages)."""
        widths = [len(seq.block_table) for seq in seqs]
        widths += [seq.head_pages.tables.shape[-1] for seq in seqs if seq.head_pages is not None]
        width = max(widths)
        blocks = torch.tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs],
                              dtype=torch.int32, device=self.device)
        tables = cache.batch_pages(blocks)
        lens = [seq.num_kv_slots + n for seq, n in zip(seqs, num_new)]
        bound = max(lens)
        lens = torch.tensor(lens, dtype=torch.int32, device=self.device)[None, :, None].repeat(
            tables.shape[0], 1, tables.shape[2])
        for b, (seq, n) in enumerate(zip(seqs, num_new)):
            own = seq.head_pages
            if own is not None:
                tables[:, b, :, :own.tables.shape[-1]] = own.tables
                lens[:, b] = own.lens + (seq.num_kv_slots + n - own.slots)
                bound = max(bound, own.tables.shape[-1] * self.block_size)
        return tables, lens, bound

    def _slot_mapping(self, tables: torch.Tensor, lens: torch.Tensor, num_new: list[int]) -> torch.Tensor:
        """[L, T, Hkv] int64: where each new token's pair goes in every head, the last
        num_new[b] of the head's lens [L, B, Hkv] slots, through its pages tables [L, B, Hkv, W]."""
        L, B, H = lens.shape
        device = self.device
        n = torch.tensor(num_new, device=device)
        seq = torch.repeat_interleave(torch.arange(B, device=device), n)          # [T]: each row's sequence
        j = torch.arange(len(seq), device=device) - (n.cumsum(0) - n)[seq]        # its index in the chunk
        index = lens[:, seq] - (n[seq] - j)[None, :, None]                          # [L, T, H]: its slot per head
        pages = tables[torch.arange(L, device=device)[:, None, None], seq[None, :, None],
                       torch.arange(H, device=device)[None, None, :], index // self.block_size]
        return pages.long() * self.block_size + index % self.block_size

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> dict[int, int]:
        """Copy cached blocks, evict, then one forward pass; returns seq_id -> sampled token for the
        sequences whose chunk reached their end."""
        with on_device(self.device):
            return self._run(batch)

    def _run(self, batch: ScheduledBatch) -> dict[int, int]:
        start = self._clock()
        if batch.copies:
            cached, own = zip(*batch.copies)
            self.kv_cache.copy_blocks(list(cached), list(own))
        self.evictor.evict(batch.evictions)
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

    def kept_positions(self, seq: Sequence) -> torch.Tensor:
        """[L, H, n]: the original positions of the pairs seq holds at the end (evict.py)."""
        with on_device(self.device):
            return self.evictor.kept_positions(seq)

    def _clock(self) -> float:
        if self.timings is None:
            return 0.0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
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
