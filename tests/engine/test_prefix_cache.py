"""Prefix caching: the same outputs with and without it, consistent books, sound sharing under eviction."""
import random
from collections import Counter

import pytest
import torch

from helpers import VOCAB
from models import HostKVCache
from nanokv import LLM, SamplingParams
from nanokv.engine.block_manager import BlockManager
from nanokv.engine.prefix_cache import PrefixCache

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engine(tiny_dir, caching: bool, **options) -> LLM:
    options = dict(dict(num_kv_blocks=64, max_model_len=256), **options)
    return LLM(str(tiny_dir), dtype="float64", enable_prefix_caching=caching, **options)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def check_books(llm: LLM) -> None:
    """Every reference is a running sequence's; a block no one holds is free or cached, never both."""
    blocks, n = llm.blocks, llm.blocks.num_blocks
    held = Counter(block for seq in llm.scheduler.running for block in seq.block_table)
    assert blocks.ref_counts == [held[b] for b in range(n)]
    free, reclaimable = set(blocks.free_blocks), set(blocks.reclaimable)
    assert len(free) == len(blocks.free_blocks) and not free & reclaimable
    assert free | reclaimable == {b for b in range(n) if not held[b]}
    cached = set(blocks.cache.keys) if blocks.cache else set()
    assert reclaimable <= cached and not free & cached
    # The host tier: each block is a swapped sequence's, free, or a spilled cached block, one of them.
    swapped = [b for seq in llm.scheduler.waiting if seq.swapped is not None for b in seq.swapped.host]
    spilled, host_free = set(blocks.host_reclaimable), set(blocks.free_host_blocks)
    assert sorted(swapped + list(spilled) + list(host_free)) == list(range(blocks.num_host_blocks))
    assert spilled == set(blocks.cache.host_keys if blocks.cache else ())


def test_shared_system_prompt_chat_turns_and_block_boundaries_match_no_caching(tiny_dir):
    system = tokens(40, seed=1)   # 2 full blocks of 16, and 8 tokens into the third
    tail = tokens(20, seed=2)
    rounds = [
        [system + tokens(5, seed=3), system + tail, system + tokens(33, seed=4)],  # common part ends in a block
        [system[:32] + tokens(n, seed=n) for n in (1, 16)],   # ... exactly at a block boundary
        [system + tail[:8], system + tail[:10]],   # 48 and 50 tokens whose 3 full blocks are all cached
        [system + tokens(5, seed=3)],              # an earlier prompt again
    ]
    results, cached = {}, None
    for caching in (False, True):
        llm = engine(tiny_dir, caching, max_num_batched_tokens=32)   # later prompts admitted while the first runs
        outs = [llm.generate(prompts, GREEDY) for prompts in rounds]
        turn = outs[0][0]   # a chat: the next prompt is the conversation so far and a new message
        conversation = turn.prompt_token_ids + turn.token_ids + tokens(7, seed=5)
        outs.append(llm.generate([conversation], GREEDY))
        results[caching] = [[o.token_ids for o in round_] for round_ in outs]
        check_books(llm)
        if caching:
            cached = [[o.num_cached_tokens for o in round_] for round_ in outs]
    assert results[True] == results[False]
    # A prompt that is all cached still computes its last block (at least one token is computed).
    # The chat turn: 45 prompt + 8 output tokens, 52 of them computed: 3 full blocks.
    assert cached == [[0, 32, 32], [32, 32], [32, 48], [32], [48]]


def test_a_batch_with_a_new_common_prefix_computes_it_once(tiny_dir):
    system = tokens(40, seed=8)
    prompts = [system + tokens(n, seed=80 + n) for n in (3, 9, 17)]
    params = [GREEDY, GREEDY, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, kv_method="streamingllm",
                                             kv_budget=32, evict_every=16)]
    outs = {caching: engine(tiny_dir, caching).generate(prompts, params) for caching in (False, True)}
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    # The first computes the prefix; the second shares its blocks in that same step; the third
    # evicts, so it would copy them, and a copy takes computed blocks only.
    assert [o.num_cached_tokens for o in outs[True]] == [0, 32, 0]


def test_a_failed_step_leaves_no_uncomputed_block_in_the_cache(tiny_dir, monkeypatch):
    llm = engine(tiny_dir, True)
    prompt = tokens(40, seed=9)
    request = llm.add_request(prompt, GREEDY)

    def failing(batch, clock=None):
        raise RuntimeError("the device fell over")
    monkeypatch.setattr(llm.runner, "run", failing)
    with pytest.raises(RuntimeError, match="fell over"):
        llm.step()
    monkeypatch.undo()
    llm.abort(request)
    check_books(llm)
    assert not llm.blocks.cache.index
    out, expected = llm.generate([prompt], GREEDY)[0], engine(tiny_dir, False).generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == expected.token_ids


