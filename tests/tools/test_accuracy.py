"""The accuracy harness (nanokv/tools/accuracy.py): its arithmetic and documents without a
model, then one tiny end-to-end run on the bundled model."""
import argparse
import json
import math
from types import SimpleNamespace

import pytest

from helpers import make_tiny_model
from nanokv.tools import accuracy
from nanokv.tools.accuracy import Source
from nanokv.tools.method_spec import parse_spec, schedule_name, spec_argument


def logprobs(values, top_tokens=None):
    """A prompt_logprobs list as the engine returns it: None for position 0."""
    top_tokens = top_tokens or [0] * len(values)
    return [None] + [SimpleNamespace(logprob=v, top_token=t) for v, t in zip(values, top_tokens)]


def byte_encode(text):
    return list(text.encode())


# --- measurements ------------------------------------------------------------------------

def test_perplexity_skips_the_first_position():
    assert accuracy.perplexity(logprobs([-1.0, -2.0, -3.0])) == pytest.approx(math.exp(2.0))
    assert accuracy.perplexity(logprobs([math.log(1 / 4)] * 5)) == pytest.approx(4.0)


def test_agreement_counts_equal_top_tokens():
    run = logprobs([-1.0] * 4, top_tokens=[5, 6, 7, 8])
    full = logprobs([-1.0] * 4, top_tokens=[5, 0, 7, 0])
    assert accuracy.agreement(run, full) == 0.5
    assert accuracy.agreement(full, full) == 1.0


def test_teacher_forced_compares_every_run_with_the_first():
    full = logprobs([-1.0, -1.0], top_tokens=[3, 4])
    worse = logprobs([-2.0, -2.0], top_tokens=[3, 9])
    scores = accuracy.teacher_forced([full, worse])
    assert scores[0] == {"perplexity": pytest.approx(math.e), "ppl_ratio": 1.0, "agreement": 1.0}
    assert scores[1] == {"perplexity": pytest.approx(math.e ** 2), "ppl_ratio": pytest.approx(math.e),
                         "agreement": 0.5}


def test_continuation_counts_matches_and_the_common_prefix():
    scores = accuracy.continuation([[1, 2, 3, 4], [1, 2, 9, 4], [7, 2, 3, 4]])
    assert scores == [{"greedy_match": 4, "common_prefix": 4},
                      {"greedy_match": 3, "common_prefix": 2},
                      {"greedy_match": 3, "common_prefix": 0}]


# --- summary -----------------------------------------------------------------------------

def result(method, budget, ppl, ratio, agree, match, prefix):
    return dict(method=method, budget=budget, perplexity=ppl, ppl_ratio=ratio, agreement=agree,
                greedy_match=match, common_prefix=prefix)


def test_summarise_averages_over_documents():
    docs = [[result("full", None, 4.0, 1.0, 1.0, 64, 64), result("batchmax", 1024, 8.0, 2.0, 0.5, 10, 2)],
            [result("full", None, 9.0, 1.0, 1.0, 64, 64), result("batchmax", 1024, 9.0, 1.0, 0.7, 20, 4)]]
    full, bm = accuracy.summarise(docs, doc_tokens=4096)
    assert full["perplexity"] == pytest.approx(6.0)           # geometric mean of 4 and 9
    assert bm["perplexity"] == pytest.approx(math.sqrt(72))
    assert bm["ppl_ratio"] == pytest.approx(bm["perplexity"] / full["perplexity"])
    assert (bm["agreement"], bm["greedy_match"], bm["common_prefix"]) == (pytest.approx(0.6), 15, 3)
    assert (full["budget_pct"], bm["budget_pct"]) == (None, 25.0)


def test_verdict_compares_the_best_prefill_and_decode_schedules_at_a_quarter_of_the_document():
    def summary(prefill_ratio, prefill_prefix, decode_prefix):
        return [dict(method="batchmax", budget=1024, ppl_ratio=prefill_ratio, common_prefix=prefill_prefix),
                dict(method="snapkv@prefill,sinks=4", budget=1024, ppl_ratio=1.2, common_prefix=1),
                dict(method="decode_only", budget=1024, ppl_ratio=1.0, common_prefix=decode_prefix),
                dict(method="h2o", budget=1024, ppl_ratio=1.0, common_prefix=3),
                dict(method="ed", budget=1024, ppl_ratio=1.0, common_prefix=60)]   # ed is neither schedule
    met = accuracy.verdict(summary(1.02, 20, 30), 4096)
    assert met["met"] is True and (met["best_prefill"], met["best_decode"]) == ("batchmax", "decode_only")
    assert accuracy.verdict(summary(1.05, 20, 30), 4096)["met"] is False   # perplexity too high
    assert accuracy.verdict(summary(1.02, 19, 30), 4096)["met"] is False   # under 2/3 of 30
    missing = accuracy.verdict(summary(1.02, 20, 30), 2048)                # no budget 512
    assert missing["met"] is None and "512" in missing["text"]


def test_method_specs_name_a_ranking_a_schedule_and_settings():
    assert parse_spec("h2o") == {"kv_method": "h2o"}
    assert parse_spec("snapkv@prefill,window=16,sinks=4,every=32") == {
        "kv_method": "snapkv", "kv_schedule": "prefill", "kv_window": 16, "kv_sinks": 4, "evict_every": 32}
    assert [schedule_name(parse_spec(s)) for s in ("full", "ed", "decode_only", "h2o", "knorm", "tova@once")] \
        == ["none", "ed", "decode", "decode", "once", "once"]
    for bad, message in (("lru", "unknown kv_method 'lru'"), ("h2o@later", "unknown kv_schedule 'later'"),
                         ("h2o,sink=4", "bad setting 'sink=4'"), ("h2o,sinks=-1", "bad setting 'sinks=-1'")):
        with pytest.raises(ValueError, match=message):
            parse_spec(bad)


