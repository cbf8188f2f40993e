"""Throughput at a fixed KV memory, the modes of bench.py: paper (the largest static batch
of each method, then a continuous stream), workload (nano-vllm's 256 requests, with each
decode step against its memory roofline) and sweep. What the numbers mean: docs/BENCH.md."""
from __future__ import annotations

import datetime
import gc
import itertools
import random
import sys
import time
from typing import Callable, NamedTuple

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from nanokv import LLM, SamplingParams
from nanokv.tools.flags import engine_options
from nanokv.tools.method_spec import parse_spec
from nanokv.tools.provenance import source_commit
from nanokv.tools.tables import (CONTINUOUS_COLUMNS, STATIC_COLUMNS, SWEEP_COLUMNS, WORKLOAD_COLUMNS, method_label,
                                 print_phases, print_table)


class Method(NamedTuple):
    name: str            # RANKING[@SCHEDULE][,KEY=INT...] (nanokv/tools/method_spec.py): batchmax, h2o@prefill, ...
    budget: int | None   # |kv|; None for full

    @property
    def label(self) -> str:
        return method_label(self.name, self.budget)


def method_list(names: list[str], budgets: list[int], ed_budgets: list[int]) -> list[Method]:
    """Every named method at each of its budgets: ed at --ed-budgets, the others at --budgets."""
    def budgets_of(name):
        ranking = parse_spec(name).get("kv_method")   # None: a press
        return [None] if ranking == "full" else ed_budgets if ranking == "ed" else budgets
    return [Method(name, budget) for name in names for budget in budgets_of(name)]


