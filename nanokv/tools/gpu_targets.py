"""The figures the GPU report puts at its top: each target the project has set for a GPU,
read from what the part that measures it printed or recorded (its JSON lines), as
measured / target. A figure without a target is shown for its value alone."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

# The first GPU run's workload figure on an H200 (docs/PERF.md): overlapped steps aim at 1.4x it.
H200_WORKLOAD_TOKENS_PER_S = 14453
WORKLOAD_SHAPE = "qwen3-0.6b"   # the workload and host modes' model


@dataclass
class Figure:
    name: str
    measured: str
    target: str = ""
    met: bool | None = None   # None: no target, or nothing measured


Reader = Callable[[str, list[dict]], list[Figure]]   # (the part's output, its records) -> figures


def _ratio(name: str, value: float | None, target: float, above: bool, unit: str = "x") -> Figure:
    """value against a bound: at least target (above) or at most it."""
    bound = f"{'>=' if above else '<='} {target:g}{unit}"
    if value is None:
        return Figure(name, "not measured", bound, False)
    return Figure(name, f"{value:.2f}{unit}", bound, value >= target if above else value <= target)


def _one(records: list[dict], **fields) -> dict | None:
    return next((r for r in records if all(r.get(k) == v for k, v in fields.items())), None)


def _get(record: dict | None, key: str, scale: float = 1.0) -> float | None:
    return None if record is None or record.get(key) is None else record[key] * scale


def tests(output: str, records: list[dict]) -> list[Figure]:
    """pytest's summary line: every selected test passes."""
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", output)}
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    measured = ", ".join(f"{n} {word}" for word, n in counts.items()) or "no summary line"
    return [Figure("tests", measured, "all pass", bool(counts.get("passed")) and failed == 0)]


def kernels(output: str, records: list[dict]) -> list[Figure]:
    """Decode against SDPA and the copy bandwidth, int8 against bf16, prefill against SDPA."""
    figures = []
    for batch, ctx in ((1, 1024), (1, 4096), (16, 1024), (16, 4096)):
        figures.append(_ratio(f"decode bf16, batch {batch}, context {ctx}: time / SDPA flash's",
                              _get(_one(records, kind="decode", cache="bf16", batch=batch, context=ctx), "vs_sdpa"),
                              1.2, above=False))
    figures.append(_ratio("decode bf16, batch 16, context 4096: share of copy bandwidth",
                          _get(_one(records, kind="decode", cache="bf16", batch=16, context=4096), "copy_share", 100),
                          70, above=True, unit="%"))
    for batch in (16, 64):
        int8 = _one(records, kind="decode", cache="int8", batch=batch, context=4096)
        bf16 = _one(records, kind="decode", cache="bf16", batch=batch, context=4096)
        figures.append(_ratio(f"decode int8, batch {batch}, context 4096: share of copy bandwidth (its bytes)",
                              _get(int8, "copy_share", 100), 70, above=True, unit="%"))
        figures.append(_ratio(f"decode int8 / bf16 time, batch {batch}, context 4096",
                              int8 and bf16 and int8["us"] / bf16["us"], 1.0, above=False))
    for r in (r for r in records if r.get("kind") == "prefill"):
        figures.append(_ratio(f"prefill {r['case']}: speed / SDPA flash's", r["vs_sdpa"], 0.8, above=True))
    for step in (r for r in records if r.get("kind") == "decode_step"):
        name = f"decode step, {step['case']}: time / roofline"
        if step["shape"] == WORKLOAD_SHAPE:   # the workload's step on the device (the workload times the host's)
            figures.append(_ratio(name, step["vs_roofline"], 1.25, above=False))
        else:
            figures.append(Figure(name, f"{step['vs_roofline']:.2f}x"))
    return figures


def _largest_fitting(records: list[dict], ranking: str) -> dict | None:
    fitting = [r for r in records if r.get("mode") == "static" and r["fits"] and r["method"].split("@")[0] == ranking]
    return max(fitting, key=lambda r: r["batch"], default=None)


