"""Named model shapes with random weights, for timing without downloading anything.

Throughput does not depend on the weight values, so benchmarks build these
from a config dict (the keys of an HF config.json) and fill them with noise:
`LLM("random:llama-3.1-8b")`.
"""
from __future__ import annotations

import torch

from models.config import ModelConfig

SHAPES = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True),
    # multi-head (as many KV heads as query heads): a layer's input is half its K/V (KVPR pays)
    "llama-2-7b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False),
    # The Batch-Max paper's second model: multi-head, head_dim 96, LongRoPE (its factors here are
    # placeholders: they change the rotation's angles, not what a step costs)
    "phi-3.5-mini": dict(
        architectures=["Phi3ForCausalLM"], vocab_size=32064, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=131072, original_max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 48, long_factor=[1.0 + i / 8 for i in range(48)])),
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
    # A forward pass and a sampling that cost next to nothing (a vocabulary of bytes): what the engine
    # does around them is what shows (bench.py --mode host).
    "tiny": dict(
        architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=True),
}


RANDOM_PREFIX = "random:"


def shape_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known shapes: {', '.join(SHAPES)}")
    return ModelConfig.from_hf(SHAPES[name])


def fill_random(model: torch.nn.Module) -> None:
    """Random weights for timing: norms 1, the rest small noise (the same on every run)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    for pname, p in model.named_parameters():
        if "norm" in pname:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=generator)
