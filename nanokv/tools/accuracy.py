"""Accuracy harness: what does KV-cache eviction cost in quality?

    python -m nanokv.tools.accuracy                      # bundled SmolLM2-135M, fp32, 4 documents x 4096 tokens
    python -m nanokv.tools.accuracy --docs 2 --doc-tokens 2048 --budgets 256 512 --out /tmp/acc.json

Real long texts found offline, cut to --doc-tokens tokens, each measured teacher-forced
(perplexity and next-token agreement with the full cache, from the prompt logprobs under
eviction) and as a greedy continuation (tokens identical to the full cache's). Methods are
written as bench.py takes them (nanokv/tools/method_spec.py); --kv-cache-dtype int8 fp8
repeats every run on a quantized cache. The JSON (--out) holds every number per document,
the settings and the environment; what each column means, and the results: docs/ACCURACY.md.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import platform
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import torch

from nanokv import LLM, SamplingParams
from nanokv.tools.method_spec import parse_spec, schedule_name, spec_argument

FULL = "full"
TARGET_FRACTION = 0.25      # the target: at a budget of 25% of the document, the best prefill-schedule method ...
TARGET_PPL_RATIO = 1.03     # ... keeps perplexity within 3% of the full cache's ...
TARGET_PREFIX_SHARE = 2 / 3  # ... and 2/3 of the identical greedy start of the best decode-schedule method


# --- documents -------------------------------------------------------------------------------

class Source(NamedTuple):
    """A long text that exists offline wherever nanokv is installed."""
    name: str
    kind: str                   # "code" or "prose"
    read: Callable[[], str]     # may raise ImportError or OSError where the text is missing


@dataclass
class Document:
    name: str
    kind: str
    token_ids: list[int]


def _stdlib_file(filename: str) -> str:
    return (Path(sysconfig.get_paths()["stdlib"]) / filename).read_text(encoding="utf-8")


def _python_reference() -> str:
    """The Python language reference, as the interpreter ships it for help() (prose with
    short grammar and code snippets)."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[name] for name in sorted(topics))


def _package_readme(dist: str) -> str:
    """The long description (usually the README) of an installed package."""
    return importlib.metadata.metadata(dist).get_payload() or ""


def _package_license(dist: str, filename: str) -> str:
    files = importlib.metadata.distribution(dist).files or []
    path = next((f for f in files if f.name == filename and ".dist-info" in str(f)), None)
    if path is None:
        raise FileNotFoundError(f"{dist} ships no {filename}")
    return path.read_text(encoding="utf-8")


# In the order documents are taken. Code and prose alternate, so any --docs mixes
# both; the later ones stand in where an earlier one is missing or too short.
# Everything here comes with Python itself or with nanokv's own dependencies.
SOURCES = [
    Source("argparse.py", "code", lambda: _stdlib_file("argparse.py")),
    Source("Python language reference (pydoc_data)", "prose", _python_reference),
    Source("typing.py", "code", lambda: _stdlib_file("typing.py")),
    Source("PyTorch README", "prose", lambda: _package_readme("torch")),
    Source("inspect.py", "code", lambda: _stdlib_file("inspect.py")),
    Source("tqdm README", "prose", lambda: _package_readme("tqdm")),
    Source("subprocess.py", "code", lambda: _stdlib_file("subprocess.py")),
    Source("NumPy LICENSE.txt", "prose", lambda: _package_license("numpy", "LICENSE.txt")),
]


