"""bench.py --mode offload: the host tier under a device pool too small for the workload.

nano-vllm's workload (random prompts, input and output lengths uniform in [100, 1024]) runs
with the pool at a quarter of its peak demand (every request that can run at once holding
its whole context) and the host tier at four times the pool. A preempted sequence is
recomputed from its tokens (no tier) or swapped to the host tier and back; or, for methods
that never evict, running sequences decode from the host tier before anyone is preempted,
all their K/V copied back (l = 0) or the first positions recomputed (KVPR's l), the
staging taken out of the same pool. Per run: tokens/s, time to first token and between
tokens (p50 and p99 over the requests' streams), preemptions, swaps, blocks offloaded,
positions recomputed, the bytes copied (swaps, spills, streamed blocks) and the time the
copies before the steps took (streaming happens inside the forward pass). On a CPU the
"device" pool and the host tier are both in host memory: the table shows the mechanism
and what recomputing costs against copying (--random-weights tiny: the bookkeeping alone).
--output-len N caps each request's output at N tokens (the pool follows the shorter demand):
a run's decode steps follow its longest outputs, and steps that stream from the host tier
run without CUDA graphs (on an H200, 23-40 ms each for the Qwen3-0.6B shape), so a short
run needs short outputs. Then KVPR's split over a generation (the paper's Figure 12) on this
machine's measured link and device, for a multi-head shape and two grouped-query ones
(nanokv.engine.offload_costs.py).
"""
from __future__ import annotations

import gc
import time

import torch
from tqdm import tqdm

from models import HostKVCache
from models.shapes import shape_config
from nanokv import LLM
from nanokv.config import EngineConfig
from nanokv.engine.offload_costs import PositionCost, best_split, measure_link_and_device
from nanokv.engine.host_tier import STAGING_SHARE
from nanokv.tools.tables import print_table
from nanokv.tools.throughput import make_llm, method_list, run_context, sampling, workload

POOL_SHARE, HOST_TIMES = 0.25, 4
MAX_LEN = 2048   # the workload's longest request: 1024 + 1024
COLUMNS = [("method", "label", ""), ("K/V out of the pool", "offload", ""), ("tokens/s", "tokens_per_s", ".1f"),
           ("TTFT p50 s", "ttft_p50_s", ".2f"), ("TTFT p99 s", "ttft_p99_s", ".2f"),
           ("ITL p50 ms", "itl_p50_ms", ".1f"), ("ITL p99 ms", "itl_p99_ms", ".1f"),
           ("preemptions", "preemptions", ""), ("swaps", "swaps", ""), ("offloaded", "offloaded_blocks", ""),
           ("recomputed", "positions_recomputed", ""), ("GB copied", "copied_gb", ".3f"), ("copy s", "swap_s", ".2f")]


def percentile(values: list[float], q: float) -> float | None:
    return float(torch.tensor(values).quantile(q)) if values else None


def streamed_run(llm: LLM, requests: list) -> dict:
    """Submit (prompt, SamplingParams) requests at once and step to the end, noting when each
    request's tokens came out."""
    before = llm.stats()
    start = time.perf_counter()
    arrivals: dict[int, list[float]] = {}
    with llm.timing() as timings:
        for prompt, params in requests:
            arrivals[llm.add_request(prompt, params)] = []
        while llm.has_unfinished():
            outputs = llm.step()
            now = time.perf_counter()
            for out in outputs:
                arrivals[out.request_id] += [now] * len(out.new_token_ids)
    wall = time.perf_counter() - start
    stats = llm.stats()
    tokens = sum(map(len, arrivals.values()))
    gaps = [b - a for times in arrivals.values() for a, b in zip(times, times[1:])]
    first = [times[0] - start for times in arrivals.values()]
    copied = sum(getattr(stats, name) - getattr(before, name) for name in ("blocks_saved", "blocks_loaded",
                                                                              "blocks_streamed"))
    return dict(output_tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
                ttft_p50_s=percentile(first, 0.5), ttft_p99_s=percentile(first, 0.99),
                itl_p50_ms=1e3 * percentile(gaps, 0.5), itl_p99_ms=1e3 * percentile(gaps, 0.99),
                preemptions=stats.preemptions - before.preemptions, swaps=stats.swaps - before.swaps,
                offloaded_blocks=stats.blocks_offloaded - before.blocks_offloaded,
                positions_recomputed=stats.positions_recomputed - before.positions_recomputed,
                copied_gb=copied * stats.host_block_bytes / 1e9,
                swap_s=timings.decode["swap"] + timings.prefill["swap"])