def test_off_computes_every_token(tiny_dir):
    llm = engine(tiny_dir, False)
    prompt = tokens(40, seed=4)
    outs = llm.generate([prompt, prompt], GREEDY) + llm.generate([prompt], GREEDY)
    assert llm.blocks.cache is None and [o.num_cached_tokens for o in outs] == [0, 0, 0]


@pytest.mark.parametrize("host_blocks", [0, 10])
def test_random_workload_with_preemption_keeps_the_books(tiny_dir, host_blocks):
    """Shared prefixes, full and evicting requests, a pool so small that sequences are preempted
    and cached blocks reclaimed: outputs as without caching, books consistent after every step.
    With a small host tier: swapped, spilled to it, hit there and reclaimed from it too."""
    rng = random.Random(5)
    prefixes = [tokens(n, seed=50 + n) for n in (16, 30, 48)]
    methods = [dict(), dict(kv_method="streamingllm", kv_budget=32, evict_every=16),
               dict(kv_method="knorm", kv_schedule="decode", kv_budget=32, evict_every=16)]
    prompts = [rng.choice(prefixes) + tokens(rng.randint(1, 30), seed=i) for i in range(40)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 60), ignore_eos=True, **rng.choice(methods))
              for _ in prompts]
    expected = [o.token_ids for o in engine(tiny_dir, False, num_kv_blocks=512, max_model_len=160,
                                            max_num_seqs=64).generate(prompts, params)]
    llm = engine(tiny_dir, True, num_kv_blocks=12, max_model_len=160, max_num_seqs=16, max_num_batched_tokens=48)
    if host_blocks:
        gb = host_blocks * HostKVCache.bytes_per_block(llm.runner.kv_cache) / 1e9
        llm = engine(tiny_dir, True, num_kv_blocks=12, max_model_len=160, max_num_seqs=16, max_num_batched_tokens=48,
                     kv_offload_gb=gb, preemption_mode="swap")
        assert llm.blocks.num_host_blocks == host_blocks
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    got = {}
    while llm.has_unfinished():
        for out in llm.step():
            if out.finished:
                got[out.request_id] = out
        check_books(llm)
    assert [got[i].token_ids for i in ids] == expected
    assert llm.scheduler.num_preemptions >= 5 and sum(o.num_cached_tokens > 0 for o in got.values()) > 10
    assert llm.blocks.num_free == 12 and not any(llm.blocks.ref_counts)
    stats = llm.stats()
    if host_blocks:
        assert stats.swaps > 0 and stats.host_hits > 0 and stats.blocks_saved > 0


def test_an_aborted_request_lets_go_of_its_blocks(tiny_dir):
    llm = engine(tiny_dir, True)
    prompt = tokens(50, seed=6)
    llm.generate([prompt], GREEDY)
    request = llm.add_request(prompt, SamplingParams(max_tokens=20))
    llm.step()
    assert any(llm.blocks.ref_counts)
    llm.abort(request)
    check_books(llm)
    assert not any(llm.blocks.ref_counts) and llm.blocks.num_free == 64


def test_a_copy_that_does_not_fit_copies_fewer_blocks(tiny_dir):
    """An evicting request holds the cached blocks it copies while its own are allocated: in a
    pool too small for both it copies fewer (here 1 of 4) instead of waiting forever."""
    prefix = tokens(64, seed=10)
    prompt = prefix + tokens(40, seed=11)   # 7 blocks reserved: the prompt is read with a full cache
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, kv_method="knorm",
                            kv_schedule="decode", kv_budget=64, evict_every=16, return_kept_positions=True)
    outs = {}
    for caching in (False, True):
        llm = engine(tiny_dir, caching, num_kv_blocks=8, max_model_len=128)
        llm.generate([prefix + [1]], GREEDY)   # leaves 4 cached blocks no one holds
        outs[caching] = llm.generate([prompt], params)[0]
    assert outs[True].num_cached_tokens == 16
    assert outs[True].token_ids == outs[False].token_ids
    assert torch.equal(outs[True].kept_positions, outs[False].kept_positions)


def test_pool_pressure_reclaims_the_least_recently_used_first():
    cache = PrefixCache(2, ("model", "torch.float32"))
    blocks = BlockManager(6, 2, cache)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    for seq in (a, b):
        table = blocks.allocate(2)
        cache.add([], table, seq, 4)
        blocks.free(table)
    assert blocks.num_free == 6 and len(blocks.reclaimable) == 4
    hit = [h.block for h in cache.match(a, 4)]
    blocks.share(hit)   # a is used again: b is now the least recently used
    blocks.free(hit)
    blocks.allocate(3)   # the 2 never-used blocks, then b's last block (a prefix's tail goes first)
    assert len(cache.match(a, 4)) == 2 and len(cache.match(b, 4)) == 1
    blocks.allocate(2)   # b's first block, then a's last
    assert len(cache.match(a, 4)) == 1 and cache.match(b, 4) == []