def test_a_method_spec_may_name_a_press_and_its_fields():
    assert parse_spec("LagKVPress@prefill,lag_size=8,every=32,cross_scoring=true") == {
        "kv_press": {"name": "LagKVPress", "args": {"lag_size": 8, "cross_scoring": True}}, "kv_schedule": "prefill",
        "evict_every": 32}
    assert schedule_name(parse_spec("KnormPress")) == "once"
    assert spec_argument("KeyDiffPress@decode") == "KeyDiffPress@decode"
    assert parse_spec("AdaKVPress,press=KnormPress,alpha_safeguard=0.5")["kv_press"] == {
        "name": "AdaKVPress", "args": {"press": "KnormPress", "alpha_safeguard": 0.5}}
    assert spec_argument("AdaKVPress,press=KnormPress") == "AdaKVPress,press=KnormPress"
    assert spec_argument("SnapKVPress@prefill,window_size=16") == "SnapKVPress@prefill,window_size=16"
    for bad, message in (("ExpectedAttentionPress", "reads the hidden states of every position"),
                         ("KnormPress,norm=2", "KnormPress args"),
                         ("MagicPress", "kv_press name must be one of")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            spec_argument(bad)


# --- documents ---------------------------------------------------------------------------

def test_documents_are_distinct_real_texts_of_exactly_n_tokens():
    docs = accuracy.load_documents(byte_encode, 4, 3000)
    assert [len(d.token_ids) for d in docs] == [3000] * 4
    assert len({tuple(d.token_ids) for d in docs}) == 4
    assert {d.kind for d in docs} == {"code", "prose"}
    for d in docs:
        assert len(set(d.token_ids)) > 40, d.name   # real text, not padding or one repeated line


def test_missing_or_short_sources_are_skipped():
    def missing():
        raise FileNotFoundError("not installed here")
    sources = [Source("gone", "prose", missing), Source("short", "code", lambda: "x = 1\n"),
               Source("long", "code", lambda: "y = 2\n" * 100)]
    docs = accuracy.load_documents(byte_encode, 1, 50, sources)
    assert [(d.name, d.token_ids) for d in docs] == [("long", byte_encode("y = 2\n" * 100)[:50])]
    with pytest.raises(RuntimeError, match="found 12 documents.*gone.*not installed.*short.*only 6 tokens"):
        accuracy.load_documents(byte_encode, 13, 50, sources)   # 600 bytes: 12 segments of 50


def test_more_documents_come_from_later_segments_of_every_source():
    sources = [Source("a", "code", lambda: "a" * 25), Source("b", "prose", lambda: "b" * 10 + "c" * 10)]
    docs = accuracy.load_documents(byte_encode, 4, 10, sources)
    assert [d.name for d in docs] == ["a", "b", "a (part 2)", "b (part 2)"]
    assert docs[3].token_ids == byte_encode("c" * 10)


# --- end to end --------------------------------------------------------------------------

def test_end_to_end_on_the_bundled_model(bundled_dir, tmp_path, capsys):
    out = tmp_path / "accuracy.json"
    report = accuracy.main(["--model", str(bundled_dir), "--docs", "1", "--doc-tokens", "200",
                            "--budgets", "128", "208", "--cont-prompt", "128", "--cont-tokens", "8",
                            "--methods", "batchmax", "ed", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert set(report) == {"settings", "environment", "summary", "verdict", "documents"}
    assert set(report["environment"]) >= {"date", "torch", "run_seconds"}
    rows = {(r["method"], r["budget"]): r for r in report["documents"][0]["results"]}
    assert set(rows) == {("full", None), ("batchmax", 128), ("batchmax", 208), ("ed", 128), ("ed", 208)}

    full, roomy = rows["full", None], rows["batchmax", 208]   # 208 >= 200 + 1: nothing is evicted
    assert full["agreement"] == 1.0 and full["greedy_match"] == 8
    assert roomy["perplexity"] == pytest.approx(full["perplexity"], rel=1e-5)   # read in other chunks
    assert roomy["agreement"] == 1.0
    assert roomy["greedy_match"] == roomy["common_prefix"] == 8
    assert rows["batchmax", 128]["perplexity"] != full["perplexity"]   # it did evict
    assert rows["ed", 128]["perplexity"] == full["perplexity"]         # evicts after the prompt only
    assert "perplexity" in capsys.readouterr().out                      # the table was printed


def test_quantized_caches_are_compared_with_the_unquantized_full_cache(tmp_path):
    make_tiny_model(tmp_path, "llama")
    report = accuracy.main(["--model", str(tmp_path), "--docs", "1", "--doc-tokens", "64", "--budgets", "32", "--evict-every", "16",
                            "--methods", "batchmax", "--cont-prompt", "32", "--cont-tokens", "2",
                            "--kv-cache-dtype", "int8", "--kv-cache-gb", "0.05", "--out", str(tmp_path / "acc.json")])
    rows = {(r["method"], r["kv_cache_dtype"]): r for r in report["summary"]}
    assert set(rows) == {(m, kv) for m in ("full", "batchmax") for kv in ("auto", "int8")}
    assert rows["full", "auto"]["ppl_ratio"] == 1.0
    assert rows["full", "int8"]["ppl_ratio"] != 1.0 and rows["full", "int8"]["agreement"] > 0.9
