"""Key scores (kernels/attention/key_scores.py) against a dense float64 softmax.

The dense oracle is written out here, independent of the code under test: it
builds each sequence's keys by walking its block table slot by slot, then
takes a causal softmax in float64.
"""
import itertools
from dataclasses import dataclass

import pytest
import torch

from batches import skip_inputs
from helpers import KERNEL_DEVICE
from kernels.attention.key_scores import accumulate_key_scores_ref, accumulate_key_scores_triton
from kernels.attention.reference import paged_attention_ref


@dataclass
class Batch:
    q: torch.Tensor              # [T, Hq, D]
    k_cache: torch.Tensor        # [P, block_size, D]
    score_cache: torch.Tensor    # [P, block_size] fp32, random nonzero
    page_tables: torch.Tensor   # [B, Hkv, nb] int32, -1 past each head's pages
    cu_seqlens_q: torch.Tensor   # [B + 1] int32
    context_lens: torch.Tensor   # [B, Hkv] int32, ragged across heads
    scale: float


def make_batch(seqs, num_kv_heads, group, head_dim, block_size, dtype, device=KERNEL_DEVICE) -> Batch:
    """Random inputs for sequences [(context_len, q_len), ...], on device.

    Head 0 of a sequence holds context_len slots; every other head a random number
    between q_len and context_len (ragged heads, as after per-head eviction). Pages are
    a random permutation of a pool with spare pages that no head owns.
    """
    lens = torch.tensor([[c] + torch.randint(q, c + 1, (num_kv_heads - 1,)).tolist() for c, q in seqs],
                        dtype=torch.int32, device=device)
    pages_needed = (lens + block_size - 1) // block_size
    num_pages = int(pages_needed.sum()) + 3
    pool = torch.randperm(num_pages, dtype=torch.int32).tolist()
    tables = torch.full((len(seqs), num_kv_heads, int(pages_needed.max())), -1, dtype=torch.int32, device=device)
    for (b, h), n in zip(itertools.product(range(len(seqs)), range(num_kv_heads)), pages_needed.flatten().tolist()):
        tables[b, h, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32, device=device)
    q_lens = torch.tensor([q_len for _, q_len in seqs], device=device)
    return Batch(
        # Larger than unit logits, so the softmax is far from uniform.
        q=(3 * torch.randn(int(q_lens.sum()), num_kv_heads * group, head_dim, device=device)).to(dtype),
        k_cache=torch.randn(num_pages, block_size, head_dim, device=device).to(dtype),
        score_cache=torch.rand(num_pages, block_size, device=device) + 0.5,
        page_tables=tables,
        cu_seqlens_q=torch.cat([torch.zeros(1, dtype=torch.int32, device=device), q_lens.cumsum(0).int()]),
        context_lens=lens,
        scale=head_dim ** -0.5,
    )


