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


def test_a_decode_planned_ahead_is_the_step_a_full_plan_makes(tiny_dir, monkeypatch):
    """A decoding sequence planned ahead (Scheduler._plain_until) runs the step its schedule and
    blocks give: one token, no eviction, no block to add, not past its last token. Checked at
    every such step under every schedule, evicting together, with preemption and prefix caching."""
    llm = LLM(str(tiny_dir), dtype="float32", num_kv_blocks=20, max_model_len=200, max_num_seqs=8,
              max_num_batched_tokens=64, enable_prefix_caching=True, num_threads=1)
    scheduler, found = llm.scheduler, []
    schedule = scheduler.schedule

    def checked():   # a sequence planned ahead is as it was before the step (not in planned_in_full)
        batch = schedule()
        for i, seq in enumerate(batch.seqs):
            if i not in batch.planned_in_full:
                evict, _, n, _, room = scheduler._step_room(seq, 64)
                found.append((seq.method.schedule.name, (evict, n, batch.num_new_tokens[i]),
                              scheduler.blocks.blocks_for(room) <= len(seq.block_table.ids)
                              and seq.num_tokens <= seq.max_slots))
        return batch
    monkeypatch.setattr(scheduler, "schedule", checked)
    rng = random.Random(3)
    evicts = dict(kv_budget=32, evict_every=8)
    methods = [dict(), dict(kv_method="batchmax", **evicts), dict(kv_method="batchmax", evict_together=True, **evicts),
               dict(kv_method="decode_only", **evicts),
               dict(kv_method="snapkv", kv_schedule="once", kv_window=8, **evicts),
               dict(kv_method="ed", kv_budget=12, evict_every=4),
               dict(kv_method="kvcompress", kv_budget=48, evict_every=16)]
    shared = [rng.randrange(VOCAB) for _ in range(40)]   # a prefix the cache serves again
    prompts = [shared + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))] for _ in range(28)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(20, 60), ignore_eos=True, **methods[i % 7])
              for i in range(28)]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert llm.scheduler.num_preemptions > 0
    assert {name for name, *_ in found} == {"full", "prefill", "decode", "once", "ed"}
    assert all(step == (0, 1, 1) and fits for _, step, fits in found)


def test_a_sequence_preempted_while_planned_ahead_is_planned_in_full_again(tiny_dir, monkeypatch):
    """Two blocks: the first request's third decode needs the second, taken from the other,
    preempted halfway through its block while planned ahead; admitted again, it recomputes its
    tokens in one chunk."""
    llm = LLM(str(tiny_dir), dtype="float32", num_kv_blocks=2, max_model_len=32, num_threads=1)
    scheduler, preempt, steps = llm.scheduler, llm.scheduler._preempt, []

    def preempted(seq, batch):
        steps.append(("preempted", seq.num_tokens <= seq.plain_until))
        preempt(seq, batch)
    monkeypatch.setattr(scheduler, "_preempt", preempted)
    schedule = scheduler.schedule
    monkeypatch.setattr(scheduler, "schedule", lambda: steps.append(schedule()) or steps[-1])
    for prompt, max_tokens in ((list(range(14)), 5), ([1, 2, 3], 6)):
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while llm.has_unfinished():
        llm.step()
    at = steps.index(("preempted", True))
    chunks = [dict(zip([seq.seq_id for seq in batch.seqs], batch.num_new_tokens)) for batch in steps[at + 1:]]
    assert max(n for chunk in chunks for i, n in chunk.items() if i == 1) > 3   # its prompt and tokens, again


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
