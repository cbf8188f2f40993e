"""The engine's KV-cache eviction against an independent oracle.

The oracle is a dense, unpaged float64 decoder written here in plain torch from the
weights of the tiny random HF models: every (layer, KV head) holds a plain list of
KV pairs (stored as dense tensors, one row per pair, in position order) together
with each pair's original position and its accumulated attention (sum_weights). It
implements the eviction methods straight from the paper (Algorithm 1, Section 3.2,
Algorithm 2) and issue 4, with none of the engine's machinery: no blocks, no slots,
no kernels, no batching. The engine must keep exactly the same positions in every
(layer, KV head) and produce exactly the same greedy tokens.

Both sides run in float64 so that rounding cannot flip a ranking at the eviction
boundary; a mismatch therefore means a semantic difference, not noise.
"""
from __future__ import annotations

import copy
import math
from unittest.mock import patch

import pytest
import torch

import kernels
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


@pytest.fixture(scope="module", params=["gqa", "mha"])
def model(request, tmp_path_factory):
    return build(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    return build("gqa", tmp_path_factory.mktemp("gqa"))


@pytest.fixture(params=["cpu", "torch"])
def backend(request):
    """Engine tests that run on both CPU kernel backends: the CPU path and the references."""
    before = kernels.forced_backend()
    kernels.set_backend(request.param)
    yield request.param
    kernels.set_backend(before)


def prompt(length: int, seed: int) -> list[int]:
    """Random byte tokens: a random model has no favourite text."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=g).tolist()


# ----- the oracle on its own --------------------------------------------------------------

def test_oracle_without_eviction_is_the_hf_model(model):
    """Teacher-forced through HF, the oracle's greedy continuation is HF's own argmax,
    and its logits equal HF's: the dense re-implementation is the same model."""
    _, hf, oracle = model
    ids, n = prompt(40, seed=0), 12
    tokens, kept = oracle.generate(ids, "full", n)
    full = ids + tokens[:-1]
    with torch.no_grad():
        expected = copy.deepcopy(hf).double()(torch.tensor([full])).logits[0]
    cache = [LayerKV(oracle.num_kv_heads, oracle.head_dim) for _ in oracle.model.layers]
    got = oracle.forward(cache, full, list(range(len(full))))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)   # HF's RMSNorm is float32 inside
    assert tokens == expected[len(ids) - 1:].argmax(-1).tolist()
    assert torch.equal(kept, torch.arange(len(full)).expand(oracle.model.config.num_hidden_layers,
                                                             oracle.num_kv_heads, -1))


def test_oracle_batchmax_with_room_for_everything_is_full(model):
    _, _, oracle = model
    ids = prompt(50, seed=1)
    full, _ = oracle.generate(ids, "full", 20)
    bm, kept = oracle.generate(ids, "batchmax", 20, budget=80, evict_every=16)
    assert bm == full and kept.shape[-1] == 50 + 20 - 1


def test_oracle_sizes_follow_the_algorithms(model):
    """Final cache sizes worked out by hand from Algorithms 1 and 2."""
    _, _, oracle = model
    ids = prompt(49, seed=2)   # B=32, p=16: prefill 32, evict to 16, +16 = 32, evict, +1 = 17
    # decode (20 tokens fed): 17 + 15 = 32; before the 16th feed evict to 16; then 16 + 5 = 21
    _, kept = oracle.generate(ids, "batchmax", 21, budget=32, evict_every=16)
    assert kept.shape[-1] == 21
    _, kept = oracle.generate(ids, "ed", 10, budget=2)
    assert kept[..., 0].eq(49 + 10 - 2).all() and kept.shape[-1] == 1
    _, kept = oracle.generate(ids, "ed", 1, budget=5)   # nothing fed: what prefill left
    assert kept.shape[-1] == 1 and kept.eq(48).all()
    _, kept = oracle.generate(ids, "decode_only", 1, budget=48, evict_every=16)
    assert kept.shape[-1] == 49   # nothing fed: it never evicted
    _, kept = oracle.generate(ids, "decode_only", 2, budget=48, evict_every=16)
    assert kept.shape[-1] == 33   # 49 down to |kv| - p = 32, then one fed
    assert (kept.diff(dim=-1) > 0).all()   # rows stay in position order
    # Heads choose for themselves: they do not all keep the same positions.
    assert not (kept == kept[:1, :1]).all()


