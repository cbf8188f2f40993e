"""Inputs of the attention kernels' tests: paged caches, page tables, varlen batches (the
layout: kernels/kv_store.py), and the tolerances they are compared with."""
import torch

# (out, lse) absolute = relative tolerances. 16-bit outputs are rounded once,
# and the probabilities meet V in 16 bits, as in every flash-attention kernel;
# scores and lse come from exact products summed in fp32, in any dtype.
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 1e-4), torch.bfloat16: (2e-2, 2e-4)}
SCORE_TOL = {torch.float32: 2e-5, torch.float16: 1e-4, torch.bfloat16: 2e-4}


def param_id(value):
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


def make_cache(num_pages, block_size, head_dim, dtype, device):
    shape = (num_pages, block_size, head_dim)
    return (torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype))


def ragged(lens, num_kv_heads, fewest, device):
    """Context lengths [B, Hkv] int32: head 0 of sequence b holds lens[b] slots, every other
    head a random number from fewest[b] to lens[b], as after per-head eviction."""
    return torch.tensor([[n] + torch.randint(f, n + 1, (num_kv_heads - 1,)).tolist() for n, f in zip(lens, fewest)],
                        dtype=torch.int32, device=device)


def scattered_tables(context_lens, block_size, num_pages, width):
    """Page tables [B, Hkv, width] for context_lens [B, Hkv] (on its device), whose page ids are
    a random permutation of the pool: non-contiguous, and never shared. Unused entries are 0,
    as the runner pads them."""
    device = context_lens.device
    needed = (context_lens + block_size - 1) // block_size
    assert int(needed.sum()) <= num_pages and int(needed.max()) <= width
    used = torch.arange(width, device=device) < needed[..., None]
    tables = torch.zeros(used.shape, dtype=torch.int32, device=device)
    tables[used] = torch.randperm(num_pages, dtype=torch.int32, device=device)[:int(needed.sum())]
    return tables


def varlen_batch(chunks, num_kv_heads, group, head_dim, dtype, device):
    """chunks: (prior context, q_len) per sequence -> q, cu_seqlens_q, context_lens [B, Hkv]
    (ragged: head 0 holds prior + q_len slots, the other heads q_len and part of the prior)."""
    q_lens = torch.tensor([n for _, n in chunks], dtype=torch.int32, device=device)
    cu_seqlens_q = torch.zeros(len(chunks) + 1, dtype=torch.int32, device=device)
    cu_seqlens_q[1:] = q_lens.cumsum(0)
    context_lens = ragged([p + n for p, n in chunks], num_kv_heads, q_lens.tolist(), device)
    q = torch.randn(int(cu_seqlens_q[-1]), num_kv_heads * group, head_dim, device=device).to(dtype)
    return q, cu_seqlens_q, context_lens


def mixed_chunks(block_size):
    """A fresh prefill, chunked prefills with prior context (one spanning
    several query tiles), and decodes at the block-boundary edge cases."""
    decodes = [(n - 1, 1) for n in (1, block_size - 1, block_size, block_size + 1, 2 * block_size + 5)]
    return [(0, 37), (block_size + 3, 45), (0, block_size)] + decodes + [(30, 70)]


def mixed_squares(batch_size, device):
    """square_scores [B] with both kinds of sequence: every other one squares."""
    return torch.arange(batch_size, device=device) % 2 == 1


def skip_inputs(batch_size, num_queries, cache_shape, device):
    """KVC-full's score_skip [B] (0, which skips nothing, for every third sequence), query
    positions [T] and key positions pos_cache [P, bs]: each key 1 to 99 positions before each query."""
    score_skip = torch.tensor([(0, 40, 55)[b % 3] for b in range(batch_size)], dtype=torch.int32, device=device)
    positions = torch.randint(50, 100, (num_queries,), device=device)
    return score_skip, positions, torch.randint(0, 50, cache_shape, dtype=torch.int32, device=device)
