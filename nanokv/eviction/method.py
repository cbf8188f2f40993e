"""KVMethod: one request's eviction method, a schedule (when, how many) times a ranking
(which pairs), with the sinks and recent pairs every ranking protects."""
from __future__ import annotations

import functools

import torch

from kernels import Protected
from nanokv.eviction.rankings import Ranking
from nanokv.eviction.schedules import Progress, Schedule

NO_QUERY = 2**31 - 1   # score_from of a chunk none of whose queries counts


class KVMethod:
    """One request's method. With no arguments, the full cache: it never evicts."""

    def __init__(self, schedule: Schedule | None = None, ranking: Ranking | None = None,
                 sinks: int = 0, recent: int = 0, name: str = "full", together: bool = False):
        # The full cache never evicts, so it never writes into its blocks after filling them: it
        # may share them with other sequences through the prefix cache (others take a private copy).
        self.shares_blocks = ranking is None
        self.schedule, self.ranking = schedule or Schedule(), ranking or Ranking()
        self.sinks, self.recent, self.name = sinks, recent, name
        self.together = together   # evicts early with others of its cohort (EvictionSettings.evict_together)
        self.needs_scores, self.squares_scores = self.ranking.needs_scores, self.ranking.squares_scores
        self.score_skip, self.uneven = self.ranking.skip, self.ranking.uneven

    @property
    def rule(self) -> tuple:
        """What decides which pairs go: sequences with the same rule are ranked together."""
        return (self.name, self.sinks, self.recent, *self.ranking.settings)

    @functools.cached_property   # read at every step
    def cohort(self) -> tuple:
        """Sequences that evict alike, the same rule under the same schedule: one that evicts
        together joins the others' evictions."""
        return (*self.rule, self.schedule.name, self.schedule.budget, self.schedule.evict_every)

    @property
    def windowed(self) -> bool:
        """Its scores count a window of queries and restart after each eviction."""
        return self.ranking.window is not None

    def score_from(self, seq: Progress) -> int:
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

    def reusable_tokens(self, seq: Progress) -> int:
        """How many of a fresh seq's first tokens could come from the prefix cache with its
        results unchanged: all under the full cache; under eviction, only tokens read before
        the first eviction, and none whose query's attention would count (a query skipped
        adds no score): none for batchmax, h2o and KVC-full, whose scores count every query,
        for tova, snapkv and KVC-w only those before their window, and for a press only those
        before the positions whose layer inputs it reads."""
        if self.shares_blocks:
            return seq.num_tokens
        if self.needs_scores and not self.windowed:
            return 0
        end = self.schedule.next_eviction(seq)
        return seq.num_tokens if end is None else max(end - max(self.ranking.window or 0, self.ranking.inputs), 0)

    def floor_pages(self, block_size: int) -> int:
        """The fewest pages a head of an uneven method keeps: its protected pairs', at least one."""
        return max(-(-(self.sinks + self.recent) // block_size), 1)

    def protected(self, current: torch.Tensor) -> Protected:
        """The pairs its evictions never take, whatever the ranking's priority: the sinks (the
        first positions) and the `recent` most recent, the positions after current [S] - recent
        (every one of them is held: none was ever evicted)."""
        return Protected(self.sinks, self.recent, current)