def test_a_reclaimed_parent_orphans_its_children():
    """Entries name their parent by a serial that is never reused: once a block is reclaimed and
    holds other tokens, the blocks cached after it cannot be served after the new tokens."""
    cache = PrefixCache(2, ("model", "torch.float32"))
    blocks = BlockManager(2, 2, cache)
    parent, child = table = blocks.allocate(2)
    cache.add([], table, [1, 2, 3, 4], 4)
    blocks.free([parent])
    blocks.free([child])   # the parent is now the least recently used
    [reused] = blocks.allocate(1)
    assert reused == parent and not cache.holds(parent) and cache.holds(child)
    cache.add([], [reused], [9, 9], 2)   # the parent's id holds other tokens
    assert [h.block for h in cache.match([9, 9, 3, 4], 4)] == [reused]   # not the child of [1, 2]
    assert cache.match([1, 2, 3, 4], 4) == []


def test_a_spill_reclaimed_in_its_own_step_is_not_copied():
    """A cached block spills to the only host block, which the same step then takes for a
    swap: the spill's copy must go, or two copies would land in one host block."""
    cache = PrefixCache(2, ("model", "torch.float32"))
    blocks = BlockManager(1, 2, cache, num_host_blocks=1)
    table = blocks.allocate(1)
    cache.add([], table, [1, 2], 2)
    blocks.free(table)
    blocks.allocate(1)   # reclaims the cached block: it spills to host block 0
    assert blocks.spills == [(0, 0)]
    assert blocks.allocate_host(1) == [0] and blocks.take_spills() == []
    assert cache.match([1, 2], 2) == []


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_evicting_requests_share_soundly(tiny_dir, kv_cache_dtype):
    """Full-cache and evicting requests behind one cached prefix: every request keeps the same
    positions and tokens as without caching; the shared blocks are never written. int8: the
    private copies carry the scales of their pairs."""
    prefix = tokens(64, seed=7)
    # (method, prompt tokens after the prefix, tokens it may take from the cache): the full cache
    # all; a ranking that needs no scores what it reads before its first eviction (streamingllm
    # under prefill: |kv| = 32; knorm, ed and tova: the prompt, tova's window being its last
    # query); snapkv only what comes before its window (at 70 - 16 = 54: 3 blocks), kvcompress too
    # (under prefill at 32 - 8 = 24: 1 block); batchmax, h2o and KVC-full (every query counts) none
    cases = [(dict(), 10, 64), (dict(kv_method="streamingllm", kv_budget=32), 13, 32),
             (dict(kv_method="knorm", kv_budget=32), 16, 64), (dict(kv_method="ed", kv_budget=4), 19, 64),
             (dict(kv_method="tova", kv_budget=64), 22, 64),
             (dict(kv_method="snapkv", kv_budget=32, kv_window=16), 6, 48),
             (dict(kv_method="kvcompress", kv_budget=32), 9, 16),
             (dict(kv_method="batchmax", kv_budget=64), 28, 0), (dict(kv_method="h2o", kv_budget=64), 31, 0),
             (dict(kv_method="kvcompress", kv_budget=32, kv_score_all=True), 25, 0)]
    prompts = [prefix + tokens(n, seed=70 + n) for _, n, _ in cases]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, evict_every=16,
                             return_kept_positions="kv_method" in m, **m) for m, _, _ in cases]
    results = {}
    for caching in (False, True):
        llm = engine(tiny_dir, caching, kv_cache_dtype=kv_cache_dtype)
        llm.generate([prefix + [1]], GREEDY)   # the prefix is cached (with caching)
        cache = llm.runner.kv_cache
        keys = dict(llm.blocks.cache.keys) if caching else {}
        shared = sorted(keys)
        pages = cache.pages(torch.tensor(shared, dtype=torch.long)).flatten().long()
        before = [t[pages].clone() for t in cache.per_slot]
        results[caching] = llm.generate(prompts, params)
        if caching:
            assert len(shared) == 4 and all(llm.blocks.cache.keys[b] == keys[b] for b in shared)
            for t, was in zip(cache.per_slot, before):
                assert torch.equal(t[pages], was)
    for off, on in zip(results[False], results[True]):
        assert on.token_ids == off.token_ids
        assert (on.kept_positions is None) == (off.kept_positions is None)
        if on.kept_positions is not None:
            assert torch.equal(on.kept_positions, off.kept_positions)
    assert [o.num_cached_tokens for o in results[True]] == [n for _, _, n in cases]
