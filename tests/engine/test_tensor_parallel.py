"""Tensor parallelism on the CPU (gloo, one thread per rank): the model split over 2 or 3
processes gives the single-rank engine's tokens and kept positions, in float64 so that the
all-reduces' summation order cannot flip a token. Each engine costs a few seconds to start
(a spawned process per rank), so each test runs several requests and methods through one."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from unittest.mock import patch

import kvpress
import pytest
import torch

import nanokv.engine.offload_costs
from helpers import FAMILIES, VOCAB, make_tiny_model, preemption_params as params, preemption_prompts as prompts
from models.tensor_parallel import Shard
from nanokv import LLM, SamplingParams, StructuredOutput


EVICTING = ["batchmax", "h2o", "tova", "snapkv", "streamingllm", "knorm", "ed"]   # kvcompress: apart


def engine(directory, **options) -> LLM:
    return LLM(str(directory), **{"dtype": "float64", "max_model_len": 112, "num_threads": 1, **options})


def run(llm: LLM, method: str) -> list:
    return llm.generate(prompts(), params(method))


@pytest.fixture
def split(request):
    """split(directory, size, **options): an engine of size ranks, closed at the end of the test."""
    engines = []

    def make(directory, size: int, **options) -> LLM:
        engines.append(engine(directory, tensor_parallel_size=size, **options))
        return engines[-1]
    yield make
    for llm in engines:
        llm.close()


def assert_same(outs, expected) -> None:
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    for out, want in zip(outs, expected):
        assert (out.kept_positions is None) == (want.kept_positions is None)
        if want.kept_positions is not None:
            assert torch.equal(out.kept_positions, want.kept_positions)


def test_two_ranks_give_one_rank_s_tokens_and_kept_positions(tiny_dir, split):
    """A pool small enough to preempt: the workers' mirrors follow recomputed sequences too.
    kvcompress holds a block more for each eviction step under tensor parallelism (evict.py),
    so it preempts more often; its tokens and kept positions are still one rank's."""
    one, two = engine(tiny_dir, num_kv_blocks=9, press_window=9), split(tiny_dir, 2, num_kv_blocks=9, press_window=9)
    for method in ["full", "batchmax", "h2o", "snapkv", "ed"]:   # every schedule; every ranking: below
        assert_same(run(two, method), run(one, method))
    assert two.stats().preemptions == one.stats().preemptions > 0
    assert_same(run(two, "kvcompress"), run(one, "kvcompress"))
    snapkv = kvpress.SnapKVPress(window_size=8)   # each rank's press scores its own heads, from the layer inputs
    pressed = [dataclasses.replace(p, kv_method=None, kv_press=snapkv, kv_schedule="prefill") for p in params("knorm")]
    assert_same(two.generate(prompts(), pressed), one.generate(prompts(), pressed))
    constrained = [dataclasses.replace(p, structured_output=StructuredOutput(regex=r"[a-z ]{30,44}"))
                   for p in params("batchmax")]   # rank 0's matchers; the workers never see them
    assert_same(two.generate(prompts(), constrained), one.generate(prompts(), constrained))


def test_kvcompress_keeps_more_blocks_where_one_rank_s_heads_keep_more(tiny_dir, split):
    """The pages a sequence gives up are chosen over every rank's heads, so one rank's heads may
    keep more pages than their share of the blocks kept: the sequence then keeps more blocks
    (each rank's heads keep their room for new pairs), never other positions."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (40, 120, 90, 100, 33, 150)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, kv_method="kvcompress", kv_budget=64,
                            evict_every=32, kv_schedule="decode", return_kept_positions=True)

    def blocks_held(llm: LLM) -> tuple[list, list[dict]]:
        """The outputs, and after every step each running sequence's blocks."""
        for prompt in prompts:
            llm.add_request(prompt, params)
        outs, held = {}, []
        while llm.has_unfinished():
            outs.update({o.request_id: o for o in llm.step() if o.finished})
            held.append({seq.seq_id: len(seq.block_table) for seq in llm.scheduler.running})
        return [outs[i] for i in sorted(outs)], held

    (expected, one), (outs, two) = (blocks_held(engine(tiny_dir, max_model_len=256, num_kv_blocks=80)),
                                    blocks_held(split(tiny_dir, 2, max_model_len=256, num_kv_blocks=80)))
    assert_same(outs, expected)
    pairs = [(step_two[seq_id], blocks) for step_one, step_two in zip(one, two) for seq_id, blocks in step_one.items()]
    assert len(one) == len(two) and all(a >= b for a, b in pairs) and any(a > b for a, b in pairs)


