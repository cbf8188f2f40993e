"""What the engine gives back: a request's output (RequestOutput, read from the request as the
engine keeps it: Request) and a snapshot of what it holds (EngineStats, LLM.stats())."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanokv.engine.sequence import Sequence, TokenLogprob
from nanokv.engine.timing import Timings
from nanokv.tokenizer import IncrementalDetokenizer


@dataclass(eq=False)
class Request:
    """A request as the engine keeps it while it runs: its sequence, and its text so far."""
    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None   # None without a tokenizer: token ids only
    text: str = ""      # output text, cut at a stop string (it only grows until then)
    streamed: int = 0   # characters of `text` already handed out
    tokens_only: bool = field(init=False)   # no text to decode nor stop strings: a step's news is its token

    def __post_init__(self):
        self.tokens_only = self.detokenizer is None and not self.seq.params.stop


@dataclass(slots=True, repr=False)
class RequestOutput:
    """A request's output as of one step; `new_*` is what that step added. The rest is read from
    the request itself when asked for: its text (up to text_len), tokens and logprobs (its first
    num_tokens) as of this output, for they only grow; its prompt, which never changes; its kept
    positions (set when it ends) and cached tokens (at its last admission) as they are. A step
    hands out one for every request it streams, and most callers read only what is new."""
    request: Request
    text_len: int
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None   # "stop" (EOS, stop token or string), "length", "abort" or "error"
    num_tokens: int             # output tokens so far: len(token_ids)
    error: str | None = None    # with finish_reason "error": what went wrong with this request

    @property
    def request_id(self) -> int:
        return self.request.seq.seq_id

    @property
    def prompt(self) -> str | None:
        return self.request.prompt

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.seq.prompt_token_ids

    @property
    def text(self) -> str:
        return self.request.text[:self.text_len]

    @property
    def token_ids(self) -> list[int]:
        return self.request.seq.output_token_ids[:self.num_tokens]

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """token_ids', with SamplingParams(logprobs=k)."""
        logprobs = self.request.seq.logprobs
        return None if logprobs is None else logprobs[:self.num_tokens]

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """With SamplingParams(prompt_logprobs=True)."""
        return self.request.seq.prompt_logprobs

    @property
    def kept_positions(self) -> torch.Tensor | None:
        """[layers, kv_heads, n], with return_kept_positions, at the end (an uneven method's
        shorter heads padded with -1)."""
        return self.request.seq.kept_positions

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, not computed."""
        return self.request.seq.num_cached_tokens

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id}, text={self.text!r}, new_text={self.new_text!r}, "
                f"num_tokens={self.num_tokens}, finished={self.finished}, finish_reason={self.finish_reason!r}"
                + (f", error={self.error!r})" if self.error else ")"))


@dataclass
class EngineStats:
    """What the engine holds now (LLM.stats)."""
    running: int             # sequences admitted, holding blocks
    waiting: int             # queued, or preempted (waiting to be recomputed, or swapped out)
    kv_slots: int            # KV pairs per head the running sequences hold, summed
    free_blocks: int         # KV blocks free (or cached and reclaimable)
    total_blocks: int
    block_size: int
    block_bytes: int         # what one block takes in memory (K, V and every slot's metadata)
    preemptions: int         # since the engine started
    timings: Timings | None  # phase times, inside LLM.timing()
    swaps: int = 0           # preemptions that swapped to the host tier (the others recomputed)
    host_blocks_used: int = 0   # the host tier (kv_offload_gb): blocks holding swapped sequences
    host_cached_blocks: int = 0  # and cached blocks spilled from the device (reclaimable: free)
    host_blocks: int = 0
    host_block_bytes: int = 0
    blocks_saved: int = 0    # since the engine started: copied to the host tier (swapped out, cached blocks spilled)
    blocks_loaded: int = 0   # and from it (swapped back in, cached blocks found there)
    host_hits: int = 0       # cached blocks found in the host tier
    offloaded_blocks: int = 0    # decode_from_host: host blocks the running sequences decode from now,
    blocks_offloaded: int = 0    # and since the engine started: blocks they moved there,
    blocks_streamed: int = 0     # blocks copied back for a step's layers (each step counts its own),
    positions_recomputed: int = 0  # positions whose K/V a step recomputed instead
    # Counted on the device, these two reach the host behind the steps: exact once the steps that
    # evicted are done (their tokens read).
    pairs_evicted: int = 0   # since the engine started: KV pairs eviction dropped, per KV head summed
    pairs_moved: int = 0     # and pairs it wrote to keep each head's dense (rank 0's heads when split),
    eviction_pieces: int = 0   # and the pieces it took them in (nanokv/engine/evict.py), each the same launches
