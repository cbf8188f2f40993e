"""The Triton paged-attention kernels against the torch oracle (kernels/attention/reference.py)
and, for key scores, a dense float64 softmax.

On the CPU the kernels run in Triton's interpreter (conftest.py), so sizes stay
small; the tests marked `gpu` repeat the comparisons on CUDA in bf16 and fp32
at larger sizes. Inputs are fresh random numbers each run (the seed is printed,
so a failure can be replayed), and every tensor the wrappers allocate comes
back NaN-filled, so an element a kernel forgets to write fails the comparison.
"""
import random

import pytest
import torch

import kernels
from batches import (SCORE_TOL, TOL, make_cache, mixed_chunks, mixed_squares, param_id, ragged, scattered_tables,
                     skip_inputs, varlen_batch)
from helpers import KERNEL_DEVICE
from kernels.attention.decode import MIN_SPLIT, decode_workspace, logits_scratch, paged_decode_attention_triton
from kernels.attention.prefill import paged_attention_triton, split_counters
from kernels.attention.reference import paged_attention_ref
from kernels.kv_store import quantize


@pytest.fixture(autouse=True)
def seed():
    seed = random.randrange(2**31)
    print(f"torch seed {seed}")
    torch.manual_seed(seed)


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch):
    """torch.empty / torch.empty_like return NaN-filled float tensors during a test."""
    def poisoned(alloc):
        def allocate(*args, **kwargs):
            t = alloc(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return allocate
    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))


