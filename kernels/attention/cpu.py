"""Paged attention for the CPU backend: the semantics of kernels/attention/reference.py
(its oracle), computed the way a CPU is fast at.

- Each layer gathers its sequences' K and V out of the pool with one
  index_select per tensor; the gather indices, the masks and the score slots
  depend only on the step's metadata, so the runner builds them once per step
  for all layers (a `StepPlan`, in AttentionMetadata) and each layer takes its
  own (StepPlan.layer). When every head holds the same slots, one mask serves
  all layers; heads of different lengths (an uneven method) get theirs.
- Without eviction scores the attention itself is torch's fused flash
  attention for the CPU (GQA without copies); a prefill chunk whose heads
  differ in length takes the explicit path below. A prefill chunk that follows
  earlier context is causal with an offset, which SDPA's is_causal (aligned
  top-left) cannot express; rather than a masked pass over all n x L pairs, it
  is two flash passes merged by their log-sum-exps: the earlier context (no
  mask) and the chunk itself (plain causal).
- With eviction scores (meta.accumulate_scores) the probabilities are needed
  anyway, so they are computed explicitly once and serve both the output and
  the scores: no log-sum-exp, no second pass over the keys.
- A quantized cache is dequantized as it is gathered, with its scales gathered
  by the same rows (kernels/kv_store.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kernels.kv_store import dequantize

QUERY_TILE = 512   # prefill rows scored at a time: bounds the [heads, rows, context] probabilities


@dataclass
class Chunk:
    """Query rows that attend together, and where their context lives in the pool: for all
    layers in the plan, one layer's after StepPlan.layer."""
    rows: slice | torch.Tensor   # its query rows (decodes: the rows of all decode sequences)
    seqs: torch.Tensor           # [S] the batch index of each of its sequences
    pool_rows: torch.Tensor      # [(L,) S, Hkv, C] int64: each slot's row in the pool seen as [num_pages * bs, ...]
    lens: torch.Tensor           # [(L,) S, Hkv] each head's context length
    even: bool                   # every head of every layer holds the same slots (per sequence)
    widths: list[int] | None = None      # uneven: the slots layer l gathers (its longest head), C at most
    mask: torch.Tensor | None = None     # decodes: additive [S, Hkv or 1, 1, C]; None if all see all C
    visible: torch.Tensor | None = None  # bool [S or 1, Hkv or 1, n, C]: for the paths that need it


@dataclass
class StepPlan:
    """Everything about a step that does not depend on the layer, or is built for all at once."""
    decodes: Chunk | None
    prefills: list[Chunk]
    dtype: torch.dtype
    scores: bool

    def layer(self, i: int) -> StepPlan:
        """Layer i's gathers and masks."""
        decodes = None if self.decodes is None else self._layer(self.decodes, i, prefill=False)
        return replace(self, decodes=decodes, prefills=[self._layer(c, i, prefill=True) for c in self.prefills])

    def _layer(self, c: Chunk, i: int, prefill: bool) -> Chunk:
        if c.even:
            return replace(c, pool_rows=c.pool_rows[i], lens=c.lens[i])
        c = replace(c, pool_rows=c.pool_rows[i, ..., :c.widths[i]].contiguous(), lens=c.lens[i])
        return _with_masks(c, self.dtype, self.scores, prefill)


def _with_masks(c: Chunk, dtype: torch.dtype, scores: bool, prefill: bool) -> Chunk:
    """c (one layer's, or an even one's layer 0) with the masks its attention needs."""
    lens = c.lens if not c.even else c.lens[:, :1]   # [S, Hkv or 1]
    slot = torch.arange(c.pool_rows.shape[-1], device=lens.device)
    if prefill:   # query j of the chunk sees each head's slots up to its length - n + j
        n = c.rows.stop - c.rows.start
        visible = slot <= (lens - n)[..., None, None] + torch.arange(n, device=lens.device)[:, None]
        return replace(c, visible=visible if scores or not c.even else None)
    visible = (slot < lens[..., None])[:, :, None]                              # [S, Hkv or 1, 1, C]
    mask = None
    if not bool(visible.all()):   # SDPA would convert a bool mask again in every layer
        mask = torch.zeros(visible.shape, dtype=dtype, device=lens.device).masked_fill_(~visible, float("-inf"))
    return replace(c, mask=mask, visible=visible)


