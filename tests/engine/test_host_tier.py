"""The host tier (kv_offload_gb): swap preemption moves a preempted sequence's blocks to host
memory, as they are, and back when it resumes, so it goes on exactly as if it had never
been preempted, under every method and cache dtype; prefix-cached blocks reclaimed from
the device spill there and are found there."""
from __future__ import annotations

import pytest
import torch

from helpers import VOCAB, preemption_params as params, preemption_prompts as prompts
from models import HostKVCache, KVCache
from nanokv import LLM, SamplingParams

METHODS = ["full", "batchmax", "h2o", "tova", "snapkv", "streamingllm", "knorm", "ed", "kvcompress"]


def engine(tiny_dir, **options) -> LLM:
    return LLM(str(tiny_dir), dtype="float32", max_model_len=112, **options)


@pytest.mark.parametrize("method, kv_cache_dtype", [(method, "auto") for method in METHODS] + [
    (method, dtype) for dtype in ("int8", "fp8") for method in ("full", "h2o", "kvcompress")])   # scales move too
def test_swapping_gives_what_a_roomy_pool_gives(tiny_dir, method, kv_cache_dtype):
    roomy = engine(tiny_dir, num_kv_blocks=256, kv_cache_dtype=kv_cache_dtype).generate(prompts(), params(method))
    llm = engine(tiny_dir, num_kv_blocks=9 if method != "full" else 14, kv_offload_gb=0.01,
                 kv_cache_dtype=kv_cache_dtype, preemption_mode="swap")
    outs = llm.generate(prompts(), params(method))
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    for out, expected in zip(outs[1:], roomy[1:]):
        if expected.kept_positions is not None:
            assert torch.equal(out.kept_positions, expected.kept_positions)
    stats = llm.stats()
    assert stats.swaps > 0 and stats.preemptions == stats.swaps   # no sequence was recomputed
    assert stats.blocks_saved >= stats.blocks_loaded > 0   # saved: swapped out, and cached blocks spilled
    assert stats.free_blocks == stats.total_blocks and stats.host_blocks_used == 0


def test_a_swap_round_trip_is_bit_identical(tiny_models):
    """Every per-slot buffer (K, V, positions, scores, scales) of a block comes back as it
    left, into other blocks; the blocks around are untouched."""
    from models import ModelConfig

    config = ModelConfig.from_dir(tiny_models("llama"))
    cache = KVCache(config, 12, 16, torch.int8, torch.device("cpu"))
    for buffer in cache.per_slot:
        buffer.copy_(torch.randint(-100, 100, buffer.shape).to(buffer.dtype))
    before = [buffer.clone() for buffer in cache.per_slot]
    host = HostKVCache(cache, 4)
    host.save([2, 0], [3, 5])
    for buffer in cache.per_slot:
        buffer[cache.pages(torch.tensor([3, 5])).flatten()] = 0
    host.load([2, 0], [7, 1])
    moved = {3: 7, 5: 1}
    for old, buffer in zip(before, cache.per_slot):
        for src, dst in moved.items():
            assert torch.equal(buffer[cache.pages(torch.tensor([dst]))], old[cache.pages(torch.tensor([src]))])
        untouched = cache.pages(torch.tensor([b for b in range(12) if b not in (3, 5, 7, 1)])).flatten()
        assert torch.equal(buffer[untouched], old[untouched])


def test_page_tables_follow_their_blocks(tiny_models):
    from models import ModelConfig

    cache = KVCache(ModelConfig.from_dir(tiny_models("llama")), 10, 16, torch.float32, torch.device("cpu"))
    tables = cache.pages(torch.tensor([4, 2, 9]))   # [L, H, 3]
    assert torch.equal(cache.move_pages(tables, [2, 4], [7, 0]), cache.pages(torch.tensor([0, 7, 9])))


def test_auto_swaps_on_a_cpu(tiny_dir):
    """On a CPU a block's copy is quicker than its tokens' prefill, even for this tiny model (by
    about 16 times): auto (the default with a host tier) swaps, as swap does."""
    llm = engine(tiny_dir, num_kv_blocks=14, kv_offload_gb=0.01)
    assert llm.config.preemption_mode == "auto" and llm.scheduler.swap_cost.pays(1, 16)
    outs = llm.generate(prompts(), params("full"))
    assert [o.token_ids for o in outs] == [o.token_ids for o in engine(tiny_dir, num_kv_blocks=256).generate(
        prompts(), params("full"))]
    assert llm.stats().swaps == llm.stats().preemptions > 0


