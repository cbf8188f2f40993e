"""What an eviction writes: at most the pairs it drops (the survivors above each head's new
length fill the holes below it), plus one block per head, for every method; counted as the
K slots whose contents an eviction changes."""
import pytest
import torch

from helpers import VOCAB
from nanokv import LLM, SamplingParams

METHODS = ["batchmax", "h2o", "tova", "snapkv", "streamingllm", "knorm", "kvcompress", "decode_only", "ed",
           "batchmax@decode", "h2o@once"]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models("llama")), dtype="float32", num_kv_blocks=160, max_model_len=512)


@pytest.mark.parametrize("method", METHODS)
def test_an_eviction_writes_at_most_what_it_drops_plus_a_block_per_head(llm, method, monkeypatch):
    ranking, _, schedule = method.partition("@")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, kv_method=ranking, kv_budget=128,
                            evict_every=16, kv_schedule=schedule or None, **({"kv_window": 8} if ranking == "snapkv" else {}))
    cache, evictor = llm.runner.kv_cache, llm.runner.evictor
    L, H, bs = cache.num_layers, cache.num_kv_heads, cache.block_size
    counts = []

    def counted(evictions):
        before = cache.k.clone()
        evict(evictions)
        written = int((cache.k != before).any(-1).sum())   # K [pages, bs, D]: slots changed
        dropped = sum(e.num_evicted for e in evictions) * L * H
        counts.append((written, dropped, len(evictions)))

    evict = evictor.evict
    monkeypatch.setattr(evictor, "evict", counted)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (300, 180, 250)]
    before = llm.stats()
    llm.generate(prompts, params)
    after = llm.stats()
    assert sum(dropped for _, dropped, _ in counts) > 0, "nothing was evicted"
    for written, dropped, sequences in counts:
        assert written <= dropped + sequences * L * H * bs, (written, dropped)
    # LLM.stats counts them too (kvcompress: whole pages dropped, and repaged pages whole)
    moved, evicted = after.pairs_moved - before.pairs_moved, after.pairs_evicted - before.pairs_evicted
    assert moved >= sum(written for written, _, _ in counts) and evicted >= sum(dropped for _, dropped, _ in counts)
    if ranking != "kvcompress":
        assert (moved, evicted) == tuple(map(sum, zip(*counts)))[:2]
