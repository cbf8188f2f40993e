"""Throughput: what KV-cache eviction buys, measured on your own hardware.

    python bench.py                      paper mode (Tables 1-2 of Batch-Max), defaults below
    python bench.py --preset cpu-small   paper mode at toy sizes, on the bundled model, for a CPU
    python bench.py --mode workload      nano-vllm's workload (256 requests), with and without eviction
    python bench.py --mode sweep         methods x budgets x batches x input lengths, as JSON lines
    python bench.py --mode prefix        prefix caching on and off: a shared prefix, a chat (nanokv/bench_prefix.py)
    python bench.py --mode hf            nanokv against HF transformers `generate` on the CPU
                                         (batch 8, and batch 1 at three prompt lengths: nanokv/bench_hf.py)
    python bench.py --mode gpu-report --report gpu.md
                                         all a GPU session measures, in one report (nanokv/gpu_report.py)

Models: --model DIR|HUB_ID (default: the bundled SmolLM2-135M) or --random-weights SHAPE
(llama-3.1-8b, qwen3-0.6b, smollm2-135m: models/shapes.py). Throughput does not depend on
the weights, so a GPU run needs no checkpoint. Prompts are random token ids and EOS is
ignored: every request generates exactly its output length. --kv-cache-dtype int8|fp8: a
quantized KV cache (the same --kv-cache-gb then holds ~1.8x the tokens of a bf16 cache).

What the numbers mean (each record comes from one run; nothing is copied between runs):
- tokens/s: generated tokens / wall time of the whole run, prefill included.
- A static batch of b requests *fits* when the engine admits all b in its first step
  (their prompts are read together, as the paper's padded batches are) and runs them to
  the end with no preemption. Otherwise it *ran out of KV blocks* (OOM, as in the paper):
  the engine never crashes for lack of blocks, it queues or preempts, so the bench watches
  for a waiting request or a preemption after every step, and stops the run at the first.
  Admitting "in the first step" matters for ED and decode_only: given time, the engine
  would let them compress early requests before admitting later ones, which is
  continuous batching, not the paper's static batch.
- Largest batch: the paper's b0 - 1, b0 the smallest batch that runs out. Whether a batch
  fits cannot be decided without running it (a full cache grows while it decodes), so the
  search runs batches: b = 1, 2, 4, ... until one runs out, then bisection, up to
  --max-batch. Fitting is monotone in b. The largest run that fit is the one reported.
- Continuous batching: N requests of the same shape, all submitted at t=0; the engine
  admits them as memory allows and preempts when it must. Here a decode-only method can
  read one prompt, compress it, then admit the next: decode_only shows where evicting
  during the prefill still wins (prompts long relative to memory) and where it does not.
- Peak KV: the most KV blocks in use after any step x bytes per block (K, V, and each
  slot's position, score and, quantized, the scales of K and V). Blocks taken and given back within one step are not seen.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from tqdm import tqdm

from models.shapes import SHAPES
from nanokv import LLM, SamplingParams
from nanokv.bench_hf import bench_vs_hf
from nanokv.bench_prefix import bench_prefix
from nanokv.eviction import parse_spec, spec_argument
from nanokv.kv_cache import KVCache
from nanokv.runner import Timings

PRESETS = {
    # static batches only, under 2 minutes on one CPU core (docs/BENCH.md); full fits 2 requests
    "cpu-small": dict(mode="paper", input_len=512, output_len=32, kv_cache_gb=0.052, budgets=[128],
                      ed_budgets=[2], max_batch=16, num_requests=0),
    # the paper's shape with a shorter output, static batches only: the gpu report's part (2-3 minutes)
    "gpu-paper": dict(mode="paper", random_weights="llama-3.1-8b", input_len=3584, output_len=128,
                      kv_cache_gb=4.0, budgets=[1024], ed_budgets=[2], max_batch=128, num_requests=0),
}
MODE_DEFAULTS = {
    "hf": dict(input_len=200, output_len=128),
    "paper": dict(input_len=3584, output_len=512, methods=["full", "ed", "batchmax"]),
    "sweep": dict(input_len=3584, output_len=512, methods=["full", "ed", "batchmax", "decode_only"]),
    "workload": dict(num_requests=256, methods=["full", "batchmax"], max_num_batched_tokens=16384),
    "gpu-report": {},
    "prefix": dict(num_requests=8, input_len=512, output_len=16),
}


# ----- what runs -------------------------------------------------------------------------

class Method(NamedTuple):
    name: str            # RANKING[@SCHEDULE][,KEY=INT...] (nanokv.eviction.parse_spec): batchmax, h2o@prefill, ...
    budget: int | None   # |kv|; None for full

    @property
    def label(self) -> str:
        return self.name if self.budget is None else f"{self.name} |kv|={self.budget}"


def label(record: dict) -> str:
    return Method(record["method"], record["budget"]).label


def method_list(names: list[str], budgets: list[int], ed_budgets: list[int]) -> list[Method]:
    """Every named method at each of its budgets: ed at --ed-budgets, the others at --budgets."""
    def budgets_of(name):
        ranking = parse_spec(name)["kv_method"]
        return [None] if ranking == "full" else ed_budgets if ranking == "ed" else budgets
    return [Method(name, budget) for name in names for budget in budgets_of(name)]


def same_shape(n: int, input_len: int, output_len: int, method: Method, evict_every: int, vocab: int):
    """n requests of one shape with random prompts (seed 0: every method reads the same ones)."""
    rng = random.Random(0)
    params = sampling(method, output_len, evict_every)
    return [([rng.randrange(vocab) for _ in range(input_len)], params) for _ in range(n)]


def workload(n: int = 256, seed: int = 0, vocab: int = 10000) -> list[tuple[list[int], int]]:
    """nano-vllm's benchmark workload: (prompt, output length) pairs, random prompt token ids
    below 10000, input and output lengths uniform in [100, 1024]. Request i is the same
    whatever n is, so a smaller n is a prefix of the full 256."""
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt = [rng.randrange(min(vocab, 10000)) for _ in range(rng.randint(100, 1024))]
        requests.append((prompt, rng.randint(100, 1024)))
    return requests


def sampling(method: Method, max_tokens: int, evict_every: int) -> SamplingParams:
    eviction = {} if method.budget is None else {"kv_budget": method.budget, "evict_every": evict_every}
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0,
                          **{**eviction, **parse_spec(method.name)})


def make_llm(args, max_model_len: int, **options) -> LLM:
    """The engine for this bench, with a pool of --kv-cache-gb (the engine's default if None).
    No prefix caching unless asked for: the modes that compare methods repeat their prompts,
    and a cache would serve later runs from earlier ones."""
    model = f"random:{args.random_weights}" if args.random_weights else args.model
    options.setdefault("enable_prefix_caching", False)
    return LLM(model, dtype=args.dtype, kv_cache_gb=args.kv_cache_gb, max_model_len=max_model_len,
               block_size=args.block_size, enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype,
               **options)


def warm_up(llm, input_len: int, args) -> None:
    """One request with a full cache and one that evicts: compiles the kernels (GPU) and
    touches every code path once, so the first measured run is not also a warm-up."""
    budget = min(args.budgets)
    prompt = [1] * min(input_len, budget + 2 * args.evict_every)   # long enough to evict twice
    llm.generate([prompt] * 2, [sampling(Method("full", None), 2, args.evict_every),
                                sampling(Method("batchmax", budget), 2, args.evict_every)])


# ----- one run ---------------------------------------------------------------------------

def measure(llm: LLM, requests: list[tuple[list[int], SamplingParams]], static: bool) -> dict:
    """Submit (prompt, SamplingParams) requests at once, step the engine until they are
    done, and say what it cost. static: stop as soon as the batch is known not to fit
    (a request waits after a step, or one was preempted) and report it as not fitting."""
    sched, blocks, cuda = llm.scheduler, llm.blocks, llm.runner.device.type == "cuda"
    llm.runner.timings = timings = Timings()
    preempted = sched.num_preemptions
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    fits = True
    tokens = peak_blocks = max_running = decode_batch = decode_context = 0
    start = time.perf_counter()
    ids = [llm.add_request(prompt, params) for prompt, params in requests]
    while llm.has_unfinished():
        running = len(sched.running)   # for the roofline: what a decode step reads, at its start
        context = sum(seq.num_kv_slots + 1 for seq in sched.running)
        decode_steps = timings.decode_steps
        tokens += sum(len(out.new_token_ids) for out in llm.step())
        if timings.decode_steps > decode_steps:
            decode_batch, decode_context = decode_batch + running, decode_context + context
        peak_blocks = max(peak_blocks, blocks.num_blocks - blocks.num_free)
        max_running = max(max_running, len(sched.running))
        if static and (sched.waiting or sched.num_preemptions > preempted):
            fits = False
            break
    wall = time.perf_counter() - start
    if not fits:   # give the blocks back (aborting a finished request does nothing)
        for request_id in ids:
            llm.abort(request_id)
    steps = timings.decode_steps
    return dict(
        fits=fits, requests=len(requests), output_tokens=tokens, wall_s=wall,
        tokens_per_s=tokens / wall if fits else None,
        peak_kv_gb=peak_blocks * KVCache.bytes_per_block(llm.model_config, blocks.block_size, llm.runner.kv_dtype,
                                                                llm.runner.device)
        / 1e9,
        cuda_max_allocated_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        decode_ms_per_step=1e3 * timings.decode_s / steps if steps else None,
        prefill_s=timings.prefill_s, decode_s=timings.decode_s, evict_s=timings.evict_s,
        host_ms_per_step=1e3 * timings.host_s / max(steps + timings.prefill_steps, 1),
        prefill_steps=timings.prefill_steps, decode_steps=steps,
        mean_decode_batch=decode_batch / steps if steps else None,
        mean_decode_context=decode_context / decode_batch if decode_batch else None,
        preemptions=sched.num_preemptions - preempted, max_running=max_running)


def run_context(args, llm) -> dict:
    """The fields every record of this process shares: where, what, when, which code."""
    device = llm.runner.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu, {torch.get_num_threads()} torch threads"
    per_block = KVCache.bytes_per_block(llm.model_config, llm.config.block_size, llm.runner.kv_dtype, llm.runner.device)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        commit = None
    return dict(device=name, model=f"random:{args.random_weights}" if args.random_weights else
                (args.model or "bundled SmolLM2-135M"), dtype=str(llm.dtype).removeprefix("torch."),
                kv_cache_dtype=str(llm.runner.kv_dtype).removeprefix("torch."),
                kv_pool_gb=llm.blocks.num_blocks * per_block / 1e9, kv_blocks=llm.blocks.num_blocks,
                block_size=llm.config.block_size, evict_every=args.evict_every,
                date=datetime.datetime.now().isoformat(timespec="seconds"), commit=commit)


def record(context: dict, mode: str, method: Method, input_len, output_len, run: dict) -> dict:
    """One JSON line: the context, what ran, and what it measured. batch = requests submitted."""
    return dict(context, mode=mode, method=method.name, budget=method.budget, batch=run["requests"],
                input_len=input_len, output_len=output_len, **run)


def largest_batch(fits: Callable[[int], bool], max_batch: int) -> int:
    """The paper's b0 - 1 (b0: the smallest batch that does not fit), found with few runs:
    b = 1, 2, 4, ... until one does not fit, then bisection between the last two. 0 if not
    even one request fits; max_batch if everything up to it fits (b0 is then unknown)."""
    lo, hi, b = 0, max_batch + 1, 1   # lo fits (0 trivially), hi does not (or is past the search)
    while hi - lo > 1:
        if fits(b):
            lo = b
        else:
            hi = b
        b = min(2 * b, max_batch) if hi > max_batch else (lo + hi) // 2
    return lo


# ----- modes -----------------------------------------------------------------------------

def static_search(llm, method: Method, args, context: dict, save: Callable[[dict], None]) -> tuple[dict, int]:
    """The largest-batch search for one method: every static batch it ran (by batch size),
    and the largest that fit."""
    inp, out, vocab = args.input_len, args.output_len, llm.model_config.vocab_size
    runs = {}

    def fits(b: int) -> bool:
        run = measure(llm, same_shape(b, inp, out, method, args.evict_every, vocab), static=True)
        runs[b] = record(context, "static", method, inp, out, run)
        save(runs[b])
        print(f"  {method.label:<22} batch {b:>4}: {'fits' if run['fits'] else 'OOM'} ({run['wall_s']:.1f} s)",
              file=sys.stderr)
        return run["fits"]

    best = largest_batch(fits, args.max_batch)
    return runs, best


def bench_paper(args, save: Callable[[dict], None]) -> list[dict]:
    """Tables 1-2 of Batch-Max: each method at its largest static batch under a fixed KV
    memory, then the same shapes as a continuous stream."""
    inp, out = args.input_len, args.output_len
    methods = method_list(args.methods, args.budgets, args.ed_budgets)
    llm = make_llm(args, inp + out, max_num_seqs=args.max_batch, max_num_batched_tokens=args.max_batch * inp)
    context, vocab = run_context(args, llm), llm.model_config.vocab_size
    warm_up(llm, inp, args)
    records, rows = [], []
    for method in methods:
        runs, best = static_search(llm, method, args, context, save)
        oom_at = min((b for b, r in runs.items() if not r["fits"]), default=f">{args.max_batch}")
        rows.append(dict(runs.get(best, {"fits": False}), label=method.label, largest=best, oom_at=oom_at))
        records += runs.values()
    print(f"\nstatic batches: {context['model']}, {context['dtype']} (KV cache {context['kv_cache_dtype']}), "
          f"{context['device']}, input {inp}, "
          f"output {out}, KV pool {context['kv_pool_gb']:.3f} GB = {context['kv_blocks']} blocks "
          f"of {context['block_size']}, p = {args.evict_every}")
    print_table(rows, STATIC_COLUMNS)
    del llm   # before the next engine takes its memory
    gc.collect()
    torch.cuda.empty_cache()

    if args.num_requests == 0:
        return records
    n = args.num_requests or 4 * max(row["largest"] for row in rows)
    methods += [Method("decode_only", b) for b in args.budgets if Method("decode_only", b) not in methods]
    llm = make_llm(args, inp + out, max_num_seqs=n, max_num_batched_tokens=args.max_num_batched_tokens)
    warm_up(llm, inp, args)
    rows = []
    for method in tqdm(methods, desc="continuous", leave=False):
        rows.append(record(context, "continuous", method, inp, out,
                           measure(llm, same_shape(n, inp, out, method, args.evict_every, vocab), static=False)))
        save(rows[-1])
    print(f"\ncontinuous batching: {n} requests of the same shape submitted at t=0, same KV pool")
    print_table(rows, CONTINUOUS_COLUMNS)
    return records + rows


def bench_workload(args, save: Callable[[dict], None]) -> list[dict]:
    """nano-vllm's workload, with and without eviction, and each decode step's time against
    its memory roofline: weights + the KV it reads, over a measured copy bandwidth."""
    llm = make_llm(args, 2048, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    context = run_context(args, llm)
    warm_up(llm, 512, args)
    bandwidth = copy_bandwidth(llm.runner.device)
    requests = workload(args.num_requests, seed=0, vocab=llm.model_config.vocab_size)
    rows = []
    for method in tqdm(method_list(args.methods, args.budgets, args.ed_budgets), desc="workload", leave=False):
        batch = [(prompt, sampling(method, n, args.evict_every)) for prompt, n in requests]
        rows.append(record(context, "workload", method, None, None, measure(llm, batch, static=False)))
        rows[-1].update(copy_gb_per_s=bandwidth / 1e9,
                        roofline_ms_per_step=1e3 * decode_bytes(llm, rows[-1]) / bandwidth)
        save(rows[-1])
    print(f"\nworkload: {args.num_requests} requests, seed 0, random prompts, input and output lengths "
          f"uniform in [100, 1024], EOS ignored; {context['model']}, {context['dtype']}, {context['device']}, "
          f"KV pool {context['kv_pool_gb']:.2f} GB; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print_table(rows, WORKLOAD_COLUMNS)
    return rows


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s one large copy moves (read + write): the most a memory-bound step can hope for."""
    n = 2**30 if device.type == "cuda" else 2**28
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    sync()
    return 2 * n * 5 / (time.perf_counter() - start)


def decode_bytes(llm, run: dict) -> float:
    """Bytes a mean decode step must read: every weight once (the embedding table only by
    row, unless it is also the output head), and K and V of every slot in the batch."""
    model, cfg = llm.runner.model, llm.model_config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    kv_dtype = llm.runner.kv_dtype
    scales = 4 if kv_dtype != llm.dtype else 0   # a quantized cache's fp32 scale per (slot, head) of K and of V
    per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim * kv_dtype.itemsize + scales)
    slots = (run["mean_decode_batch"] or 0) * (run["mean_decode_context"] or 0)
    return weights + slots * per_slot


