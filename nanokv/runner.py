"""Runs one scheduled batch through the model: flat tensors in, sampled tokens out.

This is the one place where attention metadata is built. It also owns the
model, the KV cache tensors and the sampler.
"""
from __future__ import annotations

from pathlib import Path

import torch

from nanokv.attention import AttentionMetadata
import kernels
from nanokv.config import EngineConfig, ModelConfig
from nanokv.cuda_graphs import DecodeGraphs
from nanokv.kv_cache import KVCache
from nanokv.loader import load_model
from nanokv.sampling import Sampler
from nanokv.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, path: Path,
                 dtype: torch.dtype, device: torch.device):
        self.config, self.device = config, device
        self.block_size = config.block_size
        self.model = load_model(path, model_config, dtype, device, config.max_model_len)
        num_blocks = self._num_kv_blocks(model_config, dtype)
        self.kv_cache = KVCache(model_config, num_blocks, config.block_size, dtype, device)
        self.sampler = Sampler(device, config.seed)
        self.graphs = None   # CUDA graphs need the Triton kernels: the references synchronise
        if device.type == "cuda" and kernels.BACKEND == "triton" and not config.enforce_eager:
            self.graphs = DecodeGraphs(self.model, self.kv_cache, config.max_num_seqs,
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
        dtype = next(self.model.parameters()).dtype
        scratch = KVCache(self.model.config, num_blocks, bs, dtype, device)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=device),
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
            context_lens=torch.tensor([n], dtype=torch.int32, device=device),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
            max_query_len=n, max_context_len=n)
        positions = torch.arange(n, device=device)
        hidden = self.model(torch.zeros(n, dtype=torch.long, device=device), positions, scratch, meta)
        self.model.compute_logits(hidden[-self.config.max_num_seqs:])

    def prepare(self, batch: ScheduledBatch):
        """Flatten the batch: token ids, positions, metadata, and which rows (of which
        sequences) to sample from: the last row of every chunk that ends its sequence."""
        ids, positions, slots, cu_seqlens, context_lens = [], [], [], [0], []
        sample_rows, sampled_seqs = [], []
        bs = self.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            slots += (seq.block_table[i // bs] * bs + i % bs for i in range(start, start + n))
            cu_seqlens.append(cu_seqlens[-1] + n)
            context_lens.append(start + n)
            if start + n == seq.num_tokens:   # the chunk reaches the end: sample the next token
                sample_rows.append(cu_seqlens[-1] - 1)
                sampled_seqs.append(seq)
        width = max(len(seq.block_table) for seq in batch.seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.seqs]

        def tensor(x, dtype):
            return torch.tensor(x, dtype=dtype, device=self.device)
        meta = AttentionMetadata(slot_mapping=tensor(slots, torch.long),
                                 cu_seqlens_q=tensor(cu_seqlens, torch.int32),
                                 context_lens=tensor(context_lens, torch.int32),
                                 block_tables=tensor(tables, torch.int32),
                                 max_query_len=max(batch.num_new_tokens), max_context_len=max(context_lens))
        return tensor(ids, torch.long), tensor(positions, torch.long), meta, sample_rows, sampled_seqs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> dict[int, int]:
        """One forward pass; returns seq_id -> sampled token for sequences that reached their end."""
        ids, positions, meta, sample_rows, sampled_seqs = self.prepare(batch)
        if self.graphs is not None and meta.max_query_len == 1 and self.graphs.fits(len(batch)):
            hidden = self.graphs.run(ids, positions, meta)
        else:
            hidden = self.model(ids, positions, self.kv_cache, meta)
        if not sample_rows:
            return {}
        logits = self.model.compute_logits(hidden[sample_rows])
        tokens = self.sampler(logits, [s.params for s in sampled_seqs], [s.generator for s in sampled_seqs])
        return dict(zip((s.seq_id for s in sampled_seqs), tokens.tolist()))
