"""Which prompt positions each (layer, KV head) kept, drawn as a picture.

    python -m nanokv.tools.plot_kept --budget 256 --out kept.png [--model DIR] [--text-file F]

One row per (layer, KV head), one column per position: a dark pixel is a KV
pair still in the cache at the end. Attention sinks, recent windows and the
heads that keep scattered "heavy hitters" show at a glance.
Needs matplotlib (pip install matplotlib).
"""
from __future__ import annotations

import argparse
import inspect
import json

import torch


def plot_kept_positions(kept: torch.Tensor, num_positions: int, path: str, title: str = "") -> None:
    """kept: [layers, kv_heads, n] original positions (RequestOutput.kept_positions; -1 pads
    the heads of an uneven method that hold fewer)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, heads, _ = kept.shape
    grid = torch.zeros(layers * heads, num_positions + 1)   # the last column takes the padding
    grid.scatter_(1, kept.reshape(layers * heads, -1).long() % (num_positions + 1), 1.0)
    grid = grid[:, :-1]
    fig, ax = plt.subplots(figsize=(12, max(3.0, 0.12 * layers * heads)))
    ax.imshow(grid.numpy(), aspect="auto", interpolation="nearest", cmap="Greys")
    ax.set_xlabel("token position")
    ax.set_ylabel("layer")
    ax.set_yticks([layer * heads for layer in range(0, layers, max(1, layers // 10))])
    ax.set_yticklabels(range(0, layers, max(1, layers // 10)))
    held = (kept >= 0).sum(dim=-1).float()
    ax.set_title(f"{title or 'KV pairs kept per (layer, KV head)'}\n{held.mean():.0f} pairs per head on average "
                 f"(from {held.min():.0f} to {held.max():.0f}) of {num_positions}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def held_per_layer(kept: torch.Tensor) -> list[tuple[int, float, int]]:
    """(min, median, max) pairs held per KV head, for each layer: how uneven the budgets are."""
    held = (kept >= 0).sum(dim=-1).float()
    return [(int(h.min()), float(h.median()), int(h.max())) for h in held]


def main() -> None:
    from nanokv import LLM, SamplingParams
    from nanokv.eviction import METHODS, SCHEDULE_NAMES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--text-file", default=None, help="the prompt (default: the source of the json module)")
    parser.add_argument("--tokens", type=int, default=1024, help="prompt length, in tokens")
    parser.add_argument("--method", default="batchmax", choices=[m for m in METHODS if m != "full"])
    parser.add_argument("--schedule", default=None, choices=SCHEDULE_NAMES, help="default: the method's own")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--evict-every", type=int, default=64)
    parser.add_argument("--out", default="kept.png")
    args = parser.parse_args()
    text = open(args.text_file).read() if args.text_file else inspect.getsource(json)
    llm = LLM(args.model, dtype="float32")
    prompt = llm.tokenizer.encode(text)[:args.tokens]
    params = SamplingParams(temperature=0, max_tokens=1, kv_method=args.method, kv_schedule=args.schedule,
                            kv_budget=args.budget,
                            evict_every=args.evict_every, return_kept_positions=True)
    kept = llm.generate([prompt], params)[0].kept_positions
    title = f"{args.method}, |kv| = {args.budget}, p = {args.evict_every}: kept of {len(prompt)} prompt tokens"
    plot_kept_positions(kept, len(prompt), args.out, title)
    print("layer  pairs per KV head: min  median  max")
    for layer, (low, median, high) in enumerate(held_per_layer(kept)):
        print(f"{layer:5d}  {low:24d}  {median:6.0f}  {high:3d}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