def bench_sweep(args, save: Callable[[dict], None]) -> list[dict]:
    """Every method x budget x batch size x input length as a static batch, one record each."""
    lens, out = args.input_lens or [args.input_len], args.output_len
    llm = make_llm(args, max(lens) + out, max_num_seqs=max(args.batches),
                   max_num_batched_tokens=max(args.batches) * max(lens))
    context, vocab = run_context(args, llm), llm.model_config.vocab_size
    warm_up(llm, max(lens), args)
    grid = list(itertools.product(method_list(args.methods, args.budgets, args.ed_budgets), lens, args.batches))
    records = []
    for method, inp, b in tqdm(grid, desc="sweep", leave=False):
        run = measure(llm, same_shape(b, inp, out, method, args.evict_every, vocab), static=True)
        records.append(record(context, "static", method, inp, out, run))
        save(records[-1])
    rows = []
    for r in records:   # the ratio against full at its largest batch that fit, same input length
        full = [f for f in records if f["method"] == "full" and f["input_len"] == r["input_len"] and f["fits"]]
        best = max(full, key=lambda f: f["batch"], default=None)
        rows.append(dict(r, x_full=r["tokens_per_s"] / best["tokens_per_s"] if best and r["fits"] else None))
    print_table(rows, SWEEP_COLUMNS)
    return records


