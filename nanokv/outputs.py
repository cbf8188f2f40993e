"""What the engine gives back: a request's output (RequestOutput) and a snapshot of what it
holds (EngineStats, LLM.stats())."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanokv.engine.sequence import TokenLogprob
from nanokv.engine.timing import Timings


@dataclass(slots=True)
class RequestOutput:
    """A request's output as of one step; `new_*` is what that step added. `token_ids` and
    `logprobs` are copied from the request's lists when read: a step hands out an output for
    every request it streams, and most callers read only what is new."""
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None   # "stop" (EOS, stop token or string), "length", "abort" or "error"
    num_tokens: int             # output tokens so far: len(token_ids)
    prompt_logprobs: list[TokenLogprob | None] | None = None    # with SamplingParams(prompt_logprobs=True)
    kept_positions: torch.Tensor | None = None   # [layers, kv_heads, n], with return_kept_positions, at the end
    #                                               (an uneven method's shorter heads padded with -1)
    error: str | None = None    # with finish_reason "error": what went wrong with this request
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, not computed
    # The request's own lists, which only grow: this output's are their first num_tokens entries.
    request_token_ids: list[int] = field(default_factory=list, repr=False)
    request_logprobs: list[TokenLogprob] | None = field(default=None, repr=False)

    @property
    def token_ids(self) -> list[int]:
        return self.request_token_ids[:self.num_tokens]

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """token_ids', with SamplingParams(logprobs=k)."""
        return None if self.request_logprobs is None else self.request_logprobs[:self.num_tokens]


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
