"""bench.py: the largest-batch search, the workload, the records, and toy end-to-end runs.

Timings are never asserted: only that every figure is there and makes sense.
"""
import json
import sys

import pytest
import torch

import bench
from nanokv import LLM
from nanokv.tools import throughput

RECORD_FIELDS = {"device", "model", "dtype", "mode", "method", "budget", "batch", "input_len", "output_len",
                 "tokens_per_s", "peak_kv_gb", "kv_pool_gb", "decode_ms_per_step", "prefill_s", "evict_s",
                 "evict_pieces", "fits", "preemptions", "date", "commit", "cuda_max_allocated_gb"}


def search(threshold: int, max_batch: int, start: int = 1) -> tuple[int, list[int]]:
    """largest_batch against a fake engine where batches up to `threshold` fit."""
    probes = []

    def fits(b: int) -> bool:
        probes.append(b)
        return b <= threshold

    return throughput.largest_batch(fits, max_batch, start), probes


@pytest.mark.parametrize("max_batch", [1, 2, 7, 16, 100])
def test_largest_batch_finds_the_threshold(max_batch):
    for threshold in range(0, max_batch + 3):
        best, probes = search(threshold, max_batch)
        assert best == min(threshold, max_batch)
        assert len(probes) == len(set(probes)), "no batch is run twice"
        assert all(1 <= b <= max_batch for b in probes)
        assert len(probes) <= 2 * max_batch.bit_length() + 1


@pytest.mark.parametrize("start", [1, 5, 28, 200])
def test_largest_batch_from_a_guess(start):
    for threshold in (0, 1, 4, 27, 28, 29, 64, 127, 128, 500):
        best, probes = search(threshold, 128, start)
        assert best == min(threshold, 128)
        assert len(probes) == len(set(probes)) and all(1 <= b <= 128 for b in probes)
        assert len(probes) <= 2 * 128 .bit_length() + 1
    assert search(28, 128, start=28)[1] == [28, 29]    # a right guess: the answer and one more
    assert search(27, 128, start=28)[1] == [28, 27]


def test_largest_batch_edges():
    assert search(0, 64) == (0, [1])                      # not even one request fits
    assert search(10**6, 64) == (64, [1, 2, 4, 8, 16, 32, 64])   # everything fits: stop at the cap
    best, probes = search(5, 64)                           # the paper's b0 - 1: 6 was run and did not fit
    assert best == 5 and 6 in probes and probes[:4] == [1, 2, 4, 8]


def test_workload_is_nano_vllms():
    requests = throughput.workload()
    assert len(requests) == 256
    assert requests == throughput.workload(256, seed=0)         # reproducible
    assert requests != throughput.workload(256, seed=1)
    assert throughput.workload(8) == requests[:8]               # a shorter run is a prefix of the full one
    for prompt, output_len in requests:
        assert 100 <= len(prompt) <= 1024 and 100 <= output_len <= 1024
        assert all(0 <= t < 10000 for t in prompt)
    lengths = [len(p) for p, _ in requests]
    assert min(lengths) < 200 and max(lengths) > 900     # spread over the range, not a constant
    assert all(t < 300 for p, _ in throughput.workload(4, vocab=300) for t in p)


def test_presets_and_mode_defaults():
    args = bench.parse_args(["--preset", "cpu-small", "--input-len", "64"])
    assert args.mode == "paper" and args.input_len == 64 and args.budgets == [128] and args.num_requests == 0
    args = bench.parse_args(["--mode", "paper"])
    assert args.mode == "paper" and (args.input_len, args.output_len) == (3584, 512) and not args.cpu_default
    assert args.methods == ["full", "ed", "batchmax"] and args.kv_cache_gb > 0
    args = bench.parse_args(["--mode", "sweep"])
    assert args.out == "bench.jsonl" and "decode_only" in args.methods
    assert bench.parse_args(["--mode", "hf"]).output_len == 128


