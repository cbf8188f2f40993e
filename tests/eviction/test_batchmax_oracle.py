"""The engine's KV-cache eviction against an independent oracle.

The oracle (oracle.py) is a dense float64 decoder that implements the eviction methods
straight from the paper. The engine must keep exactly the same positions in every
(layer, KV head) and produce exactly the same greedy tokens; both run in float64, so a
mismatch means a semantic difference, not noise.
"""
from __future__ import annotations

import copy
import math

import torch

from oracle import BLOCK, LayerKV, differences, engine, request


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
