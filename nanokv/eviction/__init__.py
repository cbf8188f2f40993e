"""KV-cache eviction policy: a method (method.py) is a schedule (schedules.py: when, how many)
times a ranking (rankings.py: which pairs), with sinks and recent pairs protected; an uneven
ranking gives up whole pages across heads (pages.py); the settings are declared and checked
in settings.py. Policy only: nothing here imports the engine, and kernels never know which
method runs."""
from nanokv.eviction.method import KVMethod
from nanokv.eviction.rankings import RANKINGS, AverageAttention, HeldPairs
from nanokv.eviction.schedules import SCHEDULES
from nanokv.eviction.settings import METHODS, SCHEDULE_NAMES, EvictionSettings, make_method, method_for

__all__ = ["METHODS", "RANKINGS", "SCHEDULES", "SCHEDULE_NAMES", "AverageAttention", "EvictionSettings", "HeldPairs",
           "KVMethod", "make_method", "method_for"]
