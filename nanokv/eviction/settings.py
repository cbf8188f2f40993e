"""The eviction settings, declared once: SamplingParams carries them for one request and
EngineConfig as the engine's defaults (both subclass EvictionSettings). Each setting is
checked on its own when either is built; a request's unset settings take the engine's,
and the combination is checked, in method_for, the one place a request's method is made."""
from __future__ import annotations

from dataclasses import dataclass

from nanokv.checks import check_bool, check_choice, check_int
from nanokv.eviction.method import KVMethod
from nanokv.eviction.press import PressRanking, check_press, press_by_name
from nanokv.eviction.rankings import RANKINGS, AverageAttention, ObservationWindow, Ranking, Recency, SquaredAttention
from nanokv.eviction.schedules import SCHEDULES, ExtremeDecoding

# decode_only: Batch-Max's ranking under the decode schedule, by its old name.
METHODS = ("full", *RANKINGS, "decode_only", "ed")
SCHEDULE_NAMES = tuple(SCHEDULES)
DEFAULT_BUDGET = 1024  # |kv| of a request that names a method but gives no kv_budget
DEFAULT_EVERY = 64     # p of a request that gives no evict_every


@dataclass(kw_only=True)
class EvictionSettings:
    """A request's KV-cache method; None takes the engine's setting, then the default named."""
    kv_method: str | None = None        # a ranking (METHODS): "full", "batchmax", "h2o", ...; None: full, or
                                        # with a kv_budget the recommended method (make_method)
    kv_schedule: str | None = None      # when it evicts: "prefill", "decode" or "once"; None: the ranking's own
    kv_budget: int | None = None        # |kv|: most KV pairs kept per KV head; None: DEFAULT_BUDGET
    evict_every: int | None = None      # p: pairs evicted at a time (prefill, decode schedules); None: DEFAULT_EVERY
    kv_sinks: int | None = None         # first positions never evicted; None: the ranking's default
    kv_recent: int | None = None        # most recent pairs never evicted; None: the ranking's default
    kv_window: int | None = None        # snapkv, kvcompress: queries in the observation window; None: 32, 8
    kv_pool: int | None = None          # snapkv: odd max-pooling kernel over neighbouring slots; None: 7
    kv_score_all: bool | None = None    # kvcompress: KVC-full, every query but the kv_window nearest; None: False
    kv_press: object | None = None      # a kvpress ScorerPress: the ranking, kv_method None (eviction/press.py);
                                        # or {"name": its class name, "args": {...}}, as JSON gives it
    evict_together: bool | None = None  # while decoding, evict early (down to |kv| - p) in a step where another
                                        # request of the same method evicts: fewer eviction steps, each a fixed
                                        # number of launches, but its evictions depend on the other requests.
                                        # None: False

    def check_eviction_settings(self) -> None:
        """Each setting on its own: a TypeError or ValueError naming the first bad one."""
        check_choice("kv_method", self.kv_method, METHODS, optional=True)
        check_choice("kv_schedule", self.kv_schedule, SCHEDULE_NAMES, optional=True)
        check_int("kv_budget", self.kv_budget, 1, optional=True)
        check_int("evict_every", self.evict_every, 1, optional=True)
        check_int("kv_sinks", self.kv_sinks, 0, optional=True)
        check_int("kv_recent", self.kv_recent, 0, optional=True)
        check_int("kv_window", self.kv_window, 1, optional=True)
        check_int("kv_pool", self.kv_pool, 1, optional=True)
        check_bool("kv_score_all", self.kv_score_all, optional=True)
        check_bool("evict_together", self.evict_together, optional=True)
        if isinstance(self.kv_press, dict):   # as JSON gives it
            self.kv_press = press_by_name(self.kv_press)
        if self.kv_press is not None:
            check_press(self.kv_press)


# The settings only some rankings take (any other refuses them), and those no full cache or ed takes.
OWNERS = {"kv_window": ("snapkv", "kvcompress"), "kv_pool": ("snapkv",), "kv_score_all": ("kvcompress",),
          "kv_press": ("press",)}
EVICTION_ONLY = ("kv_schedule", "kv_sinks", "kv_recent", "evict_together", *OWNERS)


def applies(setting: str, method: str) -> bool:
    """Whether `setting` means anything to the ranking `method` (full and ed take only a budget
    and p; decode_only has its schedule; a press is the ranking: it takes no kv_method)."""
    if setting == "kv_method":
        return method != "press"
    if method in ("full", "ed") and setting in EVICTION_ONLY:
        return False
    if setting == "kv_schedule":
        return method != "decode_only"
    return method in OWNERS.get(setting, (method,))