def _pool_rows(tables: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Page tables [..., nb] -> [..., C] int64: the row of each of the first C slots in the
    pool seen as [num_pages * bs, D] (one flat index_select gathers a layer's context)."""
    slots = torch.arange(context_len, device=tables.device)
    return (tables.long() * block_size)[..., slots // block_size] + slots % block_size


def make_plan(page_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
              block_size: int, dtype: torch.dtype, scores: bool) -> StepPlan:
    """For every layer (page_tables [L, B, Hkv, nb], context_lens [L, B, Hkv]): split the
    step into its decode rows (one batch padded to the longest context) and its prefill
    chunks (one each, so that a long prompt never makes the decodes pad to its length)."""
    device = page_tables.device
    starts = cu_seqlens_q.tolist()
    longest = context_lens.amax(dim=2)                                          # [L, B]: per layer and sequence
    per_seq = longest.amax(dim=0).tolist()
    even = (context_lens == context_lens[:1, :, :1]).all(dim=(0, 2)).tolist()   # all its heads alike

    def widths(seqs) -> list[int] | None:   # an uneven chunk gathers, in each layer, its longest head
        return None if all(even[b] for b in seqs) else longest[:, seqs].amax(dim=1).tolist()
    decode_seqs = [b for b in range(len(per_seq)) if starts[b + 1] - starts[b] == 1]
    decodes = None
    if decode_seqs:
        seqs = torch.tensor(decode_seqs, device=device)
        rows = slice(0, len(decode_seqs)) if decode_seqs == list(range(len(decode_seqs))) \
            else cu_seqlens_q[seqs].long()
        longest_decode = max(per_seq[b] for b in decode_seqs)
        decodes = Chunk(rows, seqs, _pool_rows(page_tables[:, seqs], longest_decode, block_size),
                        context_lens[:, seqs], all(even[b] for b in decode_seqs), widths(decode_seqs))
    prefills = []
    for b in range(len(per_seq)):
        if starts[b + 1] - starts[b] > 1:
            prefills.append(Chunk(slice(starts[b], starts[b + 1]), torch.tensor([b], device=device),
                                  _pool_rows(page_tables[:, b:b + 1], per_seq[b], block_size),
                                  context_lens[:, b:b + 1], even[b], widths([b])))

    def shared_masks(c: Chunk, prefill: bool) -> Chunk:   # an even chunk sees alike in every layer
        if not c.even:
            return c
        masked = _with_masks(replace(c, lens=c.lens[0]), dtype, scores, prefill)
        return replace(c, mask=masked.mask, visible=masked.visible)
    return StepPlan(decodes and shared_masks(decodes, False), [shared_masks(c, True) for c in prefills],
                    dtype, scores)


def _gather(cache: torch.Tensor, pool_rows: torch.Tensor) -> torch.Tensor:
    """[num_pages, bs, D] -> [S, Hkv, C, D], contiguous, in one copy."""
    D = cache.shape[-1]   # named, not -1: a padded step may gather nothing
    return cache.view(-1, D).index_select(0, pool_rows.view(-1)).view(*pool_rows.shape, D)


def _gather_kv(k_cache, v_cache, kv_scales, pool_rows, dtype):
    """K and V [S, Hkv, C, D] in dtype (q's), dequantized if the cache is quantized."""
    if kv_scales is None:
        return _gather(k_cache, pool_rows), _gather(v_cache, pool_rows)
    scales = _gather(kv_scales, pool_rows)
    return (dequantize(_gather(k_cache, pool_rows), scales[..., 0]).to(dtype),
            dequantize(_gather(v_cache, pool_rows), scales[..., 1]).to(dtype))


def _add_scores(score_cache: torch.Tensor, pool_rows: torch.Tensor, probs_sum: torch.Tensor) -> None:
    """score_cache [num_pages, bs] += probs_sum [S, Hkv, C] at the heads' slots. Accumulating:
    padded page tables repeat page 0, and the slots past a head's length receive zeros."""
    score_cache.view(-1).index_put_((pool_rows,), probs_sum, accumulate=True)


def _chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [1, Hq, n, D], the last n of k/v [1, Hkv, C, D], causal -> [1, Hq, n, D]."""
    prefix = k.shape[2] - q.shape[2]
    if prefix == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu   # SDPA's own kernel, with its lse
    seen_out, seen_lse = flash(q, k[:, :, :prefix], v[:, :, :prefix], scale=scale)
    own_out, own_lse = flash(q, k[:, :, prefix:], v[:, :, prefix:], is_causal=True, scale=scale)
    lse = torch.logaddexp(seen_lse, own_lse)
    seen_weight, own_weight = (seen_lse - lse).exp_()[..., None], (own_lse - lse).exp_()[..., None]
    return (seen_out.float() * seen_weight + own_out.float() * own_weight).to(q.dtype)


def _attend_with_scores(q, k, v, visible, scale, counted, square):
    """q [S, Hkv, G, n, D], k/v [S, Hkv, C, D], visible [S or 1, Hkv or 1, n, C] -> out
    [S, Hkv, G, n, D] in q's dtype and the probabilities (squared where square [S] says)
    summed over G and the queries, of the counted pairs (counted [S, Hkv or 1, n, C or 1]
    bool, or None for all): [S, Hkv, C], all computed in fp32."""
    logits = torch.matmul(q.float(), k.float().unsqueeze(2).transpose(-1, -2)) * scale   # [S, Hkv, G, n, C]
    logits.masked_fill_(~visible[:, :, None], float("-inf"))
    probs = logits.softmax(dim=-1)
    out = torch.matmul(probs, v.float().unsqueeze(2)).to(q.dtype)
    if square is not None:
        probs = torch.where(square[:, None, None, None, None], probs * probs, probs)
    if counted is not None:
        probs = probs * counted[:, :, None]
    return out, probs.sum(dim=(2, 3))


def _counted(c: Chunk, first: int, n: int, score_from, score_skip, positions, pos_cache):
    """[S, Hkv or 1, n, C or 1] bool: which (query, key) pairs of queries first .. first + n - 1
    of each of c's sequences add to the scores: the queries from its score_from on and, with
    score_skip, the pairs whose positions (the queries' in positions [T], the keys' in
    pos_cache [P, bs]) are at least score_skip apart; None when all do."""
    counted = None
    if score_from is not None:
        query = torch.arange(first, first + n, device=c.seqs.device)
        counted = (query >= score_from[c.seqs, None])[:, None, :, None]
    if score_skip is not None:
        q_pos = positions[c.rows].view(len(c.seqs), -1)[:, first:first + n, None]          # [S, n, 1]
        apart = q_pos[:, None] - pos_cache.view(-1)[c.pool_rows][:, :, None] >= score_skip[c.seqs, None, None, None]
        counted = apart if counted is None else counted & apart
    return counted


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        page_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                        scale: float, score_cache: torch.Tensor | None = None,
                        score_from: torch.Tensor | None = None, square_scores: torch.Tensor | None = None,
                        plan: StepPlan | None = None, kv_scales: torch.Tensor | None = None,
                        score_skip: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                        pos_cache: torch.Tensor | None = None) -> torch.Tensor:
    """paged_attention_ref's output for q [T, Hq, D] (one layer: page_tables [B, Hkv, nb],
    context_lens [B, Hkv]); with score_cache, also accumulate_key_scores_ref's update of it,
    score_from, square_scores and score_skip included (up to float rounding). plan: this layer's
    of make_plan() (StepPlan.layer), shared by the layers (None: built here). kv_scales: a
    quantized cache's scales."""
    T, Hq, D = q.shape
    Hkv = page_tables.shape[1]
    G = Hq // Hkv
    if plan is None:
        plan = make_plan(page_tables[None], cu_seqlens_q, context_lens[None], k_cache.shape[1], q.dtype,
                         score_cache is not None).layer(0)
    out = torch.empty_like(q) if plan.prefills else None
    if plan.decodes is not None:
        c = plan.decodes
        S = c.pool_rows.shape[0]
        k, v = _gather_kv(k_cache, v_cache, kv_scales, c.pool_rows, q.dtype)
        q_d = q[c.rows].view(S, Hkv, G, D)   # a decode's G heads are G queries of its KV head
        if score_cache is None:
            o = F.scaled_dot_product_attention(q_d, k, v, attn_mask=c.mask, scale=scale)
        else:
            o, probs_sum = _attend_with_scores(q_d[:, :, :, None], k, v, c.visible, scale,
                                               _counted(c, 0, 1, score_from, score_skip, positions, pos_cache),
                                               None if square_scores is None else square_scores[c.seqs])
            _add_scores(score_cache, c.pool_rows, probs_sum)
        if out is None:
            return o.reshape(T, Hq, D)
        out[c.rows] = o.reshape(S, Hq, D)
    for c in plan.prefills:
        k, v = _gather_kv(k_cache, v_cache, kv_scales, c.pool_rows, q.dtype)
        q_p = q[c.rows].transpose(0, 1)[None]                                # [1, Hq, n, D]
        if score_cache is None and c.even:
            out[c.rows] = _chunk_attention(q_p, k, v, scale)[0].transpose(0, 1)
            continue
        n, first = q_p.shape[2], c.rows.start
        q_g = q_p.view(1, Hkv, G, n, D)
        probs_sum = torch.zeros(1, Hkv, k.shape[2], device=q.device)
        square = None if square_scores is None else square_scores[c.seqs]
        for at in range(0, n, QUERY_TILE):   # a tile of queries at a time bounds the probabilities' memory
            tile = slice(at, at + QUERY_TILE)
            counted = _counted(c, at, min(QUERY_TILE, n - at), score_from, score_skip, positions, pos_cache)
            o, tile_sum = _attend_with_scores(q_g[:, :, :, tile], k, v, c.visible[:, :, tile], scale, counted,
                                              square)
            out[first + at:first + at + o.shape[3]] = o[0].flatten(0, 1).transpose(0, 1)
            probs_sum += tile_sum
        if score_cache is not None:
            _add_scores(score_cache, c.pool_rows, probs_sum)
    return out