def test_a_bare_run_without_a_gpu_is_the_cpu_preset(monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    args = bench.parse_args([])
    assert args.cpu_default and (args.mode, args.input_len, args.kv_cache_gb) == ("paper", 512, 0.052)
    monkeypatch.setattr(bench, "bench_paper", lambda args, save: [])
    bench.main([])
    assert capsys.readouterr().out.startswith("No GPU here: the CPU preset (--preset cpu-small")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert not bench.parse_args([]).cpu_default and bench.parse_args([]).input_len == 3584


def test_a_flag_the_mode_does_not_use_is_an_error(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--mode", "host", "--kv-cache-gb", "4"])
    err = capsys.readouterr().err
    assert "--mode host does not use --kv-cache-gb" in err and "--random-weights" in err   # what it takes
    for argv in (["--mode", "workload", "--input-len", "64"], ["--mode", "hf", "--random-weights", "tiny"],
                 ["--mode", "workload", "--plot", "x.png"], ["--preset", "cpu-small", "--report", "r.md"],
                 ["--mode", "paper", "--budgets", "64", "--batches", "1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
    assert "--mode paper does not use --batches" in capsys.readouterr().err
    args = bench.parse_args(["--mode", "host", "--random-weights", "qwen3-0.6b", "--batches", "1", "256"])
    assert args.random_weights == "qwen3-0.6b" and args.batches == [1, 256]
    bench.parse_args(["--mode", "paper", "--max-batch", "128"])   # the mode's own flag, even at its default


def test_methods_take_a_schedule_and_settings():
    args = bench.parse_args(["--methods", "full", "h2o@prefill,sinks=4", "ed", "--budgets", "256",
                             "--ed-budgets", "2"])
    methods = throughput.method_list(args.methods, args.budgets, args.ed_budgets)
    assert [m.label for m in methods] == ["full", "h2o@prefill,sinks=4 |kv|=256", "ed |kv|=2"]
    params = throughput.sampling(methods[1], 8, evict_every=64)
    assert (params.kv_method, params.kv_schedule, params.kv_sinks, params.kv_budget, params.evict_every) \
        == ("h2o", "prefill", 4, 256, 64)
    assert throughput.sampling(methods[0], 8, evict_every=64).kv_budget is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--methods", "h2o@sometimes"])


# Tiny llama: a block is 2 layers x 2 KV heads x 16 slots x (2 x 16 x 4 bytes + 8) = 8704 bytes
# (on the CPU: no decode logits scratch), so 90 kB holds 10 blocks. A request of 48 + 4 tokens needs 3 blocks for its prompt and a 4th
# while it decodes (51 slots).
TOY = ["--input-len", "48", "--output-len", "4", "--kv-cache-gb", "0.00009", "--budgets", "32",
       "--evict-every", "16", "--dtype", "float32", "--threads", "1"]


def test_paper_mode_end_to_end(tiny_dir, tmp_path, capsys, monkeypatch):
    out, png = tmp_path / "runs.jsonl", tmp_path / "plot.png"
    synchronized, timing = [], LLM.timing

    def recorded(llm, synchronize=True):   # static batches' steps synchronised, continuous ones overlapping
        synchronized.append(synchronize)
        return timing(llm, synchronize)
    monkeypatch.setattr(LLM, "timing", recorded)
    records = bench.main(["--mode", "paper", "--model", str(tiny_dir), *TOY, "--max-batch", "8", "--num-requests", "6",
                          "--out", str(out), "--plot", str(png)])
    assert [json.loads(line) for line in out.read_text().splitlines()] == records
    static = {}
    for r in records:
        assert RECORD_FIELDS <= r.keys()
        assert r["kv_pool_gb"] == pytest.approx(10 * 8704 / 1e9)
        if r["mode"] == "static":
            static.setdefault((r["method"], r["budget"]), {})[r["batch"]] = r
        if r["fits"]:   # (a continuous stream may preempt: it still ran to the end)
            assert r["tokens_per_s"] > 0 and 0 < r["peak_kv_gb"] <= r["kv_pool_gb"]
            assert r["preemptions"] == 0 or r["mode"] == "continuous"
            assert r["prefill_s"] > 0 and r["decode_ms_per_step"] > 0
        else:
            assert r["tokens_per_s"] is None
    largest = {m: max(b for b, r in runs.items() if r["fits"]) for m, runs in static.items()}
    oom_at = {m: min(b for b, r in runs.items() if not r["fits"]) for m, runs in static.items()}
    # full: 3 requests are admitted (9 blocks) but need 12 while decoding: a preemption, OOM.
    # ed |kv|=2: 3 prompts fit (9 blocks), 4 do not; |kv|=65 > 51 slots reserves all 4 blocks.
    # batchmax |kv|=32: 2 blocks each, 5 fit.
    assert largest == {("full", None): 2, ("ed", 2): 3, ("ed", 65): 2, ("batchmax", 32): 5}
    assert oom_at == {m: b + 1 for m, b in largest.items()}
    assert static[("full", None)][3]["preemptions"] == 1
    continuous = [r for r in records if r["mode"] == "continuous"]
    assert {(r["method"], r["budget"]) for r in continuous} >= {("decode_only", 32), ("full", None)}
    assert all(r["fits"] and r["batch"] == 6 and r["output_tokens"] == 6 * 4 for r in continuous)
    assert synchronized == [r["mode"] == "static" for r in records]
    assert all(r["wait_ms_per_step"] >= 0 for r in continuous)
    for r in continuous:   # the phases of each kind of step add up to its steps' time
        steps = {kind: r[f"{kind}_steps"] for kind in r["phase_ms"]}
        assert sum(sum(ms.values()) * steps[kind] for kind, ms in r["phase_ms"].items()) == \
            pytest.approx(1e3 * (r["prefill_s"] + r["decode_s"]))
    assert all(r["evict_pieces"] == 0 for r in records if r["method"] == "full")
    assert all(r["evict_pieces"] > 0 for r in records if r["method"] == "batchmax" and r["fits"])
    table = capsys.readouterr().out
    assert "static batches" in table and "continuous batching" in table and "batchmax |kv|=32" in table
    assert "wait ms/step" in table and "evict pieces" in table
    assert "ms per step in each phase" in table and "batchmax |kv|=32, decode" in table
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_batch_that_cannot_fit_is_oom_not_a_crash(tiny_dir):
    args = bench.parse_args(["--model", str(tiny_dir), *TOY])
    llm = throughput.make_llm(args, 52, max_num_seqs=8, max_num_batched_tokens=8 * 48)
    method = throughput.Method("full", None)
    run = throughput.measure(llm, throughput.same_shape(8, 48, 4, method, 16, 300), static=True)
    assert not run["fits"] and run["tokens_per_s"] is None
    assert not llm.has_unfinished() and llm.blocks.num_free == llm.blocks.num_blocks   # all given back
    run = throughput.measure(llm, throughput.same_shape(2, 48, 4, method, 16, 300), static=True)
    assert run["fits"] and run["output_tokens"] == 8   # the engine is as good as new


def test_a_continuous_run_profiles_the_steps_asked_for(tiny_dir, monkeypatch):
    """The profiler runs over exactly steps first to last - 1 (or to the run's end, the last step
    that only reads tokens too) and its table of ops comes in the record; off a GPU there are no
    allocator calls to count."""
    args = bench.parse_args(["--model", str(tiny_dir), *TOY])
    llm = throughput.make_llm(args, 64, max_num_seqs=4)
    profiled, step = [], llm.step

    def watched():   # whether the profiler ran during each step
        outputs = step()
        profiled.append(torch.autograd.profiler._is_profiler_enabled)
        return outputs
    monkeypatch.setattr(llm, "step", watched)
    requests = throughput.same_shape(2, 40, 8, throughput.Method("batchmax", 32), 16, 300)
    for first, last in ((2, 4), (2, 10_000)):
        profiled.clear()
        run = throughput.measure(llm, requests, static=False, profile_steps=(first, last))
        assert [i for i, on in enumerate(profiled) if on] == list(range(first, min(last, len(profiled))))
        assert "Self CPU" in run["profile"] and "aten::" in run["profile"]
    assert run["cuda_mallocs"] is run["alloc_retries"] is run["pinned_mallocs"] is None
    assert throughput.measure(llm, requests, static=False)["profile"] is None


def test_sweep_writes_one_record_per_run(tiny_dir, tmp_path):
    out = tmp_path / "sweep.jsonl"
    bench.main(["--mode", "sweep", "--model", str(tiny_dir), *TOY, "--methods", "full", "batchmax",
                "--batches", "1", "6", "--input-lens", "32", "48", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 2 * 2 * 2   # methods x input lengths x batches
    assert all(RECORD_FIELDS <= r.keys() for r in lines)
    fits = {(r["method"], r["input_len"], r["batch"]): r["fits"] for r in lines}
    assert fits[("full", 48, 1)] and fits[("batchmax", 48, 1)] and not fits[("full", 48, 6)]


def test_decode_bytes_counts_weights_and_kv(tiny_dir):
    args = bench.parse_args(["--model", str(tiny_dir), *TOY])
    llm = throughput.make_llm(args, 52)
    model = llm.runner.model
    weights = sum(p.numel() * 4 for p in model.parameters()) - model.embed_tokens.weight.numel() * 4
    assert throughput.decode_bytes(llm, {"mean_decode_batch": None, "mean_decode_context": None}) == weights
    kv = 2 * 2 * 2 * 16 * 4   # K and V, layers, KV heads, head_dim, fp32
    assert throughput.decode_bytes(llm, {"mean_decode_batch": 3, "mean_decode_context": 10}) == weights + 30 * kv


def test_hf_mode_prints_both_tables(tiny_dir, capsys):
    """nanokv against HF generate on a tiny_dir model: the batch table and the batch-1 table."""
    bench.main(["--mode", "hf", "--model", str(tiny_dir), "--batch", "2", "--input-len", "16", "--output-len", "4",
                "--chat-lens", "20", "60", "--chat-tokens", "3"])
    out = capsys.readouterr().out
    assert "ratio nanokv / transformers" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["20"], ["60"])]
    assert len(rows) == 2 and all(len(r) == 6 and all(float(x) >= 0 for x in r) for r in rows)


def test_prefix_mode_end_to_end(tiny_dir, tmp_path, capsys):
    out = tmp_path / "prefix.jsonl"
    records = bench.main(["--model", str(tiny_dir), "--mode", "prefix", "--input-len", "40", "--suffix-len", "8",
                          "--num-requests", "3", "--turns", "3", "--output-len", "4", "--dtype", "float32",
                          "--out", str(out)])
    assert [json.loads(line) for line in out.read_text().splitlines()] == records
    assert [(r["workload"], r["caching"]) for r in records] == [
        ("shared prefix", False), ("chat", False), ("shared prefix", True), ("chat", True)]
    for r in records:
        assert r["mean_ttft_s"] > 0 and r["total_s"] >= r["mean_ttft_s"] and {"device", "date", "commit"} <= r.keys()
    # 2 of 3 requests share the 2 full blocks of the prefix; in the chat (turns of 8 + 4 tokens)
    # only turn 3 finds a full block computed before it
    assert [r["cached_tokens"] for r in records] == [0, 0, 64, 16]
    assert all(r["same_outputs"] for r in records[2:])
    assert "mean TTFT s" in capsys.readouterr().out


def test_host_mode_runs_the_shape_it_is_given():
    records = bench.main(["--mode", "host", "--random-weights", "smollm2-135m", "--batches", "2", "--methods", "full",
                          "--input-len", "8", "--output-len", "3"])
    assert {r["model"] for r in records} == {"random:smollm2-135m"} and all(r["forward"] > 0 for r in records)


def test_no_matplotlib_is_a_note_not_a_failure(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib raises ModuleNotFoundError
    png = tmp_path / "plot.png"
    bench.main(["--mode", "paper", "--model", str(tiny_dir), *TOY, "--max-batch", "2", "--num-requests", "0",
                "--plot", str(png)])
    assert "matplotlib is not installed" in capsys.readouterr().out and not png.exists()


def test_host_mode_times_every_phase_per_decode_step(capsys):
    records = bench.main(["--mode", "host", "--batches", "1", "3", "--methods", "full", "kvcompress",
                          "--input-len", "20", "--output-len", "6"])
    assert len(records) == 2 * 2 * 2   # methods x batches x caching off and on
    for r in records:
        assert r["decode_steps"] > 0 and {"device", "date", "commit", "caching", "method", "batch"} <= r.keys()
        phases = [r[p] for p in ("schedule", "describe", "swap", "evict", "prepare", "sample", "update", "outputs")]
        assert min(phases) >= 0 and r["host"] == pytest.approx(sum(phases)) and r["forward"] > 0
        assert all(r[column] > 0 for column in ("serial", "overlap", "step()"))   # wall less the run's own forward
    out = capsys.readouterr().out
    assert "per-sequence slope, batch 1 to 3" in out and "step()" in out


def test_offload_mode_swaps_where_the_tier_is_on(capsys):
    records = bench.main(["--mode", "offload", "--random-weights", "tiny", "--num-requests", "4", "--methods", "full",
                          "--output-len", "300"])
    recompute, swap, host, kvpr, *splits = records
    assert [r["shape"] for r in splits] == ["llama-2-7b", "qwen3-0.6b", "llama-3.1-8b"]
    assert all(len(r["splits"]) == len(r["lengths"]) == 5 and r["link_gb_per_s"] > 0 for r in splits)
    assert splits[2]["splits"] == [0] * 5   # grouped-query: a layer's input is larger than its K/V
    assert recompute["offload"] == "recompute" and recompute["preemptions"] > 0 == recompute["swaps"]
    assert swap["preemptions"] == swap["swaps"] > 0 and swap["copied_gb"] > 0 and swap["swap_s"] > 0
    assert recompute["output_tokens"] == swap["output_tokens"] and swap["ttft_p99_s"] >= swap["ttft_p50_s"] > 0
    for row in (host, kvpr):   # the tiny shape's layer input is as large as its K/V: KVPR's l is 0 too
        assert row["offloaded_blocks"] > 0 and row["positions_recomputed"] == 0 and row["copied_gb"] > 0
        assert row["output_tokens"] == swap["output_tokens"]
    assert "GB copied" in capsys.readouterr().out


def test_the_warm_up_runs_every_method_until_it_has_evicted_while_decoding(tiny_dir, monkeypatch):
    """On a GPU each method's first call at a shape compiles its kernels: the warm-up makes
    that call for every method measured, on the prompts given, past the prompt's eviction
    into one while decoding."""
    args = bench.parse_args(["--model", str(tiny_dir), *TOY])
    llm = throughput.make_llm(args, 128, max_num_seqs=4)
    methods = throughput.method_list(["full", "batchmax", "kvcompress"], [32], [])
    runs, generate = [], llm.generate

    def watched(prompts, params):   # each run's evicted pairs and tokens
        before = llm.stats().pairs_evicted
        outputs = generate(prompts, params)
        runs.append((params.kv_method, llm.stats().pairs_evicted - before, len(outputs[0].token_ids)))
        return outputs
    monkeypatch.setattr(llm, "generate", watched)
    prompts = throughput.random_prompts(2, 48, 300)
    throughput.warm_up(llm, methods, prompts, args)
    llm.generate(prompts, throughput.sampling(methods[1], 1, 16))
    prompt_only = runs.pop()[1]   # what reading the prompt evicts
    assert prompt_only > 0
    assert [(name, evicted > prompt_only if name != "full" else evicted == 0, tokens)
            for name, evicted, tokens in runs] == [("full", True, 18), ("batchmax", True, 18), ("kvcompress", True, 18)]
