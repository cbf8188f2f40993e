"""Sampling parameters of one request, and the batched sampler."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanokv.checks import (SEED_RANGE, check_bool, check_choice, check_float, check_int,
                           check_token_ids)
from nanokv.eviction import METHODS, SCHEDULE_NAMES

FAILED = -1   # the token of a row that could not be sampled (its error is in Sampler.errors)


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0        # 0 = greedy
    top_p: float = 1.0              # nucleus: keep the smallest set of tokens with this much mass
    top_k: int = 0                  # keep the k most likely tokens; 0 = all
    seed: int | None = None         # a request's own random stream, independent of its batch
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings, not included in the text
    # KV-cache eviction (nanokv/eviction/); None takes the engine's default.
    kv_method: str | None = None        # a ranking (METHODS): "full", "batchmax", "h2o", ...
    kv_schedule: str | None = None      # when it evicts: "prefill", "decode" or "once" (None: the ranking's)
    kv_budget: int | None = None        # |kv|: most KV pairs kept per KV head
    evict_every: int | None = None      # p: pairs evicted at a time (prefill, decode schedules)
    kv_sinks: int | None = None         # first positions never evicted (None: the ranking's default)
    kv_recent: int | None = None        # most recent pairs never evicted (None: the ranking's default)
    kv_window: int | None = None        # snapkv, kvcompress: queries in the observation window (None: 32, 8)
    kv_pool: int | None = None          # snapkv: odd max-pooling kernel over neighbouring slots (None: 7)
    kv_score_all: bool | None = None    # kvcompress: KVC-full, every query but the kv_window nearest (None: False)
    return_kept_positions: bool = False  # output: positions each (layer, KV head) kept at the end
    prompt_logprobs: bool = False       # output: log-probability of every prompt token

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raise a TypeError or ValueError naming the first bad field. Run at construction
        and again when a request is queued (the fields may have been changed since)."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        check_int("max_tokens", self.max_tokens, 1)
        check_float("temperature", self.temperature, 0)
        check_float("top_p", self.top_p, 0, 1, low_open=True)
        check_int("top_k", self.top_k, 0)
        check_int("seed", self.seed, *SEED_RANGE, optional=True)
        check_bool("ignore_eos", self.ignore_eos)
        check_token_ids("stop_token_ids", self.stop_token_ids)
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not all(self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")
        check_choice("kv_method", self.kv_method, METHODS, optional=True)
        check_choice("kv_schedule", self.kv_schedule, SCHEDULE_NAMES, optional=True)
        check_int("kv_budget", self.kv_budget, 1, optional=True)
        check_int("evict_every", self.evict_every, 1, optional=True)
        check_int("kv_sinks", self.kv_sinks, 0, optional=True)
        check_int("kv_recent", self.kv_recent, 0, optional=True)
        check_int("kv_window", self.kv_window, 1, optional=True)
        check_int("kv_pool", self.kv_pool, 1, optional=True)
        check_bool("kv_score_all", self.kv_score_all, optional=True)
        check_bool("return_kept_positions", self.return_kept_positions)
        check_bool("prompt_logprobs", self.prompt_logprobs)


class Sampler:
    """Picks one token per row of logits, every row with its own parameters.

    All rows go through the same tensor ops. Random rows use the exponential
    race (argmax of p / E with E ~ Exp(1) draws from p); rows with a seed draw
    their E from their own generator, so their tokens do not depend on what
    else is in the batch.

    A failure cannot be pinned on a row of the batched pass, so after one every
    row is sampled again on its own: a row that fails alone gets the token
    FAILED and its error in `errors`; greedy and seeded rows get the token the
    batched pass would have given them (seeded streams are rewound first).
    """

    def __init__(self, device: torch.device, seed: int):
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.errors: dict[int, Exception] = {}   # row -> why it got FAILED, in row order

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
        self.errors = {}
        states = {}   # row -> its seeded stream before this call
        try:
            for row, gen in enumerate(generators):
                if gen is not None:
                    states[row] = gen.get_state()
            return self._sample(logits, params, generators)
        except Exception:
            return self._sample_rows_alone(logits, params, generators, states)

    def _sample_rows_alone(self, logits: torch.Tensor, params: list[SamplingParams],
                           generators: list[torch.Generator | None], states: dict) -> torch.Tensor:
        tokens = []
        for row, (p, gen) in enumerate(zip(params, generators)):
            try:
                if row in states:   # rows without a state had drawn nothing yet
                    gen.set_state(states[row])
                tokens.append(int(self._sample(logits[row:row + 1], [p], [gen])[0]))
            except Exception as error:
                self.errors[row] = error
                tokens.append(FAILED)
        return torch.tensor(tokens, device=logits.device)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        if all(p.temperature == 0 for p in params):
            return greedy
        device = logits.device
        temperature = torch.tensor([p.temperature or 1.0 for p in params], device=device)
        probs = (logits / temperature[:, None]).softmax(dim=-1)
        if any(p.top_k or p.top_p < 1 for p in params):
            probs = self._truncate(probs, params)
        races = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in enumerate(generators):
            if gen is not None:
                races[row].exponential_(generator=gen)
        sampled = (probs / races).argmax(dim=-1)
        is_greedy = torch.tensor([p.temperature == 0 for p in params], device=device)
        return torch.where(is_greedy, greedy, sampled)

    @staticmethod
    def _truncate(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Zero every token outside each row's top-k and top-p set (the top token always stays)."""
        device, vocab = probs.device, probs.shape[-1]
        top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (rank[None] >= top_k[:, None]) | (mass_before >= top_p[:, None])
        return probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
