"""Eviction settings are checked up front, and evicting requests run on both kernel backends."""
import pytest
import torch

import kernels
from helpers import VOCAB
from kernels.compact import move_slots_ref, move_slots_triton
from kernels.eviction_order import eviction_order_ref, eviction_order_triton, lowest_ref, lowest_triton
from kernels.head_slots import head_slots_ref, head_slots_triton
from kernels.hole_filling import hole_moves_ref, hole_moves_triton
from kernels.page_choice import choose_pages_ref, choose_pages_triton
from kernels.repaging import repage_ref, repage_triton
from nanokv import LLM, SamplingParams
from nanokv.config import EngineConfig
from nanokv.eviction.settings import method_for


@pytest.fixture(scope="module")
def tiny_dir(tiny_models):
    return tiny_models("qwen3")


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", num_kv_blocks=64, max_model_len=256,
               kv_method="batchmax", kv_budget=64, evict_every=16)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_method="batchmax", kv_budget=16, evict_every=16), "at least 2 \\* evict_every = 32"),
    (dict(kv_method="batchmax", kv_budget=40, evict_every=16), "multiple of the block size 16, got 40"),
    (dict(kv_method="decode_only", kv_budget=48, evict_every=32), "at least 2 \\* evict_every = 64"),
    (dict(kv_method="ed", kv_budget=1), "kv_budget for ed must be >= 2, got 1"),
    (dict(kv_method="batchmax", evict_every=0), "evict_every must be None or an integer >= 1, got 0"),
    (dict(kv_method="full", return_kept_positions=True), "return_kept_positions needs an evicting kv_method"),
    (dict(kv_method="ed", kv_schedule="once"),
     "kv_method ed has its own schedule \\(Algorithm 2\\): kv_schedule must be None, got 'once'"),
    (dict(kv_method="full", kv_sinks=2), "kv_method full never evicts: kv_sinks must be None, got 2"),
    (dict(kv_method="decode_only", kv_schedule="prefill"),
     "decode_only is batchmax under the decode schedule: kv_schedule must be None or 'decode', got 'prefill'"),
    (dict(kv_method="h2o", kv_budget=32, evict_every=16, kv_sinks=10, kv_recent=10),
     "kv_sinks \\+ kv_recent = 10 \\+ 10 leaves h2o nothing to evict under the decode schedule: "
     "it must be at most kv_budget - evict_every = 16"),
    (dict(kv_method="knorm", kv_budget=20, kv_recent=20),
     "kv_sinks \\+ kv_recent = 0 \\+ 20 leaves knorm nothing to evict under the once schedule: "
     "it must be less than kv_budget = 20"),
    (dict(kv_method="streamingllm", kv_schedule="once", kv_budget=3),
     "kv_sinks \\+ kv_recent = 4 \\+ 0 leaves streamingllm nothing to evict"),
    (dict(kv_method="h2o", kv_schedule="prefill", kv_budget=40), "multiple of the block size 16, got 40"),
    (dict(kv_method="snapkv", kv_budget=32, kv_window=40), "kv_window must be an integer in \\[1, kv_budget = 32\\], got 40"),
    (dict(kv_method="snapkv", kv_pool=4), "kv_pool must be an odd integer >= 1 \\(a centred kernel\\), got 4"),
    (dict(kv_pool=0), "kv_pool must be None or an integer >= 1, got 0"),
    (dict(kv_method="h2o", kv_window=8), "kv_window is a setting of snapkv and kvcompress only; it must be None for h2o, got 8"),
    (dict(kv_method="snapkv", kv_budget=32, kv_window=20, kv_schedule="prefill"),
     "kv_sinks \\+ kv_recent = 0 \\+ 20 leaves snapkv nothing to evict under the prefill schedule"),
    (dict(kv_schedule="sometimes"), "unknown kv_schedule 'sometimes'; use one of prefill, decode, once or None"),
    (dict(kv_sinks=-1), "kv_sinks must be None or an integer >= 0, got -1"),
])
def test_bad_eviction_settings_are_refused(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.add_request([1, 2, 3], SamplingParams(**kwargs))
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(), SamplingParams(**kwargs)])
    assert not llm.has_unfinished()


def test_unknown_method_name(tiny_dir):
    message = "unknown kv_method 'bogus'; use one of full, batchmax, h2o, tova, snapkv, streamingllm, knorm, kvcompress, decode_only, ed"
    with pytest.raises(ValueError, match=message):
        SamplingParams(kv_method="bogus")
    with pytest.raises(ValueError, match=message):   # a bad engine default fails at construction
        LLM(str(tiny_dir), dtype="float32", num_kv_blocks=64, max_model_len=256, kv_method="bogus")


