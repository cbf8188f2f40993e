"""A dense, unpaged float64 decoder written in plain torch from the weights of the tiny
random HF models, which the eviction oracles of this folder build on: every (layer, KV
head) holds a plain list of KV pairs (dense tensors, one row per pair, in position order)
with each pair's original position and its accumulated attention. It implements the
eviction methods straight from the paper (Algorithm 1, Section 3.2, Algorithm 2), with none
of the engine's machinery: no blocks, no slots, no kernels, no batching. Both sides run in
float64 so that rounding cannot flip a ranking at the eviction boundary.
"""
from __future__ import annotations

import copy
import math
from unittest.mock import patch

import torch

from helpers import FAMILIES, make_tiny_model
from kernels.kv_store import dequantize, quantize

BLOCK = 16


# ----- the oracle -------------------------------------------------------------------------

class LayerKV:
    """One layer's KV lists: row j of head h is one kept pair, rows in position order.

    All KV heads of a layer always hold the same number of pairs (every eviction
    removes the same count from each head), so the lists fit in dense tensors, but
    each head chooses *which* pairs it keeps on its own.
    """

    def __init__(self, num_kv_heads: int, head_dim: int):
        self.k = torch.empty(num_kv_heads, 0, head_dim, dtype=torch.float64)
        self.v = torch.empty(num_kv_heads, 0, head_dim, dtype=torch.float64)
        self.pos = torch.empty(num_kv_heads, 0, dtype=torch.long)         # kv_ids
        self.score = torch.empty(num_kv_heads, 0, dtype=torch.float64)   # sum_weights

    def __len__(self) -> int:
        return self.pos.shape[1]

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """New pairs [Hkv, T, D] at positions [T]; they start with sum_weights 0."""
        self.k = torch.cat([self.k, k], dim=1)
        self.v = torch.cat([self.v, v], dim=1)
        self.pos = torch.cat([self.pos, pos.expand(self.pos.shape[0], -1)], dim=1)
        fresh = torch.zeros(self.score.shape[0], len(pos), dtype=torch.float64)
        self.score = torch.cat([self.score, fresh], dim=1)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep rows [Hkv, n'] (per head, ascending, so position order is preserved)."""
        self.k = self.k.gather(1, rows[..., None].expand(-1, -1, self.k.shape[-1]))
        self.v = self.v.gather(1, rows[..., None].expand(-1, -1, self.v.shape[-1]))
        self.pos = self.pos.gather(1, rows)
        self.score = self.score.gather(1, rows)

    def evict_lowest_average(self, count: int, curr_id: int) -> None:
        """Section 3.2: drop the `count` pairs with the smallest sum_weights / (curr_id + 1 - kv_id).

        A stable ascending sort over rows in position order: on an exact tie the lower
        position goes first (the convention the engine documents).
        """
        average = self.score / (curr_id + 1 - self.pos)
        order = torch.sort(average, dim=1, stable=True).indices
        self.keep(order[:, count:].sort(dim=1).values)

    def keep_most_recent(self) -> None:
        """Algorithm 2: remove all but the most recent pair (the last row)."""
        self.keep(torch.full((self.pos.shape[0], 1), len(self) - 1, dtype=torch.long))


class Oracle:
    """A float64 re-implementation of a tiny HF llama-style decoder with evicting KV lists.

    It reads the HF module tree's weights and calls only its Linear/MLP/embedding
    submodules; RMSNorm and RoPE are written out because HF's RMSNorm computes in
    float32 and its rotary module in float32 angles, which would waste float64.
    """

    def __init__(self, hf):
        cfg = hf.config
        rope = getattr(cfg, "rope_parameters", None) or {}
        assert rope.get("rope_type", "default") == "default", "the oracle implements plain RoPE only"
        assert not hasattr(hf.model.layers[0].self_attn, "q_norm"), "the oracle has no QK-norm"
        self.model = copy.deepcopy(hf.model).double().eval()
        self.lm_head = copy.deepcopy(hf.lm_head).double()
        self.eps = cfg.rms_norm_eps
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        theta = getattr(cfg, "rope_theta", None) or rope.get("rope_theta", 10000.0)
        half = torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
        self.inv_freq = 1.0 / theta ** half
        self.kv_cache_dtype = None   # int8 / fp8: the pairs are kept as a quantized cache gives them back

    def quantized(self, kv_cache_dtype: torch.dtype) -> "Oracle":
        """The same oracle, keeping each new K and V row quantized and dequantized (per token and
        KV head, kernels/kv_store.py), as an engine with that kv_cache_dtype does."""
        oracle = copy.copy(self)
        oracle.kv_cache_dtype = kv_cache_dtype
        return oracle

    # --- the decoder ---

    def rms_norm(self, x: torch.Tensor, norm) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * norm.weight

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate x [heads, T, D] by its true positions (HF's rotate-half layout).

        cos/sin are rounded to float32 values, as both HF and the engine tabulate them:
        the positions are what matters here, and this keeps the float64 runs within
        ~1e-15 of each other instead of 1e-7.
        """
        angles = pos[:, None].double() * self.inv_freq
        cos, sin = angles.cos().float().double(), angles.sin().float().double()
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    @torch.no_grad()
    def forward(self, cache: list[LayerKV], ids: list[int], positions: list[int]) -> torch.Tensor:
        """Process a block of tokens at `positions` against the cached pairs plus the
        block itself (causally); append the block's pairs and add every query's softmax
        probabilities to the sum_weights of the pairs it attended to. Returns logits [T, V]."""
        pos = torch.tensor(positions)
        T, H, Hkv, D = len(ids), self.num_heads, self.num_kv_heads, self.head_dim
        group = H // Hkv   # query heads h*group .. h*group+group-1 share KV head h (HF's repeat_kv)
        x = self.model.embed_tokens(torch.tensor(ids))
        for layer, kv in zip(self.model.layers, cache):
            attn = layer.self_attn
            h = self.rms_norm(x, layer.input_layernorm)
            q = self.rope(attn.q_proj(h).view(T, H, D).transpose(0, 1), pos)
            k = self.rope(attn.k_proj(h).view(T, Hkv, D).transpose(0, 1), pos)  # RoPE'd before caching
            v = attn.v_proj(h).view(T, Hkv, D).transpose(0, 1)
            if self.kv_cache_dtype is not None:
                k, v = (dequantize(*quantize(x, self.kv_cache_dtype)).double() for x in (k, v))
            kv.append(k, v, pos)
            keys, values = kv.k.repeat_interleave(group, 0), kv.v.repeat_interleave(group, 0)
            logits = q @ keys.transpose(1, 2) / math.sqrt(D)                      # [H, T, n]
            future = kv.pos.repeat_interleave(group, 0)[:, None, :] > pos[None, :, None]
            probs = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
            kv.score += probs.view(Hkv, group, T, -1).sum(dim=(1, 2))
            x = x + attn.o_proj((probs @ values).transpose(0, 1).reshape(T, H * D))
            x = x + layer.mlp(self.rms_norm(x, layer.post_attention_layernorm))
        return self.lm_head(self.rms_norm(x, self.model.norm))

    # --- the methods ---

    def generate(self, prompt: list[int], method: str, max_tokens: int,
                 budget: int = 0, evict_every: int = 0) -> tuple[list[int], torch.Tensor]:
        """Greedy tokens and the kept positions [layers, kv_heads, n] when the request
        finishes (after the last token was sampled; that token is never fed)."""
        B, p, s = budget, evict_every, len(prompt)
        cache = [LayerKV(self.num_kv_heads, self.head_dim) for _ in self.model.layers]

        def size() -> int:
            return len(cache[0])

        def evict(count: int, curr_id: int) -> None:
            for kv in cache:
                kv.evict_lowest_average(count, curr_id)

        if method == "batchmax":   # Algorithm 1, prefill: blocks of p after the first |kv|
            t1 = min(s, B)
            logits = self.forward(cache, prompt[:t1], list(range(t1)))
            while t1 < s:
                evict(p, curr_id=t1 - 1)
                t0, t1 = t1, min(s, t1 + p)
                logits = self.forward(cache, prompt[t0:t1], list(range(t0, t1)))
        else:                      # full, ed, decode_only: one unevicted prefill
            logits = self.forward(cache, prompt, list(range(s)))
            if method == "ed":     # Algorithm 2: right after the prefill
                for kv in cache:
                    kv.keep_most_recent()
            assert method in ("full", "ed", "decode_only"), method

        tokens = [int(logits[-1].argmax())]
        for position in range(s, s + max_tokens - 1):   # feed every sampled token but the last
            if method == "decode_only" and position == s and size() > B - p:
                evict(size() - (B - p), curr_id=s - 1)   # once, before the first generated token
            elif method in ("batchmax", "decode_only") and size() == B:
                evict(p, curr_id=position - 1)
            logits = self.forward(cache, tokens[-1:], [position])
            if method == "ed" and size() == B:        # Algorithm 2: evict as soon as it is full
                for kv in cache:
                    kv.keep_most_recent()
            if method != "full":
                assert size() <= B
            tokens.append(int(logits[-1].argmax()))
        return tokens, torch.stack([kv.pos for kv in cache])


# ----- models and prompts -----------------------------------------------------------------

def make_mha_model(path):
    """The tiny llama with as many KV heads as query heads (multi-head attention)."""
    mha = dict(FAMILIES["llama"], num_key_value_heads=FAMILIES["llama"]["num_attention_heads"])
    with patch.dict(FAMILIES, {"llama-mha": mha}):
        return make_tiny_model(path, "llama-mha", seed=1)


def sharpen(hf, path, scale: float = 12.0):
    """Scale W_q and W_k so attention is peaked, and save the model again.

    At HF's initialisation the attention logits of the tiny models are ~0.03, so
    attention is almost uniform and the average-attention rule degenerates into
    "keep the oldest pairs" everywhere: a wrong score would go unnoticed. Peaked
    attention makes each head's choice depend on its actual scores.
    """
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(scale)
            layer.self_attn.k_proj.weight.mul_(scale)
    hf.save_pretrained(path)
    return hf


def build(kind: str, path):
    """(model directory, HF model, oracle) for a GQA (4 query / 2 KV heads) or an MHA model."""
    hf = make_tiny_model(path, "llama") if kind == "gqa" else make_mha_model(path)
    hf = sharpen(hf, path)
    return path, hf, Oracle(hf)


def distinct_prompt(length: int, seed: int) -> list[int]:
    """Random distinct byte tokens. K-norm ranks keys by their norm, and equal tokens have
    equal layer-0 keys before RoPE, which keeps norms: a tie in exact arithmetic that only
    rounding breaks. So its prompts repeat no token, and its cases end before it would rank
    generated tokens (which may repeat the prompt's)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(256, generator=g)[:length].tolist()


# ----- the engine beside it ---------------------------------------------------------------

def engine(path, **options):
    """A float64 engine: exact comparisons with the float64 oracle."""
    from nanokv import LLM

    return LLM(str(path), **dict(dict(dtype="float64", num_kv_blocks=128, max_model_len=256,
                                      block_size=BLOCK), **options))


def request(method: str, max_tokens: int, budget: int | None = None, evict_every: int | None = None):
    """SamplingParams for one greedy request; kept positions asked for wherever allowed."""
    from nanokv import SamplingParams

    extra = {} if method == "full" else dict(kv_budget=budget, return_kept_positions=True)
    if evict_every is not None:
        extra["evict_every"] = evict_every
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, kv_method=method, **extra)


def differences(label: str, out, tokens: list[int], kept: torch.Tensor | None) -> list[str]:
    """What the engine's output does differently from the oracle's, in words (empty: same)."""
    found = []
    if list(out.token_ids) != tokens:
        first = next((i for i, (a, b) in enumerate(zip(out.token_ids, tokens)) if a != b),
                     min(len(tokens), len(out.token_ids)))
        found.append(f"{label}: tokens differ from index {first}: "
                     f"engine {list(out.token_ids)[first:first + 5]} oracle {tokens[first:first + 5]}")
    if kept is None:
        return found
    got = out.kept_positions
    if got is None or tuple(got.shape) != tuple(kept.shape):
        return found + [f"{label}: kept_positions shape {None if got is None else tuple(got.shape)}, "
                        f"oracle {tuple(kept.shape)}"]
    for layer, head in zip(*torch.nonzero((got.long() != kept).any(-1), as_tuple=True)):
        engine_only = sorted(set(got[layer, head].tolist()) - set(kept[layer, head].tolist()))
        oracle_only = sorted(set(kept[layer, head].tolist()) - set(got[layer, head].tolist()))
        found.append(f"{label}: layer {layer} KV head {head} keeps {engine_only} instead of {oracle_only}")
    return found
