"""The attention metadata of one step: built once by the engine's runner, read by every layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import DecodeWorkspace
from models.host_stream import HostStream


@dataclass
class AttentionMetadata:
    """Where each new token goes in the paged cache, and what each sequence attends to.

    The batch is flat: sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1].
    Sequences that decode (one query each) come first, so that their rows go to
    flash-decoding together and the prompt chunks after them to the prefill kernel.
    Every (layer, KV head) of a sequence has its own pages and length (models/kv_cache.py):
    layer i reads slot_mapping[i], context_lens[i] and page_tables[i].
    """
    slot_mapping: torch.Tensor   # [L, T, Hkv] int64: cache slot of each new token's pair (-1: padding)
    cu_seqlens_q: torch.Tensor   # [B+1] int32: query row offsets
    context_lens: torch.Tensor   # [L, B, Hkv] int32: slots each head attends to, this step's included
    page_tables: torch.Tensor    # [L, B, Hkv, max_pages] int32: each head's pages, padded with 0
    max_query_len: int           # longest query chunk (1: a pure decode step)
    max_context_len: int         # an upper bound of context_lens (decode graphs: max_model_len)
    num_decodes: int = 0         # the first num_decodes sequences have one query each
    accumulate_scores: bool = False  # add each key's attention probabilities to its slot's score
    score_from: torch.Tensor | None = None  # [B] int32: only queries from this index of a chunk add (None: all)
    square_scores: torch.Tensor | None = None  # [B] bool: the sequence adds squared probabilities (None: none does)
    score_skip: torch.Tensor | None = None  # [B] int32: queries add nothing to keys fewer positions before (KVC-full)
    decode_workspace: DecodeWorkspace | None = None  # flash-decoding's scratch, allocated once (None: per call)
    host_stream: HostStream | None = None  # K/V from the host tier and layer inputs kept there (None: no traffic)
    rope_rows: torch.Tensor | None = None  # [T] each token's RoPE table row (None: its position; long_rope_rows)
    kept_inputs: KeptInputs | None = None  # layer inputs of rows a press reads later (None: none kept)


@dataclass
class KeptInputs:
    """Each layer's attention inputs (after the input norm) of the step's rows `rows`, kept at
    store[layer, places]: the hidden states a press reads (nanokv/engine/press_window.py)."""
    store: torch.Tensor    # [L, places, hidden]
    rows: torch.Tensor     # [K] int64
    places: torch.Tensor   # [K] int64

    def keep(self, layer: int, x: torch.Tensor) -> None:
        self.store[layer].index_copy_(0, self.places, x[self.rows])