def bench_offload(args, save) -> list[dict]:
    block_size = args.block_size or EngineConfig.block_size
    sizing = make_llm(args, MAX_LEN, num_kv_blocks=-(-MAX_LEN // block_size))   # only to read the sizes
    host_block_bytes = HostKVCache.bytes_per_block(sizing.runner.kv_cache) * sizing.config.tensor_parallel_size
    requests = [(prompt, min(n, args.output_len or n))
                for prompt, n in workload(args.num_requests, seed=0, vocab=sizing.model_config.vocab_size)]
    concurrent = requests[:sizing.config.max_num_seqs]
    demand = sum(-(-(len(prompt) + n) // block_size) for prompt, n in concurrent)
    pool = max(int(demand * POOL_SHARE), int(-(-MAX_LEN // block_size) / (1 - STAGING_SHARE)) + 1)   # + staging
    sizing.close()   # a split engine's ranks end before the next one starts
    del sizing
    gc.collect()
    host_gb = HOST_TIMES * pool * host_block_bytes / 1e9
    tier = dict(kv_offload_gb=host_gb, preemption_mode="swap")
    modes = {"recompute": dict(preemption_mode="recompute"), "swap": tier,
             "host, l = 0": dict(tier, decode_from_host=True, partial_recompute=False),
             "host, KVPR's l": dict(tier, decode_from_host=True)}
    rows = []
    runs = [(method, mode) for method in method_list(args.methods, args.budgets, args.ed_budgets)
            for mode in modes if method.name == "full" or not mode.startswith("host")]
    for method, mode in tqdm(runs, desc="offload", leave=False):
        llm = make_llm(args, MAX_LEN, num_kv_blocks=pool, **modes[mode])
        context = run_context(args, llm)
        batch = [(prompt, sampling(method, n, args.evict_every)) for prompt, n in requests]
        rows.append(dict(context, mode="offload", method=method.name, budget=method.budget, label=method.label,
                         offload=mode, pool_blocks=pool, demand_blocks=demand, host_gb=host_gb,
                         **streamed_run(llm, batch)))
        save(rows[-1])
        device, dtype = llm.device, llm.dtype
        llm.close()
        del llm   # before the next engine takes its memory
        gc.collect()
        torch.cuda.empty_cache()
    outputs = f"at most {args.output_len}" if args.output_len else "uniform in [100, 1024]"
    print(f"\noffload: {args.num_requests} requests (input lengths uniform in [100, 1024], output {outputs}, EOS "
          f"ignored); {rows[0]['model']}, {rows[0]['dtype']}, {rows[0]['device']}; pool {pool} blocks of "
          f"{block_size} ({POOL_SHARE:.0%} of the {demand} the first {len(concurrent)} requests hold at once), "
          f"host tier {host_gb:.3f} GB ({HOST_TIMES}x)")
    print_table(rows, COLUMNS)
    rows += kvpr_splits(device, dtype, save)
    return rows


def kvpr_splits(device: torch.device, dtype: torch.dtype, save, prompt: int = 128, new: int = 32) -> list[dict]:
    """KVPR's best l at every 8th length of a generation of `new` tokens after `prompt` (the
    paper's setting for its Figure 12), the link and the device measured here for each shape."""
    lengths = list(range(prompt, prompt + new + 1, 8))
    rows = []
    print(f"\nKVPR's split: positions recomputed per layer (l of s), {str(dtype).removeprefix('torch.')} "
          f"activations and K/V, this machine's link and device")
    print(f"{'shape':<14} {'link GB/s':>9} {'TFLOP/s':>8}  " + "  ".join(f"s={s:<4}" for s in lengths))
    for shape in ("llama-2-7b", "qwen3-0.6b", "llama-3.1-8b"):
        model = shape_config(shape)
        link, flops = measure_link_and_device(device, dtype, model.hidden_size, 2 * model.num_kv_heads * model.head_dim)
        cost = PositionCost.of(model, dtype, dtype, False, link, flops)
        rows.append(dict(mode="kvpr-split", shape=shape, link_gb_per_s=link / 1e9, tflops=flops / 1e12,
                         lengths=lengths, splits=[best_split(s, cost) for s in lengths]))
        save(rows[-1])
        splits = "  ".join(f"{l:<6}" for l in rows[-1]["splits"])
        print(f"{shape:<14} {link / 1e9:>9.1f} {flops / 1e12:>8.3f}  {splits}")
    return rows
