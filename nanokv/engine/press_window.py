"""The layer inputs a press reads (hidden_states in kvpress's score(): nanokv/eviction/press.py).

Each running sequence keeps the attention inputs (after the input norm) of its last `window`
positions, in every layer, in a ring on the device: position p of the sequence in block-table
row r lies at r * window + p % window. A step writes only the positions the next eviction of a
sequence's press reads (the last `inputs` before it: models' KeptInputs); the eviction hands
them to the press with their position embeddings. A step that writes runs without decode
graphs. A swapped-out sequence's ring is kept aside, its row free for another.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

import kernels
from models import Decoder, KeptInputs
from nanokv.engine.sequence import Sequence
from nanokv.eviction.press import attention_view, hf_cos_sin


class PressWindow:
    def __init__(self, model: Decoder, window: int, num_rows: int, device: torch.device):
        """window: the positions a sequence keeps (press_window; 0: none, no memory)."""
        self.model, self.window, self.device = model, window, device
        cfg, dtype = model.config, model.embed_tokens.weight.dtype
        self.store = torch.zeros(cfg.num_layers, num_rows * window, cfg.hidden_size, dtype=dtype, device=device)
        self.views = [attention_view(layer.self_attn, model.cos_sin, dtype) for layer in model.layers]

    def writes(self, seqs: list[Sequence], starts: list[int], num_new: list[int],
               cu_seqlens: list[int]) -> KeptInputs | None:
        """The step's rows whose layer inputs a press reads at its sequence's next eviction, and their
        places in the ring (None: none)."""
        if not self.window:   # no press reads any: no step looks
            return None
        rows, places, window = [], [], self.window
        for b, seq in enumerate(seqs):
            end = seq.method.ranking.inputs and seq.method.schedule.next_eviction(seq)
            if not end:
                continue
            first, last = max(starts[b], end - seq.method.ranking.inputs), min(starts[b] + num_new[b], end)
            rows += range(cu_seqlens[b] + first - starts[b], cu_seqlens[b] + last - starts[b])
            places += (seq.block_table.row * window + p % window for p in range(first, last))
        if not rows:
            return None
        return KeptInputs(self.store, *(kernels.from_host(np.array(x, dtype=np.int64), self.device)
                                        for x in (rows, places)))

    def press_args(self, seq: Sequence) -> Callable[[int], tuple[object, torch.Tensor | None, dict]]:
        """What seq's press is handed for a layer besides the pairs: the layer's view, the layer
        inputs of the sequence's last positions [1, n, hidden] (fp32 at least), and their
        position_embeddings (found once for every layer); None and {} for a press that reads none."""
        n = min(seq.method.ranking.inputs, seq.num_computed_tokens)
        if not n:
            return lambda layer: (self.views[layer], None, {})
        positions = np.arange(seq.num_computed_tokens - n, seq.num_computed_tokens)
        places = kernels.from_host(seq.block_table.row * self.window + positions % self.window, self.device)
        dtype = torch.promote_types(self.store.dtype, torch.float32)
        rows = self.model.rope_rows(positions, np.full(n, seq.num_prompt_tokens))
        rows = kernels.from_host(positions if rows is None else rows, self.device)[None]
        kwargs = {"position_embeddings": hf_cos_sin(self.model.cos_sin, rows, dtype)}
        return lambda layer: (self.views[layer], self.store[layer, places][None].to(dtype), kwargs)

    def keep_aside(self, seq: Sequence) -> None:
        """A copy of a swapped-out seq's ring, for while another sequence may take its row."""
        if seq.method.ranking.inputs:
            seq.inputs_aside = self.store[:, self._ring(seq.block_table.last_row)].clone()

    def put_back(self, seq: Sequence) -> None:
        """seq's ring kept aside, written at its new row."""
        if seq.inputs_aside is not None:
            self.store[:, self._ring(seq.block_table.row)] = seq.inputs_aside
            seq.inputs_aside = None

    def _ring(self, row: int) -> slice:
        return slice(row * self.window, (row + 1) * self.window)
