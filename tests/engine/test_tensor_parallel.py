"""Tensor parallelism on the CPU (gloo, one thread per rank): the model split over 2 or 3
processes gives the single-rank engine's tokens and kept positions, in float64 so that the
all-reduces' summation order cannot flip a token. Each engine costs a few seconds to start
(a spawned process per rank), so each test runs several requests and methods through one."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from unittest.mock import patch

import pytest
import torch

import nanokv.engine.runner
from helpers import FAMILIES, VOCAB, make_tiny_model, preemption_params as params, preemption_prompts as prompts
from nanokv import LLM, SamplingParams

EVICTING = ["batchmax", "h2o", "tova", "snapkv", "streamingllm", "knorm", "ed"]


def engine(directory, **options) -> LLM:
    return LLM(str(directory), dtype="float64", max_model_len=112, num_threads=1, **options)


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


def test_two_ranks_give_one_rank_s_tokens_and_kept_positions_for_every_method(tiny_dir, split):
    """A pool small enough to preempt: the workers' mirrors follow recomputed sequences too."""
    one, two = engine(tiny_dir, num_kv_blocks=9), split(tiny_dir, 2, num_kv_blocks=9)
    for method in ["full", *EVICTING]:
        assert_same(run(two, method), run(one, method))
    assert two.stats().preemptions == one.stats().preemptions > 0


@pytest.mark.parametrize("family, kv_cache_dtype", [("llama3", "auto"), ("mistral", "int8"), ("qwen2", "auto"),
                                                    ("qwen3", "fp8")])
def test_every_family_splits(tiny_models, split, family, kv_cache_dtype):
    """llama3's one KV head is replicated on both ranks, each summing its scores over its own query
    heads: every method ranks the sum over the replicas; qwen2 splits its q/k/v biases, qwen3
    keeps its q/k norms whole; a quantized cache's scales are per head, so each rank keeps its own."""
    methods = ["full", *EVICTING] if family == "llama3" else ["full", "h2o"]
    options = dict(num_kv_blocks=14, kv_cache_dtype=kv_cache_dtype)
    one, two = engine(tiny_models(family), **options), split(tiny_models(family), 2, **options)
    for method in methods:
        assert_same(run(two, method), run(one, method))


def test_the_bundled_model_on_three_ranks(bundled_dir, split):
    """SmolLM2-135M: 9 query heads and 3 KV heads, one KV head a rank."""
    greedy = SamplingParams(temperature=0, max_tokens=12)
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
    monkeypatch.setattr(nanokv.engine.runner, "measure_link_and_device", lambda *args: (1e9, 1e12))
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
    assert two.runner.input_positions > 0 and one.runner.input_positions > 0
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


@pytest.mark.parametrize("size, options, message", [
    (3, {}, "tensor_parallel_size=3 cannot split this model's 4 query heads, 2 KV heads and 96 MLP columns evenly; "
            "it allows 1, 2, 4"),
    (2, dict(kv_method="kvcompress", kv_budget=128), "not split over ranks"),
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