def method_for(request: EvictionSettings, engine: EvictionSettings, block_size: int, press_window: int = 0) -> KVMethod:
    """The request's method: each setting it leaves None takes the engine's, then the
    combination is checked (make_method). A request that names its own kv_method takes only
    the engine's settings that mean something to that method: a full-cache request on an
    engine whose default is h2o under the prefill schedule does not take the schedule. A request
    that gives a press names its method (press), and an engine's default press is its default method.
    press_window: the latest positions whose layer inputs the engine keeps for a press."""
    own = "press" if request.kv_press is not None else request.kv_method

    def setting(name: str):
        value = getattr(request, name)
        if value is not None:
            return value
        if own is not None and not applies(name, own):
            return None
        return getattr(engine, name)
    return make_method(setting("kv_method"), setting("kv_schedule"), setting("kv_budget"), setting("evict_every"),
                       block_size, sinks=setting("kv_sinks"), recent=setting("kv_recent"),
                       window=setting("kv_window"), pool=setting("kv_pool"), score_all=setting("kv_score_all"),
                       press=setting("kv_press"), press_window=press_window, together=setting("evict_together"))


def make_method(name: str | None, schedule: str | None, budget: int | None, evict_every: int | None,
                block_size: int, *, sinks: int | None = None, recent: int | None = None, window: int | None = None,
                pool: int | None = None, score_all: bool | None = None, press=None, press_window: int = 0,
                together: bool | None = None) -> KVMethod:
    """The method of settings each already checked on its own, or a ValueError naming what is
    wrong with their combination. No name: the full cache, or with a budget the recommended
    method (below). None for budget and evict_every: DEFAULT_BUDGET and DEFAULT_EVERY; for
    schedule, sinks, recent, window, pool or score_all: the ranking's default; together: False (full
    and ed ignore it: they join no one). A press (checked on its own) is the ranking: no name."""
    evict_every = DEFAULT_EVERY if evict_every is None else evict_every
    if press is not None:
        if name is not None:
            raise ValueError(f"kv_press is the request's ranking: kv_method must be None, got {name!r}")
        name = "press"
    if name is None and budget is not None:
        # Of all that evict while reading the prompt, the closest to the full cache in
        # docs/ACCURACY.md: average attention, 4 sinks and half of what stays after an
        # eviction kept for the most recent pairs.
        name, schedule = "batchmax", schedule or "prefill"
        sinks = 4 if sinks is None else sinks
        recent = max(budget - evict_every, 0) // 2 if recent is None else recent
    name = name or "full"
    budget = DEFAULT_BUDGET if budget is None else budget
    for field, value in (("kv_window", window), ("kv_pool", pool), ("kv_score_all", score_all), ("kv_press", press)):
        if value is not None and name not in OWNERS[field]:
            raise ValueError(f"{field} is a setting of {' and '.join(OWNERS[field])} only; it must be None for "
                             f"{name}, got {value!r}")
    if name in ("full", "ed"):
        fixed = "never evicts" if name == "full" else "has its own schedule (Algorithm 2)"
        for field, value in (("kv_schedule", schedule), ("kv_sinks", sinks), ("kv_recent", recent)):
            if value is not None:
                raise ValueError(f"kv_method {name} {fixed}: {field} must be None, got {value!r}")
    if name == "full":
        return KVMethod()
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
                   else PressRanking(press, press_window) if name == "press" else RANKINGS[name]())
        schedule = schedule or ranking.default_schedule
    if schedule == "once":
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
    if name in ("snapkv", "kvcompress"):   # the window's own pairs are kept (KVC-full: no query counted them yet)
        recent = max(recent, ranking.window or ranking.skip)
    if ranking.uneven:
        _check_uneven(schedule, budget, evict_every, block_size, sinks + recent)
    if sinks + recent > room:
        raise ValueError(f"kv_sinks + kv_recent = {sinks} + {recent} leaves {name} nothing to evict under the "
                         f"{schedule} schedule: it must be {limit}")
    return KVMethod(SCHEDULES[schedule](budget, evict_every), ranking, sinks, recent, name, together=bool(together))


def _windowed(name: str, budget: int, window: int | None, pool: int | None, score_all: bool | None) -> Ranking:
    """SnapKV's or KV-Compress's ranking with its observation window (and SnapKV's pooling;
    KV-Compress's window is the keys each query skips under score_all, KVC-full)."""
    window = (32 if name == "snapkv" else 8) if window is None else window
    if window > budget:
        raise ValueError(f"kv_window must be an integer in [1, kv_budget = {budget}], got {window!r}")
    if name == "kvcompress":
        return SquaredAttention(window, bool(score_all))
    pool = 7 if pool is None else pool
    if pool % 2 == 0:
        raise ValueError(f"kv_pool must be an odd integer >= 1 (a centred kernel), got {pool!r}")
    return ObservationWindow(window, pool)


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
