"""The tables and the plot bench.py prints and draws from its records."""
from __future__ import annotations

from nanokv.engine.timing import PHASES


def method_label(name: str, budget: int | None) -> str:
    return name if budget is None else f"{name} |kv|={budget}"


# (header, record key, format) of each table's columns
TIMES = [("decode ms/step", "decode_ms_per_step", ".1f"), ("prefill s", "prefill_s", ".2f"),
         ("evict s", "evict_s", ".2f"), ("evict pieces", "evict_pieces", ""),
         ("moved / evicted", "moved_per_evicted", ".2f"),
         ("host ms/step", "host_ms_per_step", ".2f")]
SPEED = [("tokens/s", "tokens_per_s", ".1f"), ("x full", "x_full", ".2f")]
STATIC_COLUMNS = [("method", "label", ""), ("batch", "largest", ""), ("OOM at", "oom_at", ""), *SPEED,
                  ("peak KV GB", "peak_kv_gb", ".3f"), *TIMES]
WAIT = ("wait ms/step", "wait_ms_per_step", ".2f")   # continuous runs: their steps are not synchronised
ALLOCATOR = [("cudaMalloc", "cuda_mallocs", ""), ("retries", "alloc_retries", ""),   # a GPU's, in the run
             ("cudaHostAlloc", "pinned_mallocs", "")]
CONTINUOUS_HEAD = [("method", "label", ""), *SPEED, ("max running", "max_running", ""),
                   ("preemptions", "preemptions", ""), ("peak KV GB", "peak_kv_gb", ".3f")]
CONTINUOUS_COLUMNS = [*CONTINUOUS_HEAD, *TIMES, WAIT, *ALLOCATOR]
WORKLOAD_COLUMNS = [*CONTINUOUS_HEAD, TIMES[0], ("roofline ms/step", "roofline_ms_per_step", ".1f"),
                    ("mean batch", "mean_decode_batch", ".1f"), ("mean context", "mean_decode_context", ".0f"),
                    *TIMES[1:], WAIT, *ALLOCATOR]
SWEEP_COLUMNS = [("method", "label", ""), ("input", "input_len", ""), ("batch", "batch", ""), ("fits", "fits", ""),
                 *SPEED, ("peak KV GB", "peak_kv_gb", ".3f"), *TIMES]


def print_table(rows: list[dict], columns: list[tuple]) -> None:
    """A plain-text table; adds the ratio of tokens/s against the row for `full` if missing."""
    full = next((r for r in rows if r.get("method") == "full" and r.get("tokens_per_s")), None)
    rows = [dict(r) for r in rows]   # the records themselves stay as they were saved
    for r in rows:
        r.setdefault("label", method_label(r["method"], r["budget"]))
        if "x_full" not in r:
            r["x_full"] = r["tokens_per_s"] / full["tokens_per_s"] if full and r.get("tokens_per_s") else None
    cells = [[header for header, _, _ in columns]]
    for r in rows:
        cells.append(["OOM" if key == "tokens_per_s" and r.get("fits") is False else
                      "-" if r.get(key) is None else format(r[key], spec) for _, key, spec in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for row in cells:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))


def print_phases(rows: list[dict]) -> None:
    """Each run's milliseconds per step in each phase of a step (nanokv/engine/timing.py), its
    prefill steps (any prompt chunk) and decode steps apart: where a continuous run's host time goes."""
    table = [dict(r, label=f"{method_label(r['method'], r['budget'])}, {kind}", steps=r[f"{kind}_steps"], **ms)
             for r in rows for kind, ms in r["phase_ms"].items()]
    phases = [phase for phase in PHASES if any(row[phase] for row in table)]
    print("\nms per step in each phase (unsynchronised: forward and wait are where the host met the device)")
    print_table(table, [("method, steps", "label", ""), ("steps", "steps", ""), *[(p, p, ".2f") for p in phases]])


def plot(records: list[dict], path: str) -> None:
    """Two panels against batch size, a line per method (and input length): tokens/s and
    peak KV memory of the static batches that fit; the legend says where each ran out."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        print(f"--plot: matplotlib is not installed, so no {path} (pip install matplotlib draws it; the "
              "tables above hold the same numbers)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    static = [r for r in records if r["mode"] == "static"]
    if not static:
        print("--plot: no static batches to plot (paper and sweep modes run them)")
        return
    several_lens = len({r["input_len"] for r in static}) > 1
    curves: dict[str, list[dict]] = {}
    for r in sorted(static, key=lambda r: r["batch"]):
        curves.setdefault(method_label(r["method"], r["budget"]) + (f", input {r['input_len']}" if several_lens else ""), []).append(r)
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
