"""One decoder-only transformer for Llama, Mistral, Qwen2, Qwen3 and Phi-3.

Plain PyTorch modules; the families differ only by config flags (qkv bias,
q/k RMSNorm, RoPE scaling, tied embeddings). The hot ops come from
`kernels`. The model knows nothing of sequences: it maps flat token ids and
positions to hidden states, reading and writing the KV cache through the
step's AttentionMetadata.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import kernels
from models.attention_metadata import AttentionMetadata
from models.config import ModelConfig
from models.kv_cache import KVCache
from models.tensor_parallel import Shard


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, shard: Shard):
        super().__init__()
        self.layer_idx, self.shard = layer_idx, shard
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k and v projections fused into one matmul (the loader fills the three parts).
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5

    def project(self, x: torch.Tensor, rope_rows: torch.Tensor | None, cos_sin: torch.Tensor | None):
        """q [T, Hq, D], k and v [T, Hkv, D] of layer inputs x [T, hidden], rotated by their rows
        rope_rows [T] of the cos/sin table (their positions but for LongRoPE's long prompts);
        None: not rotated (what a press reads: nanokv/eviction/press.py)."""
        q, k, v = (part.unflatten(-1, (-1, self.head_dim))
                   for part in self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1))
        norms = None if self.q_norm is None else kernels.QKNorms(self.q_norm.weight, self.k_norm.weight,
                                                                 self.q_norm.eps)
        if rope_rows is not None:   # before caching: a kept key keeps its position
            kernels.apply_rope(q, k, rope_rows, cos_sin, norms)   # the norms first, in the same pass
        elif norms is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata, cpu_plan: kernels.StepPlan | None) -> torch.Tensor:
        q, k, v = self.project(x, positions if meta.rope_rows is None else meta.rope_rows, cos_sin)
        i = self.layer_idx   # the pool serves every layer: this layer's pages come from its tables
        if meta.host_stream is not None:   # K/V of pages staged from the host tier (models/host_stream.py)
            meta.host_stream.before_attention(i, x, self, cos_sin)
        if meta.kept_inputs is not None:   # what a press reads at an eviction to come
            meta.kept_inputs.keep(i, x)
        kernels.store_kv(k, v, cache.k, cache.v, cache.positions, cache.scores,
                         meta.slot_mapping[i], positions, kv_scales=cache.kv_scales)
        out = kernels.paged_attention(q, cache.k, cache.v, meta.page_tables[i], meta.cu_seqlens_q,
                                      meta.context_lens[i], self.scale, max_query_len=meta.max_query_len,
                                      max_context_len=meta.max_context_len, num_decodes=meta.num_decodes,
                                      score_cache=cache.scores if meta.accumulate_scores else None,
                                      score_from=meta.score_from, square_scores=meta.square_scores,
                                      score_skip=meta.score_skip, positions=positions, pos_cache=cache.positions,
                                      logits=cache.logits, workspace=meta.decode_workspace,
                                      cpu_plan=None if cpu_plan is None else cpu_plan.layer(i),
                                      kv_scales=cache.kv_scales)
        return self.shard.all_reduce(self.o_proj(out.flatten(1)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard):
        super().__init__()
        self.shard = shard
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shard.all_reduce(self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, shard: Shard):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard)

    def forward(self, x, residual, positions, cos_sin, cache, meta, cpu_plan):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin, cache, meta, cpu_plan)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Decoder(nn.Module):
    """Token ids and positions in, hidden states out; `compute_logits` is separate
    so that only the rows that are sampled pay for the vocabulary projection. cfg: the shape
    this rank holds of a model split over shard.size ranks (models/tensor_parallel.py)."""

    def __init__(self, cfg: ModelConfig, max_len: int, shard: Shard = Shard()):
        super().__init__()
        self.config, self.shard, self.max_len = cfg, shard, max_len
        # A table as given, not nn.Embedding's random init: on the meta device that init imports
        # torch.compile's machinery (seconds).
        self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, shard) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # A float32 table, deliberately not a buffer: casting the model to bf16 must not touch it.
        self.cos_sin = kernels.rope_cos_sin_cache(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        # The CPU backend's gathers and masks for every layer, built once (None elsewhere).
        cpu_plan = kernels.plan_step(meta.page_tables, meta.cu_seqlens_q, meta.context_lens, cache.block_size,
                                     x.dtype, meta.accumulate_scores)
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.cos_sin, cache, meta, cpu_plan)
        if meta.host_stream is not None:
            meta.host_stream.finish()
        x, _ = self.norm(x, residual)
        return x

    @property
    def long_rope(self) -> bool:
        """LongRoPE (Phi-3): a token's row of cos_sin depends on its prompt's length too."""
        scaling = self.config.rope_scaling
        return scaling is not None and scaling["rope_type"] == "longrope"

    def rope_rows(self, positions: np.ndarray, prompt_lens: np.ndarray) -> np.ndarray | None:
        """Each token's row of cos_sin, of a sequence with a prompt of prompt_lens tokens, where
        some row is not the token's position (LongRoPE's long prompts: kernels.long_rope_rows), else None."""
        if not self.long_rope:
            return None
        original = self.config.rope_scaling["original_max_position_embeddings"]
        return kernels.long_rope_rows(positions, prompt_lens, original, self.max_len)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype: a greedy step takes only their argmax, and whatever computes with
        them (sampling, penalties, logprobs) takes them to float32 first."""
        if self.lm_head is None:   # tied: the embedding table is the output projection
            return F.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)

    def prepack_linears(self) -> None:
        """For the CPU backend: every matmul's weight in oneDNN's layout (kernels/linear_cpu.py).
        A tied output projection gets a packed copy of the embedding table too."""
        if self.lm_head is None and kernels.can_prepack(self.embed_tokens.weight):
            self.lm_head = kernels.PackedLinear(self.embed_tokens.weight, None)
        kernels.prepack_linears(self)
