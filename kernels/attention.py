"""Paged attention over the KV cache: the torch reference.

One function serves prefill, chunked prefill and decode. The batch is
flattened ("varlen"): sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1],
and its keys are the first context_lens[b] slots of its blocks, the last
q_len of which are this step's own tokens. Query j of sequence b sees slots
0 .. context_len - q_len + j (causal by slot, which equals causal by position
because new tokens are always appended after the kept ones).
"""
import torch


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float):
    """q [B, Q, Hkv, G, D], k/v [B, Hkv, L, D], visible [B, Q, L] -> [B, Q, Hkv, G, D]."""
    scores = torch.einsum("bqhgd,bhld->bhgql", q.float(), k.float()) * scale
    scores.masked_fill_(~visible[:, None, None], float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("bhgql,bhld->bqhgd", probs, v.float())


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """[num_blocks, Hkv, bs, D] paged through block_tables [B, nb] -> [B, Hkv, max_len, D]."""
    block_size = cache.shape[2]
    num_blocks = -(-max_len // block_size)
    pages = cache[block_tables[:, :num_blocks].long()]            # [B, nb, Hkv, bs, D]
    B, nb, H, bs, D = pages.shape
    return pages.permute(0, 2, 1, 3, 4).reshape(B, H, nb * bs, D)[:, :, :max_len]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D], attending through the paged cache.

    Decode rows (one query each) are computed together as one padded batch;
    each longer query chunk is computed on its own, so a step that mixes one
    long prefill with many decodes never pads every sequence to the longest.
    """
    T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    group = Hq // Hkv
    out = torch.empty_like(q)
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    starts, ctx = cu_seqlens_q[:-1].tolist(), context_lens.tolist()

    decodes = [b for b, n in enumerate(q_lens) if n == 1]
    if decodes:
        rows = cu_seqlens_q[:-1][decodes].long()
        max_len = max(ctx[b] for b in decodes)
        k = _gather_context(k_cache, block_tables[decodes], max_len)
        v = _gather_context(v_cache, block_tables[decodes], max_len)
        lens = context_lens[decodes].to(q.device)
        visible = (torch.arange(max_len, device=q.device) < lens[:, None])[:, None, :]
        o = _attend(q[rows].view(len(decodes), 1, Hkv, group, D), k, v, visible, scale)
        out[rows] = o.reshape(len(decodes), Hq, D).to(q.dtype)

    for b, n in enumerate(q_lens):
        if n <= 1:
            continue
        k = _gather_context(k_cache, block_tables[b:b + 1], ctx[b])
        v = _gather_context(v_cache, block_tables[b:b + 1], ctx[b])
        first_query_slot = ctx[b] - n
        visible = (torch.arange(ctx[b], device=q.device)[None, :]
                   <= first_query_slot + torch.arange(n, device=q.device)[:, None])
        qb = q[starts[b]:starts[b] + n].view(1, n, Hkv, group, D)
        o = _attend(qb, k, v, visible[None], scale)
        out[starts[b]:starts[b] + n] = o.reshape(n, Hq, D).to(q.dtype)
    return out