def random_prompts(n: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of input_len token ids below vocab, the same for the same seed."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(n)]


def same_shape(n: int, input_len: int, output_len: int, method: Method, evict_every: int, vocab: int):
    """n requests of one shape with random prompts (seed 0: every method reads the same ones)."""
    params = sampling(method, output_len, evict_every)
    return [(prompt, params) for prompt in random_prompts(n, input_len, vocab)]


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
    """The engine for this bench: the engine flags given, then `options`. No prefix caching
    unless asked for: the modes that compare methods repeat their prompts, and a cache would
    serve later runs from earlier ones."""
    model = f"random:{args.random_weights}" if args.random_weights else args.model
    options = {"enable_prefix_caching": False, **engine_options(args), "max_model_len": max_model_len, **options}
    return LLM(model, **options)


WARM_UP_REQUESTS = 32   # the most of the workload's shape each method's warm-up runs: long and short prompts together


def warm_up(llm, methods: list[Method], prompts: list[list[int]], args) -> None:
    """Each method once on `prompts` (the shapes its measured runs read), p + 2 tokens each so
    that an evicting method also evicts while decoding: compiles the kernels each method and
    shape calls for (GPU) and touches their code paths, so no measured run pays for a first call."""
    for method in methods:
        llm.generate(prompts, sampling(method, args.evict_every + 2, args.evict_every))


# ----- one run ---------------------------------------------------------------------------

def measure(llm: LLM, requests: list[tuple[list[int], SamplingParams]], static: bool,
            profile_steps: tuple[int, int] | None = None) -> dict:
    """Submit (prompt, SamplingParams) requests at once, step the engine until they are
    done, and say what it cost. static: stop as soon as the batch is known not to fit
    (a request waits after a step, or one was preempted) and report it as not fitting; its
    phases are timed with the device synchronised at each (what eviction and prefill cost the
    device). A continuous run's are not, so its steps overlap as a server's do: its decode
    ms/step is each decode step's wall time, its evict s and host ms/step the host's own time,
    and wait ms/step how long the host waited for the device. On a GPU also the caching
    allocator's calls to the driver in the run (allocator_calls): each costs the host far more
    than a launch. profile_steps (first, last): those steps run under torch.profiler (StepProfile),
    its table of ops in the record."""
    cuda = llm.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(llm.device)
    calls = allocator_calls(llm.device)
    fits = True
    tokens = peak_blocks = max_running = decode_batch = decode_context = 0
    stats = before = llm.stats()
    window = StepProfile(*profile_steps) if profile_steps else None
    start = time.perf_counter()
    with llm.timing(synchronize=static) as timings:
        ids = [llm.add_request(prompt, params) for prompt, params in requests]
        while llm.has_unfinished():
            decode_steps = timings.decode_steps
            if window:
                window.before_step(decode_steps + timings.prefill_steps)
            tokens += sum(len(out.new_token_ids) for out in llm.step())
            if timings.decode_steps > decode_steps:   # for the roofline: what the step read, at its start
                decode_batch, decode_context = decode_batch + stats.running, decode_context + stats.kv_slots + stats.running
            stats = llm.stats()
            peak_blocks = max(peak_blocks, stats.total_blocks - stats.free_blocks)
            max_running = max(max_running, stats.running)
            if static and (stats.waiting or stats.preemptions > before.preemptions):
                fits = False
                break
    wall = time.perf_counter() - start
    if window:
        window.stop()
    calls = {key: n - calls[key] for key, n in allocator_calls(llm.device).items()}
    if not fits:   # give the blocks back (aborting a finished request does nothing)
        for request_id in ids:
            llm.abort(request_id)
    steps, decode_s, prefill_s = timings.decode_steps, sum(timings.decode.values()), sum(timings.prefill.values())
    return dict(
        fits=fits, requests=len(requests), output_tokens=tokens, wall_s=wall,
        tokens_per_s=tokens / wall if fits else None,
        peak_kv_gb=peak_blocks * stats.block_bytes / 1e9,
        cuda_max_allocated_gb=torch.cuda.max_memory_allocated(llm.device) / 1e9 if cuda else None,
        cuda_mallocs=calls.get("num_device_alloc"), alloc_retries=calls.get("num_alloc_retries"),
        pinned_mallocs=calls.get("num_host_alloc"), profile=window and window.table,
        decode_ms_per_step=1e3 * decode_s / steps if steps else None,
        prefill_s=prefill_s, decode_s=decode_s, evict_s=timings.decode["evict"] + timings.prefill["evict"],
        host_ms_per_step=1e3 * (timings.host_s("decode") + timings.host_s("prefill"))
        / max(steps + timings.prefill_steps, 1),
        wait_ms_per_step=1e3 * (timings.decode["wait"] + timings.prefill["wait"])
        / max(steps + timings.prefill_steps, 1),
        prefill_steps=timings.prefill_steps, decode_steps=steps,
        phase_ms={kind: {phase: 1e3 * seconds / n for phase, seconds in getattr(timings, kind).items()}
                  for kind, n in (("prefill", timings.prefill_steps), ("decode", steps)) if n},
        mean_decode_batch=decode_batch / steps if steps else None,
        mean_decode_context=decode_context / decode_batch if decode_batch else None,
        preemptions=stats.preemptions - before.preemptions, max_running=max_running,
        evict_pieces=stats.eviction_pieces - before.eviction_pieces,
        moved_per_evicted=(stats.pairs_moved - before.pairs_moved) / (stats.pairs_evicted - before.pairs_evicted)
        if stats.pairs_evicted > before.pairs_evicted else None)


class StepProfile:
    """torch.profiler over steps first to last - 1 of a run (counting from 0, the steps that
    launched), the host's activity and on a GPU the device's: its table of the ops by the host's
    own time in them, the ROWS costliest (the profiler's own cost slows those steps)."""
    ROWS = 30

    def __init__(self, first: int, last: int):
        self.first, self.last = first, last
        self.profiler, self.table = None, None

    def before_step(self, launched: int) -> None:
        """Before a step, with the number of steps launched so far."""
        if self.profiler is None and self.table is None and self.first <= launched < self.last:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.profiler = profile(activities=activities)
            self.profiler.start()
        elif self.profiler is not None and launched >= self.last:
            self.stop()

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.table = self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=self.ROWS)
            self.profiler = None


