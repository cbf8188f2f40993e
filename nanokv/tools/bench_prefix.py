"""bench.py --mode prefix: what prefix caching saves, measured with it and without.

Two workloads of random token ids, greedy, EOS ignored, each on a fresh engine per setting:
- shared prefix: N requests, each a common prefix of S tokens and U tokens of its own,
  all submitted at once (the first computes the prefix, the others share its blocks);
- chat: T turns of one conversation, each turn's prompt the whole conversation so far
  (every earlier message and reply) and a new message of U tokens.
Time to first token is from submission to a request's first output token.
"""
from __future__ import annotations

import random
import time

from nanokv import LLM, SamplingParams
from nanokv.tools.throughput import make_llm, run_context


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
    """Submit prompts at once and run them to the end: per request, its time to first token,
    its output and the prompt tokens the cache served."""
    start = time.perf_counter()
    ids = [llm.add_request(p, params) for p in prompts]
    first, outs = {}, {}
    while llm.has_unfinished():
        for out in llm.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
            outs[out.request_id] = out
    return [dict(ttft=first[i], output=outs[i].token_ids, cached=outs[i].num_cached_tokens) for i in ids]


def run(llm: LLM, args, seed: int = 0) -> dict[str, dict]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(llm.model_config.vocab_size) for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    timed(llm, [tokens(8)], SamplingParams(max_tokens=2))   # warm-up: a prompt no one shares
    start, prefix = time.perf_counter(), tokens(args.input_len)
    shared = timed(llm, [prefix + tokens(args.suffix_len) for _ in range(args.num_requests)], params)
    shared_s = time.perf_counter() - start
    start, conversation, turns = time.perf_counter(), [], []
    for _ in range(args.turns):
        conversation += tokens(args.suffix_len)
        turns += timed(llm, [conversation], params)
        conversation += turns[-1]["output"]
    chat_s = time.perf_counter() - start
    return {"shared prefix": summary(shared, shared_s), "chat": summary(turns, chat_s)}


def summary(results: list[dict], seconds: float) -> dict:
    return dict(mean_ttft_s=sum(r["ttft"] for r in results) / len(results), total_s=seconds,
                cached_tokens=sum(r["cached"] for r in results), outputs=[r["output"] for r in results])


def bench_prefix(args, save) -> list[dict]:
    """Both workloads, caching off then on; prints a table, saves and returns one record per row."""
    rows, longest = [], max(args.input_len + args.suffix_len, args.turns * (args.suffix_len + args.output_len))
    for caching in (False, True):
        llm = make_llm(args, longest + args.output_len, enable_prefix_caching=caching)
        context = run_context(args, llm)
        rows += [dict(context, mode="prefix", workload=workload, caching=caching, **result)
                 for workload, result in run(llm, args).items()]
        llm.close()   # a split engine's ranks end before the next one starts
    for row in rows[2:]:   # caching must change nothing in the outputs
        row["same_outputs"] = row["outputs"] == next(r["outputs"] for r in rows if r["workload"] == row["workload"])
    print(f"\nprefix caching: {context['model']}, {context['dtype']}, {context['device']}; shared prefix: "
          f"{args.num_requests} requests of {args.input_len} common + {args.suffix_len} own tokens; chat: "
          f"{args.turns} turns of {args.suffix_len} new tokens; {args.output_len} output tokens per request")
    print(f"{'workload':14} {'caching':>7} {'mean TTFT s':>11} {'total s':>8} {'cached tokens':>13} same outputs")
    for r in rows:
        print(f"{r['workload']:14} {'on' if r['caching'] else 'off':>7} {r['mean_ttft_s']:11.2f} "
              f"{r['total_s']:8.2f} {r['cached_tokens']:13} {r.get('same_outputs', '-')}")
    for r in rows:
        del r["outputs"]
        save(r)
    return rows
