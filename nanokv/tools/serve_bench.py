"""Load a running nanokv.serve with N concurrent streaming clients and measure it.

    python -m nanokv.tools.serve_bench --url http://127.0.0.1:8000 --clients 16 --requests 64 --scale 0.1

The requests are bench.py's workload (nano-vllm's): random prompt token ids,
input and output lengths uniform in [100, 1024], EOS ignored so every request
generates exactly its length; --scale multiplies both lengths (a CPU cannot run
the full sizes in minutes). Each client sends its next request when the last
one has finished. Reported: request throughput, output tokens/s, time to first
token (TTFT: from sending to the first text) and inter-token latency (ITL: the
gaps between streamed chunks; a chunk is one token, except where text is held
back, e.g. an incomplete UTF-8 character, and comes with the next).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from nanokv.tools.throughput import workload


@dataclass
class Timing:
    """One request, as its client saw it."""
    sent: float
    chunks: list[float] = field(default_factory=list)   # arrival time of each chunk with text
    output_tokens: int = 0


def scaled_requests(n: int, scale: float, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """bench.workload's (prompt, output length) pairs with both lengths times `scale` (at least 1)."""
    return [(prompt[:max(1, round(len(prompt) * scale))], max(1, round(out * scale)))
            for prompt, out in workload(n, seed=seed, vocab=vocab)]


async def one_request(client: httpx.AsyncClient, model: str | None, prompt: list[int], max_tokens: int) -> Timing:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **({"model": model} if model else {})}
    timing = Timing(time.perf_counter())
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(f"the server failed a request: {chunk['error']['message']}")
            if chunk["choices"] and chunk["choices"][0]["text"]:
                timing.chunks.append(time.perf_counter())
            if chunk.get("usage"):
                timing.output_tokens = chunk["usage"]["completion_tokens"]
    return timing


async def run(url: str, clients: int, requests: list[tuple[list[int], int]], model: str | None = None,
              api_key: str | None = None, timeout: float = 3600.0) -> dict:
    """Send `requests` from `clients` concurrent clients; returns the measurements."""
    todo = list(reversed(requests))
    timings: list[Timing] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def client_loop(client: httpx.AsyncClient) -> None:
        while todo:
            prompt, max_tokens = todo.pop()
            timings.append(await one_request(client, model, prompt, max_tokens))

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout) as client:
        steps_before = (await client.get("/health")).json()["steps"]
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.perf_counter() - start
        health = (await client.get("/health")).json()
    steps = health["steps"] - steps_before   # the engine's, while this run was its only load
    ttft = [t.chunks[0] - t.sent for t in timings if t.chunks]
    itl = [b - a for t in timings for a, b in zip(t.chunks, t.chunks[1:])]
    tokens = sum(t.output_tokens for t in timings)
    return dict(clients=clients, requests=len(timings), wall_s=wall, requests_per_s=len(timings) / wall,
                prompt_tokens=sum(len(p) for p, _ in requests), output_tokens=tokens,
                output_tokens_per_s=tokens / wall, engine_steps=steps, tokens_per_step=tokens / steps,
                largest_batch_since_start=health["largest_batch"],
                **percentiles("ttft_s", ttft), **percentiles("itl_s", itl))


def percentiles(name: str, values: list[float]) -> dict:
    """p50, p90 and p99 of values (linear interpolation between the closest ranks), and the mean."""
    ordered = sorted(values)

    def at(q: float) -> float | None:
        if not ordered:
            return None
        rank = q * (len(ordered) - 1)
        low = int(rank)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
    mean = sum(ordered) / len(ordered) if ordered else None
    return {f"{name}_mean": mean, **{f"{name}_p{round(q * 100)}": at(q) for q in (0.5, 0.9, 0.99)}}


def report(result: dict) -> str:
    ms = lambda key: "-" if result[key] is None else f"{1e3 * result[key]:.0f}"   # noqa: E731
    lines = [
        f"{result['requests']} requests from {result['clients']} concurrent clients in {result['wall_s']:.1f} s; "
        f"{result['prompt_tokens']} prompt and {result['output_tokens']} output tokens in "
        f"{result['engine_steps']} engine steps ({result['tokens_per_step']:.1f} tokens a step; largest batch "
        f"since the server started: {result['largest_batch_since_start']})",
        "",
        "| requests/s | output tokens/s | TTFT mean / p50 / p90 / p99 (ms) | ITL mean / p50 / p90 / p99 (ms) |",
        "| --- | --- | --- | --- |",
        f"| {result['requests_per_s']:.2f} | {result['output_tokens_per_s']:.1f} | "
        + " / ".join(ms(f"ttft_s_{s}") for s in ("mean", "p50", "p90", "p99")) + " | "
        + " / ".join(ms(f"itl_s_{s}") for s in ("mean", "p50", "p90", "p99")) + " |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--scale", type=float, default=1.0, help="times every input and output length")
    parser.add_argument("--vocab", type=int, default=10000, help="prompt token ids are below this")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument("--model", default=None, help="the model name to send (default: none)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--out", help="append the result as one JSON line here")
    args = parser.parse_args(argv)
    requests = scaled_requests(args.requests, args.scale, args.vocab, args.seed)
    result = asyncio.run(run(args.url, args.clients, requests, args.model, args.api_key))
    print(report(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