def test_uneven_eviction_swapping_under_tensor_parallelism_preempts_as_one_rank_does(tiny_dir, split):
    """A kvcompress sequence swapped back in whose first step needs more room under tensor
    parallelism (its ranks' allowance) is admitted only when the pool has that room, and a
    sequence preempted in a step waits for the next: no swap-out, swap-in cycles."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (40, 70, 55, 60, 33, 61)]
    params = [SamplingParams(temperature=0, max_tokens=45 + 3 * i, ignore_eos=True,
                             **(dict(kv_method="kvcompress", kv_budget=32, evict_every=16) if i % 2 else {}))
              for i in range(6)]
    options = dict(num_kv_blocks=12, kv_offload_gb=0.002, preemption_mode="swap")
    one, two = engine(tiny_dir, **options), split(tiny_dir, 2, **options)
    assert_same(two.generate(prompts, params), one.generate(prompts, params))
    assert 0 < one.stats().preemptions <= two.stats().preemptions <= one.stats().preemptions + 2
    assert two.stats().swaps == two.stats().preemptions


def test_a_kvcompress_sequence_swapped_out_comes_back_with_every_rank_s_own_pages(tiny_dir, split):
    """Pages of 4 slots, so that heads trade pages before they are swapped out: every rank
    keeps its heads' own page tables aside while a sequence is out, and its tokens and kept
    positions are one rank's."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (40, 70, 55, 60, 33, 61)]
    params = [SamplingParams(temperature=0, max_tokens=45 + 3 * i, ignore_eos=True,
                             **(dict(kv_method="kvcompress", kv_budget=32, evict_every=8, return_kept_positions=True)
                                if i % 2 else {}))
              for i in range(6)]
    options = dict(block_size=4, num_kv_blocks=48, kv_offload_gb=0.002, preemption_mode="swap")
    one, two = engine(tiny_dir, **options), split(tiny_dir, 2, **options)
    assert_same(two.generate(prompts, params), one.generate(prompts, params))
    assert two.stats().swaps > 0


@pytest.mark.parametrize("family, kv_cache_dtype", [("llama3", "auto"), ("mistral", "int8"), ("qwen2", "auto"),
                                                    ("qwen3", "fp8"), ("phi3", "auto")])
def test_every_family_splits(tiny_models, split, family, kv_cache_dtype):
    """llama3's one KV head is replicated on both ranks, each summing its scores over its own query
    heads: every method ranks the sum over the replicas; qwen2 splits its q/k/v biases, qwen3
    keeps its q/k norms whole; phi3's fused q/k/v and gate/up are cut into each rank's parts;
    a quantized cache's scales are per head, so each rank keeps its own."""
    methods = ["full", *EVICTING, "kvcompress"] if family == "llama3" else ["full", "h2o"]
    options = dict(num_kv_blocks=14, kv_cache_dtype=kv_cache_dtype)
    one, two = engine(tiny_models(family), **options), split(tiny_models(family), 2, **options)
    for method in methods:
        assert_same(run(two, method), run(one, method))


def test_the_bundled_model_on_three_ranks(bundled_dir, split):
    """SmolLM2-135M: 9 query heads and 3 KV heads, one KV head a rank."""
    greedy = SamplingParams(temperature=0, max_tokens=8)
    prompts = ["The capital of France is", "Write a haiku about the sea."]
    expected = engine(bundled_dir).generate(prompts, greedy)
    three = split(bundled_dir, 3)
    assert [o.token_ids for o in three.generate(prompts, greedy)] == [o.token_ids for o in expected]


def test_the_host_tier_splits(tmp_path, split, monkeypatch):
    """Each rank keeps its KV heads' part of every host block: full-cache requests decode from
    the host, the first positions recomputed from their layer inputs (which every rank keeps
    whole), the newest are swapped out and back, and a chat's cached blocks reclaimed from the
    device spill there and are found again, all as on one rank. Every rank splits by rank 0's
    link and device, here a device quick enough for recomputing to pay. A rank moves its heads'
    K/V but the whole layer input, so the model has 4 KV heads: with qwen3's 2, one a rank, the
    two are the same size and recomputing never pays."""
    monkeypatch.setattr(nanokv.engine.offload_costs, "measure_link_and_device", lambda *args: (1e9, 1e12))
    with patch.dict(FAMILIES, {"qwen3-mha": dict(FAMILIES["qwen3"], num_key_value_heads=4)}):
        make_tiny_model(tmp_path, "qwen3-mha")
    options = dict(num_kv_blocks=16, max_num_seqs=8, kv_offload_gb=0.0032, decode_from_host=True,
                   preemption_mode="swap")
    g = torch.Generator().manual_seed(1)
    first, others = torch.randint(0, VOCAB, (64,), generator=g).tolist(), torch.randint(0, VOCAB, (3, 90), generator=g)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def serve(llm: LLM) -> list:
        outs = [*run(llm, "full"), *run(llm, "h2o")]
        turn = llm.generate([first], greedy)[0]
        llm.generate(others.tolist(), greedy)
        return outs + llm.generate([turn.prompt_token_ids + turn.token_ids + [5, 6, 7]], greedy)

    one, two = engine(tmp_path, **options), split(tmp_path, 2, **options)
    assert_same(serve(two), serve(one))
    assert two.runner.host_tier.input_positions > 0 and one.runner.host_tier.input_positions > 0
    stats = two.stats()
    assert stats.blocks_offloaded > 0 and stats.positions_recomputed > 0 and stats.swaps > 0 and stats.host_hits > 0
    assert stats.free_blocks == stats.total_blocks and stats.host_blocks_used == 0


