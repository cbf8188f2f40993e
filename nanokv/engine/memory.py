"""How many KV blocks the pool gets: given exactly, from a size in GB, or on CUDA what is
left of the device after everything else the run needs, measured and counted."""
from __future__ import annotations

from typing import Callable

import torch

import kernels
from models import KVCache, ModelConfig
from nanokv.config import EngineConfig
from nanokv.engine import evict
from nanokv.engine.cuda_graphs import DecodeGraphs

ALLOCATOR_MARGIN = 0.01   # of the device's memory, kept free for the caching allocator's rounding
CPU_POOL_BYTES = 10**9    # the pool on a CPU when no size is given



def pool_blocks(config: EngineConfig, model: ModelConfig, kv_dtype: torch.dtype, device: torch.device,
                graphs: bool, profile: Callable[[list[int]], None]) -> int:
    """The pool size in blocks, or a ValueError if it cannot hold one sequence of max_model_len.
    profile(lengths) runs one step of prompts of those lengths (ModelRunner.profile_forward)."""
    per_block = KVCache.bytes_per_block(model, config.block_size, kv_dtype, device)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_gb is not None:
        num_blocks = int(config.kv_cache_gb * 1e9) // per_block
    elif device.type == "cuda":
        num_blocks = free_for_pool(config, model, kv_dtype, device, graphs, profile) // per_block
    else:
        num_blocks = CPU_POOL_BYTES // per_block
    if num_blocks * config.block_size < config.max_model_len:
        raise ValueError(
            f"the KV cache ({num_blocks} blocks of {config.block_size} = {num_blocks * config.block_size} "
            f"tokens) cannot hold one sequence of max_model_len={config.max_model_len}: "
            "give more memory (kv_cache_gb / num_kv_blocks) or a smaller max_model_len")
    return num_blocks


def free_for_pool(config: EngineConfig, model: ModelConfig, kv_dtype: torch.dtype, device: torch.device,
                  graphs: bool, profile: Callable[[list[int]], None]) -> int:
    """Bytes for the pool on a CUDA device: the share of it this process may use, less what
    others use, the peak of the largest step (a profiling pass), the activations the decode
    graphs keep (a second pass, at the largest decode batch) and memory_reserve."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile(profile_lengths(config))
    peak = torch.cuda.max_memory_allocated(device)
    graph_activations = 0
    if graphs:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        profile([1] * config.max_num_seqs)
        graph_activations = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    reserve = memory_reserve(model, config, kv_dtype, graphs, total, device)
    budget = total * config.gpu_memory_utilization - used_by_others - peak - graph_activations - sum(reserve.values())
    return max(int(budget), 0)


def profile_lengths(config: EngineConfig) -> list[int]:
    """The largest step: max_num_batched_tokens prompt tokens, in sequences of at most
    max_model_len (the positions a sequence can reach, and the RoPE table's rows)."""
    n, longest = config.max_num_batched_tokens, config.max_model_len
    return [min(longest, n - start) for start in range(0, n, longest)]


def memory_reserve(model: ModelConfig, config: EngineConfig, kv_dtype: torch.dtype, graphs: bool,
                   total_memory: int, device: torch.device) -> dict[str, int]:
    """Bytes a run allocates on top of the K/V pool and of what the profiling pass measures
    (the weights and the largest step's activations, logits, prompt logprobs and sampling):
    each step's page tables, the decode graphs' copies of them, eviction's pieces
    (evict.py), a split prefill's partial results (short chunks: the profiling pass runs
    long ones) and a margin for the allocator."""
    L, H = model.num_layers, model.num_kv_heads
    tables = config.max_num_seqs * L * H * -(-config.max_model_len // config.block_size) * 4
    reserve = {"step page tables": tables,
               "eviction": evict.reserve_bytes(H, model.head_dim, kv_dtype, config.max_model_len,
                                               model.num_heads // H, config.press_window, evict.piece_bytes(device)),
               "split prefill": kernels.prefill_split_bytes(model.head_dim, device),
               "allocator margin": int(ALLOCATOR_MARGIN * total_memory)}
    if graphs:
        reserve["decode graph inputs"] = DecodeGraphs.buffer_bytes(L, H, config.max_num_seqs, config.max_model_len,
                                                                   config.block_size, model.hidden_size)
    return reserve
