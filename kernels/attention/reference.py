"""Paged attention over the KV cache: the torch reference (the oracle of
kernels/attention/tiles.py and kernels/attention/decode.py).

One function serves prefill, chunked prefill and decode. The batch is
flattened ("varlen"): sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1].
Each KV head h of it has its own pages (page_tables[b, h], layout in
kernels/kv_store.py) and its own context length context_lens[b, h], the last
q_len slots of which are this step's own tokens. Query j of sequence b sees,
in head h, slots 0 .. context_lens[b, h] - q_len + j (causal by slot, which
equals causal by position because new tokens are always appended after the
kept ones). A quantized cache is dequantized as it is gathered.
"""
import torch

from kernels.kv_store import dequantize


def _gather_context(cache: torch.Tensor, page_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """[P, bs, ...] paged through page_tables [B, Hkv, nb] -> [B, Hkv, max_len, ...]."""
    block_size = cache.shape[1]
    tables = page_tables[..., :-(-max_len // block_size)]
    pages = cache[tables.long()]                                  # [B, Hkv, nb, bs, ...]
    return pages.flatten(2, 3)[:, :, :max_len]


def _gather_kv(k_cache, v_cache, kv_scales, page_tables, max_len: int):
    """K and V of each (sequence, KV head)'s first max_len slots, dequantized: [B, Hkv, max_len, D] each."""
    if kv_scales is None:
        return _gather_context(k_cache, page_tables, max_len), _gather_context(v_cache, page_tables, max_len)
    scales = _gather_context(kv_scales, page_tables, max_len)
    return (dequantize(_gather_context(k_cache, page_tables, max_len), scales[..., 0]),
            dequantize(_gather_context(v_cache, page_tables, max_len), scales[..., 1]))


def _attend(q, k_cache, v_cache, kv_scales, page_tables, context_lens, scale):
    """Queries q [B, n, Hq, D], each sequence's n of them the last n slots of each of its KV
    heads' contexts (page_tables [B, Hkv, nb], context_lens [B, Hkv]), causal by slot ->
    out [B * n, Hq, D] and the log-sum-exp of each query's scores [B * n, Hq] (fp32)."""
    B, n, Hq, D = q.shape
    Hkv = page_tables.shape[1]
    max_len = int(context_lens.max())
    k, v = _gather_kv(k_cache, v_cache, kv_scales, page_tables, max_len)           # [B, Hkv, L, D]
    query_slot = context_lens[..., None] - n + torch.arange(n, device=q.device)    # [B, Hkv, n]
    visible = torch.arange(max_len, device=q.device) <= query_slot[..., None]      # [B, Hkv, n, L]
    scores = torch.einsum("bqhgd,bhld->bhgql", q.view(B, n, Hkv, Hq // Hkv, D).float(), k.float()) * scale
    scores.masked_fill_(~visible[:, :, None], float("-inf"))
    out = torch.einsum("bhgql,bhld->bqhgd", scores.softmax(dim=-1), v.float())
    lse = scores.logsumexp(dim=-1).permute(0, 3, 1, 2)                             # [B, n, Hkv, G]
    return out.reshape(B * n, Hq, D).to(q.dtype), lse.reshape(B * n, Hq)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        page_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        context_lens: torch.Tensor, scale: float, return_lse: bool = False,
                        kv_scales: torch.Tensor | None = None):
    """q [T, Hq, D] -> out [T, Hq, D] (and, if asked, lse [T, Hq] fp32: the natural
    log of each query's softmax denominator, which key scores are computed from).
    page_tables [B, Hkv, nb], context_lens [B, Hkv]; kv_scales: the scales of a
    quantized cache, None for an unquantized one.

    Decode rows (one query each) are computed together as one padded batch;
    each longer chunk on its own, so one long prefill never makes every
    decode in the step pad to its length.
    """
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    decodes = (q_lens == 1).nonzero().flatten()
    if len(decodes):
        rows = cu_seqlens_q[decodes].long()
        out[rows], lse[rows] = _attend(q[rows, None], k_cache, v_cache, kv_scales, page_tables[decodes],
                                       context_lens[decodes], scale)
    for b in (q_lens > 1).nonzero().flatten().tolist():
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        out[start:end], lse[start:end] = _attend(q[None, start:end], k_cache, v_cache, kv_scales,
                                                 page_tables[b:b + 1], context_lens[b:b + 1], scale)
    return (out, lse) if return_lse else out
