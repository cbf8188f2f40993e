"""Accuracy harness: what does KV-cache eviction cost in quality?

    python -m nanokv.accuracy                      # bundled SmolLM2-135M, fp32, 4 documents x 4096 tokens
    python -m nanokv.accuracy --docs 2 --doc-tokens 2048 --budgets 256 512 --out /tmp/acc.json

Every document is a real long text found offline (Python standard-library
source files, the Python language reference that ships with the interpreter,
the README of an installed package), cut to exactly --doc-tokens tokens.
Each document is measured twice, for the full cache and for every method and
budget:

- teacher-forced: the document is the prompt and the engine returns the
  log-probability of every prompt token, computed under the method's
  eviction. From it: perplexity, and next-token agreement (how often the
  method's most likely next token equals the full cache's).
- greedy continuation: the first --cont-prompt tokens are the prompt and 64
  tokens are generated greedily; how many of them match the full cache's, and
  how long the run of identical tokens at the start is.

ed (the paper's Algorithm 2) prefills with the whole cache and evicts only
afterwards, so its teacher-forced numbers equal the full cache's by
construction: it pays in the continuation, not in the perplexity.

--kv-cache-dtype int8 fp8 repeats every run on an engine with that quantized
KV cache (kernels/kv_store.py), each compared with the unquantized full cache.

The table averages over documents; the JSON (--out, default docs/accuracy.json)
holds every number per document, the settings and the environment.
The target from issue 4: at a budget of 25% of the document, batchmax's
perplexity is within 5% of the full cache's, and batchmax is far better than ed.
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
from nanokv.eviction import METHODS

FULL = "full"
TARGET_FRACTION = 0.25      # the target: a budget of 25% of the document ...
TARGET_PPL_RATIO = 1.05     # ... keeps perplexity within 5% of the full cache's ...
FAR_BETTER_FACTOR = 2.0     # ... and matches at least twice as many greedy tokens as ed


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
    """The first `num_docs` sources that exist and are long enough, each cut to its
    first `doc_tokens` tokens, so every document weighs the same in the averages."""
    documents, skipped = [], []
    for source in sources:
        if len(documents) == num_docs:
            break
        try:
            text = source.read()
        except (ImportError, OSError) as e:
            skipped.append(f"{source.name} ({e})")
            continue
        ids = encode(text)
        if len(ids) < doc_tokens:
            skipped.append(f"{source.name} (only {len(ids)} tokens)")
            continue
        documents.append(Document(source.name, source.kind, ids[:doc_tokens]))
    if len(documents) < num_docs:
        raise RuntimeError(f"found {len(documents)} documents of {doc_tokens} tokens, {num_docs} wanted; "
                           f"skipped: {'; '.join(skipped)}. Ask for fewer or shorter documents.")
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
    """Both measurements of one document for every (method, budget) run on the engine of
    every kv_cache_dtype in llms, all against the first engine's first run (the full cache).

    All requests of an engine go into one generate() call, so the engine batches them
    continuously (the decode steps of the continuations ride along with the
    prefill chunks of the teacher-forced requests).
    """
    def params(method, budget, **options):
        eviction = {} if method == FULL else {"kv_budget": budget, "evict_every": evict_every}
        return SamplingParams(temperature=0, kv_method=method, **eviction, **options)

    forced = [params(m, b, max_tokens=1, prompt_logprobs=True) for m, b in runs]
    greedy = [params(m, b, max_tokens=cont_tokens, ignore_eos=True) for m, b in runs]
    prompts = [token_ids] * len(runs) + [token_ids[:cont_prompt]] * len(runs)
    labels, forced_outs, greedy_outs = [], [], []
    for kv_cache_dtype, llm in llms.items():
        outs = llm.generate(prompts, forced + greedy, use_tqdm=True)
        labels += [(m, b, kv_cache_dtype) for m, b in runs]
        forced_outs, greedy_outs = forced_outs + outs[:len(runs)], greedy_outs + outs[len(runs):]
    scores = zip(teacher_forced([o.prompt_logprobs for o in forced_outs]),
                 continuation([o.token_ids for o in greedy_outs]))
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


def verdict(summary: list[dict], doc_tokens: int, cont_tokens: int) -> dict:
    """The issue's target, checked at the budget that is 25% of the document.

    Batchmax against the full cache is a perplexity question. Against ed it is
    a generation question: ed (Algorithm 2) prefills with the whole cache and
    only evicts once it generates, so its teacher-forced numbers equal the full
    cache's by construction; ed pays in the continuation, which is where the
    two are compared.
    """
    budget = round(TARGET_FRACTION * doc_tokens)
    row = {(r["method"], r["budget"]): r for r in summary if r.get("kv_cache_dtype", "auto") == "auto"}
    bm, ed = row.get(("batchmax", budget)), row.get(("ed", budget))
    if bm is None or ed is None:
        return {"budget": budget, "met": None,
                "text": f"target not measured: it needs batchmax and ed at budget {budget} "
                        f"({TARGET_FRACTION:.0%} of {doc_tokens})"}
    within = bm["ppl_ratio"] <= TARGET_PPL_RATIO
    far_better = bm["greedy_match"] >= FAR_BETTER_FACTOR * ed["greedy_match"] and bm["greedy_match"] > 0
    text = (f"target at budget {budget} ({TARGET_FRACTION:.0%} of {doc_tokens}): "
            f"batchmax perplexity {bm['ppl_ratio'] - 1:+.1%} vs full "
            f"(within {TARGET_PPL_RATIO - 1:.0%}: {'yes' if within else 'NO'}); "
            f"greedy tokens matching full: batchmax {bm['greedy_match']:.1f}/{cont_tokens}, "
            f"ed {ed['greedy_match']:.1f}/{cont_tokens} (far better, >= {FAR_BETTER_FACTOR:g}x: "
            f"{'yes' if far_better else 'NO'}) -> {'MET' if within and far_better else 'NOT MET'}")
    return {"budget": budget, "ppl_ratio": bm["ppl_ratio"], "within_5pct": within,
            "batchmax_greedy_match": bm["greedy_match"], "ed_greedy_match": ed["greedy_match"],
            "far_better_than_ed": far_better, "met": within and far_better, "text": text}


def format_table(summary: list[dict], cont_tokens: int) -> str:
    header = (f"{'method':<15}{'budget':>7}{'% doc':>7}{'perplexity':>12}{'ppl/full':>10}"
              f"{'next-token agree':>18}{'greedy match':>14}{'common prefix':>15}")
    lines = [header, "-" * len(header)]
    for r in summary:
        budget = "-" if r["budget"] is None else str(r["budget"])
        pct = "-" if r["budget_pct"] is None else f"{r['budget_pct']:.1f}%"
        kv = r.get("kv_cache_dtype", "auto")
        method = r["method"] + ("" if kv == "auto" else f" {kv}")
        lines.append(f"{method:<15}{budget:>7}{pct:>7}{r['perplexity']:>12.3f}{r['ppl_ratio']:>10.3f}"
                     f"{r['agreement']:>17.1%} {r['greedy_match']:>10.1f}/{cont_tokens:<3}"
                     f"{r['common_prefix']:>15.1f}")
    return "\n".join(lines)


# --- command line ----------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m nanokv.accuracy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory or hub id (default: the bundled SmolLM2-135M)")
    parser.add_argument("--docs", type=int, default=4, help="number of documents")
    parser.add_argument("--doc-tokens", type=int, default=4096, help="tokens per document")
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512, 1024],
                        help="KV budgets (pairs per KV head) for every method")
    parser.add_argument("--methods", nargs="+", default=["batchmax", "ed"],
                        choices=[m for m in METHODS if m != FULL],
                        help="methods compared with the full cache, each under its default schedule")
    parser.add_argument("--evict-every", type=int, default=64, help="p: pairs evicted at a time")
    parser.add_argument("--cont-prompt", type=int, default=2048,
                        help="prompt tokens (the start of each document) for the greedy continuation")
    parser.add_argument("--cont-tokens", type=int, default=64, help="greedy tokens generated")
    parser.add_argument("--kv-cache-gb", type=float, default=2.0,
                        help="KV pool: big enough that a document's requests need not preempt each other")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice); on cores shared with other "
                             "jobs, 1 can be several times faster than threads that wait for each other")
    parser.add_argument("--kv-cache-dtype", nargs="*", default=[], choices=["int8", "fp8"],
                        help="quantized KV caches whose runs are compared with the unquantized full cache too")
    parser.add_argument("--out", default="docs/accuracy.json", help="where the JSON goes")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the harness; returns what it writes to --out."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cont_prompt = min(args.cont_prompt, args.doc_tokens)
    started = time.perf_counter()
    llms = {kv_cache_dtype: LLM(args.model, dtype="float32", kv_cache_gb=args.kv_cache_gb,
                                max_model_len=args.doc_tokens + args.cont_tokens, kv_cache_dtype=kv_cache_dtype)
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
    check = verdict(summary, args.doc_tokens, args.cont_tokens)
    seconds = time.perf_counter() - started

    print(f"\nmodel {args.model or 'bundled SmolLM2-135M-Instruct'}, fp32, {llm.runner.device}, "
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
                        "device": str(llm.runner.device), "machine": platform.machine(),
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
