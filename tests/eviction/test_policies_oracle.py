"""Every ranking under every schedule against a dense float64 oracle.

The oracle reuses the dense decoder of oracle.py (its KV lists and its accumulated
attention) and implements the rankings and schedules straight
from their definitions, with none of the engine's machinery. The engine must keep
exactly the same positions in every (layer, KV head) and produce exactly the same
greedy tokens, for MHA and GQA models whose heads disagree.
"""
from __future__ import annotations

import math

import torch

from oracle import BLOCK, LayerKV, differences, distinct_prompt as prompt, engine

# Each ranking's defaults: schedule, sinks, recent (a function of the budget).
DEFAULTS = {"batchmax": ("prefill", 0, lambda b: 0), "h2o": ("decode", 0, lambda b: b // 2),
            "tova": ("decode", 0, lambda b: 0), "snapkv": ("once", 0, lambda b: 0),
            "streamingllm": ("prefill", 4, lambda b: 0), "knorm": ("once", 0, lambda b: 0)}
RANKINGS, SCHEDULES = tuple(DEFAULTS), ("prefill", "decode", "once")


def max_pooled(score: torch.Tensor, kernel: int) -> torch.Tensor:
    """Each slot's score replaced by the largest within kernel // 2 slots either side."""
    r, n = kernel // 2, score.shape[1]
    return torch.stack([score[:, max(i - r, 0):i + r + 1].max(dim=1).values for i in range(n)], dim=1)


def keep_priority(kv: LayerKV, case: dict, curr_id: int) -> torch.Tensor:
    """[Hkv, n]: the lowest is evicted first."""
    ranking = case["ranking"]
    if ranking == "batchmax":   # average attention: sum_weights over the queries that saw the pair
        return kv.score / (curr_id + 1 - kv.pos)
    if ranking in ("h2o", "tova"):   # accumulated attention; tova's counts only its last query
        return kv.score.clone()
    if ranking == "snapkv":     # its window's attention, pooled
        return max_pooled(kv.score, case.get("pool", 7))
    if ranking == "streamingllm":
        return kv.pos.double()
    assert ranking == "knorm", ranking   # low key norm first kept: high norm evicted first
    return -kv.k.norm(dim=-1)


def window(case: dict) -> int | None:
    """How many queries before an eviction count (None: all of them)."""
    return {"tova": 1, "snapkv": case.get("window", 32)}.get(case["ranking"])


def oracle_generate(oracle, ids: list[int], case: dict) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and kept positions [layers, kv_heads, n] at the end, for one case.

    A windowed ranking's scores are zeroed where its window starts (the last `window`
    queries before the next eviction) and after every eviction, so only the window's
    queries count."""
    B, p, n, W = case["budget"], case["p"], case["max_tokens"], window(case)
    schedule, sinks, recent = resolved(case)
    s = len(ids)
    cache = [LayerKV(oracle.num_kv_heads, oracle.head_dim) for _ in oracle.model.layers]

    def size() -> int:
        return len(cache[0])

    def zero_scores() -> None:
        for kv in cache:
            kv.score.zero_()

    def drop(count: int, curr_id: int) -> None:
        for kv in cache:
            m = len(kv)
            protected = (kv.pos < sinks) | (torch.arange(m) >= m - recent)
            priority = keep_priority(kv, case, curr_id).masked_fill(protected, math.inf)
            order = torch.sort(priority, dim=1, stable=True).indices   # ties: the lower position goes first
            kv.keep(order[:, count:].sort(dim=1).values)
        if W is not None:
            zero_scores()

    def next_eviction(t: int) -> int | None:
        """The position before which the cache, holding size() pairs before position t, evicts next."""
        if schedule == "once":
            return s if t < s and s > B else None
        if schedule == "decode" and t < s and s > B - p:
            return s
        return t + B - size()

    def feed(t0: int, t1: int, tokens: list[int]) -> torch.Tensor:
        """Positions t0..t1 (no eviction in between), the scores zeroed where a window starts."""
        end = next_eviction(t0)
        start = None if W is None or end is None else end - W
        if start is not None and t0 <= start < t1:
            if start > t0:
                oracle.forward(cache, tokens[:start - t0], list(range(t0, start)))
            zero_scores()
            return oracle.forward(cache, tokens[start - t0:], list(range(start, t1)))
        return oracle.forward(cache, tokens, list(range(t0, t1)))

    if schedule == "prefill":   # Algorithm 1: chunks of p after the first |kv|
        t1 = min(s, B)
        logits = feed(0, t1, ids[:t1])
        while t1 < s:
            drop(p, curr_id=t1 - 1)
            t0, t1 = t1, min(s, t1 + p)
            logits = feed(t0, t1, ids[t0:t1])
    else:
        logits = feed(0, s, ids)
    tokens = [int(logits[-1].argmax())]
    for position in range(s, s + n - 1):   # feed every sampled token but the last
        if position == s and schedule == "decode" and size() > B - p:
            drop(size() - (B - p), curr_id=s - 1)
        elif position == s and schedule == "once" and size() > B:
            drop(size() - B, curr_id=s - 1)
        elif schedule != "once" and size() == B:
            drop(p, curr_id=position - 1)
        logits = feed(position, position + 1, tokens[-1:])
        if schedule != "once":
            assert size() <= B
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack([kv.pos for kv in cache])


def resolved(case: dict) -> tuple[str, int, int]:
    """Schedule, sinks and recent as given, else the ranking's defaults; snapkv keeps its window."""
    schedule, sinks, recent = DEFAULTS[case["ranking"]]
    recent = case.get("recent", recent(case["budget"]))
    if case["ranking"] == "snapkv":
        recent = max(recent, window(case))
    return case.get("schedule") or schedule, case.get("sinks", sinks), recent


