"""Rankings: which pairs of one (layer, KV head) are worth keeping.

A ranking turns what a sequence holds (HeldPairs, read from the cache at
eviction time) into a keep priority per pair: the lowest go first. It knows
nothing of when eviction happens (schedules.py) nor of the protected sinks
and recent pairs (method.py names them, the selections apply them: kernels/eviction_order.py).
Scores are summed over the query heads of a KV head's group by the attention
kernels (kernels/attention/key_scores.py, kernels/attention/decode.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class HeldPairs:
    """The pairs of S sequences that evict together, each [S, L, H, n] in slot order, which is
    not position order (evictions fill holes: kernels/hole_filling.py). Head (l, h) holds its
    first lens[..., l, h] slots; n of them when lens is None."""
    positions: torch.Tensor            # original positions (int32)
    scores: torch.Tensor               # attention probabilities accumulated (windowed: in the window), fp32
    current: torch.Tensor              # [S, 1, 1, 1]: position of each sequence's last query processed
    key_norms: Callable[[], torch.Tensor]   # -> [S, L, H, n] L2 norms of the keys: read only for a ranking that asks
    lens: torch.Tensor | None = None   # [S, L, H]: pairs per head, when heads hold different numbers
    num_evicted: int = 0               # pairs each head drops, when they all drop as many
    num_kept: list[int] | None = None  # uneven: pairs each sequence's heads keep on average
    keys_values: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None   # -> K, V [S, L, H, n, head_dim],
    #                                                                                dequantized: for a press
    press_args: Callable[[int, int], tuple] | None = None   # (S index, L index) -> what a press's score() is
    #                                       handed besides the pairs: (module, hidden_states, kwargs)


class Ranking:
    name = ""
    needs_scores = False           # attention must accumulate per-slot scores for it
    window: int | None = None      # scores count only the last `window` queries before an eviction
    skip = 0                       # a query adds nothing to the keys fewer than `skip` positions before it
    squares_scores = False         # scores add squared probabilities (KV-Compress's L2 metric)
    uneven = False                 # heads keep different numbers of pairs: whole pages go (KV-Compress)
    reads_keys = False             # keep_priority reads the keys (held.key_norms(), held.keys_values())
    reads_values = False           # and the values (held.keys_values())
    inputs = 0                     # the layer inputs of a sequence's last `inputs` positions (held.press_args())
    default_schedule = "prefill"
    default_sinks = 0

    def default_recent(self, budget: int) -> int:
        return 0

    @property
    def settings(self) -> tuple:
        """What besides its name tells this ranking's choices from another's."""
        return self.window, getattr(self, "pool", None)

    def keep_priority(self, held: HeldPairs) -> torch.Tensor:
        """[..., L, H, n]: each pair's worth, the lowest evicted first; unless a ranking says
        otherwise, the scores attention accumulated for it (as it asked: needs_scores, window...)."""
        return held.scores


class AverageAttention(Ranking):
    """Batch-Max, Section 3.2: the summed probabilities over the number of queries
    that could see the key (current + 1 - its position)."""
    name = "batchmax"
    needs_scores = True

    def keep_priority(self, held):
        return held.scores / (held.current + 1 - held.positions).float()


class AccumulatedAttention(Ranking):
    """H2O's heavy hitters: the probabilities summed over every query so far;
    half the budget goes to the most recent pairs."""
    name = "h2o"
    needs_scores = True
    default_schedule = "decode"

    def default_recent(self, budget):
        return budget // 2


class Recency(Ranking):
    """StreamingLLM: the attention sinks (the first 4 positions) and the most recent pairs."""
    name = "streamingllm"
    default_sinks = 4

    def keep_priority(self, held):
        return held.positions.float()


class KeyNorm(Ranking):
    """K-norm: the keys with the lowest L2 norm draw the most attention, so they stay."""
    name = "knorm"
    default_schedule = "once"
    reads_keys = True

    def keep_priority(self, held):
        return -held.key_norms()


class LastQuery(Ranking):
    """TOVA: the attention given by the most recent query alone (a window of one)."""
    name = "tova"
    needs_scores = True
    window = 1
    default_schedule = "decode"


class ObservationWindow(Ranking):
    """SnapKV: attention summed over the last `window` queries before the eviction,
    max-pooled over `pool` neighbouring slots so that a kept key keeps its neighbours.
    The window's own pairs are kept (make_method protects them)."""
    name = "snapkv"
    needs_scores = True
    default_schedule = "once"

    def __init__(self, window: int = 32, pool: int = 7):
        self.window, self.pool = window, pool

    def keep_priority(self, held):
        """Pooled over neighbouring positions: the scores in position order, pooled, put back."""
        order = held.positions.argsort(dim=-1)
        scores = held.scores.gather(-1, order)
        pooled = torch.nn.functional.max_pool1d(scores.reshape(-1, 1, scores.shape[-1]), self.pool, stride=1,
                                                padding=self.pool // 2)
        return torch.empty_like(scores).scatter_(-1, order, pooled.view_as(scores))


class SquaredAttention(Ranking):
    """KV-Compress (KVC-w): squared probabilities summed over the last `window` queries, and
    every (layer, head) keeps as many pairs as its scores earn: an eviction frees whole pages
    chosen across all heads and layers (pages.py). The window's own pairs are
    kept (make_method protects them). With score_all (KVC-full, eq. 19): summed over every
    query so far, never reset, except that a query adds nothing to the `window` keys nearest
    before it (local attention says little about later queries); those pairs are kept."""
    name = "kvcompress"
    needs_scores = True
    squares_scores = True
    uneven = True

    def __init__(self, window: int = 8, score_all: bool = False):
        self.window, self.skip = (None, window) if score_all else (window, 0)


RANKINGS = {r.name: r for r in (AverageAttention, AccumulatedAttention, LastQuery, ObservationWindow,
                                Recency, KeyNorm, SquaredAttention)}