def load_documents(encode: Callable[[str], list[int]], num_docs: int, doc_tokens: int,
                   sources: list[Source] = SOURCES) -> list[Document]:
    """`num_docs` documents of exactly `doc_tokens` tokens, so every one weighs the same in
    the averages: the first segment of every source that exists and is long enough, in
    order, then their second segments (the next `doc_tokens` tokens), and so on."""
    texts, skipped = [], []
    for source in sources:
        try:
            ids = encode(source.read())
        except (ImportError, OSError) as e:
            skipped.append(f"{source.name} ({e})")
            continue
        if len(ids) < doc_tokens:
            skipped.append(f"{source.name} (only {len(ids)} tokens)")
            continue
        texts.append((source, ids))
    documents = []
    for k in range(max((len(ids) // doc_tokens for _, ids in texts), default=0)):
        for source, ids in texts:
            if len(documents) < num_docs and len(ids) >= (k + 1) * doc_tokens:
                name = source.name if k == 0 else f"{source.name} (part {k + 1})"
                documents.append(Document(name, source.kind, ids[k * doc_tokens:(k + 1) * doc_tokens]))
    if len(documents) < num_docs:
        raise RuntimeError(f"found {len(documents)} documents of {doc_tokens} tokens, {num_docs} wanted; "
                           f"skipped: {'; '.join(skipped) or 'none'}. Ask for fewer or shorter documents.")
    return documents


# --- measurements ----------------------------------------------------------------------------

def perplexity(prompt_logprobs: list) -> float:
    """exp of the mean negative log-likelihood of prompt tokens 1..n-1.

    Entry 0 is None: nothing comes before the first token, so nothing predicts it.
    """
    scored = prompt_logprobs[1:]
    return math.exp(-math.fsum(p.logprob for p in scored) / len(scored))


def agreement(prompt_logprobs: list, reference: list) -> float:
    """Fraction of positions 1..n-1 where both runs predict the same next token.

    Perplexity only sees the probability of the token that came; agreement sees
    whether the method would still have *chosen* what the full cache chooses.
    """
    pairs = list(zip(prompt_logprobs[1:], reference[1:], strict=True))
    return sum(p.top_token == r.top_token for p, r in pairs) / len(pairs)


def teacher_forced(prompt_logprobs_per_run: list[list]) -> list[dict]:
    """Perplexity (also as a ratio) and agreement of every run against the first run,
    the full cache."""
    reference = prompt_logprobs_per_run[0]
    full_ppl = perplexity(reference)
    return [{"perplexity": perplexity(lps), "ppl_ratio": perplexity(lps) / full_ppl,
             "agreement": agreement(lps, reference)}
            for lps in prompt_logprobs_per_run]


def common_prefix(tokens: list[int], reference: list[int]) -> int:
    """How many tokens at the start are identical: after the first difference the two
    texts continue from different contexts, so later matches are partly luck."""
    n = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        n += 1
    return n


def continuation(tokens_per_run: list[list[int]]) -> list[dict]:
    """Greedy matches of every run against the first run (the full cache): matching
    positions, and the length of the identical start."""
    reference = tokens_per_run[0]
    return [{"greedy_match": sum(a == b for a, b in zip(tokens, reference)),
             "common_prefix": common_prefix(tokens, reference)}
            for tokens in tokens_per_run]


def evaluate_document(llms: dict[str, LLM], token_ids: list[int], runs: list[tuple[str, int | None]],
                      evict_every: int, cont_prompt: int, cont_tokens: int) -> list[dict]:
    """Both measurements of one document for every (method spec, budget) run on the engine of
    every kv_cache_dtype in llms, all against the first engine's first run (the full cache).

    All requests of an engine go into one generate() call, so the engine batches them
    continuously (the decode steps of the continuations ride along with the
    prefill chunks of the teacher-forced requests).
    """
    def params(method, budget, **options):
        eviction = {} if method == FULL else {"kv_budget": budget, "evict_every": evict_every}
        return SamplingParams(temperature=0, **{**eviction, **parse_spec(method)}, **options)

    # Only the prefill schedule evicts while the prompt is read: every other method's prompt
    # log-probabilities are the full cache's by construction, so they are not computed again.
    forced_runs = [0] + [i for i, (m, _) in enumerate(runs) if schedule_name(parse_spec(m)) == "prefill"]
    forced = [params(*runs[i], max_tokens=1, prompt_logprobs=True) for i in forced_runs]
    greedy = [params(m, b, max_tokens=cont_tokens, ignore_eos=True) for m, b in runs]
    prompts = [token_ids] * len(forced) + [token_ids[:cont_prompt]] * len(runs)
    labels, logprobs, tokens = [], [], []
    for kv_cache_dtype, llm in llms.items():
        outs = llm.generate(prompts, forced + greedy, use_tqdm=True)
        run_logprobs = [outs[0].prompt_logprobs] * len(runs)   # this engine's full cache
        for i, out in zip(forced_runs, outs):
            run_logprobs[i] = out.prompt_logprobs
        labels += [(m, b, kv_cache_dtype) for m, b in runs]
        logprobs += run_logprobs
        tokens += [o.token_ids for o in outs[len(forced):]]
    scores = zip(teacher_forced(logprobs), continuation(tokens))
    return [{"method": m, "budget": b, "kv_cache_dtype": kv, **f, **g} for (m, b, kv), (f, g) in zip(labels, scores)]


# --- summary ---------------------------------------------------------------------------------

def summarise(results_per_doc: list[list[dict]], doc_tokens: int) -> list[dict]:
    """One row per (method, budget), averaged over documents.

    Perplexities and their ratios take the geometric mean: for documents of
    equal length that is the perplexity of all of them together, and the mean
    ratio is then exactly the ratio of the mean perplexities. The rest are
    plain means.
    """
    rows = []
    for i, first in enumerate(results_per_doc[0]):
        column = {key: [results[i][key] for results in results_per_doc] for key in first}
        rows.append({
            "method": first["method"], "budget": first["budget"], "kv_cache_dtype": first.get("kv_cache_dtype", "auto"),
            "budget_pct": None if first["budget"] is None else 100 * first["budget"] / doc_tokens,
            "perplexity": _geometric_mean(column["perplexity"]),
            "ppl_ratio": _geometric_mean(column["ppl_ratio"]),
            "agreement": _mean(column["agreement"]),
            "greedy_match": _mean(column["greedy_match"]),
            "common_prefix": _mean(column["common_prefix"]),
        })
    return rows


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _geometric_mean(values: list[float]) -> float:
    return math.exp(_mean([math.log(v) for v in values]))


def verdict(summary: list[dict], doc_tokens: int) -> dict:
    """The target, checked at the budget that is 25% of the document: is some method that
    evicts while reading the prompt within TARGET_PPL_RATIO of the full cache's perplexity
    and within TARGET_PREFIX_SHARE of the best decode-schedule method's identical greedy start?"""
    budget = round(TARGET_FRACTION * doc_tokens)
    at_budget = [r for r in summary if r["budget"] == budget and r.get("kv_cache_dtype", "auto") == "auto"]
    prefill = [r for r in at_budget if schedule_name(parse_spec(r["method"])) == "prefill"]
    decode = [r for r in at_budget if schedule_name(parse_spec(r["method"])) == "decode"]
    if not prefill or not decode:
        return {"budget": budget, "met": None,
                "text": f"target not measured: it needs prefill- and decode-schedule methods at budget "
                        f"{budget} ({TARGET_FRACTION:.0%} of {doc_tokens})"}
    best_decode = max(decode, key=lambda r: r["common_prefix"])
    needed = TARGET_PREFIX_SHARE * best_decode["common_prefix"]
    passing = [r for r in prefill if r["ppl_ratio"] <= TARGET_PPL_RATIO and r["common_prefix"] >= needed]
    best_prefill = max(passing or prefill, key=lambda r: (r["common_prefix"], -r["ppl_ratio"]))
    met = bool(passing)
    text = (f"target at budget {budget} ({TARGET_FRACTION:.0%} of {doc_tokens}): best prefill-schedule method "
            f"{best_prefill['method']}: identical greedy start {best_prefill['common_prefix']:.1f} vs "
            f"{best_decode['common_prefix']:.1f} for {best_decode['method']} (needs >= {needed:.1f}), "
            f"perplexity {best_prefill['ppl_ratio'] - 1:+.1%} vs full (needs <= {TARGET_PPL_RATIO - 1:+.0%}) "
            f"-> {'MET' if met else 'NOT MET'}")
    return {"budget": budget, "best_prefill": best_prefill["method"], "best_decode": best_decode["method"],
            "prefill_common_prefix": best_prefill["common_prefix"],
            "decode_common_prefix": best_decode["common_prefix"],
            "prefill_ppl_ratio": best_prefill["ppl_ratio"], "met": met, "text": text}


def format_table(summary: list[dict], cont_tokens: int) -> str:
    def label(r):   # the method, and the cache's dtype when quantized
        kv = r.get("kv_cache_dtype", "auto")
        return r["method"] + ("" if kv == "auto" else f" {kv}")

    width = max(11, *(len(label(r)) + 2 for r in summary))
    header = (f"{'method':<{width}}{'budget':>7}{'% doc':>7}{'perplexity':>12}{'ppl/full':>10}"
              f"{'next-token agree':>18}{'greedy match':>14}{'common prefix':>15}")
    lines = [header, "-" * len(header)]
    for r in summary:
        budget = "-" if r["budget"] is None else str(r["budget"])
        pct = "-" if r["budget_pct"] is None else f"{r['budget_pct']:.1f}%"
        lines.append(f"{label(r):<{width}}{budget:>7}{pct:>7}{r['perplexity']:>12.3f}{r['ppl_ratio']:>10.3f}"
                     f"{r['agreement']:>17.1%} {r['greedy_match']:>10.1f}/{cont_tokens:<3}"
                     f"{r['common_prefix']:>15.1f}")
    return "\n".join(lines)


# --- command line ----------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m nanokv.tools.accuracy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory or hub id (default: the bundled SmolLM2-135M)")
    parser.add_argument("--docs", type=int, default=4, help="number of documents")
    parser.add_argument("--doc-tokens", type=int, default=4096, help="tokens per document")
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512, 1024],
                        help="KV budgets (pairs per KV head) for every method")
    parser.add_argument("--methods", nargs="+", type=spec_argument, default=["batchmax", "decode_only"],
                        help="methods compared with the full cache: RANKING[@SCHEDULE][,KEY=INT...], "
                             "KEY in sinks, recent, window, pool, every (e.g. h2o@prefill,sinks=4)")
    parser.add_argument("--evict-every", type=int, default=64, help="p: pairs evicted at a time")
    parser.add_argument("--cont-prompt", type=int, default=None,
                        help="prompt tokens (the start of each document) for the greedy continuation "
                             "(default: the whole document, so the budget is the same share of both prompts)")
    parser.add_argument("--cont-tokens", type=int, default=64, help="greedy tokens generated")
    parser.add_argument("--kv-cache-gb", type=float, default=2.0,
                        help="KV pool: big enough that a document's requests need not preempt each other")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice); on cores shared with other "
                             "jobs, 1 can be several times faster than threads that wait for each other")
    parser.add_argument("--kv-cache-dtype", nargs="*", default=[], choices=["int8", "fp8"],
                        help="quantized KV caches whose runs are compared with the unquantized full cache too")
    parser.add_argument("--press-window", type=int, default=0,
                        help="the engine's press_window: 65 for kvpress's SnapKVPress (its window of 64, and one)")
    parser.add_argument("--out", default="docs/accuracy.json", help="where the JSON goes")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the harness; returns what it writes to --out."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cont_prompt = min(args.cont_prompt or args.doc_tokens, args.doc_tokens)
    started = time.perf_counter()
    llms = {kv_cache_dtype: LLM(args.model, dtype="float32", kv_cache_gb=args.kv_cache_gb,
                                max_model_len=args.doc_tokens + args.cont_tokens, kv_cache_dtype=kv_cache_dtype,
                                press_window=args.press_window)
            for kv_cache_dtype in ["auto", *args.kv_cache_dtype]}
    llm = llms["auto"]
    documents = load_documents(llm.tokenizer.encode, args.docs, args.doc_tokens)
    runs = [(FULL, None)] + [(m, b) for m in args.methods for b in args.budgets]

    per_doc = []
    for i, doc in enumerate(documents, 1):
        print(f"document {i}/{len(documents)}: {doc.name} ({doc.kind}, {len(doc.token_ids)} tokens)",
              file=sys.stderr)
        doc_started = time.perf_counter()
        results = evaluate_document(llms, doc.token_ids, runs, args.evict_every, cont_prompt, args.cont_tokens)
        per_doc.append({"name": doc.name, "kind": doc.kind, "results": results,
                        "seconds": round(time.perf_counter() - doc_started, 1)})
    summary = summarise([d["results"] for d in per_doc], args.doc_tokens)
    check = verdict(summary, args.doc_tokens)
    seconds = time.perf_counter() - started

    print(f"\nmodel {args.model or 'bundled SmolLM2-135M-Instruct'}, fp32, {llm.device}, "
          f"{len(documents)} documents x {args.doc_tokens} tokens, p={args.evict_every}, "
          f"continuation: {cont_prompt}-token prompt + {args.cont_tokens} greedy tokens, {seconds:.0f} s")
    print(format_table(summary, args.cont_tokens))
    print(check["text"])

    report = {
        "settings": {"model": args.model or "bundled:SmolLM2-135M-Instruct", "dtype": "float32",
                     "docs": len(documents), "doc_tokens": args.doc_tokens, "budgets": args.budgets,
                     "methods": args.methods, "evict_every": args.evict_every,
                     "cont_prompt": cont_prompt, "cont_tokens": args.cont_tokens,
                     "kv_cache_dtypes": ["auto", *args.kv_cache_dtype]},
        "environment": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "torch": torch.__version__, "python": platform.python_version(),
                        "device": str(llm.device), "machine": platform.machine(),
                        "threads": torch.get_num_threads(), "run_seconds": round(seconds, 1)},
        "summary": summary,
        "verdict": check,
        "documents": per_doc,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
