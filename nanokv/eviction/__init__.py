"""KV-cache eviction policy: a method is a schedule times a ranking.

The scheduler asks a method's schedule (schedules.py) how many pairs to drop
before a sequence's next chunk and how long that chunk may be; the eviction
surgery (nanokv/engine/evict.py) asks its ranking (rankings.py) which pairs each
(layer, KV head) keeps. Common to every ranking: the first `sinks` positions and
the `recent` most recent pairs are never evicted (method.py). An uneven ranking
(kvcompress) lets heads keep different numbers of pairs: whole pages go, chosen
across all heads and layers (pages.py). The settings are declared and checked
in settings.py. Policy only: nothing here imports the engine, and kernels never
know which method runs.
"""
from nanokv.eviction.method import NO_QUERY, KVMethod
from nanokv.eviction.rankings import RANKINGS, AverageAttention, HeldPairs, Ranking
from nanokv.eviction.schedules import SCHEDULES, Progress, Schedule
from nanokv.eviction.settings import (DEFAULT_BUDGET, DEFAULT_EVERY, EVICTION_FIELDS, METHODS, SCHEDULE_NAMES,
                                      EvictionSettings, make_method, method_for)
from nanokv.eviction.spec import parse_spec, schedule_name, spec_argument

__all__ = ["DEFAULT_BUDGET", "DEFAULT_EVERY", "EVICTION_FIELDS", "METHODS", "NO_QUERY", "RANKINGS", "SCHEDULES",
           "SCHEDULE_NAMES", "AverageAttention", "EvictionSettings", "HeldPairs", "KVMethod", "Progress", "Ranking",
           "Schedule", "make_method", "method_for", "parse_spec", "schedule_name", "spec_argument"]
