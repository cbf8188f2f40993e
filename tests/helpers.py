"""Tiny random checkpoints of every supported family, written as HF directories, and a small
workload that outgrows a small pool."""
from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from nanokv import SamplingParams

VOCAB = 300   # 256 byte tokens + 2 specials, padded: ids 258..299 exist only in the model

# Where kernel tests run Triton: compiled on a GPU, else in the interpreter on the CPU (conftest).
# Tests of Triton build no tensor on a default device (tests/kernels/test_kernel_device.py).
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer with no merges: every byte is one token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<s>assistant: {% endif %}"}))


FAMILIES = {
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "llama3": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=1,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "mistral": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=None),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    # multi-head; LongRoPE: its short factors up to 32 positions, its long ones beyond (and for longer prompts)
    "phi3": dict(model_type="phi3", num_attention_heads=4, num_key_value_heads=4, pad_token_id=0,
                 original_max_position_embeddings=32,
                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                               "long_factor": [1.5 + i for i in range(8)]}),
}


def make_tiny_model(path: Path, family: str, tied: bool = False, seed: int = 0,
                    max_shard_size: str | None = None, layers: int = 2):
    """Write a random model of `family` (2 layers unless asked) to `path`; returns the HF model (fp32)."""
    import transformers

    cfg = transformers.AutoConfig.for_model(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, bos_token_id=256, eos_token_id=257, **FAMILIES[family])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():   # HF initialises biases and norms to constants: make them random
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    write_byte_tokenizer(path)
    return model


def preemption_prompts() -> list[list[int]]:
    """Six prompts, two of them sharing their first 32 tokens (prefix-cached blocks swap too)."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (40, 70, 55, 60, 33, 61)]
    ids[3][:32] = ids[1][:32]
    return ids


def preemption_params(method: str) -> list[SamplingParams]:
    """A full-cache request that grows (it preempts the newer ones), then five of method."""
    full = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    if method == "full":
        return [full] * 6
    window = dict(kv_window=8) if method == "snapkv" else {}
    evicting = SamplingParams(temperature=0, max_tokens=45, ignore_eos=True, kv_method=method, kv_budget=32,
                              evict_every=16, return_kept_positions=True, **window)
    return [full] + [evicting] * 5


@contextlib.contextmanager
def device_waits(record: Callable[[], None]):
    """Within it, each operation that makes the host wait for the CUDA device calls record()
    (torch's sync debug mode). The mode's own notice, once per process, that it is a prototype
    is not a wait."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *_, **__: None if "prototype" in str(message) else record()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
