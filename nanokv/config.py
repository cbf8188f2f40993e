"""The engine's options (EngineConfig). Everything else reads these; nothing keeps its own
copy of an option. The model's shape is models/config.py's; the command lines' flags for
these options, nanokv/tools/flags.py's."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kernels import QUANT_MAX
from nanokv.checks import SEED_RANGE, check_bool, check_choice, check_float, check_int, check_type
from nanokv.eviction import EvictionSettings

# kv_cache_dtype: "auto" is the model's dtype; the others quantize the cache (kernels/kv_store.py).
KV_CACHE_DTYPES = {"auto": None, "int8": torch.int8, "fp8": getattr(torch, "float8_e4m3fn", None)}
PREEMPTION_MODES = ("auto", "swap", "recompute")


def host_memory_gb() -> float:
    """This machine's memory in GB: the most the host tier may take."""
    return round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9, 1)


@dataclass
class EngineConfig(EvictionSettings):
    """Every engine option, with its default. `LLM(**options)` fills this in. The eviction
    settings (keyword arguments: nanokv/eviction/settings.py) are the defaults of requests
    whose SamplingParams leave them unset."""
    model: str | None = None            # HF directory or hub id; None = the bundled SmolLM2-135M
    dtype: torch.dtype | str = "auto"   # auto: bfloat16 on CUDA, float32 on CPU
    device: str | None = None           # None: cuda if available, else cpu
    block_size: int = 16                # KV pairs per cache block (per KV head); a power of two,
                                        # >= 16 with the Triton kernels (the references take any)
    num_kv_blocks: int | None = None    # exact pool size; overrides kv_cache_gb
    kv_cache_gb: float | None = None    # pool size in GB (default on CPU: 1 GB)
    gpu_memory_utilization: float = 0.9  # on CUDA without a size: fraction of memory to use
    max_num_seqs: int = 64              # sequences in one step
    max_num_batched_tokens: int = 2048  # tokens in one step (prefill chunks + decodes)
    max_model_len: int | None = None    # prompt + output limit; default: the model's context
    seed: int = 0                       # for requests that give no seed of their own
    enforce_eager: bool = False         # CUDA: no decode graphs (debugging, profiling)
    overlap_steps: bool = True          # the next step is scheduled and launched before this one's tokens are read
    enable_prefix_caching: bool = True  # prompts that start alike share the KV blocks of their common start
    kv_cache_dtype: str = "auto"        # "auto" (the model's dtype), "int8" or "fp8" (e4m3): a quantized cache
    num_threads: int | None = None      # CPU threads for torch's ops, for the whole process; None: torch's own
    kv_offload_gb: float = 0.0          # the host tier: KV blocks in host memory beside the pool (0: none),
                                        # for swapped sequences and prefix-cached blocks reclaimed from the pool
                                        # (split models: in all, each rank holding its heads' part)
    preemption_mode: str | None = None  # a preempted sequence's K/V: "swap" to the host tier (exact, kept
                                        # as it was), "recompute" from its tokens, or "auto": swap when that is
                                        # quicker (measured at start); None: auto with a host tier
    decode_from_host: bool = False      # when the pool runs short, running sequences that never evict move
                                        # their full blocks to the host tier and go on decoding, their K/V
                                        # streamed back layer by layer, before anyone is preempted (KVPR)
    partial_recompute: bool = True      # decoding from the host: the first positions' K/V recomputed from
                                        # their layer inputs instead of moved, where that is quicker (KVPR's
                                        # split, from the link and device measured at start); False: all moved

    press_window: int = 0               # a press that reads hidden states (kvpress's SnapKV: window_size + 1, TOVA:
                                        # 1) is handed the layer inputs of its sequence's last press_window
                                        # positions, kept on the device for max_num_seqs sequences (L x hidden
                                        # values a position each, counted before the pool is sized); 0: none

    tensor_parallel_size: int = 1       # ranks the model is split over by heads (models/tensor_parallel.py):
                                        # this process is rank 0 and starts the others (nanokv/engine/workers.py)

    def __post_init__(self):
        check_type("model", self.model, (str,), "a model directory or hub id (str)", optional=True)
        check_type("dtype", self.dtype, (str, torch.dtype), "a torch.dtype or its name")
        check_type("device", self.device, (str, torch.device), "a device ('cuda', 'cpu', ...)", optional=True)
        check_int("block_size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        check_int("num_kv_blocks", self.num_kv_blocks, 1, optional=True)
        check_float("kv_cache_gb", self.kv_cache_gb, 0, low_open=True, optional=True)
        check_float("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, low_open=True)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_num_batched_tokens < self.block_size:   # most likely the two mixed up
            raise ValueError(f"max_num_batched_tokens must be at least block_size = {self.block_size}, "
                             f"got {self.max_num_batched_tokens}")
        check_int("max_model_len", self.max_model_len, 2, optional=True)
        check_int("seed", self.seed, *SEED_RANGE)
        check_bool("enforce_eager", self.enforce_eager)
        check_bool("overlap_steps", self.overlap_steps)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, tuple(KV_CACHE_DTYPES))
        check_int("num_threads", self.num_threads, 1, optional=True)
        check_float("kv_offload_gb", self.kv_offload_gb, 0, host_memory_gb())
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES, optional=True)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int("press_window", self.press_window, 0)
        check_bool("decode_from_host", self.decode_from_host)
        check_bool("partial_recompute", self.partial_recompute)
        if self.decode_from_host and not self.kv_offload_gb:
            raise ValueError("decode_from_host=True needs the host tier: give kv_offload_gb > 0")
        if self.preemption_mode in ("auto", "swap") and not self.kv_offload_gb:
            raise ValueError(f"preemption_mode={self.preemption_mode!r} needs the host tier: give kv_offload_gb > 0")
        if self.preemption_mode == "recompute" and self.kv_offload_gb and not (self.enable_prefix_caching
                                                                                or self.decode_from_host):
            raise ValueError(f"kv_offload_gb={self.kv_offload_gb} with preemption_mode='recompute', no prefix caching "
                             "and no decode_from_host leaves the host tier unused: those three are what use it")
        self.preemption_mode = self.preemption_mode or ("auto" if self.kv_offload_gb else "recompute")
        if self.kv_cache_dtype == "fp8" and KV_CACHE_DTYPES["fp8"] not in QUANT_MAX:
            raise ValueError(f"kv_cache_dtype='fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} "
                             "lacks; use 'int8' or 'auto'")
        self.check_eviction_settings()


def resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    """Accept a torch dtype or its name ('float16', 'bf16', 'auto', ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float64": torch.float64,  # for exact-comparison tests
             "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    name = str(dtype).removeprefix("torch.")
    if name not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(names)}")
    return names[name]