def test_an_aborted_swapped_sequence_gives_its_host_blocks_back(tiny_dir):
    llm = engine(tiny_dir, num_kv_blocks=9, kv_offload_gb=0.01, preemption_mode="swap")
    ids = [llm.add_request(p, q) for p, q in zip(prompts(), params("batchmax"))]
    while llm.stats().host_blocks_used == 0:
        llm.step()
    swapped = [seq for seq in llm.scheduler.waiting if seq.swapped is not None]
    llm.abort(swapped[0].seq_id)
    while llm.has_unfinished():
        llm.step()
    stats = llm.stats()
    assert stats.host_blocks_used == 0 and stats.free_blocks == stats.total_blocks and len(ids) == 6


def test_recompute_preemption_still_works_without_a_host_tier(tiny_dir):
    roomy = engine(tiny_dir, num_kv_blocks=256).generate(prompts(), params("full"))
    llm = engine(tiny_dir, num_kv_blocks=14)
    assert [o.token_ids for o in llm.generate(prompts(), params("full"))] == [o.token_ids for o in roomy]
    stats = llm.stats()
    assert stats.preemptions > 0 and stats.swaps == 0 and stats.host_blocks == 0


@pytest.mark.parametrize("options, message", [
    (dict(kv_offload_gb=-1), "kv_offload_gb"),
    (dict(kv_offload_gb=1e9), "kv_offload_gb"),
    (dict(kv_offload_gb="1"), "kv_offload_gb"),
    (dict(kv_offload_gb=1e-9), "holds no KV block"),
    (dict(preemption_mode="spill"), "preemption_mode"),
    (dict(preemption_mode="swap"), "kv_offload_gb > 0"),
    (dict(preemption_mode="auto"), "kv_offload_gb > 0"),
    (dict(preemption_mode="recompute", kv_offload_gb=1, enable_prefix_caching=False), "unused"),
])
def test_bad_host_tier_settings_are_clear_errors(tiny_dir, options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        engine(tiny_dir, num_kv_blocks=16, **options)


@pytest.mark.parametrize("follow_up", [{}, dict(kv_method="streamingllm", kv_schedule="decode", kv_budget=32,
                                                evict_every=16)])
def test_a_chat_follow_up_is_served_from_the_host_tier(tiny_dir, follow_up):
    """The first turn's blocks are cached, then reclaimed from the device by other requests:
    they spill to the host tier, and the next turn finds them there (a full-cache request
    shares them back on the device, an evicting one loads them into its own blocks)."""
    g = torch.Generator().manual_seed(1)
    first, others = torch.randint(0, VOCAB, (64,), generator=g).tolist(), torch.randint(0, VOCAB, (3, 90), generator=g)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = engine(tiny_dir, num_kv_blocks=8, kv_offload_gb=0.01)
    turn = llm.generate([first], greedy)[0]
    llm.generate(others.tolist(), greedy)
    assert llm.stats().host_cached_blocks >= 4
    follow = turn.prompt_token_ids + turn.token_ids + torch.randint(0, VOCAB, (7,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **follow_up)
    out = llm.generate([follow], params)[0]
    expected = engine(tiny_dir, num_kv_blocks=8, enable_prefix_caching=False).generate([follow], params)[0]
    assert out.token_ids == expected.token_ids
    assert out.num_cached_tokens == 64 and llm.stats().host_hits == 4
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks and stats.host_blocks_used == 0


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["full", "kvcompress"])
def test_swapping_on_a_gpu_gives_what_a_roomy_pool_gives(tiny_dir, method):
    """Pinned host blocks, the copies across the link, decodes from CUDA graphs."""
    roomy = engine(tiny_dir, device="cuda", num_kv_blocks=256).generate(prompts(), params(method))
    llm = engine(tiny_dir, device="cuda", num_kv_blocks=9 if method != "full" else 14, kv_offload_gb=0.01,
                 preemption_mode="swap")
    assert llm.runner.host_tier.cache.per_slot[0].is_pinned() and llm.runner.graphs is not None
    outs = llm.generate(prompts(), params(method))
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    stats = llm.stats()
    assert stats.swaps > 0 and stats.preemptions == stats.swaps and stats.host_blocks_used == 0
