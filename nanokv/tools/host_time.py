"""bench.py --mode host: the engine's own time per decode step, what a GPU would wait for.

A tiny random model (models/shapes.py, "tiny") makes the forward pass nearly free; its
measured time is taken out. --random-weights SHAPE runs a real shape instead (on a GPU, the
decodes replayed from CUDA graphs): its step against its forward alone says how much of a
step the device waits for the host. Every method runs under its default schedule, with prefix
caching off and on, at each batch size: prompts of --input-len random tokens and
--output-len new tokens each, all submitted at once. Reported per decode step: the host
time (every phase but the forward pass) and its parts, and per method the cost of one more
sequence (the slope up to the largest batch, from one an eighth of it: 64 to 512). Then, per
step of the whole run untimed, what a device would wait for: the wall time less the forward
passes' (a GPU's, timed; a CPU's, the run's own), through generate() with overlap_steps off
(serial) and on (overlap), and through step() as the server streams (step()).

With --constrained FRACTION..., the bundled model instead (structured output needs a
tokenizer), a fraction of each batch under a JSON schema whose output outlasts
--output-len: the sample phase per decode step (the fastest of 3 runs), and what the masks
add per constrained request (against the same batch with none).
"""
from __future__ import annotations

import copy
import random
import time

from tqdm import tqdm

from nanokv import LLM, SamplingParams, StructuredOutput
from nanokv.config import EngineConfig
from nanokv.engine.timing import PHASES
from nanokv.tools.flags import engine_options
from nanokv.tools.method_spec import parse_spec
from nanokv.tools.throughput import random_prompts, run_context

DEFAULT_SHAPE = "tiny"
REPEATS = 3   # --constrained: each run's fastest
# A list of records: it runs on for hundreds of tokens, its strings and numbers bounded.
LONG_JSON = {"type": "object", "properties": {"records": {"type": "array", "minItems": 100, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "count": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "count"], "additionalProperties": False}}}, "required": ["records"]}
COLUMNS = ("host", *[p for p in PHASES if p != "forward"], "forward", "serial", "overlap", "step()")


def host_run(llm: LLM, batch: int, method: str, args) -> dict:
    """One batch run to its end, after a shorter warm-up, four times: timed phase by phase
    (milliseconds per decode step of each), then untimed through generate() with overlap_steps
    on and off, and through step() as a server streams: per step (prefill steps too), the wall
    time the forward passes do not account for, what a device waits for."""
    prompts = random_prompts(batch, args.input_len, llm.model_config.vocab_size)
    eviction = {} if method == "full" else dict(kv_budget=args.budgets[0], evict_every=args.evict_every)

    def sampling(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **eviction,
                              **parse_spec(method))
    params = sampling(args.output_len)
    # Warm-up, through an eviction in decode: a forward that compiles a kernel is no step's time,
    # and with caching on the four runs below all find the prompts cached.
    llm.generate(prompts, sampling(min(args.output_len, args.evict_every + 1)))
    with llm.timing() as timings:
        llm.generate(prompts, params)
    steps = timings.decode_steps
    per_step = {phase: 1e3 * seconds / steps for phase, seconds in timings.decode.items()}
    all_steps = steps + timings.prefill_steps
    forward_s = timings.decode["forward"] + timings.prefill["forward"]

    def exposed_ms(run) -> float:
        with llm.timing(synchronize=False) as own:
            start = time.perf_counter()
            run()
            wall = time.perf_counter() - start
        # On a GPU the timed run's forward passes are the device's; on a CPU the forward is the host's
        # own work, which drifts from run to run: this run's.
        forward = forward_s if llm.device.type == "cuda" else own.decode["forward"] + own.prefill["forward"]
        return 1e3 * (wall - forward) / all_steps

    def streamed():
        for prompt in prompts:
            llm.add_request(prompt, params)
        while llm.has_unfinished():
            llm.step()
    overlap = llm.config.overlap_steps
    exposed = {}
    for column, on in (("serial", False), ("overlap", True)):
        llm.config.overlap_steps = on
        exposed[column] = exposed_ms(lambda: llm.generate(prompts, params))
    exposed["step()"] = exposed_ms(streamed)
    llm.config.overlap_steps = overlap
    return dict(method=method, batch=batch, decode_steps=steps, host=1e3 * timings.host_s("decode") / steps,
                **per_step, **exposed)