def test_engine_defaults_apply_and_requests_override(llm):
    prompt = torch.randint(0, VOCAB, (100,)).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, return_kept_positions=True))[0]
    assert out.kept_positions.shape[-1] <= 64          # the engine default: batchmax, |kv| = 64
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, kv_method="ed", kv_budget=2,
                                                return_kept_positions=True))[0]
    assert out.kept_positions.shape[-1] == 1     # Algorithm 2: the most recent of 100 + 4 - 1 fed tokens
    assert (out.kept_positions == 102).all()


@pytest.mark.parametrize("engine", [dict(kv_method="h2o", kv_budget=64, evict_every=16, kv_schedule="prefill"),
                                    dict(kv_method="h2o", kv_budget=64, evict_every=16, kv_sinks=4, kv_recent=8),
                                    dict(kv_method="snapkv", kv_budget=64, evict_every=16, kv_window=8, kv_pool=3),
                                    dict(kv_method="kvcompress", kv_budget=64, evict_every=16, kv_score_all=True)])
def test_a_request_naming_its_method_takes_only_the_engine_settings_that_mean_something_to_it(engine):
    """A request may opt out of the engine's method (full), or pick another: it inherits only
    what applies to its own method; what it gives itself is still checked."""
    defaults = EngineConfig(**engine)
    assert method_for(SamplingParams(kv_method="full"), defaults, 16).name == "full"
    ed = method_for(SamplingParams(kv_method="ed"), defaults, 16)
    assert (ed.name, ed.schedule.budget) == ("ed", 64)                         # the engine's budget applies
    h2o = method_for(SamplingParams(kv_method="h2o"), defaults, 16)
    assert h2o.ranking.name == "h2o" and h2o.sinks == engine.get("kv_sinks", 0)   # sinks mean something to h2o
    assert type(method_for(SamplingParams(kv_method="decode_only"), defaults, 16).schedule).__name__ == "Decode"
    inherited = method_for(SamplingParams(), defaults, 16)                     # no method named: all of the engine's
    assert inherited.name == engine["kv_method"]
    with pytest.raises(ValueError, match="kv_method full never evicts: kv_schedule must be None"):
        method_for(SamplingParams(kv_method="full", kv_schedule="prefill"), defaults, 16)


def test_a_full_cache_request_on_an_evicting_engine(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=128, num_kv_blocks=32, kv_method="h2o", kv_budget=64,
              evict_every=16, kv_schedule="prefill")
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2, kv_method="full"))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 2


def test_a_budget_alone_asks_for_the_default_evicting_method(tiny_dir):
    plain = LLM(str(tiny_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)
    method = plain._checked(SamplingParams(kv_budget=64, evict_every=16))[0]
    assert (method.name, type(method.schedule).__name__, method.sinks, method.recent) \
        == ("batchmax", "Prefill", 4, 24)                                  # recent: (64 - 16) / 2
    assert plain._checked(SamplingParams(kv_budget=64, evict_every=16, kv_recent=8, kv_schedule="decode"))[0].rule \
        == ("batchmax", 4, 8, None, None)                                  # settings given are kept
    assert plain._checked(SamplingParams())[0].name == "full"                    # no budget: no eviction
    assert plain._checked(SamplingParams(kv_method="tova"))[0].schedule.budget == 1024   # a name alone: 1024
    engine_budget = LLM(str(tiny_dir), dtype="float32", num_kv_blocks=64, max_model_len=256, kv_budget=64,
                        evict_every=16)
    assert engine_budget._checked(SamplingParams())[0].name == "batchmax"
    assert engine_budget._checked(SamplingParams(kv_method="full"))[0].name == "full"


def test_prompt_logprobs_under_a_large_budget_equal_full(llm):
    prompt = torch.randint(0, VOCAB, (40,)).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, kv_method="full", prompt_logprobs=True))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 40
    tokens = out.prompt_logprobs[1:]
    again = llm.generate([prompt], SamplingParams(max_tokens=1, kv_method="batchmax", kv_budget=64,
                                                  prompt_logprobs=True))[0].prompt_logprobs[1:]
    assert [t.top_token for t in tokens] == [t.top_token for t in again]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(tokens, again)) < 1e-5
    assert all(t.logprob <= t.top_logprob + 1e-6 for t in tokens)


