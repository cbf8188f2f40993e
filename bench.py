"""Throughput: what KV-cache eviction buys, measured on your own hardware.

    python bench.py                      paper mode (Tables 1-2 of Batch-Max); without a GPU, --preset cpu-small
    python bench.py --preset cpu-small   paper mode at toy sizes, on the bundled model, for a CPU
    python bench.py --mode workload      nano-vllm's workload (256 requests), with and without eviction
    python bench.py --mode sweep         methods x budgets x batches x input lengths, as JSON lines
    python bench.py --mode prefix        prefix caching on and off: a shared prefix, a chat
                                         (nanokv/tools/bench_prefix.py)
    python bench.py --mode host          the engine's own time per decode step, on a tiny model
                                         (batch 1 to 512, every method: nanokv/tools/host_time.py)
    python bench.py --mode offload       the host tier: swap against recompute preemption, with the pool
                                         at a quarter of the workload's demand (nanokv/tools/bench_offload.py)
    python bench.py --mode hf            nanokv against HF transformers `generate` on the CPU
                                         (batch 8, and batch 1 at three prompt lengths: nanokv/tools/bench_hf.py)
    python bench.py --mode gpu-report --report gpu.md
                                         all a GPU session measures, in one report (nanokv/tools/gpu_report.py)

Models: --model DIR|HUB_ID (default: the bundled SmolLM2-135M) or --random-weights SHAPE
(llama-3.1-8b, qwen3-0.6b, smollm2-135m: models/shapes.py). Throughput does not depend on
the weights, so a GPU run needs no checkpoint. Prompts are random token ids and EOS is
ignored: every request generates exactly its output length. --kv-cache-gb: the KV pool
(paper and sweep: 4 on CUDA, 0.4 on a CPU); --kv-cache-dtype int8|fp8: a quantized KV cache
(the same pool then holds ~1.8x the tokens of a bf16 cache); the other engine flags as the
server's (nanokv/tools/flags.py).

What the numbers mean (fits, largest batch, tokens/s, peak KV): docs/BENCH.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from models.shapes import SHAPES
from nanokv.tools.bench_hf import bench_vs_hf
from nanokv.tools.bench_offload import bench_offload
from nanokv.tools.bench_prefix import bench_prefix
from nanokv.tools.flags import add_engine_flags
from nanokv.tools.host_time import bench_host
from nanokv.tools.method_spec import spec_argument
from nanokv.tools.tables import plot
from nanokv.tools.throughput import bench_paper, bench_sweep, bench_workload

PRESETS = {
    # static batches only, under 2 minutes on one CPU core (docs/BENCH.md); full fits 2 requests
    "cpu-small": dict(mode="paper", input_len=512, output_len=32, kv_cache_gb=0.052, budgets=[128],
                      ed_budgets=[2], max_batch=16, num_requests=0),
    # the paper's setting, static batches only: the gpu report's part (about 1.5 minutes on an H200)
    "gpu-paper": dict(mode="paper", random_weights="llama-3.1-8b", input_len=3584, output_len=512,
                      kv_cache_gb=4.0, budgets=[1024], ed_budgets=[2], max_batch=128, num_requests=0),
    # the paper's Table 2 (Phi-3.5-mini): a pool where full fits 2 requests of 4096 tokens, not 3, as there
    "gpu-paper-phi": dict(mode="paper", random_weights="phi-3.5-mini", input_len=3584, output_len=512,
                          kv_cache_gb=3.5, budgets=[1664, 1984, 2176], ed_budgets=[2], max_batch=32, num_requests=0),
}
MODE_DEFAULTS = {
    "hf": dict(input_len=200, output_len=128),
    "paper": dict(input_len=3584, output_len=512, methods=["full", "ed", "batchmax"]),
    "sweep": dict(input_len=3584, output_len=512, methods=["full", "ed", "batchmax", "decode_only"]),
    "workload": dict(num_requests=256, methods=["full", "batchmax"], max_num_seqs=256, max_num_batched_tokens=16384),
    "host": dict(input_len=100, output_len=200, budgets=[64], evict_every=32, batches=[1, 16, 64, 256, 512], num_threads=1,
                 methods=["full", "batchmax", "h2o", "tova", "snapkv", "streamingllm", "knorm", "kvcompress", "ed"]),
    "gpu-report": {},
    "prefix": dict(num_requests=8, input_len=512, output_len=16),
    "offload": dict(num_requests=16, methods=["full", "batchmax"], budgets=[256], max_num_seqs=64,
                    max_num_batched_tokens=4096),
}
ENGINE_FLAGS = ("dtype", "kv_cache_dtype", "kv_cache_gb", "block_size", "enforce_eager", "max_num_seqs",
                "max_num_batched_tokens", "num_threads", "tensor_parallel_size")
MODEL = ("model", "random_weights")
METHODS = ("methods", "budgets", "ed_budgets", "evict_every")
# The flags each mode reads (besides --mode and --preset): any other one given is an error, never ignored.
MODE_FLAGS = {
    "paper": {*MODEL, *ENGINE_FLAGS, *METHODS, "input_len", "output_len", "max_batch", "num_requests", "out", "plot"},
    "sweep": {*MODEL, *ENGINE_FLAGS, *METHODS, "input_len", "input_lens", "output_len", "batches", "out", "plot"},
    "workload": {*MODEL, *ENGINE_FLAGS, *METHODS, "num_requests", "profile_steps", "out"},
    "prefix": {*MODEL, *ENGINE_FLAGS, "input_len", "output_len", "num_requests", "suffix_len", "turns", "out"},
    "host": {"random_weights", "dtype", "kv_cache_dtype", "block_size", "enforce_eager", "num_threads",
             "tensor_parallel_size", "methods", "budgets", "evict_every", "input_len", "output_len", "batches", "out",
             "constrained"},
    "offload": {*MODEL, *(set(ENGINE_FLAGS) - {"kv_cache_gb"}), *METHODS, "num_requests", "output_len", "out"},
    "hf": {"model", "num_threads", "input_len", "output_len", "batch", "chat_lens", "chat_tokens"},
    "gpu-report": {"report", "commit"},
}


# ----- command line ----------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags, with defaults that depend on the mode and the preset (the preset's win)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--mode", choices=["paper", "workload", "sweep", "hf", "gpu-report", "prefix", "host",
                                                  "offload"])
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--model", default=None, help="HF directory or hub id (default: the bundled SmolLM2-135M)")
    p.add_argument("--random-weights", metavar="SHAPE", choices=sorted(SHAPES),
                   help=f"random weights of a model shape: {', '.join(SHAPES)}")
    add_engine_flags(p, only=("dtype", "kv_cache_dtype", "kv_cache_gb", "block_size", "enforce_eager", "max_num_seqs",
                              "max_num_batched_tokens", "num_threads", "tensor_parallel_size", "press_window"))
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
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="sweep, host: batch sizes")
    p.add_argument("--input-lens", type=int, nargs="+", help="sweep: input lengths (default --input-len)")
    p.add_argument("--constrained", type=float, nargs="+", metavar="FRACTION",
                   help="host: instead of the methods, the bundled model at each batch with these fractions of it "
                        "under a JSON schema (e.g. 0 0.5 1): what the token masks cost")
    p.add_argument("--batch", type=int, default=8, help="hf: batch size (0: no batch table)")
    p.add_argument("--chat-lens", type=int, nargs="*", default=[100, 1000, 4000],
                   help="hf: prompt lengths of the batch-1 table (none: no table)")
    p.add_argument("--chat-tokens", type=int, default=64, help="hf: new tokens per batch-1 request")
    p.add_argument("--suffix-len", type=int, default=64, help="prefix: each request's own tokens after the "
                   "shared prefix (--input-len), and each chat message")
    p.add_argument("--turns", type=int, default=8, help="prefix: chat turns")
    p.add_argument("--profile-steps", type=int, nargs=2, metavar=("FIRST", "LAST"),
                   help="workload: run steps FIRST to LAST - 1 of each method under torch.profiler and print the ops "
                   "that took the host's time (the profiler slows those steps)")
    p.add_argument("--out", help="append one JSON line per run here (sweep default: bench.jsonl)")
    p.add_argument("--plot", metavar="PNG", help="tokens/s and peak KV memory against batch size")
    p.add_argument("--report", default="gpu-report.md", help="gpu-report: where the markdown report goes")
    p.add_argument("--commit", help="gpu-report: the commit the tree was copied from (default: git's, if this "
                   "directory is a checkout of its own)")
    first, _ = p.parse_known_args(argv)
    cpu_default = first.mode is None and first.preset is None and not torch.cuda.is_available()
    preset = PRESETS["cpu-small" if cpu_default else first.preset] if cpu_default or first.preset else {}
    mode = first.mode or preset.get("mode", "paper")
    p.set_defaults(**{**MODE_DEFAULTS[mode], **preset, "mode": mode, "cpu_default": cpu_default},
                   **({"plot": "bench.png"} if cpu_default else {}))
    args = p.parse_args(argv)
    unused = sorted(given_flags(p, argv, args) - MODE_FLAGS[mode] - {"mode", "preset"})
    if unused:
        p.error(f"--mode {mode} does not use {', '.join('--' + f.replace('_', '-') for f in unused)} "
                f"(it takes {', '.join(sorted('--' + f.replace('_', '-') for f in MODE_FLAGS[mode]))})")
    if args.profile_steps and not 0 <= args.profile_steps[0] < args.profile_steps[1]:
        p.error(f"--profile-steps {' '.join(map(str, args.profile_steps))}: FIRST must be at least 0 and below LAST")
    if args.kv_cache_gb is None and args.mode in ("paper", "sweep"):
        args.kv_cache_gb = 4.0 if torch.cuda.is_available() else 0.4
    if args.out is None and args.mode == "sweep":
        args.out = "bench.jsonl"
    return args


def given_flags(parser: argparse.ArgumentParser, argv: list[str] | None, parsed: argparse.Namespace) -> set[str]:
    """The options the command line itself set: argparse fills in a default only where the
    namespace it parses into lacks the attribute, so parsing into one that has them all,
    unset, leaves exactly the given ones set."""
    unset = object()
    again = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(vars(parsed), unset)))
    return {name for name, value in vars(again).items() if value is not unset}


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.cpu_default:
        print("No GPU here: the CPU preset (--preset cpu-small: paper mode at toy sizes on the bundled model, "
              f"under two minutes, the plot in {args.plot}). The full-size paper mode: python bench.py --mode paper "
              "(hours on a CPU).", flush=True)
    if args.mode == "hf":
        bench_vs_hf(args)
        return []
    if args.mode == "gpu-report":
        from nanokv.tools import gpu_report
        sys.exit(gpu_report.main(args.report, commit=args.commit))

    def save(rec: dict) -> None:
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")

    start = time.perf_counter()
    modes = {"paper": bench_paper, "workload": bench_workload, "sweep": bench_sweep,
             "prefix": bench_prefix, "host": bench_host, "offload": bench_offload}
    records = modes[args.mode](args, save)
    if args.plot:
        plot(records, args.plot)
    print(f"\n{time.perf_counter() - start:.0f} s in all")
    return records


if __name__ == "__main__":
    main()
