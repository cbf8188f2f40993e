"""Throughput measurements.

    python bench.py --mode hf     nanokv against HF transformers `generate` on the
                                  CPU: same model (the bundled SmolLM2-135M unless
                                  --model), fp32, same threads, greedy, batch of 8.

The eviction sweeps (paper tables, workload, sweep) are the next modes to come.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import time

import torch


def stdlib_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n real, different prompts of exactly `length` tokens: the heads of stdlib modules."""
    modules = ["json", "argparse", "pathlib", "dataclasses", "inspect", "typing", "functools",
               "collections", "logging", "subprocess", "threading", "tempfile"]
    prompts = []
    for name in modules[:n]:
        ids = tokenizer.encode(inspect.getsource(importlib.import_module(name)))
        prompts.append(ids[:length])
    return prompts


def bench_vs_hf(args) -> None:
    import transformers

    from nanokv import LLM, SamplingParams
    from nanokv.loader import resolve_model_path

    torch.set_num_threads(args.threads or torch.get_num_threads())
    path = resolve_model_path(args.model)
    llm = LLM(str(path), dtype="float32", device="cpu")
    prompts = stdlib_prompts(llm.tokenizer, args.batch, args.input_len)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))   # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    ours = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = llm.tokenizer.eos_token_id or 0
    ids = torch.tensor(prompts)   # equal lengths: no padding needed
    with torch.no_grad():
        hf.generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=pad)   # warm-up
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                          min_new_tokens=args.output_len, do_sample=False, pad_token_id=pad)
        theirs = (out.shape[1] - ids.shape[1]) * len(prompts) / (time.perf_counter() - start)

    print(f"model {path.name}, fp32, {torch.get_num_threads()} threads, batch {args.batch}, "
          f"input {args.input_len}, output {args.output_len}, greedy")
    print(f"{'engine':<14}{'output tokens/s':>16}")
    print(f"{'nanokv':<14}{ours:>16.1f}")
    print(f"{'transformers':<14}{theirs:>16.1f}")
    print(f"ratio nanokv / transformers: {ours / theirs:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["hf"], default="hf")
    parser.add_argument("--model", default=None, help="HF directory or hub id (default: bundled)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    bench_vs_hf(args)


if __name__ == "__main__":
    main()
