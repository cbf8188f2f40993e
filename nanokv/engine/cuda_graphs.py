"""Decode steps captured as CUDA graphs, two per batch-size bucket (with and
without eviction scores).

A decode step of a small model is hundreds of short kernel launches; replaying
a captured graph issues them all at once. Graphs replay fixed addresses, so
every input lives in a static buffer: a real batch is copied in and padded up
to the next bucket (padding rows: slot -1, context length 0, which the kernels
skip). Each copy is a launch the host pays for, so what the last step left in the
buffers is not copied again: its padding, its page tables when a decode made from
it keeps them (no block changed), score settings that no sequence sets. Logits and
sampling stay outside the graph; so does a step whose page tables are wider than
the buffers (an uneven method's head that kept many pages).
"""
from __future__ import annotations

import torch

from kernels import DecodeWorkspace
from models import AttentionMetadata, KVCache


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16, up to max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, workspace: DecodeWorkspace, max_num_seqs: int,
                 max_blocks_per_seq: int, max_model_len: int):
        self.model, self.kv_cache, self.max_model_len = model, kv_cache, max_model_len
        self.workspace = workspace   # allocated outside the graphs, so the memory profile saw it
        device = kv_cache.k.device
        n = max_num_seqs
        heads = (kv_cache.num_layers, n, kv_cache.num_kv_heads)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full(heads, -1, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(heads, dtype=torch.int32, device=device)
        self.page_tables = torch.zeros(*heads, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.score_from = torch.zeros(n, dtype=torch.int32, device=device)   # windowed rankings (AttentionMetadata)
        self.square_scores = torch.zeros(n, dtype=torch.bool, device=device)
        self.score_skip = torch.zeros(n, dtype=torch.int32, device=device)   # 0: every pair counts
        self.hidden = torch.zeros(n, model.config.hidden_size, dtype=model.embed_tokens.weight.dtype, device=device)
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        # Two graphs per size: one that also accumulates eviction scores (a batch with an
        # evicting sequence) and one that does not, so a full cache never pays for scores.
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        # What the buffers hold from the last step (run): padding after its rows, its page tables,
        # how many rows have scores neither squared nor skipped.
        self.padded, self.tables, self.plain_scores = 0, None, 0
        pool = None
        for scores in (True, False):
            for bs in reversed(self.batch_sizes):   # largest first: smaller graphs reuse its memory
                graph = torch.cuda.CUDAGraph()
                self._forward(bs, scores)           # warm-up: compiles the Triton kernels
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(bs, scores)
                pool = graph.pool()
                self.graphs[bs, scores] = graph
        torch.cuda.synchronize()

    @staticmethod
    def buffer_bytes(num_layers: int, num_kv_heads: int, max_num_seqs: int, max_model_len: int, block_size: int,
                     hidden_size: int) -> int:
        """The static inputs' memory (the page tables dominate), counted before the pool is sized;
        the hidden states at 4 bytes an element, the most a model dtype takes."""
        heads = num_layers * max_num_seqs * num_kv_heads   # slots (int64), lengths and page tables (int32)
        per_seq = 8 + 8 + 4 + 4 + 1 + 4 + 4 * hidden_size   # ids, positions, cu_seqlens, score_from, square, skip
        return heads * (8 + 4 + 4 * -(-max_model_len // block_size)) + max_num_seqs * per_seq + 4

    def _metadata(self, bs: int, scores: bool) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:, :bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
                                 context_lens=self.context_lens[:, :bs], page_tables=self.page_tables[:, :bs],
                                 max_query_len=1, max_context_len=self.max_model_len, num_decodes=bs,
                                 accumulate_scores=scores, score_from=self.score_from[:bs],
                                 square_scores=self.square_scores[:bs], score_skip=self.score_skip[:bs],
                                 decode_workspace=self.workspace)

    @torch.inference_mode()
    def _forward(self, bs: int, scores: bool) -> None:
        self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_cache,
                                      self._metadata(bs, scores))

    def fits(self, meta: AttentionMetadata) -> bool:
        """A batch no larger than the largest graph, with page tables no wider than its buffers."""
        width = self.page_tables.shape[-1]
        return len(meta.cu_seqlens_q) - 1 <= self.batch_sizes[-1] and meta.page_tables.shape[-1] <= width

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The decode step of len(input_ids) sequences, through the smallest graph that holds them."""
        n = input_ids.shape[0]
        bs = next(s for s in self.batch_sizes if s >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:, :n] = meta.slot_mapping
        self.context_lens[:, :n] = meta.context_lens
        if self.padded != n:
            self.slot_mapping[:, n:bs] = -1
            self.context_lens[:, n:bs] = 0
            self.padded = n
        if meta.page_tables is not self.tables:
            self.page_tables[:, :n, :, :meta.page_tables.shape[-1]] = meta.page_tables
            self.tables = meta.page_tables
        if meta.accumulate_scores:
            self.score_from[:n] = meta.score_from
            plain = meta.square_scores is None and meta.score_skip is None
            if not (plain and self.plain_scores == n):
                self.square_scores[:n] = False if meta.square_scores is None else meta.square_scores
                self.score_skip[:n] = 0 if meta.score_skip is None else meta.score_skip
                self.plain_scores = n if plain else 0
        self.graphs[bs, meta.accumulate_scores].replay()
        return self.hidden[:n]