# ----- output ----------------------------------------------------------------------------

# (header, record key, format) of each table's columns
TIMES = [("decode ms/step", "decode_ms_per_step", ".1f"), ("prefill s", "prefill_s", ".2f"),
         ("evict s", "evict_s", ".2f"), ("host ms/step", "host_ms_per_step", ".2f")]
SPEED = [("tokens/s", "tokens_per_s", ".1f"), ("x full", "x_full", ".2f")]
STATIC_COLUMNS = [("method", "label", ""), ("batch", "largest", ""), ("OOM at", "oom_at", ""), *SPEED,
                  ("peak KV GB", "peak_kv_gb", ".3f"), *TIMES]
CONTINUOUS_COLUMNS = [("method", "label", ""), *SPEED, ("max running", "max_running", ""),
                      ("preemptions", "preemptions", ""), ("peak KV GB", "peak_kv_gb", ".3f"), *TIMES]
WORKLOAD_COLUMNS = [*CONTINUOUS_COLUMNS[:1 - len(TIMES)], ("roofline ms/step", "roofline_ms_per_step", ".1f"),
                    ("mean batch", "mean_decode_batch", ".1f"), ("mean context", "mean_decode_context", ".0f"),
                    *TIMES[1:]]
SWEEP_COLUMNS = [("method", "label", ""), ("input", "input_len", ""), ("batch", "batch", ""), ("fits", "fits", ""),
                 *SPEED, ("peak KV GB", "peak_kv_gb", ".3f"), *TIMES]


