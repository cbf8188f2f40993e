"""The two configuration objects: the model's shape (parsed from config.json)
and the engine's options. Everything else reads these; nothing else parses
config.json or keeps its own copy of an option."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels.kv_store import QUANT_MAX
from nanokv.checks import SEED_RANGE, check_bool, check_choice, check_float, check_int, check_type
from nanokv.eviction import METHODS, SCHEDULE_NAMES

# HF `architectures` name -> the family flags our one decoder needs.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=False, qk_norm=True),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# kv_cache_dtype: "auto" is the model's dtype; the others quantize the cache (kernels/kv_store.py).
KV_CACHE_DTYPES = {"auto": None, "int8": torch.int8, "fp8": getattr(torch, "float8_e4m3fn", None)}


@dataclass
class ModelConfig:
    """The shape of a decoder-only transformer, as the model code needs it."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or hf.get('model_type')!r}; "
                f"nanokv supports {', '.join(SUPPORTED_ARCHITECTURES)}")
        # transformers >= 5 writes rope_theta and the scaling into "rope_parameters".
        scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
        rope_theta = hf.get("rope_theta") or (scaling or {}).get("rope_theta", 10000.0)
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"unsupported rope_scaling type {rope_type!r}; "
                                 f"nanokv supports {', '.join(SUPPORTED_ROPE_TYPES)}")
            scaling = dict(scaling, rope_type=rope_type)
            if rope_type == "default":
                scaling = None
        eos = hf.get("eos_token_id")
        num_heads = hf["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            rope_scaling=scaling,
            sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", True) else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            **SUPPORTED_ARCHITECTURES[arch],
        )

    @classmethod
    def from_dir(cls, path: Path) -> "ModelConfig":
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{path} has no config.json: is it a Hugging Face model directory?")
        return cls.from_hf(json.loads(config_file.read_text()))


@dataclass
class EngineConfig:
    """Every engine option, with its default. `LLM(**options)` fills this in."""
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
    enable_prefix_caching: bool = True  # prompts that start alike share the KV blocks of their common start
    kv_cache_dtype: str = "auto"        # "auto" (the model's dtype), "int8" or "fp8" (e4m3): a quantized cache
    # Defaults for requests whose SamplingParams leave them unset (nanokv/eviction/).
    kv_method: str | None = None        # a ranking (METHODS): "full", "batchmax", "h2o", ...; None: full,
                                        # or with a kv_budget the recommended method (eviction.make_method)
    kv_schedule: str | None = None      # "prefill", "decode" or "once"; None: the ranking's own
    kv_budget: int | None = None        # |kv|: most KV pairs kept per KV head; None: 1024 for a named method
    evict_every: int = 64               # p: pairs evicted at a time
    kv_sinks: int | None = None         # first positions never evicted; None: the ranking's default
    kv_recent: int | None = None        # most recent pairs never evicted; None: the ranking's default
    kv_window: int | None = None        # snapkv's / kvcompress's observation window; None: 32 / 8
    kv_pool: int | None = None          # snapkv's odd max-pooling kernel; None: 7
    kv_score_all: bool | None = None    # kvcompress: KVC-full's scores (every query); None: False (KVC-w)

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
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, tuple(KV_CACHE_DTYPES))
        if self.kv_cache_dtype == "fp8" and KV_CACHE_DTYPES["fp8"] not in QUANT_MAX:
            raise ValueError(f"kv_cache_dtype='fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} "
                             "lacks; use 'int8' or 'auto'")
        check_choice("kv_method", self.kv_method, METHODS, optional=True)   # LLM checks the rest with make_method
        check_choice("kv_schedule", self.kv_schedule, SCHEDULE_NAMES, optional=True)
        check_int("kv_budget", self.kv_budget, 1, optional=True)
        check_int("evict_every", self.evict_every, 1)
        check_int("kv_sinks", self.kv_sinks, 0, optional=True)
        check_int("kv_recent", self.kv_recent, 0, optional=True)
        check_int("kv_window", self.kv_window, 1, optional=True)
        check_int("kv_pool", self.kv_pool, 1, optional=True)
        check_bool("kv_score_all", self.kv_score_all, optional=True)


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