def test_evicting_engine_on_triton_kernels_matches_references(tiny_dir):
    """Prefill key scores, decode scores, compaction, kvcompress's pages: the interpreted Triton
    path and the CPU backend keep the same pairs as the references, for every ranking."""
    methods = (("batchmax", None, 32, {}), ("decode_only", None, 48, {}), ("ed", None, 5, {}),
               ("h2o", "prefill", 32, {}), ("knorm", "decode", 32, {}), ("streamingllm", "once", 32, {}),
               ("tova", "prefill", 32, {}), ("snapkv", "decode", 32, dict(kv_window=8, kv_pool=3)),
               ("kvcompress", None, 32, {}), ("kvcompress", None, 32, {}))
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (28, 50, 60, 50, 40, 40, 55, 40, 60, 45)]   # each evicts
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, kv_method=m, kv_schedule=schedule,
                             kv_budget=b, evict_every=16, return_kept_positions=True, **extra)
              for m, schedule, b, extra in methods]
    results = {}
    before = kernels.forced_backend()
    try:
        for backend in ("torch", "triton", "cpu"):
            kernels.set_backend(backend)
            engine = LLM(str(tiny_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)
            results[backend] = engine.generate(prompts, params)
    finally:
        kernels.set_backend(before)
    for backend in ("triton", "cpu"):
        for ref, out in zip(results["torch"], results[backend]):
            assert out.token_ids == ref.token_ids, backend
            assert torch.equal(out.kept_positions, ref.kept_positions), backend


def test_the_moves_an_eviction_makes_are_the_triton_kernel_s_too(tiny_dir, monkeypatch):
    """Every move_slots call of evictions (batchmax's and kvcompress's holes filled, kvcompress's
    pages moved whole), made on the CPU backend, is made again by the Triton kernel in the
    interpreter on a copy of the cache: the same bytes everywhere."""
    calls = []

    def both(buffers, tables, src, dst):
        copies = [b.clone() for b in buffers]
        move_slots_triton(copies, tables, src, dst)
        move_slots_ref(buffers, tables, src, dst)
        calls.append(src.shape)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(copies, buffers))
    monkeypatch.setitem(kernels._OPS, "cpu", kernels._OPS["cpu"]._replace(move_slots=both))
    llm = LLM(str(tiny_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (60, 75, 50)]
    llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, kv_method=m, kv_budget=32,
                                          evict_every=16) for m in ("batchmax", "kvcompress", "kvcompress")])
    assert len(calls) > 6 and all(len(shape) == 2 for shape in calls)   # a row of moves a sequence


@pytest.mark.parametrize("op, reference, kernel", [("repage", repage_ref, repage_triton),
                                                    ("hole_moves", hole_moves_ref, hole_moves_triton),
                                                    ("eviction_order", eviction_order_ref, eviction_order_triton),
                                                    ("lowest", lowest_ref, lowest_triton),
                                                    ("choose_pages", choose_pages_ref, choose_pages_triton),
                                                    ("head_slots", head_slots_ref, head_slots_triton)])
def test_eviction_surgery_is_the_triton_kernels_too(tiny_dir, monkeypatch, op, reference, kernel):
    """Every eviction order, page choice and repage of kvcompress's evictions, every selection of batchmax's,
    every set of hole-filling moves (kvcompress's and batchmax's) and the slots of every step's
    pairs in heads with pages of their own, made on the CPU backend (the reference), is made again
    by the Triton kernels in the interpreter: the same results and the same counts written in
    place, whether a step evicts one sequence or several."""
    calls = []

    def both(*args):
        copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        expected = reference(*args)
        calls.append(len(args[0]))
        assert all(torch.equal(a, b) for a, b in zip(kernel(*copies), expected))
        assert all(torch.equal(a, b) for a, b in zip(copies, args) if isinstance(a, torch.Tensor))
        return expected
    monkeypatch.setitem(kernels._OPS, "cpu", kernels._OPS["cpu"]._replace(**{op: both}))
    llm = LLM(str(tiny_dir), dtype="float32", num_kv_blocks=64, max_model_len=256, block_size=8)
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (60, 75, 50, 60, 70)]
    llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, kv_method=method,
                                          kv_budget=32, evict_every=8)
                           for method in ("batchmax", "kvcompress", "kvcompress", "batchmax", "kvcompress")])
    assert len(calls) > 6 and max(calls) > 1   # the two batchmax prompts of 60 evict together


def test_plot_of_kept_positions_is_written(llm, tmp_path):
    from nanokv.tools.plot_kept import plot_kept_positions
    prompt = torch.randint(0, VOCAB, (120,)).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, return_kept_positions=True))[0]
    plot_kept_positions(out.kept_positions, len(prompt), str(tmp_path / "kept.png"))
    assert (tmp_path / "kept.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