def dense_attention(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale,
                    score_from=None, square_scores=None, skip=None):
    """The float64 oracle, each (sequence, KV head) on its own with its keys walked slot by
    slot: out [T, Hq, D], lse [T, Hq] (-inf for a head with no slots) and the key scores
    [P, bs] the queries add (from query score_from[b] on; squared where square_scores[b]; with
    skip = skip_inputs(), only pairs whose positions are score_skip[b] or more apart)."""
    T, Hq, D = q.shape
    Hkv, block_size = tables.shape[1], k_cache.shape[1]
    G = Hq // Hkv
    out = torch.zeros(T, Hq, D, dtype=torch.float64, device=q.device)
    lse = torch.full((T, Hq), float("-inf"), dtype=torch.float64, device=q.device)
    scores = torch.zeros(k_cache.shape[:2], dtype=torch.float64, device=q.device)
    for b in range(len(context_lens)):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n, rows = end - start, slice(start, end)
        for h in range(Hkv):
            heads, slots = slice(h * G, (h + 1) * G), torch.arange(int(context_lens[b, h]), device=q.device)
            if len(slots) == 0:
                continue
            pages, offsets = tables[b, h, slots // block_size].long(), slots % block_size
            k, v = k_cache[pages, offsets].double(), v_cache[pages, offsets].double()
            logits = torch.einsum("ngd,ld->gnl", q[rows, heads].double(), k) * scale
            visible = slots <= (len(slots) - n + torch.arange(n, device=q.device))[:, None]
            logits.masked_fill_(~visible, float("-inf"))
            probs = logits.softmax(dim=-1)
            out[rows, heads] = torch.einsum("gnl,ld->ngd", probs, v)
            lse[rows, heads] = logits.logsumexp(dim=-1).T
            counted = probs
            if score_from is not None:
                counted = counted * (torch.arange(n, device=q.device) >= int(score_from[b]))[:, None]
            if skip is not None:
                score_skip, positions, pos_cache = skip
                counted = counted * (positions[rows, None] - pos_cache[pages, offsets] >= int(score_skip[b]))
            if square_scores is not None and square_scores[b]:
                counted = counted ** 2
            scores[pages, offsets] += counted.sum(dim=(0, 1))
    return out, lse, scores


def assert_close(actual, expected, tol, what):
    assert not actual.isnan().any(), f"{what}: NaN (an element left unwritten?)"
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


# ----------------------------------------------------------------------------
# Prefill, chunked prefill and mixed batches
# ----------------------------------------------------------------------------

def test_reference_matches_dense():
    """The oracle itself: a mixed batch with ragged heads, against the float64 walk."""
    block_size, Hkv, G, D = 16, 3, 2, 32
    chunks = mixed_chunks(block_size)
    q, cu_seqlens_q, context_lens = varlen_batch(chunks, Hkv, G, D, torch.float32, KERNEL_DEVICE)
    width = -(-int(context_lens.max()) // block_size)
    k_cache, v_cache = make_cache(len(chunks) * Hkv * width, block_size, D, torch.float32, KERNEL_DEVICE)
    tables = scattered_tables(context_lens, block_size, len(k_cache), width)
    out, lse = paged_attention_ref(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.2, return_lse=True)
    dense_out, dense_lse, _ = dense_attention(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.2)
    assert_close(out, dense_out, 1e-5, "out")
    assert_close(lse, dense_lse, 1e-5, "lse")


def check_mixed_batch(dtype, G, head_dim, block_size, num_kv_heads, device, chunks=None, num_splits=1, cache=None):
    chunks = chunks or mixed_chunks(block_size)
    q, cu_seqlens_q, context_lens = varlen_batch(chunks, num_kv_heads, G, head_dim, dtype, device)
    width = -(-int(context_lens.max()) // block_size) + 2
    num_pages = len(chunks) * num_kv_heads * width
    k_cache, v_cache = make_cache(num_pages, block_size, head_dim, dtype, device)
    scales = None
    if cache is not None:   # the kernel reads the 8-bit values, the reference their dequantized copy
        fmt = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[cache]
        (k_cache, k_scale), (v_cache, v_scale) = (quantize(x, fmt) for x in (k_cache, v_cache))
        scales = torch.stack([k_scale, v_scale], dim=-1)
    tables = scattered_tables(context_lens, block_size, num_pages, width)
    scale = head_dim ** -0.5
    max_query_len = max(n for _, n in chunks)
    out, lse = paged_attention_triton(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale,
                                      return_lse=True, max_query_len=max_query_len, num_splits=num_splits,
                                      kv_scales=scales)
    ref_out, ref_lse = paged_attention_ref(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale,
                                           return_lse=True, kv_scales=scales)
    assert out.dtype == dtype and lse.dtype == torch.float32
    out_tol, lse_tol = TOL[dtype]
    assert_close(out, ref_out, out_tol, "out")
    assert_close(lse, ref_lse, lse_tol, "lse")


@pytest.mark.parametrize("dtype,G,head_dim,block_size", [
    (torch.float32, 1, 64, 16),
    (torch.float16, 3, 64, 16),
    (torch.float32, 3, 128, 32),
    (torch.float16, 4, 128, 64),
    (torch.float16, 8, 64, 32),
    (torch.float32, 8, 64, 128),
    (torch.bfloat16, 4, 80, 32),     # the interpreter's bf16 upcast; a head_dim that is no power of 2
], ids=param_id)
def test_mixed_batch(dtype, G, head_dim, block_size):
    check_mixed_batch(dtype, G, head_dim, block_size, num_kv_heads=2, device=KERNEL_DEVICE)


@pytest.mark.parametrize("G", [1, 3, 8])
def test_decode_rows_only(G):
    """A batch of single-query rows takes the small query tile; max_query_len is left to the wrapper."""
    block_size = 16
    q, cu_seqlens_q, context_lens = varlen_batch([(n - 1, 1) for n in (1, 15, 16, 17, 90)],
                                                 2, G, 64, torch.float32, KERNEL_DEVICE)
    k_cache, v_cache = make_cache(60, block_size, 64, torch.float32, KERNEL_DEVICE)
    tables = scattered_tables(context_lens, block_size, 60, 8)
    out, lse = paged_attention_triton(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.125,
                                      return_lse=True)
    ref_out, ref_lse = paged_attention_ref(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.125,
                                           return_lse=True)
    assert_close(out, ref_out, 2e-5, "out")
    assert_close(lse, ref_lse, 2e-5, "lse")
    assert torch.equal(paged_attention_triton(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.125,
                                              max_query_len=1), out)


# Short chunks over long contexts (block-wise prefill), each context cut into splits: ragged heads,
# a fresh prompt, chunks spanning several query tiles and splits, a single query.
SPLIT_CHUNKS = [(0, 5), (230, 40), (700, 20), (900, 1)]   # (230, 40): split 1 starts mid-chunk


@pytest.mark.parametrize("dtype,G,num_splits", [(torch.float32, 1, 2), (torch.float16, 3, 5), (torch.bfloat16, 4, 3),
                                                (torch.float16, 8, 7)], ids=param_id)
def test_split_chunks(dtype, G, num_splits):
    """Every split's partial result merged: the reference's output and log-sum-exp, also where a
    split lies past a query (it sees none of it) and where splits outnumber a context's."""
    check_mixed_batch(dtype, G, 64, 16, num_kv_heads=2, device=KERNEL_DEVICE, chunks=SPLIT_CHUNKS,
                      num_splits=num_splits)


def test_split_launches_merge_each_tile_once_and_leave_the_counters_zero():
    """The last of a query tile's splits merges them in the same launch: launched again and again
    (on a GPU many tiles' splits racing to their counters), every launch gives the first's bits
    and leaves every counter zero for the next."""
    on_gpu = KERNEL_DEVICE == "cuda"
    chunks = [(900, 64), (2000, 40), (300, 128), (0, 7)] * (16 if on_gpu else 1)
    Hkv, G, D, block_size = 2, 4, 64, 16
    q, cu_seqlens_q, context_lens = varlen_batch(chunks, Hkv, G, D, torch.bfloat16, KERNEL_DEVICE)
    width = -(-int(context_lens.max()) // block_size)
    k_cache, v_cache = make_cache(len(chunks) * Hkv * width, block_size, D, torch.bfloat16, KERNEL_DEVICE)
    tables = scattered_tables(context_lens, block_size, len(k_cache), width)

    def launch():
        return paged_attention_triton(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.125,
                                      return_lse=True, max_query_len=128, num_splits=5)
    first = launch()
    for _ in range(200 if on_gpu else 1):
        assert all(torch.equal(a, b) for a, b in zip(launch(), first))
    assert not split_counters(1, q.device).any()


@pytest.mark.parametrize("cache", ["int8", "fp8"])
def test_split_chunks_over_a_quantized_cache(cache):
    check_mixed_batch(torch.float16, 4, 64, 16, num_kv_heads=2, device=KERNEL_DEVICE, chunks=SPLIT_CHUNKS,
                      num_splits=4, cache=cache)


def test_prefill_splits_fill_the_gpu_where_the_batch_does_not():
    """kernels.prefill_num_splits: a long prefill, or many chunks, takes one split; a few short
    chunks over long contexts take as many as give each SM a program, each of MIN_SPLIT slots at least."""
    gpu = torch.device("cuda", 0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kernels.attention.splits.prefill_wave", lambda device: 132)
        splits = lambda seqs, q_len, ctx: kernels.prefill_num_splits(seqs, q_len, 8, 4, torch.bfloat16, ctx, gpu)
        assert splits(1, 4096, 4096) == 1                    # 128 query tiles x 8 heads: enough
        assert splits(1, 64, 4096) == 8                      # 2 tiles x 8 heads: 8 splits make 128 programs
        assert splits(1, 64, 1024) == 1024 // MIN_SPLIT      # every split the context has
        assert splits(28, 64, 1088) == 1                     # block-wise prefill at batch 28
        assert splits(1, 64, 100) == 1

# ----------------------------------------------------------------------------
# Decode: split + merge, and key scores
# ----------------------------------------------------------------------------

def decode_batch(lens, num_kv_heads, G, head_dim, block_size, dtype, device, spare=3, full=False):
    """Decode inputs for head-0 context lengths `lens` (0: a CUDA-graph padding row, every
    head empty; others ragged): q, k_cache, v_cache, tables, context_lens [B, Hkv].
    full: every head holds lens[b] slots, so that the tables fit any shorter lengths."""
    context_lens = ragged(lens, num_kv_heads, lens if full else [min(n, 1) for n in lens], device)
    width = -(-max(lens) // block_size) + 1
    num_pages = len(lens) * num_kv_heads * width + spare      # some pages stay unused
    k_cache, v_cache = make_cache(num_pages, block_size, head_dim, dtype, device)
    tables = scattered_tables(context_lens, block_size, num_pages, width)
    q = torch.randn(len(lens), num_kv_heads * G, head_dim, device=device).to(dtype)
    return q, k_cache, v_cache, tables, context_lens


def check_decode(dtype, G, head_dim, block_size, num_kv_heads, num_splits, device, lens=None):
    """Decode with key scores (squared for every other sequence) added onto a nonzero score
    cache, against the oracle (out, lse) and the float64 walk (scores). Rows with
    context_len 0 must come out 0, without NaN."""
    lens = lens or [0, 1, block_size - 1, block_size, block_size + 1, 150, 0]
    q, k_cache, v_cache, tables, context_lens = decode_batch(lens, num_kv_heads, G, head_dim, block_size, dtype,
                                                             device)
    B, scale = len(lens), head_dim ** -0.5
    square = mixed_squares(B, device)
    score_cache = torch.rand(k_cache.shape[:2], device=device) + 1.0
    before = score_cache.clone()

    out, lse = paged_decode_attention_triton(q, k_cache, v_cache, tables, context_lens, scale, num_splits,
                                             return_lse=True, score_cache=score_cache, square_scores=square)

    live = context_lens[:, 0] > 0
    cu_seqlens_q = torch.arange(B + 1, dtype=torch.int32, device=device)
    ref_out, ref_lse = paged_attention_ref(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale,
                                           return_lse=True)
    out_tol, lse_tol = TOL[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out[live], ref_out[live], out_tol, "out")
    assert_close(lse[live], ref_lse[live], lse_tol, "lse")
    assert torch.equal(out[~live], torch.zeros_like(out[~live])), "context_len 0 rows must be 0"
    assert (lse[~live] == float("-inf")).all()

    added = dense_attention(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale,
                            square_scores=square)[2]
    touched = added != 0
    assert_close(score_cache, before.double() + added, SCORE_TOL[dtype], "score_cache")
    assert torch.equal(score_cache[~touched], before[~touched]), "slots nobody sees must be untouched"


@pytest.mark.parametrize("dtype,G,head_dim,block_size,num_splits", [
    (torch.float32, 1, 64, 16, 1),
    (torch.float16, 3, 64, 16, 4),
    (torch.float32, 4, 128, 32, 3),
    (torch.float16, 8, 64, 64, 8),
    (torch.float32, 3, 128, 128, 2),
    (torch.bfloat16, 3, 80, 32, 5),
], ids=param_id)
def test_decode(dtype, G, head_dim, block_size, num_splits):
    check_decode(dtype, G, head_dim, block_size, num_kv_heads=2, num_splits=num_splits, device=KERNEL_DEVICE)


def test_decode_without_scores_matches():
    """The score path only adds work: out and lse are the same without it."""
    q, k_cache, v_cache, tables, context_lens = decode_batch([5, 70, 33], 2, 4, 64, 16, torch.float32,
                                                             KERNEL_DEVICE)
    scores = torch.zeros(k_cache.shape[:2], device=KERNEL_DEVICE)
    args = (q, k_cache, v_cache, tables, context_lens, 0.125, 3)
    with_scores = paged_decode_attention_triton(*args, return_lse=True, score_cache=scores)
    without = paged_decode_attention_triton(*args, return_lse=True)
    assert torch.equal(with_scores[0], without[0]) and torch.equal(with_scores[1], without[1])
    assert not isinstance(paged_decode_attention_triton(*args), tuple)


def test_decode_scores_only_where_score_from_allows():
    """score_from > 0: the sequence's one query is before its window, so it adds no score
    (windowed rankings); its output is the same either way, and so with squared scores."""
    q, k_cache, v_cache, tables, context_lens = decode_batch([5, 70, 33, 300], 2, 3, 64, 16, torch.float32,
                                                             KERNEL_DEVICE)
    score_from = torch.tensor([0, 1, -3, 2**31 - 1], dtype=torch.int32, device=KERNEL_DEVICE)
    square = torch.tensor([False, True, True, False], device=KERNEL_DEVICE)
    scores = torch.zeros(k_cache.shape[:2], device=KERNEL_DEVICE)
    args = (q, k_cache, v_cache, tables, context_lens, 0.125, 3)
    out = paged_decode_attention_triton(*args, score_cache=scores, score_from=score_from, square_scores=square)
    assert torch.equal(out, paged_decode_attention_triton(*args))
    expected = dense_attention(q, k_cache, v_cache, tables, torch.arange(5, device=KERNEL_DEVICE), context_lens,
                               0.125, score_from=score_from, square_scores=square)[2]
    assert_close(scores, expected, SCORE_TOL[torch.float32], "scores")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_scores_only_pairs_far_enough_apart(num_splits):
    """score_skip (KVC-full): a sequence's query adds nothing to the keys fewer than
    score_skip[b] positions before it; 0 skips nothing. Mixed with squared sequences and
    with score_from, and the output is the same as without scores."""
    lens = [5, 70, 33, 300, 17, 150]
    q, k_cache, v_cache, tables, context_lens = decode_batch(lens, 2, 3, 64, 16, torch.float32, KERNEL_DEVICE)
    skip = skip_inputs(len(lens), len(lens), k_cache.shape[:2], KERNEL_DEVICE)
    score_from = torch.tensor([0, 0, 0, 0, 1, 0], dtype=torch.int32, device=KERNEL_DEVICE)
    square = mixed_squares(len(lens), KERNEL_DEVICE)
    scores = torch.zeros(k_cache.shape[:2], device=KERNEL_DEVICE)
    args = (q, k_cache, v_cache, tables, context_lens, 0.125, num_splits)
    out = paged_decode_attention_triton(*args, score_cache=scores, score_from=score_from, square_scores=square,
                                        score_skip=skip[0], positions=skip[1], pos_cache=skip[2])
    assert torch.equal(out, paged_decode_attention_triton(*args))
    expected = dense_attention(q, k_cache, v_cache, tables, torch.arange(len(lens) + 1, device=KERNEL_DEVICE),
                               context_lens, 0.125, score_from=score_from, square_scores=square, skip=skip)[2]
    assert_close(scores, expected, SCORE_TOL[torch.float32], "scores")
    assert 0 < int((expected > 0).sum()) < int(context_lens.sum())   # some pairs count, others are skipped


def test_decode_workspace_reuse():
    """As under CUDA-graph replay: one workspace and one logits scratch, sized for a
    bigger batch, serve calls whose context lengths change; they are never cleared."""
    Hkv, G, D, block_size, num_splits, width = 2, 3, 64, 16, 4, 8
    q, k_cache, v_cache, tables, _ = decode_batch([width * block_size] * 3, Hkv, G, D, block_size,
                                                  torch.float16, KERNEL_DEVICE, full=True)
    workspace = decode_workspace(6 * Hkv * G * num_splits, D, device=KERNEL_DEVICE)
    logits = logits_scratch(len(k_cache), G, block_size, KERNEL_DEVICE)
    cu_seqlens_q = torch.arange(4, dtype=torch.int32, device=KERNEL_DEVICE)
    for lens in ([100, 0, 3], [7, 128, 64]):
        context_lens = ragged(lens, Hkv, [min(n, 1) for n in lens], KERNEL_DEVICE)
        scores = torch.zeros(k_cache.shape[:2], device=KERNEL_DEVICE)
        out = paged_decode_attention_triton(q, k_cache, v_cache, tables, context_lens, 0.125, num_splits,
                                            score_cache=scores, logits=logits, workspace=workspace)
        ref = paged_attention_ref(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.125)
        live = context_lens[:, 0] > 0
        assert_close(out[live], ref[live], TOL[torch.float16][0], "out")
        expected = dense_attention(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.125)[2]
        assert_close(scores, expected, SCORE_TOL[torch.float16], "scores")
    assert not workspace.counters.any(), "every call leaves its counters zero"
    with pytest.raises(ValueError, match="decode workspace holds"):
        paged_decode_attention_triton(q, k_cache, v_cache, tables, context_lens, 0.125, 64, workspace=workspace)


def test_decode_launches_merge_each_head_once_and_leave_the_counters_zero():
    """The last of a (sequence, KV head)'s splits merges them in the same launch: launched again
    and again (on a GPU many heads' splits racing to their counters), every launch gives the
    first's bits, and leaves every counter zero."""
    on_gpu = KERNEL_DEVICE == "cuda"
    lens = [900, 2000, 300, 0, 64] * (16 if on_gpu else 1)
    Hkv, G, D, block_size, num_splits = 2, 4, 64, 16, 5
    q, k_cache, v_cache, tables, context_lens = decode_batch(lens, Hkv, G, D, block_size, torch.bfloat16,
                                                             KERNEL_DEVICE)
    workspace = decode_workspace(len(lens) * Hkv * G * num_splits, D, KERNEL_DEVICE)

    def launch():
        return paged_decode_attention_triton(q, k_cache, v_cache, tables, context_lens, 0.125, num_splits,
                                             return_lse=True, workspace=workspace)
    first = launch()
    for _ in range(200 if on_gpu else 1):
        assert all(torch.equal(a, b) for a, b in zip(launch(), first))
    assert not workspace.counters.any()


def test_decode_splits_follow_each_context():
    """Each (sequence, KV head) cuts its own context into splits of at least MIN_SPLIT slots,
    whatever the table's width: a table as wide as a long max_model_len does not leave all
    the work to one split, and a short context uses only its first splits."""
    G, D, block_size, num_splits = 2, 16, 16, 8
    width = 1024   # a 16k-slot table
    lens = [0, 100, MIN_SPLIT, MIN_SPLIT + 1, 3 * MIN_SPLIT, 8 * MIN_SPLIT + 5]
    context_lens = torch.tensor([lens, lens[::-1]], dtype=torch.int32,   # two heads, unlike
                                device=KERNEL_DEVICE).T.contiguous()
    num_pages = int(((context_lens + block_size - 1) // block_size).sum()) + 1
    k_cache, v_cache = make_cache(num_pages, block_size, D, torch.float16, KERNEL_DEVICE)
    tables = scattered_tables(context_lens, block_size, num_pages, width)
    q = torch.randn(len(lens), 2 * G, D, device=KERNEL_DEVICE).half()
    workspace = decode_workspace(len(lens) * 2 * G * num_splits, D, KERNEL_DEVICE)
    out = paged_decode_attention_triton(q, k_cache, v_cache, tables, context_lens, 0.25, num_splits,
                                        workspace=workspace)
    ref = paged_attention_ref(q, k_cache, v_cache, tables,
                              torch.arange(len(lens) + 1, dtype=torch.int32, device=KERNEL_DEVICE), context_lens, 0.25)
    # Rows 0 and 5 each have a head with no keys: compare the other head.
    assert_close(out[1:, :G], ref[1:, :G], TOL[torch.float16][0], "out")
    assert_close(out[:-1, G:], ref[:-1, G:], TOL[torch.float16][0], "out")
    _, partial_lse, _ = workspace.views(len(lens), 2 * G, num_splits, D)
    used = (partial_lse[:, ::G] > float("-inf")).sum(dim=-1).T.tolist()   # splits that held slots, per head
    # 2053 slots: cdiv(2053, 8) = 257, a whole number of 64-slot fp16 tiles is 320, so 7 splits
    # (cut from the table's 16384 slots instead, split 0 would hold them all).
    assert used == [[0, 1, 1, 2, 3, 7], [7, 3, 2, 1, 1, 0]]


def on_both_backends(attend, score_shape) -> dict:
    """backend -> (out, scores) of attend(scores), a kernels.paged_attention call adding to a
    fresh score cache, on the references and on the Triton kernels."""
    results, before = {}, kernels.forced_backend()
    try:
        for backend in ("torch", "triton"):
            kernels.set_backend(backend)
            scores = torch.zeros(score_shape, device=KERNEL_DEVICE)
            results[backend] = attend(scores), scores
    finally:
        kernels.set_backend(before)
    return results


def test_mixed_step_sends_decodes_to_flash_decoding(monkeypatch):
    """kernels.paged_attention with the decodes first: their rows go to flash-decoding,
    the chunks to the prefill kernel; out and the key scores (plain and squared, KVC-full's
    skipping and not) match the references and the float64 oracle."""
    block_size, Hkv, G, D = 16, 2, 3, 64
    chunks = [(20, 1), (0, 1), (47, 1), (0, 37), (block_size + 3, 45)]
    q, cu_seqlens_q, context_lens = varlen_batch(chunks, Hkv, G, D, torch.float32, KERNEL_DEVICE)
    width = 6
    num_pages = len(chunks) * Hkv * width
    k_cache, v_cache = make_cache(num_pages, block_size, D, torch.float32, KERNEL_DEVICE)
    tables = scattered_tables(context_lens, block_size, num_pages, width)
    square = mixed_squares(len(chunks), KERNEL_DEVICE)
    skip = skip_inputs(len(chunks), len(q), k_cache.shape[:2], KERNEL_DEVICE)
    launched = []
    real_decode = kernels.paged_decode_attention_triton
    monkeypatch.setattr(kernels, "paged_decode_attention_triton",
                        lambda q, *args, **kw: launched.append(q.shape[0]) or real_decode(q, *args, **kw))
    results = on_both_backends(lambda scores: kernels.paged_attention(
        q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.125, max_query_len=45, max_context_len=64,
        num_decodes=3, score_cache=scores, square_scores=square, score_skip=skip[0], positions=skip[1],
        pos_cache=skip[2]), k_cache.shape[:2])
    assert launched == [3]
    assert_close(results["triton"][0], results["torch"][0], TOL[torch.float32][0], "out")
    assert_close(results["triton"][1], results["torch"][1], SCORE_TOL[torch.float32], "scores")
    expected = dense_attention(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.125,
                               square_scores=square, skip=skip)[2]
    assert_close(results["triton"][1], expected, SCORE_TOL[torch.float32], "scores")


def test_one_layer_of_rows_per_sequence_is_read_through_its_strides():
    """Where every sequence of a step has pages of its own, the runner hands the kernels each
    layer's tables and lengths as views of rows [B, L, Hkv, ...] (ModelRunner._step_pages):
    flash-decoding and the prefill kernel give what they give on contiguous copies."""
    block_size, Hkv, G, D, L = 16, 2, 3, 64, 3
    chunks = [(20, 1), (47, 1), (block_size + 3, 45)]
    q, cu_seqlens_q, context_lens = varlen_batch(chunks, Hkv, G, D, torch.float32, KERNEL_DEVICE)
    num_pages = len(chunks) * Hkv * 6
    k_cache, v_cache = make_cache(num_pages, block_size, D, torch.float32, KERNEL_DEVICE)
    tables = scattered_tables(context_lens, block_size, num_pages, 6)
    rows = torch.zeros(len(chunks), L, *tables.shape[1:], dtype=tables.dtype, device=KERNEL_DEVICE)
    lens = torch.zeros(len(chunks), L, Hkv, dtype=context_lens.dtype, device=KERNEL_DEVICE)
    rows[:, 1], lens[:, 1] = tables, context_lens
    strided = rows.transpose(0, 1)[1], lens.transpose(0, 1)[1]
    assert not strided[0].is_contiguous() and not strided[1].is_contiguous()
    results = [on_both_backends(lambda scores: kernels.paged_attention(
        q, k_cache, v_cache, layer_tables, cu_seqlens_q, layer_lens, 0.125, max_query_len=45, max_context_len=64,
        num_decodes=2, score_cache=scores), k_cache.shape[:2])["triton"]
        for layer_tables, layer_lens in (strided, (tables, context_lens))]
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_a_step_of_short_chunks_over_long_contexts_splits_them(monkeypatch):
    """kernels.paged_attention on a GPU's aim of programs (few query tiles): the chunks' contexts
    are split, and out and the key scores (from the merged log-sum-exps) match the references."""
    block_size, Hkv, G, D = 16, 2, 4, 64
    chunks = [(600, 20), (280, 30)]
    q, cu_seqlens_q, context_lens = varlen_batch(chunks, Hkv, G, D, torch.float32, KERNEL_DEVICE)
    width = 40
    k_cache, v_cache = make_cache(len(chunks) * Hkv * width, block_size, D, torch.float32, KERNEL_DEVICE)
    tables = scattered_tables(context_lens, block_size, len(k_cache), width)
    monkeypatch.setattr("kernels.attention.splits.prefill_wave", lambda device: 132)   # an H100's SMs
    splits = []
    real_prefill = kernels.paged_attention_triton
    monkeypatch.setattr(kernels, "paged_attention_triton",
                        lambda *args, num_splits, **kw: splits.append(num_splits) or real_prefill(
                            *args, num_splits=num_splits, **kw))
    results = on_both_backends(lambda scores: kernels.paged_attention(
        q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.125, max_query_len=30, max_context_len=620,
        score_cache=scores), k_cache.shape[:2])
    assert splits == [3]   # 620 slots: 3 splits of at least MIN_SPLIT
    assert_close(results["triton"][0], results["torch"][0], TOL[torch.float32][0], "out")
    assert_close(results["triton"][1], results["torch"][1], SCORE_TOL[torch.float32], "scores")


# ----------------------------------------------------------------------------
# The same comparisons on a GPU, at sizes the interpreter could not afford
# ----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=param_id)
@pytest.mark.parametrize("G,head_dim,block_size", [(1, 128, 16), (3, 64, 16), (4, 128, 32), (8, 128, 256)])
@pytest.mark.parametrize("num_splits", [1, 6])
def test_mixed_batch_gpu(dtype, G, head_dim, block_size, num_splits):
    chunks = mixed_chunks(block_size) + [(1000, 300), (0, 513), (2047, 1), (4900, 64)]
    check_mixed_batch(dtype, G, head_dim, block_size, num_kv_heads=4, device=KERNEL_DEVICE, chunks=chunks,
                      num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=param_id)
@pytest.mark.parametrize("G,head_dim,block_size,num_splits", [(3, 64, 16, 16), (4, 128, 32, 7), (8, 128, 256, 32)])
def test_decode_gpu(dtype, G, head_dim, block_size, num_splits):
    lens = [0, 1, block_size - 1, block_size, block_size + 1, 700, 4000, 0]
    check_decode(dtype, G, head_dim, block_size, num_kv_heads=4, num_splits=num_splits, device=KERNEL_DEVICE,
                 lens=lens)


@pytest.mark.gpu
def test_decode_cuda_graph_replay():
    """Captured once, replayed with other (ragged) context lengths: the static grid at work."""
    Hkv, G, D, block_size, num_splits, width = 4, 3, 64, 16, 8, 64
    q, k_cache, v_cache, tables, context_lens = decode_batch([width * block_size] * 4, Hkv, G, D, block_size,
                                                             torch.bfloat16, KERNEL_DEVICE, full=True)
    context_lens.fill_(1)
    scores = torch.zeros(k_cache.shape[:2], device=KERNEL_DEVICE)
    square = mixed_squares(4, KERNEL_DEVICE)
    workspace = decode_workspace(4 * Hkv * G * num_splits, D, device=KERNEL_DEVICE)
    logits = logits_scratch(len(k_cache), G, block_size, KERNEL_DEVICE)

    def run():
        return paged_decode_attention_triton(q, k_cache, v_cache, tables, context_lens, 0.125, num_splits,
                                             score_cache=scores, logits=logits, workspace=workspace,
                                             square_scores=square)

    run()   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    cu_seqlens_q = torch.arange(5, dtype=torch.int32, device=KERNEL_DEVICE)
    for lens in ([1000, 0, 17, 64], [3, 1024, 512, 999]):
        context_lens.copy_(ragged(lens, Hkv, [min(n, 1) for n in lens], KERNEL_DEVICE))
        scores.zero_()
        graph.replay()
        ref = paged_attention_ref(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.125)
        live = context_lens[:, 0] > 0
        assert_close(out[live], ref[live], TOL[torch.bfloat16][0], "out")
        assert torch.equal(out[~live], torch.zeros_like(out[~live]))
        expected = dense_attention(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.125,
                                   square_scores=square)[2]
        assert_close(scores, expected, SCORE_TOL[torch.bfloat16], "scores")
