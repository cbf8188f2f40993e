"""Decoding from the host tier (decode_from_host, KVPR): when the pool runs short, running
sequences that never evict move their full blocks to host memory and go on decoding, each
layer's K/V staged back (copied, or for the first positions recomputed from their kept
layer inputs), and the tokens are the ones a roomy pool gives.

The tiny llama's layer input (64 values) is as large as its K/V (2 x 2 heads x 16): KVPR's
split is 0 there and every block is copied. The tiny qwen3's K/V is twice its input (head
dim 32): the split recomputes most positions. The link and the device are fixed here
(instead of measured) so that the split does not depend on the machine."""
from __future__ import annotations

import pytest
import torch

import nanokv.engine.offload_costs
from helpers import preemption_params as params, preemption_prompts as prompts
from nanokv import LLM
from nanokv.engine.offload_costs import PositionCost, best_split
from nanokv.engine.scheduler import ScheduledBatch

HOST_GB = 0.0008   # 91 host blocks for the llama, 24 and the first 96 positions' layer inputs for the qwen3


@pytest.fixture(autouse=True)
def fixed_link_and_device(monkeypatch):
    monkeypatch.setattr(nanokv.engine.offload_costs, "measure_link_and_device", lambda *args: (1e9, 1e12))


def engine(directory, num_kv_blocks: int, **options) -> LLM:
    return LLM(str(directory), dtype="float32", max_model_len=112, max_num_seqs=8, num_kv_blocks=num_kv_blocks,
               **options)


def from_host(tiny_models, family: str, num_kv_blocks: int = 16, **options) -> LLM:
    """16 blocks: 4 of them stage (STAGING_SHARE: two halves of 4 pages for 2 layers), 12 hold what
    sequences decode on the device."""
    return engine(tiny_models(family), num_kv_blocks, kv_offload_gb=HOST_GB, decode_from_host=True, **options)