def case(ranking, schedule, s, budget=32, p=16, max_tokens=24, **protect) -> dict:
    return dict(ranking=ranking, schedule=schedule, s=s, budget=budget, p=p, max_tokens=max_tokens, **protect)


def params(c: dict):
    from nanokv import SamplingParams

    return SamplingParams(temperature=0, max_tokens=c["max_tokens"], ignore_eos=True, kv_method=c["ranking"],
                          kv_schedule=c["schedule"], kv_budget=c["budget"], evict_every=c["p"],
                          kv_sinks=c.get("sinks"), kv_recent=c.get("recent"), kv_window=c.get("window"),
                          kv_pool=c.get("pool"), return_kept_positions=True)


def label(c: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in c.items())


def check_against_oracle(llm, oracle, cases: list[dict], seed: int = 0) -> list:
    """All cases in ONE generate call, each compared with the oracle's run of it alone."""
    prompts = [prompt(c["s"], seed=seed + i) for i, c in enumerate(cases)]
    outs = llm.generate(prompts, [params(c) for c in cases])
    problems = []
    for c, ids, out in zip(cases, prompts, outs):
        tokens, kept = oracle_generate(oracle, ids, c)
        problems += differences(label(c), out, tokens, kept)
    assert not problems, "\n".join(problems)
    return outs


# Prompt lengths around the budget (32) and the block boundaries (16), each ranking under each
# schedule (None: the ranking's default), and protected positions and windows given explicitly.
# GQA gets every combination at two lengths, MHA at one (the interpreter-free run is still the
# slow part of the suite).
SETTINGS = {"knorm": dict(max_tokens=16), "snapkv": dict(window=8, pool=3)}
COMBINATIONS = [(r, sch) for r in RANKINGS for sch in SCHEDULES]
GQA_GRID = ([case(r, sch, s, **SETTINGS.get(r, {})) for i, (r, sch) in enumerate(COMBINATIONS)
             for s in (31 if i % 2 else 33, 64)]
            + [case(r, None, s) for r, s in (("batchmax", 47), ("h2o", 49), ("tova", 50), ("streamingllm", 80),
                                             ("knorm", 17))]
            + [case("snapkv", None, 70, budget=48),   # its default window (32) and pooling (7)
               case("batchmax", "prefill", 70, sinks=3, recent=5), case("h2o", "prefill", 70, recent=0),
               case("tova", "prefill", 70, sinks=2, recent=3),
               case("snapkv", "prefill", 60, window=5, pool=1, sinks=2),
               case("snapkv", "decode", 45, budget=48, window=20, pool=5),
               case("knorm", "decode", 50, budget=48, max_tokens=16, sinks=2, recent=7),
               case("streamingllm", "once", 40, sinks=0), case("h2o", "once", 90, budget=48, sinks=4, recent=20)])
MHA_GRID = [case(r, sch, (31, 48, 64)[i % 3], **SETTINGS.get(r, {})) for i, (r, sch) in enumerate(COMBINATIONS)]