def print_table(rows: list[dict], columns: list[tuple]) -> None:
    """A plain-text table; adds the ratio of tokens/s against the row for `full` if missing."""
    full = next((r for r in rows if r.get("method") == "full" and r.get("tokens_per_s")), None)
    rows = [dict(r) for r in rows]   # the records themselves stay as they were saved
    for r in rows:
        r.setdefault("label", label(r))
        if "x_full" not in r:
            r["x_full"] = r["tokens_per_s"] / full["tokens_per_s"] if full and r.get("tokens_per_s") else None
    cells = [[header for header, _, _ in columns]]
    for r in rows:
        cells.append(["OOM" if key == "tokens_per_s" and r.get("fits") is False else
                      "-" if r.get(key) is None else format(r[key], spec) for _, key, spec in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for row in cells:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))


def plot(records: list[dict], path: str) -> None:
    """Two panels against batch size, a line per method (and input length): tokens/s and
    peak KV memory of the static batches that fit; the legend says where each ran out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    static = [r for r in records if r["mode"] == "static"]
    if not static:
        print("--plot: no static batches to plot (paper and sweep modes run them)")
        return
    several_lens = len({r["input_len"] for r in static}) > 1
    curves: dict[str, list[dict]] = {}
    for r in sorted(static, key=lambda r: r["batch"]):
        curves.setdefault(label(r) + (f", input {r['input_len']}" if several_lens else ""), []).append(r)
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for name, runs in curves.items():
        fit = [r for r in runs if r["fits"]]
        oom = min((r["batch"] for r in runs if not r["fits"]), default=None)
        name += f" (OOM at {oom})" if oom else ""
        speed.plot([r["batch"] for r in fit], [r["tokens_per_s"] for r in fit], "o-", label=name)
        memory.plot([r["batch"] for r in fit], [r["peak_kv_gb"] for r in fit], "o-")
    memory.axhline(static[0]["kv_pool_gb"], color="gray", linestyle="--", label="KV pool")
    batches = sorted({r["batch"] for r in static if r["fits"]})
    for ax, ylabel, title in ((speed, "output tokens/s", "throughput"), (memory, "peak KV GB", "peak KV memory")):
        ax.set(xscale="log", xlabel="batch size (static)", ylabel=ylabel, ylim=(0, None), title=title)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
    speed.legend(fontsize=8)
    memory.legend(fontsize=8)
    r = static[0]
    lens = "" if several_lens else f"input {r['input_len']}, "
    fig.suptitle(f"{r['model']}, {r['dtype']}, {r['device']}; {lens}output {r['output_len']}, "
                 f"KV pool {r['kv_pool_gb']:.3g} GB", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


# ----- command line ----------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags, with defaults that depend on the mode and the preset (the preset's win)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["paper", "workload", "sweep", "hf", "gpu-report", "prefix"])
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--model", default=None, help="HF directory or hub id (default: the bundled SmolLM2-135M)")
    p.add_argument("--random-weights", metavar="SHAPE", choices=sorted(SHAPES),
                   help=f"random weights of a model shape: {', '.join(SHAPES)}")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                   help="auto: the model's dtype; int8 / fp8: a quantized KV cache")
    p.add_argument("--kv-cache-gb", type=float, help="KV pool size; default 4 on CUDA, 0.4 on the CPU "
                   "(paper, sweep), the engine's own in workload mode")
    p.add_argument("--input-len", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--methods", nargs="+", type=spec_argument, help="methods: RANKING[@SCHEDULE][,KEY=INT...], "
                   "KEY in sinks, recent, window, pool, every (e.g. full batchmax h2o@prefill,sinks=4)")
    p.add_argument("--budgets", type=int, nargs="+", default=[1024, 512], help="|kv| of every method but ed")
    p.add_argument("--ed-budgets", type=int, nargs="+", default=[2, 65], help="|kv| of ed")
    p.add_argument("--evict-every", type=int, default=64, help="p, pairs evicted at a time")
    p.add_argument("--max-batch", type=int, default=128, help="paper: the largest static batch tried")
    p.add_argument("--num-requests", type=int, help="paper: continuous stream length (default 4 x the "
                   "largest static batch; 0: no continuous run); workload: requests (default 256)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="sweep: batch sizes")
    p.add_argument("--input-lens", type=int, nargs="+", help="sweep: input lengths (default --input-len)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="workload: engine option")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="engine option (continuous and workload; static batches read all prompts at once)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode graphs")
    p.add_argument("--threads", type=int, help="CPU threads for torch")
    p.add_argument("--batch", type=int, default=8, help="hf: batch size (0: no batch table)")
    p.add_argument("--chat-lens", type=int, nargs="*", default=[100, 1000, 4000],
                   help="hf: prompt lengths of the batch-1 table (none: no table)")
    p.add_argument("--chat-tokens", type=int, default=64, help="hf: new tokens per batch-1 request")
    p.add_argument("--suffix-len", type=int, default=64, help="prefix: each request's own tokens after the "
                   "shared prefix (--input-len), and each chat message")
    p.add_argument("--turns", type=int, default=8, help="prefix: chat turns")
    p.add_argument("--out", help="append one JSON line per run here (sweep default: bench.jsonl)")
    p.add_argument("--plot", metavar="PNG", help="tokens/s and peak KV memory against batch size")
    p.add_argument("--report", default="gpu-report.md", help="gpu-report: where the markdown report goes")
    first, _ = p.parse_known_args(argv)
    preset = PRESETS.get(first.preset, {})
    mode = first.mode or preset.get("mode", "paper")
    p.set_defaults(**{**MODE_DEFAULTS[mode], **preset, "mode": mode})
    args = p.parse_args(argv)
    if args.kv_cache_gb is None and args.mode in ("paper", "sweep"):
        args.kv_cache_gb = 4.0 if torch.cuda.is_available() else 0.4
    if args.out is None and args.mode == "sweep":
        args.out = "bench.jsonl"
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mode == "hf":
        bench_vs_hf(args)
        return []
    if args.mode == "gpu-report":
        from nanokv import gpu_report
        sys.exit(gpu_report.main(args.report))

    def save(rec: dict) -> None:
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")

    start = time.perf_counter()
    modes = {"paper": bench_paper, "workload": bench_workload, "sweep": bench_sweep,
             "prefix": lambda args, save: bench_prefix(args, save, make_llm, run_context)}
    records = modes[args.mode](args, save)
    if args.plot:
        plot(records, args.plot)
    print(f"\n{time.perf_counter() - start:.0f} s in all")
    return records


if __name__ == "__main__":
    main()