# ----- the engine against the oracle ------------------------------------------------------

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


def run_against_oracle(llm, oracle, cases: list[tuple]) -> None:
    """Run every (method, budget, evict_every, prompt length, max_tokens) case in ONE generate
    call and compare each request with the oracle's run of it alone."""
    prompts = [prompt(s, seed=i) for i, (_, _, _, s, _) in enumerate(cases)]
    params = [request(m, n, b, p) for m, b, p, _, n in cases]
    outs = llm.generate(prompts, params)
    problems = []
    for (method, budget, p, s, n), ids, out in zip(cases, prompts, outs):
        tokens, kept = oracle.generate(ids, method, n, budget=budget or 0, evict_every=p or 0)
        label = f"{method} |kv|={budget} p={p} s={s} max_tokens={n}"
        problems += differences(label, out, tokens, None if method == "full" else kept)
    assert not problems, "\n".join(problems)


# Prompt lengths around the budget and the block boundaries.
BATCHMAX_CASES = ([("batchmax", 32, 16, s, 30) for s in (5, 31, 32, 33, 47, 48, 49, 80, 100)]
                  + [("batchmax", 32, 8, s, 30) for s in (33, 41, 70)]
                  + [("batchmax", 48, 16, s, 30) for s in (47, 65, 90)])


def test_batchmax_keeps_what_the_oracle_keeps(model, backend):
    """Algorithm 1 with the average-attention rule: per (layer, KV head) kept positions
    and the greedy tokens equal the oracle's, for MHA and GQA."""
    path, _, oracle = model
    run_against_oracle(engine(path), oracle, BATCHMAX_CASES)


def test_a_batch_of_methods_and_budgets_each_matches_its_oracle(gqa, backend):
    path, _, oracle = gqa
    run_against_oracle(engine(path), oracle, [
        ("batchmax", 32, 16, 70, 30), ("batchmax", 48, 16, 90, 30), ("full", None, None, 40, 30),
        ("ed", 2, None, 60, 30), ("ed", 5, None, 33, 30), ("decode_only", 48, 16, 100, 30),
        ("decode_only", 48, 16, 40, 30), ("decode_only", 48, 16, 20, 40)])


def test_every_method_on_an_int8_cache_matches_its_oracle(gqa):
    """kv_cache_dtype="int8": against the oracle that keeps every pair as the int8 cache gives
    it back, the same tokens and the same kept positions in every (layer, KV head) (against
    the unquantized oracle, the kept positions differ)."""
    path, _, oracle = gqa
    run_against_oracle(engine(path, kv_cache_dtype="int8"), oracle.quantized(torch.int8), [
        ("batchmax", 32, 16, 70, 30), ("full", None, None, 40, 30), ("ed", 5, None, 33, 30),
        ("decode_only", 48, 16, 100, 30)])


def test_batchmax_with_room_for_everything_is_full(model):
    """|kv| >= prompt + max_tokens: nothing is ever evicted, so batchmax is full."""
    path, _, oracle = model
    llm, shapes = engine(path), [(1, 30), (40, 30), (98, 30)]   # 98 + 30 = |kv| exactly
    prompts = [prompt(s, seed=s) for s, _ in shapes]
    full = llm.generate(prompts, [request("full", n) for _, n in shapes])
    bm = llm.generate(prompts, [request("batchmax", n, 128, 16) for _, n in shapes])
    for (s, n), ids, f, b in zip(shapes, prompts, full, bm):
        assert b.token_ids == f.token_ids == oracle.generate(ids, "full", n)[0]
        assert torch.equal(b.kept_positions.long(), torch.arange(s + n - 1).expand_as(b.kept_positions))