def bench_constrained(args, save) -> list[dict]:
    """Each batch x fraction constrained, on the bundled model: sample time per decode step
    and the masks' cost per constrained request; prints one table, returns the records."""
    rows = []
    longest = args.input_len + args.output_len
    llm = LLM(None, dtype="float32", num_kv_blocks=max(args.batches) * -(-longest // EngineConfig.block_size) + 64,
              max_model_len=longest + 1, max_num_seqs=max(args.batches),
              max_num_batched_tokens=max(args.batches) * args.input_len, **engine_options(args))
    context = run_context(args, llm)
    rng = random.Random(0)
    plain = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)   # greedy: sampling is
    constrained = SamplingParams(temperature=0, max_tokens=args.output_len,              # one argmax, the masks
                                 structured_output=StructuredOutput(json=LONG_JSON))     # stand out
    llm.generate([[1000] * args.input_len] * 4, [constrained] * 4)   # warm-up: the grammar's states built lazily
    for batch in args.batches:
        prompts = [[rng.randrange(1000, 20000) for _ in range(args.input_len)] for _ in range(batch)]
        base = None
        for fraction in args.constrained:
            n = round(fraction * batch)
            runs = []
            for _ in range(REPEATS):
                with llm.timing() as timings:
                    outs = llm.generate(prompts, [constrained] * n + [plain] * (batch - n))
                assert all(len(o.token_ids) == args.output_len for o in outs), "a constrained request ended early"
                runs.append(copy.deepcopy(timings))
            timings = min(runs, key=lambda t: t.decode["sample"])
            sample = 1e3 * timings.decode["sample"] / timings.decode_steps
            base = sample if n == 0 else base
            extra = None if base is None or n == 0 else 1e3 * (sample - base) / n
            rows.append(dict(context, mode="host", batch=batch, constrained=n, sample_ms=sample,
                             host_ms=1e3 * timings.host_s("decode") / timings.decode_steps, mask_us_per_request=extra))
            save(rows[-1])
    print(f"\nstructured output: the bundled model, {rows[0]['device']}, batches of prompts of {args.input_len} "
          f"tokens, {args.output_len} new tokens each, greedy; a fraction under a JSON schema")
    print(f"{'batch':>6} {'constrained':>12} {'host ms/step':>13} {'sample ms/step':>15} {'mask us/request':>16}")
    for r in rows:
        extra = "" if r["mask_us_per_request"] is None else f"{r['mask_us_per_request']:.1f}"
        print(f"{r['batch']:>6} {r['constrained']:>12} {r['host_ms']:>13.3f} {r['sample_ms']:>15.3f} {extra:>16}")
    return rows


def bench_host(args, save) -> list[dict]:
    """Every method x caching x batch; prints one table and the slopes, returns the records
    (with --constrained: bench_constrained)."""
    if args.constrained:
        return bench_constrained(args, save)
    rows = []
    shape = args.random_weights or DEFAULT_SHAPE
    longest = args.input_len + args.output_len
    block_size = args.block_size or EngineConfig.block_size
    blocks = max(args.batches) * -(-longest // block_size) + 64
    for caching in (False, True):
        options = dict(dtype="float32" if shape == DEFAULT_SHAPE else "auto", num_kv_blocks=blocks,
                       max_model_len=longest + 1, max_num_seqs=max(args.batches),
                       max_num_batched_tokens=max(args.batches) * args.input_len, enable_prefix_caching=caching)
        llm = LLM(f"random:{shape}", **{**options, **engine_options(args)})
        context = run_context(args, llm)
        runs = [(method, batch) for method in args.methods for batch in args.batches]
        for method, batch in tqdm(runs, desc=f"host, caching {'on' if caching else 'off'}", leave=False):
            rows.append(dict(context, mode="host", caching=caching, input_len=args.input_len,
                             output_len=args.output_len, **host_run(llm, batch, method, args)))
            save(rows[-1])
        llm.close()   # a split engine's ranks end before the next one starts
    print(f"\nhost time per decode step (ms): random:{shape}, {rows[0]['dtype']}, {rows[0]['device']}; prompts of "
          f"{args.input_len} tokens, {args.output_len} new tokens each; |kv| = {args.budgets[0]}, "
          f"p = {args.evict_every} (evicting methods, default schedules); serial, overlap, step(): "
          "the untimed runs' wall time less the forward passes', per step")
    header = ["method", "caching", "batch", *COLUMNS]
    print("  ".join(f"{h:>9}" for h in header))
    for r in rows:
        cells = [r["method"], "on" if r["caching"] else "off", str(r["batch"])] + [f"{r[c]:.3f}" for c in COLUMNS]
        print("  ".join(f"{c:>9}" for c in cells))
    high = max(args.batches)   # the slope from the largest batch at most an eighth of the largest
    low = max([b for b in args.batches if b <= high // 8], default=min(args.batches))
    if high > low:
        print(f"\nper-sequence slope, batch {low} to {high} (us per sequence per decode step):")
        for caching in (False, True):
            for method in args.methods:
                at = {r["batch"]: r["host"] for r in rows if r["method"] == method and r["caching"] == caching}
                print(f"  {method:<14} caching {'on ' if caching else 'off'} {1e3 * (at[high] - at[low]) / (high - low):6.2f}")
    return rows