def test_a_worker_that_dies_ends_the_engine_with_a_clear_error(tiny_dir, split):
    llm = split(tiny_dir, 2)
    llm.generate(prompts()[:2], params("full")[:2])
    with pytest.raises(RuntimeError, match="open in this process already"):   # one process group a process
        engine(tiny_dir, tensor_parallel_size=2)
    llm.workers.processes[0].kill()
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="nanokv-rank-1 ended"):
        llm.generate(prompts(), params("full"))
    assert time.perf_counter() - start < 10


@dataclass(frozen=True)
class BesideACheaperRank(Shard):
    """Eviction's view of rank 0 of 2, in one process: the other rank holds as many KV heads,
    with as many pairs, and every page of theirs above the floor is cheaper than any of ours."""
    rank: int = 0
    size: int = 2
    floor_pages: int = 1

    def max(self, n: int, device) -> int:
        return n

    def all_heads(self, x: torch.Tensor) -> torch.Tensor:   # [S, L, H, W + 1]: page costs, then pages held
        held = x[..., -1:]
        count = torch.arange(1, x.shape[-1], dtype=x.dtype)
        theirs = torch.where(count <= held - self.floor_pages, float("-inf"), float("inf"))
        return torch.cat([x, torch.cat([theirs, held], dim=-1)], dim=2)


def test_a_rank_whose_heads_keep_every_page_keeps_their_room_for_new_pairs(tiny_dir):
    """The extreme of the uneven split: all the pages a kvcompress eviction gives up are another
    rank's, so this one's heads keep every pair and, to take new ones until the next eviction, the
    sequence keeps more blocks than one rank would, and holds them for the step (the scheduler
    makes room first). Up to the next eviction its heads then decode exactly as with a full
    cache; a head short of room would write over another's pages. Prompts of 33 to 48 tokens:
    the other rank's cheap pages are enough for the eviction after each (down to |kv| - p = 32)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (40, 48, 34, 45, 33, 47)]
    greedy = dict(temperature=0, max_tokens=33, ignore_eos=True)   # 32 decodes after the eviction, the next's
    evicting = SamplingParams(**greedy, kv_method="kvcompress", kv_budget=64, evict_every=32, kv_schedule="decode")
    llm = engine(tiny_dir, num_kv_blocks=40)
    llm.runner.evictor.shard = BesideACheaperRank()
    llm.config.tensor_parallel_size = 2   # what the scheduler reads: it makes the room
    outs = llm.generate(prompts, evicting)
    expected = engine(tiny_dir, num_kv_blocks=40).generate(prompts, SamplingParams(**greedy))
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert llm.blocks.num_free == 40


def test_a_step_that_fails_on_rank_0_ends_the_workers_at_once(tiny_dir, split, monkeypatch):
    """The workers wait in the step's collectives for a rank 0 that will not come: they are ended
    (not left waiting for the collectives' timeout), and the engine refuses to go on."""
    llm = split(tiny_dir, 2)

    def fail(*args, **kwargs):
        raise ValueError("a failure on rank 0")
    monkeypatch.setattr(llm.runner, "prepare", fail)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="a failure on rank 0"):
        llm.generate(prompts()[:2], params("full")[:2])
    assert time.perf_counter() - start < 20 and not any(p.is_alive() for p in llm.workers.processes)
    with pytest.raises(RuntimeError, match="the ranks were ended after a step failed"):
        llm.generate(prompts()[:2], params("full")[:2])


@pytest.mark.parametrize("size, options, message", [
    (3, {}, "tensor_parallel_size=3 cannot split this model's 4 query heads, 2 KV heads and 96 MLP columns evenly; "
            "it allows 1, 2, 4"),
    (0, {}, "tensor_parallel_size"),
])
def test_what_cannot_be_split_is_a_clear_error_before_any_process_starts(tiny_dir, size, options, message):
    with pytest.raises(ValueError, match=message):
        engine(tiny_dir, tensor_parallel_size=size, **options)


def test_torchrun_starts_the_ranks_instead(tiny_dir, tmp_path):
    """Under torchrun every rank runs the script: rank 0's LLM is the engine, the other's LLM()
    serves it and ends its process when the engine closes."""
    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True)
    script = tmp_path / "generate.py"
    script.write_text(textwrap.dedent(f"""
        import json
        from nanokv import LLM, SamplingParams

        llm = LLM({str(tiny_dir)!r}, dtype="float64", max_model_len=112, num_threads=1, tensor_parallel_size=2)
        outs = llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(**{greedy!r}))
        print(json.dumps([out.token_ids for out in outs]))
        llm.close()
    """))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    expected = engine(tiny_dir).generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(**greedy))
    assert json.loads(done.stdout.splitlines()[-1]) == [out.token_ids for out in expected]
