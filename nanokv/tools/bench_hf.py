"""nanokv against HF transformers `generate` on the CPU (`python bench.py --mode hf`).

Same model (the bundled SmolLM2-135M by default), fp32, greedy, EOS ignored,
both engines in one process with the same torch thread count, each warmed up
once on the batch workload before it is timed (a first run also pays for page
faults in fresh allocations and oneDNN's kernel setup: ~10% of it). Two tables:

- batch: `--batch` prompts of `--input-len` tokens, `--output-len` new tokens each,
  output tokens/s over the whole run (prefill included);
- chat: one request at a time (batch 1) with a prompt of each `--chat-lens` length and
  `--chat-tokens` new tokens: time to first token and total time.

Prompts are real text, different for each request: the sources of stdlib modules.
"""
from __future__ import annotations

import importlib
import inspect
import time

import torch

from nanokv import LLM, SamplingParams

STDLIB_MODULES = ["json", "argparse", "pathlib", "dataclasses", "inspect", "typing", "functools",
                  "collections", "logging", "subprocess", "threading", "tempfile"]


def stdlib_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n different prompts of exactly `length` tokens; a long one runs on into the next modules."""
    prompts = []
    for i in range(n):
        ids = []
        for name in STDLIB_MODULES[i:] + STDLIB_MODULES[:i]:
            ids += tokenizer.encode(inspect.getsource(importlib.import_module(name)))
            if len(ids) >= length:
                break
        prompts.append(ids[:length])
    return prompts


class FirstTokenClock:
    """A `generate` streamer that notes when the first new token arrives (its first put() is the prompt)."""

    def __init__(self):
        self.puts, self.first_token_at = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def hf_generate(hf, prompts: list[list[int]], new_tokens: int, pad: int) -> tuple[float, float]:
    """(time to first token, total) of one HF generate call, in seconds."""
    ids = torch.tensor(prompts)   # equal lengths: no padding needed
    clock = FirstTokenClock() if len(prompts) == 1 else None   # HF streams batch 1 only
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad, streamer=clock)
    total = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == new_tokens
    return (clock.first_token_at - start if clock else float("nan")), total


def nanokv_generate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(time to first token of any request, total) of one nanokv run, in seconds."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start, first = time.perf_counter(), None
    for prompt in prompts:
        llm.add_request(prompt, params)
    generated = 0
    while llm.has_unfinished():
        new = sum(len(out.new_token_ids) for out in llm.step())
        if new and first is None:
            first = time.perf_counter() - start
        generated += new
    assert generated == new_tokens * len(prompts)
    return first, time.perf_counter() - start


def bench_vs_hf(args) -> None:
    import transformers

    from models.loader import resolve_model_path

    path = resolve_model_path(args.model)
    # No prefix caching: HF has none, and the prompts below start alike (the same module's source).
    llm = LLM(str(path), dtype="float32", device="cpu", enable_prefix_caching=False, num_threads=args.num_threads)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = llm.tokenizer.eos_token_id or 0
    warm = stdlib_prompts(llm.tokenizer, args.batch or 1, args.input_len if args.batch else 32)
    nanokv_generate(llm, warm, args.output_len)
    hf_generate(hf, warm, args.output_len, pad)
    print(f"model {path.name}, fp32, {torch.get_num_threads()} threads, greedy, EOS ignored")

    if args.batch:
        prompts = stdlib_prompts(llm.tokenizer, args.batch, args.input_len)
        ours = nanokv_generate(llm, prompts, args.output_len)[1]
        theirs = hf_generate(hf, prompts, args.output_len, pad)[1]
        tokens = args.batch * args.output_len
        print(f"\nbatch {args.batch}, input {args.input_len}, output {args.output_len}")
        print(f"{'engine':<14}{'output tokens/s':>16}")
        print(f"{'nanokv':<14}{tokens / ours:>16.1f}")
        print(f"{'transformers':<14}{tokens / theirs:>16.1f}")
        print(f"ratio nanokv / transformers: {theirs / ours:.2f}")

    if args.chat_lens:
        print(f"\nbatch 1, {args.chat_tokens} new tokens; seconds (TTFT: time to first token)")
        print(f"{'prompt':>8}{'nanokv TTFT':>13}{'HF TTFT':>10}{'nanokv total':>14}{'HF total':>10}"
              f"{'total HF/nanokv':>17}")
        for length in args.chat_lens:
            prompt = stdlib_prompts(llm.tokenizer, 1, length)
            ours = nanokv_generate(llm, prompt, args.chat_tokens)
            theirs = hf_generate(hf, prompt, args.chat_tokens, pad)
            print(f"{length:>8}{ours[0]:>13.2f}{theirs[0]:>10.2f}{ours[1]:>14.2f}{theirs[1]:>10.2f}"
                  f"{theirs[1] / ours[1]:>17.2f}")
