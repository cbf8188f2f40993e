"""KV-cache eviction methods: a schedule times a ranking.

The scheduler asks the method's schedule (nanokv/eviction/schedules.py) how
many pairs to drop before a sequence's next chunk and how long that chunk may
be; the runner asks its ranking (nanokv/eviction/rankings.py) which pairs each
(layer, KV head) keeps, then compacts the survivors (kernels/compact.py).
Kernels never know which method runs. Common to every ranking: the first
`sinks` positions and the `recent` most recent pairs are never evicted. An
uneven ranking (kvcompress) lets heads keep different numbers of pairs: the
runner takes whole pages chosen across all heads and layers (pages.py).
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import torch

from nanokv.eviction.rankings import (RANKINGS, AverageAttention, HeldPairs, ObservationWindow, Ranking, Recency,
                                      SquaredAttention)
from nanokv.eviction.schedules import SCHEDULES, ExtremeDecoding, Schedule

if TYPE_CHECKING:
    from nanokv.sequence import Sequence

# decode_only: Batch-Max's ranking under the decode schedule, by its old name.
METHODS = ("full", *RANKINGS, "decode_only", "ed")
SCHEDULE_NAMES = tuple(SCHEDULES)
NO_QUERY = 2**31 - 1   # score_from of a chunk none of whose queries counts
DEFAULT_BUDGET = 1024  # |kv| of a request that names a method but gives no kv_budget


class KVMethod:
    """One request's method. With no arguments, the full cache: it never evicts."""

    def __init__(self, schedule: Schedule | None = None, ranking: Ranking | None = None,
                 sinks: int = 0, recent: int = 0, name: str = "full"):
        self.schedule, self.ranking = schedule or Schedule(), ranking
        self.sinks, self.recent, self.name = sinks, recent, name
        self.needs_scores = ranking is not None and ranking.needs_scores
        self.squares_scores = ranking is not None and ranking.squares_scores
        self.score_skip = 0 if ranking is None else ranking.skip
        self.uneven = ranking is not None and ranking.uneven
        # It never evicts, so it never writes into its blocks after filling them: it may share
        # them with other sequences through the prefix cache (others take a private copy).
        self.shares_blocks = ranking is None
        self.evicts_eagerly = self.schedule.evicts_eagerly

    def evict_count(self, seq: Sequence) -> int:
        return self.schedule.evict_count(seq)

    def max_chunk(self, seq: Sequence, slots: int) -> int:
        return self.schedule.max_chunk(seq, slots)

    def reserve_slots(self, seq: Sequence) -> int:
        return self.schedule.reserve_slots(seq)

    def steady_slots(self, seq: Sequence) -> int:
        return self.schedule.steady_slots(seq)

    @property
    def rule(self) -> tuple:
        """What decides which pairs go: sequences with the same rule are ranked together."""
        return (self.name, self.sinks, self.recent, getattr(self.ranking, "window", None),
                getattr(self.ranking, "pool", None))

    @property
    def windowed(self) -> bool:
        """Its scores count a window of queries and restart after each eviction."""
        return self.ranking is not None and self.ranking.window is not None

    def score_from(self, seq: Sequence) -> int:
        """The first query of seq's next chunk (an index into it) whose attention counts:
        a windowed ranking counts the last `window` queries before the next eviction; a
        sequence whose method reads no scores adds none (a block it shares stays unwritten)."""
        if not self.needs_scores:
            return NO_QUERY
        if not self.windowed:
            return 0
        end = self.schedule.next_eviction(seq)
        if end is None:
            return NO_QUERY
        return max(end - self.ranking.window - seq.num_computed_tokens, 0)

    def reusable_tokens(self, seq: Sequence) -> int:
        """How many of a fresh seq's first tokens could come from the prefix cache with its
        results unchanged: all under the full cache; under eviction, only tokens read before
        the first eviction, and none whose query's attention would count (a query skipped
        adds no score): none for batchmax, h2o and KVC-full, whose scores count every query,
        and for tova, snapkv and KVC-w only those before their window."""
        if self.shares_blocks:
            return seq.num_tokens
        if self.needs_scores and not self.windowed:
            return 0
        end = self.schedule.next_eviction(seq)
        return seq.num_tokens if end is None else max(end - (self.ranking.window or 0), 0)

    def floor_pages(self, block_size: int) -> int:
        """The fewest pages a head of an uneven method keeps: its protected pairs', at least one."""
        return max(-(-(self.sinks + self.recent) // block_size), 1)

    def keep_priority(self, held: HeldPairs) -> torch.Tensor:
        """[..., L, H, n] priorities, the lowest evicted first; protected pairs get +inf."""
        if self.ranking is None:
            raise NotImplementedError(f"{self.name} never evicts")
        priority = self.ranking.keep_priority(held)   # not cast: float64 key norms keep their precision
        n = held.positions.shape[-1]
        lens = n if held.lens is None else held.lens[..., None]
        slot = torch.arange(n, device=priority.device)
        protected = (held.positions < self.sinks) | ((slot >= lens - self.recent) & (slot < lens))
        return priority.masked_fill(protected, float("inf"))


def _windowed(name: str, budget: int, window: int | None, pool: int | None, score_all: bool | None) -> Ranking:
    """SnapKV's or KV-Compress's ranking with its observation window (and SnapKV's pooling;
    KV-Compress's window is the keys each query skips under score_all, KVC-full)."""
    window = (32 if name == "snapkv" else 8) if window is None else window
    if not isinstance(window, int) or isinstance(window, bool) or not 1 <= window <= budget:
        raise ValueError(f"kv_window must be an integer in [1, kv_budget = {budget}], got {window!r}")
    if name == "kvcompress":
        return SquaredAttention(window, bool(score_all))
    pool = 7 if pool is None else pool
    if not isinstance(pool, int) or isinstance(pool, bool) or pool < 1 or pool % 2 == 0:
        raise ValueError(f"kv_pool must be an odd integer >= 1 (a centred kernel), got {pool!r}")
    return ObservationWindow(window, pool)


def make_method(name: str | None, schedule: str | None, budget: int | None, evict_every: int, block_size: int, *,
                sinks: int | None = None, recent: int | None = None, window: int | None = None,
                pool: int | None = None, score_all: bool | None = None) -> KVMethod:
    """The method for a request, or a ValueError naming what is wrong with its settings.
    No name: the full cache, or with a budget the recommended method (below). No budget:
    DEFAULT_BUDGET. None for schedule, sinks, recent, window, pool or score_all takes the ranking's default."""
    if name is None and budget is not None:
        # Of all that evict while reading the prompt, the closest to the full cache in
        # docs/ACCURACY.md: average attention, 4 sinks and half of what stays after an
        # eviction kept for the most recent pairs.
        name, schedule = "batchmax", schedule or "prefill"
        sinks = 4 if sinks is None else sinks
        if recent is None and isinstance(evict_every, int) and isinstance(budget, int):
            recent = max(budget - evict_every, 0) // 2
    name = name or "full"
    budget = DEFAULT_BUDGET if budget is None else budget
    if name not in METHODS:
        raise ValueError(f"unknown kv_method {name!r}; use one of {', '.join(METHODS)}")
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"unknown kv_schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    for field, value, owners in (("kv_window", window, ("snapkv", "kvcompress")), ("kv_pool", pool, ("snapkv",)),
                                 ("kv_score_all", score_all, ("kvcompress",))):
        if value is not None and name not in owners:
            raise ValueError(f"{field} is a setting of {' and '.join(owners)} only; it must be None for {name}, "
                             f"got {value!r}")
    if name in ("full", "ed"):
        fixed = "never evicts" if name == "full" else "has its own schedule (Algorithm 2)"
        for field, value in (("kv_schedule", schedule), ("kv_sinks", sinks), ("kv_recent", recent)):
            if value is not None:
                raise ValueError(f"kv_method {name} {fixed}: {field} must be None, got {value!r}")
    if name == "full":
        return KVMethod()
    if not isinstance(budget, int) or not isinstance(evict_every, int) or evict_every < 1:
        raise ValueError(f"kv_budget and evict_every must be integers (evict_every >= 1), "
                     f"got {budget!r} and {evict_every!r}")
    if name == "ed":
        if budget < 2:
            raise ValueError(f"kv_budget for ed must be >= 2, got {budget}")
        return KVMethod(ExtremeDecoding(budget, evict_every), Recency(), name="ed")
    if name == "decode_only":
        if schedule not in (None, "decode"):
            raise ValueError(f"kv_method decode_only is batchmax under the decode schedule: kv_schedule must be "
                         f"None or 'decode', got {schedule!r}")
        ranking, schedule = AverageAttention(), "decode"
    else:
        ranking = (_windowed(name, budget, window, pool, score_all) if name in ("snapkv", "kvcompress")
                   else RANKINGS[name]())
        schedule = schedule or ranking.default_schedule
    if schedule == "once":
        if budget < 1:
            raise ValueError(f"kv_budget for {name} must be >= 1, got {budget}")
        room = budget - 1
        limit = f"less than kv_budget = {budget}"
    else:   # evicts p pairs at a time from |kv| pairs
        if budget < 2 * evict_every or budget % block_size:
            raise ValueError(f"kv_budget for {name} must be at least 2 * evict_every = {2 * evict_every} and a "
                         f"multiple of the block size {block_size}, got {budget}")
        room = budget - evict_every
        limit = f"at most kv_budget - evict_every = {room}"
    sinks = ranking.default_sinks if sinks is None else sinks
    recent = ranking.default_recent(budget) if recent is None else recent
    for field, value in (("kv_sinks", sinks), ("kv_recent", recent)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{field} must be an integer >= 0, got {value!r}")
    if name in ("snapkv", "kvcompress"):   # the window's own pairs are kept (KVC-full: no query counted them yet)
        recent = max(recent, ranking.window or ranking.skip)
    if ranking.uneven:
        _check_uneven(schedule, budget, evict_every, block_size, sinks + recent)
    if sinks + recent > room:
        raise ValueError(f"kv_sinks + kv_recent = {sinks} + {recent} leaves {name} nothing to evict under the "
                     f"{schedule} schedule: it must be {limit}")
    return KVMethod(SCHEDULES[schedule](budget, evict_every), ranking, sinks, recent, name)


def _check_uneven(schedule: str, budget: int, evict_every: int, block_size: int, protected: int) -> None:
    """KV-Compress evicts whole pages: each eviction leaves a whole number of pages per head on
    average, and each head keeps its protected pairs' pages (at least one)."""
    if budget % block_size or (schedule != "once" and evict_every % block_size):
        raise ValueError(f"kv_budget{'' if schedule == 'once' else ' and evict_every'} for kvcompress must be "
                         f"multiples of the block size {block_size} (it evicts whole pages), got {budget} "
                         f"and {evict_every}")
    after = budget if schedule == "once" else budget - evict_every
    floor = max(-(-protected // block_size), 1) * block_size
    if floor > after:
        raise ValueError(f"kv_sinks + kv_recent = {protected} fill {floor} slots of whole pages per head, more than "
                         f"kvcompress keeps after an eviction ({after})")


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