def test_ed_keeps_what_algorithm_2_says(gqa):
    """Algorithm 2 removes all but the most recent pair right after the prefill and right
    after each generated token that fills the cache, so with |kv| = 2 only the last fed
    token's pair (position s + max_tokens - 2) is left at the end, and with max_tokens = 1
    only the prompt's last. With |kv| = 5 the oracle decides."""
    path, _, oracle = gqa
    llm, shapes = engine(path), [(1, 1), (17, 1), (17, 2), (40, 25), (33, 30)]
    outs = llm.generate([prompt(s, seed=s) for s, _ in shapes], [request("ed", n, 2) for _, n in shapes])
    for (s, n), out in zip(shapes, outs):
        kept = out.kept_positions
        assert kept.shape[-1] == 1 and kept.eq(s + n - 2).all(), (s, n, kept)
    run_against_oracle(llm, oracle, [("ed", 5, None, s, 25) for s in (3, 7, 30)])


def test_the_cache_never_holds_more_than_the_budget(gqa, backend):
    """Step by step, with prefills chunked by a small token budget: every running batchmax
    sequence holds at most |kv| pairs per head in at most ceil(|kv| / block) blocks, the
    pool accounts for every block, and all of them are free at the end."""
    path, _, oracle = gqa
    llm = engine(path, max_num_batched_tokens=40)
    cases = [("batchmax", 32, 16, 20, 40), ("batchmax", 32, 16, 50, 40), ("batchmax", 32, 16, 100, 40),
             ("batchmax", 48, 16, 47, 40), ("batchmax", 48, 16, 90, 40), ("full", None, None, 30, 40)]
    ids = {}
    for i, (m, b, p, s, n) in enumerate(cases):
        ids[llm.add_request(prompt(s, seed=i), request(m, n, b, p))] = i
    outputs, steps = {}, 0
    while llm.has_unfinished():
        for out in llm.step():
            if out.finished:
                outputs[out.request_id] = out
        steps += 1
        running = llm.scheduler.running
        for seq in running:
            method, budget = cases[ids[seq.seq_id]][:2]
            if method == "batchmax":
                assert seq.num_kv_slots <= budget, (steps, cases[ids[seq.seq_id]], seq.num_kv_slots)
                assert len(seq.block_table) <= math.ceil(budget / BLOCK), (steps, seq.block_table)
        assert llm.blocks.num_free + sum(len(seq.block_table) for seq in running) == llm.blocks.num_blocks
    assert llm.blocks.num_free == llm.blocks.num_blocks
    problems = []
    for rid, i in ids.items():
        m, b, p, s, n = cases[i]
        tokens, kept = oracle.generate(prompt(s, seed=i), m, n, budget=b or 0, evict_every=p or 0)
        problems += differences(f"{cases[i]} (chunked, stepped)", outputs[rid], tokens,
                                None if m == "full" else kept)
    assert not problems, "\n".join(problems)


def test_preempted_requests_finish_with_the_same_output(gqa):
    """A pool of 7 blocks when one max_model_len sequence needs 6: the full requests grow
    and push the others out (a preempted batchmax request is recomputed from scratch);
    everything still finishes exactly as without memory pressure."""
    path, _, oracle = gqa
    cases = [("full", None, None, 30, 40), ("full", None, None, 50, 40),
             ("batchmax", 32, 16, 60, 30), ("batchmax", 32, 16, 80, 16), ("batchmax", 32, 8, 45, 40)]
    tight = engine(path, num_kv_blocks=7, max_model_len=96)
    run_against_oracle(tight, oracle, cases)
    assert tight.scheduler.num_preemptions > 0
    assert tight.blocks.num_free == tight.blocks.num_blocks
    run_against_oracle(engine(path, max_model_len=96), oracle, cases)   # and unconstrained