def assert_all_blocks_back(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks and stats.host_blocks_used == 0 and stats.offloaded_blocks == 0


@pytest.mark.parametrize("family, kv_cache_dtype, method, recomputes", [
    ("llama", "auto", "full", False), ("qwen3", "auto", "full", True),
    ("qwen3", "int8", "full", False),   # an 8-bit cache's K/V is smaller than the layer input
    ("qwen3", "auto", "h2o", True), ("qwen3", "auto", "kvcompress", True)])
def test_decoding_from_the_host_gives_what_a_roomy_pool_gives(tiny_models, family, kv_cache_dtype, method,
                                                             recomputes):
    """Full-cache requests decode from the host, as many blocks as the staging holds, before the
    newest are preempted (swapped); evicting ones beside them never offload."""
    roomy = engine(tiny_models(family), 256, kv_cache_dtype=kv_cache_dtype).generate(prompts(), params(method))
    llm = from_host(tiny_models, family, kv_cache_dtype=kv_cache_dtype, preemption_mode="swap")
    assert (llm.runner.host_tier.input_positions > 0) == recomputes
    outs = llm.generate(prompts(), params(method))
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    stats = llm.stats()
    assert stats.blocks_offloaded > 0 and stats.blocks_streamed > 0 and stats.preemptions == stats.swaps
    assert (stats.positions_recomputed > 0) == recomputes
    assert_all_blocks_back(llm)


def test_a_host_tier_too_small_for_every_context_preempts_the_newest(tiny_models):
    """Offloading stops when the host tier (7 blocks here, fewer than the staging's 8) is full;
    then the newest sequences are preempted, and recomputed: the tier has no room to swap them."""
    roomy = engine(tiny_models("qwen3"), 256).generate(prompts(), params("full"))
    llm = engine(tiny_models("qwen3"), 16, kv_offload_gb=0.0002, decode_from_host=True, preemption_mode="swap")
    assert [o.token_ids for o in llm.generate(prompts(), params("full"))] == [o.token_ids for o in roomy]
    stats = llm.stats()
    assert stats.host_blocks == 7 and stats.blocks_offloaded > 0 and stats.preemptions > stats.swaps
    assert_all_blocks_back(llm)


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_an_offloaded_sequence_that_is_preempted_resumes_exactly(tiny_models, preemption_mode):
    """Preempt a sequence decoding from the host (as the scheduler does when it is the newest and
    the pool is short): swapped, its device part joins its host part and all of it comes back;
    recomputed, its host blocks are given back. Either way it ends as it would have."""
    roomy = engine(tiny_models("qwen3"), 256).generate(prompts(), params("full"))
    llm = from_host(tiny_models, "qwen3", preemption_mode=preemption_mode)
    for prompt, p in zip(prompts(), params("full")):
        llm.add_request(prompt, p)
    while not any(seq.offloaded for seq in llm.scheduler.running):
        llm.step()
    seq = next(seq for seq in llm.scheduler.running if seq.offloaded)
    batch = ScheduledBatch()
    llm.scheduler._preempt(seq, batch)
    llm.runner._swap(batch)
    assert (seq.swapped is not None) == (preemption_mode == "swap") and seq.offloaded == []
    outs = {}
    while llm.has_unfinished():
        outs.update({o.request_id: o for o in llm.step() if o.finished})
    assert [outs[i].token_ids for i in sorted(outs)] == [o.token_ids for o in roomy]
    assert (llm.stats().swaps > 0) == (preemption_mode == "swap")
    assert_all_blocks_back(llm)


@pytest.mark.gpu
def test_decoding_from_the_host_on_a_gpu_gives_what_a_roomy_pool_gives(tiny_models):
    """The copies on their own stream, a layer ahead, the halves ordered by events; the other
    steps replay CUDA graphs."""
    roomy = engine(tiny_models("qwen3"), 256, device="cuda").generate(prompts(), params("full"))
    llm = from_host(tiny_models, "qwen3", device="cuda", preemption_mode="swap")
    assert llm.runner.host_tier.copy_stream is not None
    assert [o.token_ids for o in llm.generate(prompts(), params("full"))] == [o.token_ids for o in roomy]
    stats = llm.stats()
    assert stats.blocks_streamed > 0 and stats.positions_recomputed > 0
    assert_all_blocks_back(llm)


def test_staged_kv_equals_what_was_offloaded(tiny_models):
    """Stage every layer of an offloaded sequence by hand: copied blocks arrive bit-identical,
    recomputed ones within float rounding of the K/V the forward pass stored."""
    llm = from_host(tiny_models, "qwen3", preemption_mode="swap")
    for prompt, p in zip(prompts(), params("full")):
        llm.add_request(prompt, p)
    while not any(seq.offloaded and seq.num_kept_inputs >= 32 for seq in llm.scheduler.running):
        llm.step()
    seq = next(seq for seq in llm.scheduler.running if seq.offloaded and seq.num_kept_inputs >= 32)
    runner, model, host = llm.runner, llm.runner.model, llm.runner.host_tier.cache
    stream = runner.prepare(ScheduledBatch([seq], [1])).meta.host_stream
    recomputed = len(stream.positions) // 16
    assert 2 <= recomputed <= len(seq.offloaded) and len(stream.blocks) == len(seq.offloaded) - recomputed
    for layer in range(model.config.num_layers):
        stream.before_attention(layer, torch.empty(0, model.config.hidden_size), model.layers[layer].self_attn,
                                model.cos_sin)
        pages = runner.host_tier.staging_pages[layer % 2, :len(seq.offloaded)]   # even layers in one half, odd in the other
        for buffer, stored in zip(runner.kv_cache.per_slot, host.per_slot):
            staged, offloaded = buffer[pages], stored[seq.offloaded, layer]
            assert torch.equal(staged[recomputed:], offloaded[recomputed:])
            torch.testing.assert_close(staged[:recomputed], offloaded[:recomputed], atol=1e-5, rtol=1e-5)


def test_the_staging_buffers_are_allocated_once(tiny_models):
    """Every step decoding from the host gathers into the same host buffers: nothing is
    allocated (on CUDA, pinned) per step or per layer."""
    llm = from_host(tiny_models, "qwen3", preemption_mode="swap")
    for prompt, p in zip(prompts(), params("full")):
        llm.add_request(prompt, p)
    host, seen = llm.runner.host_tier.cache, set()
    while llm.has_unfinished():
        llm.step()
        seen.add(tuple(buffer.data_ptr() for half in host._staging for buffer in half))
    assert llm.stats().blocks_streamed > 0 and len(seen - {()}) == 1


def test_the_split_follows_the_cost_of_the_link(tiny_models, monkeypatch):
    """Without partial_recompute, or on a device too slow for recomputing to pay, every block
    is copied and no layer input is kept."""
    llm = from_host(tiny_models, "qwen3", partial_recompute=False)
    assert llm.runner.host_tier.input_positions == 0 and llm.runner.host_tier.split(96) == 0
    monkeypatch.setattr(nanokv.engine.offload_costs, "measure_link_and_device", lambda *args: (1e9, 1e6))
    llm = from_host(tiny_models, "qwen3")
    assert llm.runner.host_tier.input_positions == 0 and llm.runner.host_tier.split(96) == 0
    monkeypatch.setattr(nanokv.engine.offload_costs, "measure_link_and_device", lambda *args: (1e9, 1e12))
    cost = PositionCost.of(llm.model_config, torch.float32, torch.float32, False, 1e9, 1e12)
    assert from_host(tiny_models, "qwen3").runner.host_tier.split(96) == best_split(96, cost) > 80


@pytest.mark.parametrize("options, message", [
    (dict(decode_from_host=True), "kv_offload_gb > 0"),
    (dict(decode_from_host="yes", kv_offload_gb=0.001), "decode_from_host"),
    (dict(partial_recompute=1), "partial_recompute"),
    (dict(decode_from_host=True, kv_offload_gb=0.001, num_kv_blocks=8), "too few for max_model_len"),
])
def test_bad_settings_are_clear_errors(tiny_models, options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        engine(tiny_models("qwen3"), options.pop("num_kv_blocks", 26), **options)
