"""Paged attention for the CPU backend: the semantics of kernels/attention.py
(its oracle), computed the way a CPU is fast at.

- Each layer gathers its sequences' K and V out of the pool with one
  index_select per tensor; the gather indices, the masks and the score slots
  depend only on the step's metadata, so the runner builds them once per step
  (a `StepPlan`, in AttentionMetadata) and every layer reuses them.
- Without eviction scores the attention itself is torch's fused flash
  attention for the CPU (GQA without copies). A prefill chunk that follows
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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.kv_store import dequantize

QUERY_TILE = 512   # prefill rows scored at a time: bounds the [heads, rows, context] probabilities


@dataclass
class Chunk:
    """Query rows that attend together, and where their context lives in the pool."""
    rows: slice | torch.Tensor   # its query rows (decodes: the rows of all decode sequences)
    seqs: torch.Tensor           # [S] the batch index of each of its sequences
    pool_rows: torch.Tensor      # [S, Hkv, L] int64: each slot's row in the pool (see _pool_rows)
    blocks: torch.Tensor         # [S, L] int64: each slot's block, for the scores
    mask: torch.Tensor | None    # decodes: additive [S, 1, 1, L] where contexts differ; None: all visible
    visible: torch.Tensor | None   # bool [S, n, L], only for the path that computes probabilities


@dataclass
class StepPlan:
    """Everything about a step that does not depend on the layer."""
    decodes: Chunk | None
    prefills: list[Chunk]


def _pool_rows(block_tables: torch.Tensor, context_len: int, num_kv_heads: int, block_size: int):
    """[S, nb] tables -> [S, Hkv, L] int64, the row of each slot of each head in the pool seen
    as [num_blocks * Hkv * bs, D] (one flat index_select gathers a layer's context, with no
    second copy to put heads before slots), and [S, L] the block of each slot."""
    slots = torch.arange(context_len, device=block_tables.device)
    blocks = block_tables[:, slots // block_size].long()
    heads = torch.arange(num_kv_heads, device=block_tables.device)[None, :, None]
    return (blocks[:, None] * num_kv_heads + heads) * block_size + slots % block_size, blocks


def make_plan(block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
              num_kv_heads: int, block_size: int, dtype: torch.dtype, scores: bool) -> StepPlan:
    """Split the step into its decode rows (one batch padded to the longest context) and its
    prefill chunks (one each, so that a long prompt never makes the decodes pad to its length)."""
    device = block_tables.device

    def additive(visible):   # SDPA would convert a bool mask again in every layer
        return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))

    starts, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    decode_seqs = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    decodes = None
    if decode_seqs:
        longest = max(lens[b] for b in decode_seqs)
        seqs = torch.tensor(decode_seqs, device=device)
        visible = torch.arange(longest, device=device)[None, :] < context_lens[seqs, None]   # [S, L]
        ragged = any(lens[b] != longest for b in decode_seqs)
        rows = slice(0, len(decode_seqs)) if decode_seqs == list(range(len(decode_seqs))) \
            else cu_seqlens_q[seqs].long()
        decodes = Chunk(rows, seqs, *_pool_rows(block_tables[seqs], longest, num_kv_heads, block_size),
                        additive(visible[:, None, None]) if ragged else None, visible[:, None])
    prefills = []
    for b in range(len(lens)):
        n, context_len = starts[b + 1] - starts[b], lens[b]
        if n == 1:
            continue
        visible = None
        if scores:
            query_slot = context_len - n + torch.arange(n, device=device)
            visible = (torch.arange(context_len, device=device)[None, :] <= query_slot[:, None])[None]
        prefills.append(Chunk(slice(starts[b], starts[b + 1]), torch.tensor([b], device=device),
                              *_pool_rows(block_tables[b:b + 1], context_len, num_kv_heads, block_size),
                              None, visible))
    return StepPlan(decodes, prefills)


def _gather(cache: torch.Tensor, pool_rows: torch.Tensor) -> torch.Tensor:
    """[num_blocks, Hkv, bs, D] -> [S, Hkv, L, D], contiguous, in one copy."""
    D = cache.shape[-1]   # named, not -1: a padded step may gather nothing
    return cache.view(-1, D).index_select(0, pool_rows.view(-1)).view(*pool_rows.shape, D)


def _gather_kv(k_cache, v_cache, kv_scales, pool_rows, dtype):
    """K and V [S, Hkv, L, D] in dtype (q's), dequantized if the cache is quantized."""
    if kv_scales is None:
        return _gather(k_cache, pool_rows), _gather(v_cache, pool_rows)
    scales = _gather(kv_scales, pool_rows)
    return (dequantize(_gather(k_cache, pool_rows), scales[..., 0]).to(dtype),
            dequantize(_gather(v_cache, pool_rows), scales[..., 1]).to(dtype))


def _add_scores(score_cache: torch.Tensor, blocks: torch.Tensor, probs_sum: torch.Tensor) -> None:
    """score_cache [num_blocks, Hkv, bs] += probs_sum [S, Hkv, L] at the sequences' slots.
    Accumulating: padded block tables repeat block 0, and those slots receive zeros."""
    Hkv, bs = score_cache.shape[1:]
    slots = torch.arange(blocks.shape[1], device=score_cache.device)
    heads = torch.arange(Hkv, device=score_cache.device)[None, :, None]
    score_cache.index_put_((blocks[:, None, :], heads, (slots % bs)[None, None, :]), probs_sum,
                           accumulate=True)


def _chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [1, Hq, n, D], the last n of k/v [1, Hkv, L, D], causal -> [1, Hq, n, D]."""
    prefix = k.shape[2] - q.shape[2]
    if prefix == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu   # SDPA's own kernel, with its lse
    seen_out, seen_lse = flash(q, k[:, :, :prefix], v[:, :, :prefix], scale=scale)
    own_out, own_lse = flash(q, k[:, :, prefix:], v[:, :, prefix:], is_causal=True, scale=scale)
    lse = torch.logaddexp(seen_lse, own_lse)
    seen_weight, own_weight = (seen_lse - lse).exp_()[..., None], (own_lse - lse).exp_()[..., None]
    return (seen_out.float() * seen_weight + own_out.float() * own_weight).to(q.dtype)


def _attend_with_scores(q, k, v, visible, scale, counted):
    """q [S, Hkv, G, n, D], k/v [S, Hkv, L, D], visible [S or 1, n, L] -> out [S, Hkv, G, n, D]
    in q's dtype and the probabilities summed over G and the counted queries (counted [S, n]
    bool, or None for all): [S, Hkv, L], all computed in fp32."""
    logits = torch.matmul(q.float(), k.float().unsqueeze(2).transpose(-1, -2)) * scale   # [S, Hkv, G, n, L]
    logits.masked_fill_(~visible[:, None, None], float("-inf"))
    probs = logits.softmax(dim=-1)
    out = torch.matmul(probs, v.float().unsqueeze(2)).to(q.dtype)
    if counted is not None:
        probs = probs * counted[:, None, None, :, None]
    return out, probs.sum(dim=(2, 3))


def _counted(score_from: torch.Tensor | None, seqs: torch.Tensor, first_query: int, n: int):
    """[S, n] bool: which of queries first_query .. first_query + n - 1 of each sequence's chunk
    add to the scores (those from its score_from on); None when all do."""
    if score_from is None:
        return None
    return torch.arange(first_query, first_query + n, device=seqs.device)[None, :] >= score_from[seqs, None]


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                        scale: float, score_cache: torch.Tensor | None = None,
                        score_from: torch.Tensor | None = None, plan: StepPlan | None = None,
                        kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """paged_attention_ref's output for q [T, Hq, D]; with score_cache, also
    accumulate_key_scores_ref's update of it, score_from included (both up to float rounding).
    plan: make_plan() of this step's metadata, shared by the layers (None: built here).
    kv_scales: a quantized cache's scales."""
    T, Hq, D = q.shape
    Hkv, bs = k_cache.shape[1:3]
    G = Hq // Hkv
    if plan is None:
        plan = make_plan(block_tables, cu_seqlens_q, context_lens, Hkv, bs, q.dtype, score_cache is not None)
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
                                               _counted(score_from, c.seqs, 0, 1))
            _add_scores(score_cache, c.blocks, probs_sum)
        if out is None:
            return o.reshape(T, Hq, D)
        out[c.rows] = o.reshape(S, Hq, D)
    for c in plan.prefills:
        k, v = _gather_kv(k_cache, v_cache, kv_scales, c.pool_rows, q.dtype)
        q_p = q[c.rows].transpose(0, 1)[None]                                # [1, Hq, n, D]
        if score_cache is None:
            out[c.rows] = _chunk_attention(q_p, k, v, scale)[0].transpose(0, 1)
            continue
        n, first = q_p.shape[2], c.rows.start
        q_g = q_p.view(1, Hkv, G, n, D)
        probs_sum = torch.zeros(1, Hkv, k.shape[2], device=q.device)
        for at in range(0, n, QUERY_TILE):   # a tile of queries at a time bounds the probabilities' memory
            tile = slice(at, at + QUERY_TILE)
            o, tile_sum = _attend_with_scores(q_g[:, :, :, tile], k, v, c.visible[:, tile], scale,
                                              _counted(score_from, c.seqs, at, min(QUERY_TILE, n - at)))
            out[first + at:first + at + o.shape[3]] = o[0].flatten(0, 1).transpose(0, 1)
            probs_sum += tile_sum
        _add_scores(score_cache, c.blocks, probs_sum)
    return out
