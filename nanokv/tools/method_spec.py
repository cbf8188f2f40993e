"""A method written on one line, as the benchmarks and the accuracy harness take it:
RANKING[@SCHEDULE][,KEY=INT...], where RANKING may be a kvpress ScorerPress by its class name."""
from __future__ import annotations

import argparse
import json

from nanokv.eviction import METHODS, RANKINGS, SCHEDULES, EvictionSettings

SPEC_KEYS = {"sinks": "kv_sinks", "recent": "kv_recent", "window": "kv_window", "pool": "kv_pool",
             "every": "evict_every", "all": "kv_score_all", "together": "evict_together"}
FLAGS = ("all", "together")   # 0 or 1


def parse_spec(spec: str) -> dict:
    """SamplingParams fields from a method written on one line, as the benchmarks take it:
    RANKING[@SCHEDULE][,KEY=INT...] with KEY one of sinks, recent, window, pool, every (p), all
    (kv_score_all: 0 or 1), together (evict_together: 0 or 1); e.g. "snapkv@prefill,window=16,sinks=4",
    "kvcompress,all=1".
    Settings not written take the defaults. A RANKING ending in "Press" is a kvpress ScorerPress
    (kv_press), the other KEYs its fields, each VALUE as JSON or else text: "LagKVPress@prefill,lag_size=8"."""
    name, *pairs = spec.split(",")
    ranking, _, schedule = name.partition("@")
    press = ranking.endswith("Press")
    if not press and ranking not in METHODS:
        raise ValueError(f"unknown kv_method {ranking!r} in {spec!r}; use one of {', '.join(METHODS)}, "
                         f"or a kvpress ScorerPress's name")
    fields = {"kv_press": {"name": ranking, "args": {}}} if press else {"kv_method": ranking}
    if schedule:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown kv_schedule {schedule!r} in {spec!r}; use one of {', '.join(SCHEDULES)}")
        fields["kv_schedule"] = schedule
    for pair in pairs:
        key, _, value = pair.partition("=")
        if press and key not in SPEC_KEYS and key.isidentifier() and value:
            fields["kv_press"]["args"][key] = _json_or_text(value)
            continue
        if key not in SPEC_KEYS or not value.isdigit() or (key in FLAGS and value not in ("0", "1")):
            raise ValueError(f"bad setting {pair!r} in {spec!r}: write KEY=INTEGER with KEY one of "
                             f"{', '.join(SPEC_KEYS)} ({' and '.join(FLAGS)}: 0 or 1)")
        fields[SPEC_KEYS[key]] = value == "1" if key in FLAGS else int(value)
    return fields


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def spec_argument(spec: str) -> str:
    """argparse's type= for a method spec: the spec, checked, or the reason it is wrong."""
    try:
        EvictionSettings(**parse_spec(spec)).check_eviction_settings()   # a press: made and checked
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def schedule_name(fields: dict) -> str:
    """The schedule a method (parse_spec's fields) runs under: "none" for full, "ed" for ed; a
    press's default is kvpress's (once)."""
    if "kv_press" in fields:
        return fields.get("kv_schedule") or "once"
    name = fields["kv_method"]
    if name in ("full", "ed"):
        return "none" if name == "full" else "ed"
    if name == "decode_only":
        return "decode"
    return fields.get("kv_schedule") or RANKINGS[name].default_schedule