def allocator_calls(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocators' calls to the driver so far: cudaMalloc, retries (a malloc that
    failed, then the cache freed, which waits for the device) and pinned host blocks allocated
    (cudaHostAlloc); none off a GPU."""
    if device.type != "cuda":
        return {}
    stats = {**torch.cuda.memory_stats(device), **torch.cuda.host_memory_stats()}
    return {key: stats.get(key, 0) for key in ("num_device_alloc", "num_alloc_retries", "num_host_alloc")}


def run_context(args, llm) -> dict:
    """The fields every record of this process shares: where, what, when, which code."""
    name = torch.cuda.get_device_name(llm.device) if llm.device.type == "cuda" else \
        f"cpu, {torch.get_num_threads()} torch threads"
    stats = llm.stats()
    return dict(device=name, model=llm.config.model or "bundled SmolLM2-135M",
                dtype=str(llm.dtype).removeprefix("torch."),
                kv_cache_dtype=str(llm.kv_dtype).removeprefix("torch."),
                kv_pool_gb=stats.total_blocks * stats.block_bytes / 1e9, kv_blocks=stats.total_blocks,
                block_size=stats.block_size, evict_every=args.evict_every,
                date=datetime.datetime.now().isoformat(timespec="seconds"), commit=source_commit())


def record(context: dict, mode: str, method: Method, input_len, output_len, run: dict) -> dict:
    """One JSON line: the context, what ran, and what it measured. batch = requests submitted."""
    return dict(context, mode=mode, method=method.name, budget=method.budget, batch=run["requests"],
                input_len=input_len, output_len=output_len, **run)


def largest_batch(fits: Callable[[int], bool], max_batch: int, start: int = 1) -> int:
    """The paper's b0 - 1 (b0: the smallest batch that does not fit), found with few runs:
    `start` (a guess), then steps of 1, 2, 4, ... away from it (up while batches fit, down
    while they do not) until the answer is bracketed, then bisection. 0 if not even one
    request fits; max_batch if everything up to it fits (b0 is then unknown)."""
    lo, hi = 0, max_batch + 1   # lo fits (0 trivially), hi does not (or is past the search)
    b, step = min(max(start, 1), max_batch), 1
    while hi - lo > 1:
        if fits(b):
            lo = b
        else:
            hi = b
        if hi > max_batch:
            b = min(lo + step, max_batch)
        elif lo == 0:
            b = max(hi - step, 1)
        else:
            b = (lo + hi) // 2
        step *= 2
    return lo


# ----- modes -----------------------------------------------------------------------------

def static_search(llm, method: Method, args, context: dict, save: Callable[[dict], None]) -> tuple[dict, int]:
    """The largest-batch search for one method: every static batch it ran (by batch size),
    and the largest that fit. One request first: the pool over its peak KV memory is the
    guess the search starts from, so a method usually takes three runs (1, the answer, one
    more), and the answer's run is its timed run."""
    inp, out, vocab = args.input_len, args.output_len, llm.model_config.vocab_size
    runs = {}

    def fits(b: int) -> bool:
        if b not in runs:
            run = measure(llm, same_shape(b, inp, out, method, args.evict_every, vocab), static=True)
            runs[b] = record(context, "static", method, inp, out, run)
            save(runs[b])
            tqdm.write(f"  {method.label:<22} batch {b:>4}: {'fits' if run['fits'] else 'OOM'} "
                       f"({run['wall_s']:.1f} s)", file=sys.stderr)
        return runs[b]["fits"]

    guess = int(context["kv_pool_gb"] / runs[1]["peak_kv_gb"]) if fits(1) and runs[1]["peak_kv_gb"] else 1
    return runs, largest_batch(fits, args.max_batch, start=guess)