def dense_logits(batch: Batch, b: int, h: int):
    """Sequence b's scaled logits in KV head h, [G, n, L] in float64 (-inf where the query
    cannot see the key), and the slot addresses (pages [L], offsets [L]), from the block
    table walked slot by slot."""
    Hkv, block_size = batch.page_tables.shape[1], batch.k_cache.shape[1]
    start, end = int(batch.cu_seqlens_q[b]), int(batch.cu_seqlens_q[b + 1])
    n, context_len = end - start, int(batch.context_lens[b, h])
    device = batch.q.device
    pages = torch.tensor([int(batch.page_tables[b, h, s // block_size]) for s in range(context_len)], device=device)
    offsets = torch.arange(context_len, device=device) % block_size
    k = torch.stack([batch.k_cache[pages[s], offsets[s]] for s in range(context_len)]).double()   # [L, D]
    q = batch.q[start:end].double().unflatten(1, (Hkv, -1))[:, h]                                  # [n, G, D]
    logits = torch.einsum("ngd,ld->gnl", q, k) * batch.scale
    visible = (torch.arange(context_len, device=device)[None, :]
               <= (context_len - n + torch.arange(n, device=device))[:, None])
    return logits.masked_fill(~visible, float("-inf")), pages, offsets


def by_kv_head(lse: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """lse [n, Hq] -> [Hkv, G, n]: the lse of KV head h's queries is [h] (layout of dense_logits)."""
    return lse.T.unflatten(0, (num_kv_heads, -1))


def mixed_squares(batch: Batch) -> torch.Tensor:
    """square_scores [B] with both kinds of sequence: every other one squares."""
    return torch.arange(len(batch.context_lens), device=batch.q.device) % 2 == 1


def dense_expectation(batch: Batch, score_from=None, square_scores=None, skip=None):
    """The updated score cache (float64), which slots it touched, and the lse [T, Hq] (fp32).
    skip: skip_inputs()'s (score_skip, positions, pos_cache), KVC-full's pairs far enough apart."""
    expected = batch.score_cache.double().clone()
    touched = torch.zeros_like(batch.score_cache, dtype=torch.bool)
    lse = torch.empty(batch.q.shape[:2], device=batch.q.device)
    Hkv = batch.page_tables.shape[1]
    for b in range(len(batch.context_lens)):
        start, end = int(batch.cu_seqlens_q[b]), int(batch.cu_seqlens_q[b + 1])
        for h in range(Hkv):
            logits, pages, offsets = dense_logits(batch, b, h)
            probs = logits.softmax(dim=-1)
            if score_from is not None:
                probs[:, :max(int(score_from[b]), 0)] = 0.0
            if skip is not None:
                score_skip, positions, pos_cache = skip
                probs[:, positions[start:end, None] - pos_cache[pages, offsets] < int(score_skip[b])] = 0.0
            if square_scores is not None and square_scores[b]:
                probs = probs ** 2
            expected[pages, offsets] += probs.sum(dim=(0, 1))
            touched[pages, offsets] |= probs.sum(dim=(0, 1)) > 0
            by_kv_head(lse[start:end], Hkv)[h] = logits.logsumexp(dim=-1).float()
    return expected, touched, lse


def assert_scores(batch: Batch, initial: torch.Tensor, expected: torch.Tensor, touched: torch.Tensor,
                  tol: float = 1e-5):
    result = batch.score_cache
    assert torch.equal(result[~touched], initial[~touched]), "a slot outside every counted context changed"
    torch.testing.assert_close(result.double(), expected, rtol=tol, atol=tol)


# Context lengths 1 and block_size +- 1 (in head 0; the other heads hold fewer slots);
# decode rows (q_len 1) next to prefill chunks with earlier context; chunks longer than one query tile.
CASES = {
    "bs16-d64-g1": dict(block_size=16, head_dim=64, group=1, num_kv_heads=2,
                        seqs=[(1, 1), (15, 1), (16, 16), (17, 5), (90, 70)]),
    "bs32-d128-g3": dict(block_size=32, head_dim=128, group=3, num_kv_heads=3,
                         seqs=[(31, 1), (32, 32), (33, 9), (1, 1), (70, 25)]),
    "bs64-d64-g4": dict(block_size=64, head_dim=64, group=4, num_kv_heads=2,
                        seqs=[(63, 63), (64, 1), (65, 20), (1, 1), (130, 30)]),
    "bs16-d128-g8": dict(block_size=16, head_dim=128, group=8, num_kv_heads=1,
                         seqs=[(17, 17), (16, 1), (100, 3), (15, 15)]),
}


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_dense(case):
    batch = make_batch(**CASES[case], dtype=torch.float32)
    square = mixed_squares(batch)
    expected, touched, lse = dense_expectation(batch, square_scores=square)
    initial = batch.score_cache.clone()
    accumulate_key_scores_ref(batch.q, batch.k_cache, batch.score_cache, batch.page_tables,
                              batch.cu_seqlens_q, batch.context_lens, lse, batch.scale, square_scores=square)
    assert_scores(batch, initial, expected, touched)


def test_attention_lse_gives_probabilities_summing_to_one():
    """With the lse of paged_attention_ref, exp(logit - lse) is each query's
    softmax: it sums to 1 over the keys the query sees, so each (sequence,
    KV head) gains exactly q_len * G in total, whatever its context length."""
    case = CASES["bs16-d64-g1"] | dict(group=4)
    batch = make_batch(**case, dtype=torch.float32)
    v_cache = torch.randn_like(batch.k_cache)
    padded_with_0 = batch.page_tables.clamp(min=0)   # as the engine pads: the reference gathers whole pages
    _, lse = paged_attention_ref(batch.q, batch.k_cache, v_cache, padded_with_0, batch.cu_seqlens_q,
                                 batch.context_lens, batch.scale, return_lse=True)
    Hkv = batch.page_tables.shape[1]
    initial = batch.score_cache.clone()
    accumulate_key_scores_ref(batch.q, batch.k_cache, batch.score_cache, batch.page_tables,
                              batch.cu_seqlens_q, batch.context_lens, lse, batch.scale)
    gained = (batch.score_cache - initial).double()
    for b in range(len(batch.context_lens)):
        start, end = int(batch.cu_seqlens_q[b]), int(batch.cu_seqlens_q[b + 1])
        for h in range(Hkv):
            logits, pages, offsets = dense_logits(batch, b, h)
            probs = torch.exp(logits - by_kv_head(lse[start:end].double(), Hkv)[h][..., None])
            torch.testing.assert_close(probs.sum(dim=-1), torch.ones_like(probs[..., 0]), rtol=0, atol=1e-5)
            torch.testing.assert_close(gained[pages, offsets].sum().item(), float(probs[..., 0].numel()),
                                       rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_dense(case, dtype):
    """Ragged heads, squared and plain sequences in one batch. Under the interpreter bf16 runs
    through the fp32-dot path; on a GPU, through bf16 dots."""
    batch = make_batch(**CASES[case], dtype=dtype)
    square = mixed_squares(batch)
    expected, touched, lse = dense_expectation(batch, square_scores=square)
    initial = batch.score_cache.clone()
    seqs = CASES[case]["seqs"]
    accumulate_key_scores_triton(batch.q, batch.k_cache, batch.score_cache, batch.page_tables,
                                 batch.cu_seqlens_q, batch.context_lens, lse, batch.scale,
                                 max_query_len=max(q for _, q in seqs), max_context_len=max(c for c, _ in seqs),
                                 square_scores=square)
    assert_scores(batch, initial, expected, touched, tol=1e-4 if KERNEL_DEVICE == "cuda" else 1e-5)


@pytest.mark.parametrize("kernel", ["ref", "triton"])
def test_only_queries_from_score_from_count(kernel):
    """score_from[b]: sequence b's queries before that index of its chunk add nothing
    (windowed rankings); an index past the chunk, or a negative one, is fine. Squared
    sequences (the odd ones) count the same queries."""
    batch = make_batch(**CASES["bs32-d128-g3"], dtype=torch.float32)
    score_from = torch.tensor([0, 20, 4, 3, -2], dtype=torch.int32, device=KERNEL_DEVICE)
    square = mixed_squares(batch)
    expected, touched, lse = dense_expectation(batch, score_from, square)
    initial = batch.score_cache.clone()
    accumulate = accumulate_key_scores_ref if kernel == "ref" else accumulate_key_scores_triton
    accumulate(batch.q, batch.k_cache, batch.score_cache, batch.page_tables, batch.cu_seqlens_q,
               batch.context_lens, lse, batch.scale, score_from, square_scores=square)
    assert_scores(batch, initial, expected, touched)


@pytest.mark.parametrize("kernel", ["ref", "triton"])
@pytest.mark.parametrize("case", ["bs16-d64-g1", "bs32-d128-g3"])
def test_only_pairs_far_enough_apart_count(kernel, case):
    """score_skip[b] (KVC-full): a query adds nothing to keys fewer than score_skip[b] positions
    before it; sequences that skip nothing (0), squared ones and score_from in the same batch."""
    batch = make_batch(**CASES[case], dtype=torch.float32)
    B = len(batch.context_lens)
    skip = skip_inputs(B, len(batch.q), batch.score_cache.shape, KERNEL_DEVICE)
    score_from = torch.tensor([0, 0, 4, 0, 0][:B], dtype=torch.int32, device=KERNEL_DEVICE)
    square = mixed_squares(batch)
    expected, touched, lse = dense_expectation(batch, score_from, square, skip)
    initial = batch.score_cache.clone()
    accumulate = accumulate_key_scores_ref if kernel == "ref" else accumulate_key_scores_triton
    score_skip, positions, pos_cache = skip
    accumulate(batch.q, batch.k_cache, batch.score_cache, batch.page_tables, batch.cu_seqlens_q,
               batch.context_lens, lse, batch.scale, score_from, square_scores=square, score_skip=score_skip,
               positions=positions, pos_cache=pos_cache)
    assert_scores(batch, initial, expected, touched)


def test_triton_launch_hints_are_optional_upper_bounds():
    """Without hints the kernel reads them from the tensors; loose ones only add idle programs."""
    batch = make_batch(**CASES["bs32-d128-g3"], dtype=torch.float32)
    expected, touched, lse = dense_expectation(batch)
    initial = batch.score_cache.clone()
    args = (batch.q, batch.k_cache, batch.score_cache, batch.page_tables, batch.cu_seqlens_q,
            batch.context_lens, lse, batch.scale)
    accumulate_key_scores_triton(*args)
    accumulate_key_scores_triton(*args, max_query_len=100, max_context_len=300)
    twice = 2 * expected - initial.double()   # both calls added the same probabilities
    assert_scores(batch, initial, twice, touched)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_dense_cuda(case, dtype):
    """Compiled for a real GPU: bf16 tensor-core dots, fp32 dots kept out of TF32."""
    batch = make_batch(**CASES[case], dtype=dtype)
    square = mixed_squares(batch)
    expected, touched, lse = dense_expectation(batch, square_scores=square)
    initial = batch.score_cache.clone()
    accumulate_key_scores_triton(batch.q, batch.k_cache, batch.score_cache, batch.page_tables,
                                 batch.cu_seqlens_q, batch.context_lens, lse, batch.scale, square_scores=square)
    torch.cuda.synchronize()
    assert_scores(batch, initial, expected, touched, tol=1e-4)