def paper(output: str, records: list[dict]) -> list[Figure]:
    """Batch-Max's table: batchmax at its largest batch against full and ED at theirs."""
    full, ed, batchmax = (_largest_fitting(records, name) for name in ("full", "ed", "batchmax"))
    tokens = {name: _get(r, "tokens_per_s") for name, r in (("full", full), ("ed", ed), ("batchmax", batchmax))}
    figures = [Figure("largest batches: full / ED / batchmax",
                      " / ".join(str(r["batch"]) if r else "-" for r in (full, ed, batchmax)))]
    for other, target in (("full", 2.0), ("ed", 1.4)):
        value = tokens["batchmax"] / tokens[other] if tokens["batchmax"] and tokens[other] else None
        figures.append(_ratio(f"paper: batchmax tokens/s / {other}'s", value, target, above=True))
    figures.append(_ratio("paper: batchmax's eviction share of its run",
                          batchmax and 100 * batchmax["evict_s"] / batchmax["wall_s"], 5, above=False, unit="%"))
    per_token = {name: r["prefill_s"] / (r["batch"] * r["input_len"]) for name, r in (("full", full),
                                                                                   ("batchmax", batchmax)) if r}
    figures.append(_ratio("paper: batchmax's prefill cost per token / full's",
                          per_token["batchmax"] / per_token["full"] if len(per_token) == 2 else None, 1.2, above=False))
    return figures


def workload(output: str, records: list[dict]) -> list[Figure]:
    full = _one(records, mode="workload", method="full")
    figures = [_ratio("workload: full's tokens/s (H200: 1.4x the first run's)", _get(full, "tokens_per_s"),
                      1.4 * H200_WORKLOAD_TOKENS_PER_S, above=True, unit="")]
    for r in records:
        if r.get("mode") == "workload" and r["method"] != "full":
            figures.append(_ratio(f"workload: {r['method']} |kv| {r['budget']} tokens/s / full's",
                                  full and r["tokens_per_s"] / full["tokens_per_s"], 0.9, above=True))
    return figures


def host(output: str, records: list[dict]) -> list[Figure]:
    """At the largest batch, full cache, no prefix caching, overlapped steps: a step against its
    forward alone, and what the device waits for the host (serial: every step read before the next)."""
    runs = [r for r in records if r.get("mode") == "host" and r["method"] == "full" and not r["caching"]]
    top = max(runs, key=lambda r: r["batch"], default=None)
    batch = top["batch"] if top else "largest"
    return [_ratio(f"host: {top['model'] if top else ''} step (host + device) / forward alone, batch {batch}",
                   top and (top["overlap"] + top["forward"]) / top["forward"], 1.2, above=False),
            _ratio(f"host: the host's time per step the device waits for, overlapped, batch {batch}",
                   _get(top, "overlap"), 0.2, above=False, unit=" ms"),
            _ratio(f"host: the same, serial steps, batch {batch}", _get(top, "serial"), 0.2, above=False, unit=" ms")]


def offload(output: str, records: list[dict]) -> list[Figure]:
    rate = {r["offload"]: r["tokens_per_s"] for r in records if r.get("mode") == "offload" and r["method"] == "full"}
    figures = []
    if "recompute" in rate and "swap" in rate:
        figures.append(Figure("offload: swap tokens/s / recompute's", f"{rate['swap'] / rate['recompute']:.2f}x"))
    kvpr, copy_all = rate.get("host, KVPR's l"), rate.get("host, l = 0")
    if kvpr and copy_all:
        figures.append(Figure("offload: KVPR's l tokens/s / l = 0's (>= 1.3x where the link is the bottleneck)",
                              f"{kvpr / copy_all:.2f}x"))
    return figures or [Figure("offload", "not measured", "every mode runs", False)]


def memcheck(output: str, records: list[dict]) -> list[Figure]:
    found = re.search(r"ERROR SUMMARY: (\d+) error", output)
    return [Figure("compute-sanitizer memcheck errors", found.group(1) if found else "no summary", "0",
                   found is not None and found.group(1) == "0")]