def bench_paper(args, save: Callable[[dict], None]) -> list[dict]:
    """Tables 1-2 of Batch-Max: each method at its largest static batch under a fixed KV
    memory, then the same shapes as a continuous stream."""
    inp, out = args.input_len, args.output_len
    methods = method_list(args.methods, args.budgets, args.ed_budgets)
    llm = make_llm(args, inp + out, max_num_seqs=args.max_batch, max_num_batched_tokens=args.max_batch * inp)
    context, vocab = run_context(args, llm), llm.model_config.vocab_size
    warm_up(llm, methods, random_prompts(2, inp, vocab, seed=1), args)
    records, rows = [], []
    for method in tqdm(methods, desc="largest static batch of each method", leave=False):
        runs, best = static_search(llm, method, args, context, save)
        oom_at = min((b for b, r in runs.items() if not r["fits"]), default=f">{args.max_batch}")
        rows.append(dict(runs.get(best, {"fits": False}), label=method.label, largest=best, oom_at=oom_at))
        records += runs.values()
    print(f"\nstatic batches: {context['model']}, {context['dtype']} (KV cache {context['kv_cache_dtype']}), "
          f"{context['device']}, input {inp}, "
          f"output {out}, KV pool {context['kv_pool_gb']:.3f} GB = {context['kv_blocks']} blocks "
          f"of {context['block_size']}, p = {args.evict_every}")
    print_table(rows, STATIC_COLUMNS)
    llm.close()   # a split engine's ranks end before the next one starts
    del llm   # before the next engine takes its memory
    gc.collect()
    torch.cuda.empty_cache()

    if args.num_requests == 0:
        return records
    n = args.num_requests or 4 * max(row["largest"] for row in rows)
    methods += [Method("decode_only", b) for b in args.budgets if Method("decode_only", b) not in methods]
    llm = make_llm(args, inp + out, max_num_seqs=n)
    warm_up(llm, methods, random_prompts(2, inp, vocab, seed=1), args)
    rows = []
    for method in tqdm(methods, desc="continuous", leave=False):
        rows.append(record(context, "continuous", method, inp, out,
                           measure(llm, same_shape(n, inp, out, method, args.evict_every, vocab), static=False)))
        save(rows[-1])
    print(f"\ncontinuous batching: {n} requests of the same shape submitted at t=0, same KV pool")
    print_table(rows, CONTINUOUS_COLUMNS)
    print_phases(rows)
    return records + rows


def bench_workload(args, save: Callable[[dict], None]) -> list[dict]:
    """nano-vllm's workload, with and without eviction, and each decode step's time against
    its memory roofline: weights + the KV it reads, over a measured copy bandwidth."""
    llm = make_llm(args, 2048)
    context = run_context(args, llm)
    bandwidth = copy_bandwidth(llm.device)
    vocab = llm.model_config.vocab_size
    requests = workload(args.num_requests, seed=0, vocab=vocab)
    methods = method_list(args.methods, args.budgets, args.ed_budgets)
    warm = workload(min(WARM_UP_REQUESTS, args.num_requests), seed=1, vocab=vocab)   # other prompts, the same shape
    warm_up(llm, methods, [prompt for prompt, _ in warm], args)
    rows = []
    for method in tqdm(methods, desc="workload", leave=False):
        batch = [(prompt, sampling(method, n, args.evict_every)) for prompt, n in requests]
        rows.append(record(context, "workload", method, None, None,
                           measure(llm, batch, static=False, profile_steps=args.profile_steps)))
        rows[-1].update(copy_gb_per_s=bandwidth / 1e9,
                        roofline_ms_per_step=1e3 * decode_bytes(llm, rows[-1]) / bandwidth)
        save(rows[-1])
    print(f"\nworkload: {args.num_requests} requests, seed 0, random prompts, input and output lengths "
          f"uniform in [100, 1024], EOS ignored; {context['model']}, {context['dtype']}, {context['device']}, "
          f"KV pool {context['kv_pool_gb']:.2f} GB; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print_table(rows, WORKLOAD_COLUMNS)
    print_phases(rows)
    for r in rows:
        if r["profile"]:
            first, last = args.profile_steps
            print(f"\n{method_label(r['method'], r['budget'])}: steps {first} to {last - 1} under torch.profiler, "
                  f"the ops by the host's own time\n{r['profile']}")
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
    kv_dtype = llm.kv_dtype
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
    methods = method_list(args.methods, args.budgets, args.ed_budgets)
    warm_up(llm, methods, [p for inp in lens for p in random_prompts(1, inp, vocab, seed=1)], args)
    grid = list(itertools.product(methods, lens, args.batches))
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
