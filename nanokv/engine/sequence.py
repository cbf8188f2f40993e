"""One request's state as the scheduler and runner see it."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from functools import reduce
from operator import or_
from typing import TYPE_CHECKING

import torch

from nanokv.engine.block_table import BlockTable
from nanokv.eviction import KVMethod
from nanokv.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanokv.engine.grammar import Grammar
    from nanokv.engine.head_pages import OwnPages


@dataclass
class TokenLogprob:
    """What the model predicted where it read a prompt token or sampled an output token,
    under the request's eviction: log_softmax of its logits (before temperature)."""
    token: int           # the token there
    logprob: float       # its log-probability
    top_token: int       # the most likely token
    top_logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)   # SamplingParams(logprobs=k): the k most
    #                                                                likely (token, logprob), most likely first


@dataclass
class Swap:
    """A preempted sequence's blocks between the pool and the host tier: host[i] holds what
    device[i] held (out) or will hold (in)."""
    seq: Sequence
    host: list[int]
    device: list[int]
    device_before: list[int] = field(default_factory=list)   # in: the blocks it left (its own page tables name them)


# What a sequence's steps need beyond a token decoded greedily, a bit each (Sequence.needs; STOPS: its
# text is read at every token, for stop strings): a step takes the union of its sequences' (step_needs)
# and makes no pass over them for what none needs.
RANDOM, SEEDED, PENALTIES, LOGIT_BIAS, GRAMMAR, LOGPROBS, PROMPT_LOGPROBS, KEPT_POSITIONS, SCORES, UNEVEN, STOPS = (
    1 << bit for bit in range(11))
EVERY_NEED = (1 << 11) - 1


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)   # one request's: equal to itself alone, and hashed as such
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    block_table: BlockTable = field(default_factory=BlockTable)   # its KV blocks, while it runs
    method: KVMethod = field(default_factory=KVMethod)
    max_slots: int = 0                 # the most tokens it will ever feed (prompt + max_tokens - 1)
    num_computed_tokens: int = 0       # tokens run through the model (their positions are taken)
    num_pending: int = 0               # sampled on the device, not read yet (0 or 1): the last of its tokens
    num_kv_slots: int = 0              # KV pairs it holds per head; below num_computed_tokens once it evicts
    plain_until: int = -1              # while num_tokens is at most this, a step is one token, no more (Scheduler)
    finish_reason: str | None = None   # "length", "stop", "abort" or "error"
    generator: torch.Generator | None = None  # the request's own, when it has a seed
    prompt_logprobs: list[TokenLogprob | None] | None = None    # when asked for (None at position 0)
    logprobs: list[TokenLogprob] | None = None                   # the output tokens', when asked for
    kept_positions: torch.Tensor | None = None                  # when asked for, at the end
    num_cached_tokens: int = 0         # prompt tokens taken from the prefix cache at its last admission
    prefix_serials: list[int] = field(default_factory=list)    # prefix-cache entries of its full blocks
    own_pages: OwnPages | None = None  # an uneven method's own page tables, after its first eviction
    inputs_aside: torch.Tensor | None = None   # its press's window of layer inputs, while swapped out (press_window.py)
    swapped: Swap | None = None        # preempted to the host tier: where its blocks are
    offloaded: list[int] = field(default_factory=list)   # decoding from the host: the host blocks of its first blocks
    num_kept_inputs: int = 0           # its first positions whose layer inputs the host tier keeps (KVPR)
    grammar: Grammar | None = None     # a structured output's matcher
    num_prompt_tokens: int = field(init=False)
    needs: int = field(init=False)     # its bits of RANDOM, SEEDED, ... (its parameters' and method's)

    def __post_init__(self):
        self.num_prompt_tokens = len(self.prompt_token_ids)
        p, method = self.params, self.method
        self.needs = (RANDOM * (p.temperature > 0) | SEEDED * (self.generator is not None) | PENALTIES * p.penalizes
                      | LOGIT_BIAS * bool(p.logit_bias) | GRAMMAR * (self.grammar is not None)
                      | LOGPROBS * (self.logprobs is not None) | PROMPT_LOGPROBS * (self.prompt_logprobs is not None)
                      | KEPT_POSITIONS * p.return_kept_positions | SCORES * method.needs_scores
                      | UNEVEN * method.uneven | STOPS * bool(p.stop))

    @property
    def token_ids(self) -> list[int]:
        """Its tokens known on the host (a pending one is not)."""
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, n: int) -> list[int]:
        """token_ids[start:start + n], without building token_ids."""
        prompt = self.num_prompt_tokens
        if start >= prompt:
            return self.output_token_ids[start - prompt:start - prompt + n]
        return self.prompt_token_ids[start:start + n] + self.output_token_ids[:max(start + n - prompt, 0)]

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids) + self.num_pending

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens to run through the model: the rest of the prompt, or the one just sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None   # set with status FINISHED (Scheduler.finish): cheaper to read


def step_needs(seqs: list[Sequence]) -> int:
    """The union of the sequences' needs."""
    return reduce(or_, [seq.needs for seq in seqs], 0)