def test_every_ranking_under_every_schedule_keeps_what_the_oracle_keeps(model):
    path, _, oracle = model
    check_against_oracle(engine(path), oracle, GQA_GRID if oracle.num_kv_heads < oracle.num_heads else MHA_GRID)


def test_every_ranking_on_an_int8_cache_keeps_what_its_oracle_keeps(gqa):
    """kv_cache_dtype="int8": each ranking under its default schedule, against the oracle that
    keeps every pair as the int8 cache gives it back (K-norm ranks the dequantized keys)."""
    path, _, oracle = gqa
    check_against_oracle(engine(path, kv_cache_dtype="int8"), oracle.quantized(torch.int8),
                         [case(r, None, s, **SETTINGS.get(r, {})) for r, s in zip(RANKINGS, (47, 49, 50, 70, 80, 17))])


def test_the_cache_follows_each_schedule_step_by_step(gqa):
    """Chunked prefills, a mix of rankings, schedules and budgets: under prefill and decode
    (once the prompt is read) no head ever holds more than |kv| pairs; under once exactly |kv|
    right after the prompt, then one more per token; the pool accounts for every block and
    gets all of them back; and every request still matches the oracle."""
    path, _, oracle = gqa
    llm = engine(path, max_num_batched_tokens=40)
    cases = [case("h2o", "prefill", 100, max_tokens=40), case("streamingllm", "decode", 60, budget=48),
             case("knorm", "once", 75, max_tokens=20), case("batchmax", "once", 20, max_tokens=20),
             case("h2o", "decode", 45, budget=48, max_tokens=40), case("tova", "decode", 70, max_tokens=40),
             case("snapkv", "once", 66, budget=48, max_tokens=20, window=16)]
    by_id = {llm.add_request(prompt(c["s"], seed=i), params(c)): c for i, c in enumerate(cases)}
    outputs = {}
    while llm.has_unfinished():
        for out in llm.step():
            if out.finished:
                outputs[out.request_id] = out
        for seq in llm.scheduler.running:
            c = by_id[seq.seq_id]
            schedule, B, s = c["schedule"], c["budget"], c["s"]
            fed_after_prompt = seq.num_computed_tokens - s
            if schedule == "prefill" or (schedule == "decode" and fed_after_prompt > 0):
                assert seq.num_kv_slots <= B, (c, seq.num_kv_slots)
                assert len(seq.block_table) <= math.ceil(B / BLOCK), (c, seq.block_table)
            if schedule == "once" and fed_after_prompt > 0:
                assert seq.num_kv_slots == min(B, s) + fed_after_prompt, (c, seq.num_kv_slots)
        running = llm.scheduler.running
        assert llm.blocks.num_free + sum(len(seq.block_table) for seq in running) == llm.blocks.num_blocks
    assert llm.blocks.num_free == llm.blocks.num_blocks
    problems = []
    for rid, c in by_id.items():
        i = cases.index(c)
        tokens, kept = oracle_generate(oracle, prompt(c["s"], seed=i), c)
        problems += differences(label(c) + " (stepped)", outputs[rid], tokens, kept)
    assert not problems, "\n".join(problems)


def test_preempted_requests_of_every_ranking_finish_as_the_oracle_says(gqa):
    """A pool too small for everyone: full requests grow and push the others out; a preempted
    request is recomputed from its tokens (prompt and output) and still ends exactly as alone."""
    from nanokv import SamplingParams

    path, _, oracle = gqa
    tight = engine(path, num_kv_blocks=8, max_model_len=96)
    cases = [case("h2o", "decode", 60, max_tokens=30), case("knorm", "once", 50, max_tokens=30),
             case("streamingllm", "prefill", 45, max_tokens=40), case("snapkv", "prefill", 55, window=4, pool=3),
             case("tova", "decode", 40, max_tokens=30)]
    fulls = [prompt(40, seed=100), prompt(50, seed=101)]
    outs = tight.generate(fulls + [prompt(c["s"], seed=i) for i, c in enumerate(cases)],
                          [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 2
                          + [params(c) for c in cases])
    assert tight.scheduler.num_preemptions > 0
    assert tight.blocks.num_free == tight.blocks.num_blocks
    problems = []
    for i, (c, out) in enumerate(zip(cases, outs[2:])):
        tokens, kept = oracle_generate(oracle, prompt(c["s"], seed=i), c)
        problems += differences(label(c) + " (preempted)", out, tokens, kept)
    assert not problems, "\n".join(problems)
