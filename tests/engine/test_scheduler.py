"""Continuous batching under pressure: preemption, chunked prefill, block accounting."""
import random

import pytest

from helpers import VOCAB
from nanokv import LLM, SamplingParams
from nanokv.engine.memory import profile_lengths
from nanokv.engine.scheduler import ScheduledBatch


def random_requests(n: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 100))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=True) for _ in range(n)]
    return prompts, params


def test_300_requests_through_a_tiny_pool_match_an_unconstrained_run(tiny_dir):
    prompts, params = random_requests(300, seed=1)
    roomy = LLM(str(tiny_dir), dtype="float64", num_kv_blocks=4096, max_model_len=160,
                max_num_seqs=256, max_num_batched_tokens=8192)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]

    tight = LLM(str(tiny_dir), dtype="float64", num_kv_blocks=12, max_model_len=160,
                max_num_seqs=16, max_num_batched_tokens=48)
    outs = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 20
    assert [o.token_ids for o in outs] == expected
    assert all(len(o.token_ids) == p.max_tokens for o, p in zip(outs, params))
    assert tight.blocks.num_free == 12
    assert not tight.scheduler.running and not tight.scheduler.waiting


def test_steps_respect_token_and_sequence_limits(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", num_kv_blocks=256, max_model_len=160,
              max_num_seqs=3, max_num_batched_tokens=40)
    prompts, params = random_requests(10, seed=2)
    for p, sp in zip(prompts, params):
        llm.add_request(p, sp)
    mixed = False
    while llm.has_unfinished():
        batch = llm.scheduler.schedule()
        assert sum(batch.num_new_tokens) <= 40 and len(batch) <= 3
        assert len(llm.scheduler.running) <= 3
        sizes = set(batch.num_new_tokens)
        mixed |= 1 in sizes and any(n > 1 for n in sizes)
        sampled = llm.runner.run(batch)
        llm.scheduler.advance(batch, sampled.seqs)
        for seq, reason in llm.scheduler.record(sampled.seqs, sampled.read()):
            llm.scheduler.finish(seq, reason)
    assert mixed, "no step mixed a prefill chunk with decodes"
    assert llm.blocks.num_free == 256


def test_max_model_len_ends_a_sequence(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", num_kv_blocks=64, max_model_len=50)
    out = llm.generate([[1] * 45], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_the_memory_profiling_pass_leaves_the_pool_alone(tiny_dir):
    """On CUDA the pool is sized after this pass; it must run anywhere and write only scratch."""
    llm = LLM(str(tiny_dir), dtype="float32", num_kv_blocks=64, max_model_len=160, max_num_batched_tokens=100)
    llm.runner.profile_forward(profile_lengths(llm.config))
    llm.runner.profile_forward([1] * llm.config.max_num_seqs)   # the decode graphs' pass
    assert llm.runner.kv_cache.k.abs().sum() == 0 and llm.runner.kv_cache.v.abs().sum() == 0


def test_the_memory_profile_stays_inside_the_rope_table(tiny_dir, monkeypatch):
    """A step of max_num_batched_tokens longer than max_model_len is profiled as several
    sequences, none past the positions (and RoPE table rows) one sequence can reach."""
    llm = LLM(str(tiny_dir), dtype="float32", num_kv_blocks=64, max_model_len=160, max_num_batched_tokens=2048)
    assert profile_lengths(llm.config) == [160] * 12 + [128]
    seen = []
    forward = llm.runner.model.forward
    monkeypatch.setattr(llm.runner.model, "forward", lambda ids, positions, *rest: seen.append(positions)
                        or forward(ids, positions, *rest))
    llm.runner.profile_forward(profile_lengths(llm.config))
    (positions,) = seen
    assert len(positions) == 2048 and int(positions.max()) < len(llm.runner.model.cos_sin) == 160


@pytest.mark.gpu
def test_cuda_pool_is_sized_from_free_memory(tiny_dir):
    import torch
    llm = LLM(str(tiny_dir), dtype="bfloat16", device="cuda", max_model_len=160, gpu_memory_utilization=0.5)
    pool_bytes = llm.runner.kv_cache.k.numel() * 2 * 2
    total = torch.cuda.get_device_properties(0).total_memory
    assert llm.blocks.num_blocks * 16 >= 160 and pool_bytes <= 0.5 * total
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_a_step_never_saves_a_block_it_fills_first():
    """The runner saves to the host tier before it loads or copies into the pool: a block that
    a load or copy of the step fills cannot be saved in the same step (its save would read the
    block's old contents)."""
    batch = ScheduledBatch(loads=[(3, 5)], copies=[(8, 9)])
    batch.save([(4, 0), (6, 1)])   # blocks emptied by a preemption, filled by nothing this step
    for filled in (5, 9):
        with pytest.raises(AssertionError, match="saves a block it fills first"):
            batch.save([(filled, 2)])
    assert batch.saves == [(4, 0), (6, 1)]
