"""A method written on one line, as the benchmarks and the accuracy harness take it:
RANKING[@SCHEDULE][,KEY=INT...]."""
from __future__ import annotations

import argparse

from nanokv.eviction import METHODS, RANKINGS, SCHEDULES

SPEC_KEYS = {"sinks": "kv_sinks", "recent": "kv_recent", "window": "kv_window", "pool": "kv_pool",
             "every": "evict_every", "all": "kv_score_all"}


def parse_spec(spec: str) -> dict:
    """SamplingParams fields from a method written on one line, as the benchmarks take it:
    RANKING[@SCHEDULE][,KEY=INT...] with KEY one of sinks, recent, window, pool, every (p), all
    (kv_score_all: 0 or 1); e.g. "snapkv@prefill,window=16,sinks=4", "kvcompress,all=1".
    Settings not written take the defaults."""
    name, *pairs = spec.split(",")
    ranking, _, schedule = name.partition("@")
    if ranking not in METHODS:
        raise ValueError(f"unknown kv_method {ranking!r} in {spec!r}; use one of {', '.join(METHODS)}")
    fields = {"kv_method": ranking}
    if schedule:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown kv_schedule {schedule!r} in {spec!r}; use one of {', '.join(SCHEDULES)}")
        fields["kv_schedule"] = schedule
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in SPEC_KEYS or not value.isdigit() or (key == "all" and value not in ("0", "1")):
            raise ValueError(f"bad setting {pair!r} in {spec!r}: write KEY=INTEGER with KEY one of "
                             f"{', '.join(SPEC_KEYS)} (all: 0 or 1)")
        fields[SPEC_KEYS[key]] = value == "1" if key == "all" else int(value)
    return fields


def spec_argument(spec: str) -> str:
    """argparse's type= for a method spec: the spec, checked, or the reason it is wrong."""
    try:
        parse_spec(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def schedule_name(fields: dict) -> str:
    """The schedule a method (parse_spec's fields) runs under: "none" for full, "ed" for ed."""
    name = fields["kv_method"]
    if name in ("full", "ed"):
        return "none" if name == "full" else "ed"
    if name == "decode_only":
        return "decode"
    return fields.get("kv_schedule") or RANKINGS[name].default_schedule
