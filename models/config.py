"""The shape of a model, parsed from its Hugging Face config.json: all the model code
needs, and the one place that reads config.json (and generation_config.json's EOS ids)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# HF `architectures` name -> the family flags our one decoder needs.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=False, qk_norm=True),
    "Phi3ForCausalLM": dict(qkv_bias=False, qk_norm=False),   # q/k/v and gate/up fused in the checkpoint
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass
class ModelConfig:
    """The shape of a decoder-only transformer, as the model code needs it."""
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
    eos_token_ids: list[int] = field(default_factory=list)   # config.json's (from_dir: generation_config.json's too)

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
        partial = (scaling or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported: nanokv rotates every dimension "
                             f"of a head (1.0)")
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            rope_type = "longrope" if rope_type == "su" else rope_type   # Phi-3's first configs call it "su"
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"unsupported rope_scaling type {rope_type!r}; "
                                 f"nanokv supports {', '.join(SUPPORTED_ROPE_TYPES)}")
            scaling = dict(scaling, rope_type=rope_type)
            if rope_type == "longrope":   # Phi-3 keeps the original length beside the scaling, and no factor
                original = scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
                if not original:
                    raise ValueError("a longrope rope_scaling needs original_max_position_embeddings (the length "
                                     "the model was trained at), in it or beside it in config.json")
                scaling.update(original_max_position_embeddings=original, factor=scaling.get("factor")
                               or hf.get("max_position_embeddings", original) / original)
            if rope_type == "default":
                scaling = None
        num_heads = hf["num_attention_heads"]
        return cls(
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
            eos_token_ids=_token_ids(hf.get("eos_token_id")),
            **SUPPORTED_ARCHITECTURES[arch],
        )

    @classmethod
    def from_dir(cls, path: Path) -> "ModelConfig":
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{path} has no config.json: is it a Hugging Face model directory?")
        config = cls.from_hf(json.loads(config_file.read_text()))
        generation = Path(path) / "generation_config.json"
        if generation.is_file():
            config.eos_token_ids += _token_ids(json.loads(generation.read_text()).get("eos_token_id"))
        return config


def _token_ids(value: int | list[int] | None) -> list[int]:
    """An HF token id setting (an id, a list of them, or None) as a list."""
    return [] if value is None else [value] if isinstance(value, int) else list(value)
