"""The Triton paged-attention kernels against the torch oracle (kernels/attention.py)
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

from helpers import KERNEL_DEVICE
from kernels.attention import paged_attention_ref
from kernels.attention_triton import paged_attention_triton
import kernels
from kernels.decode_attention import MIN_SPLIT, decode_workspace, logits_scratch, paged_decode_attention_triton

# (out, lse) absolute = relative tolerances. 16-bit outputs are rounded once,
# and the probabilities meet V in 16 bits, as in every flash-attention kernel;
# scores and lse come from exact products summed in fp32, in any dtype.
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 1e-4), torch.bfloat16: (2e-2, 2e-4)}
SCORE_TOL = {torch.float32: 2e-5, torch.float16: 1e-4, torch.bfloat16: 2e-4}


def param_id(value):
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


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


# ----------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------

def make_cache(num_blocks, num_kv_heads, block_size, head_dim, dtype, device):
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    return (torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype))


def scattered_tables(context_lens, block_size, num_blocks, width, num_kv_heads=None, device="cpu"):
    """Block tables [B, width] (or [B, Hkv, width] with its own blocks per head)
    whose ids are a random permutation of the pool: non-contiguous, and never
    shared. Unused entries are 0, as the runner pads them."""
    heads = 1 if num_kv_heads is None else num_kv_heads
    needed = [-(-n // block_size) for n in context_lens]
    assert heads * sum(needed) <= num_blocks and max(needed) <= width
    ids = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(context_lens), heads, width, dtype=torch.int32)
    for b, n in enumerate(needed):
        for h in range(heads):
            tables[b, h, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    tables = tables.to(device)
    return tables[:, 0] if num_kv_heads is None else tables


def varlen_batch(chunks, num_heads, head_dim, dtype, device):
    """chunks: (prior context, q_len) per sequence -> q, cu_seqlens_q, context_lens."""
    q_lens = torch.tensor([n for _, n in chunks], dtype=torch.int32)
    cu_seqlens_q = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = q_lens.cumsum(0)
    context_lens = torch.tensor([p + n for p, n in chunks], dtype=torch.int32)
    q = torch.randn(int(cu_seqlens_q[-1]), num_heads, head_dim, device=device).to(dtype)
    return q, cu_seqlens_q.to(device), context_lens.to(device)


def mixed_chunks(block_size):
    """A fresh prefill, chunked prefills with prior context (one spanning
    several query tiles), and decodes at the block-boundary edge cases."""
    decodes = [(n - 1, 1) for n in (1, block_size - 1, block_size, block_size + 1, 2 * block_size + 5)]
    return [(0, 37), (block_size + 3, 45), (0, block_size)] + decodes + [(30, 70)]


def reference_per_head(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale):
    """The oracle for [B, Hkv, nb] tables: one KV head (and its query heads) at a time."""
    Hkv = k_cache.shape[1]
    G = q.shape[1] // Hkv
    outs, lses = zip(*(paged_attention_ref(q[:, h * G:(h + 1) * G], k_cache[:, h:h + 1], v_cache[:, h:h + 1],
                                           tables[:, h], cu_seqlens_q, context_lens, scale, return_lse=True)
                       for h in range(Hkv)))
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def dense_key_scores(q, k_cache, tables, context_lens, scale):
    """float64 key scores, [num_blocks, Hkv, block_size]: for each slot, the softmax
    probabilities its key got from the decode queries, summed over the query
    heads of its KV head. tables: [B, Hkv, nb]."""
    num_blocks, Hkv, block_size, _ = k_cache.shape
    G = q.shape[1] // Hkv
    scores = torch.zeros(num_blocks, Hkv, block_size, dtype=torch.float64, device=q.device)
    for b, n in enumerate(context_lens.tolist()):
        slots = torch.arange(n, device=q.device)
        for h in range(Hkv):
            blocks = tables[b, h, slots // block_size].long()
            k = k_cache[blocks, h, slots % block_size].double()
            probs = (q[b, h * G:(h + 1) * G].double() @ k.T * scale).softmax(dim=-1)
            scores[blocks, h, slots % block_size] += probs.sum(0)
    return scores


def assert_close(actual, expected, tol, what):
    assert not actual.isnan().any(), f"{what}: NaN (an element left unwritten?)"
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


# ----------------------------------------------------------------------------
# Prefill, chunked prefill and mixed batches
# ----------------------------------------------------------------------------

def check_mixed_batch(dtype, G, head_dim, block_size, num_kv_heads, device, chunks=None):
    chunks = chunks or mixed_chunks(block_size)
    q, cu_seqlens_q, context_lens = varlen_batch(chunks, num_kv_heads * G, head_dim, dtype, device)
    width = max(-(-int(n) // block_size) for n in context_lens) + 2
    num_blocks = len(chunks) * width
    k_cache, v_cache = make_cache(num_blocks, num_kv_heads, block_size, head_dim, dtype, device)
    tables = scattered_tables(context_lens.tolist(), block_size, num_blocks, width, device=device)
    scale = head_dim ** -0.5
    max_query_len = max(n for _, n in chunks)
    out, lse = paged_attention_triton(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale,
                                      return_lse=True, max_query_len=max_query_len)
    ref_out, ref_lse = paged_attention_ref(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale,
                                           return_lse=True)
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
                                                 2 * G, 64, torch.float32, KERNEL_DEVICE)
    k_cache, v_cache = make_cache(40, 2, block_size, 64, torch.float32, KERNEL_DEVICE)
    tables = scattered_tables(context_lens.tolist(), block_size, 40, 8)
    out, lse = paged_attention_triton(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.125,
                                      return_lse=True)
    ref_out, ref_lse = paged_attention_ref(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.125,
                                           return_lse=True)
    assert_close(out, ref_out, 2e-5, "out")
    assert_close(lse, ref_lse, 2e-5, "lse")
    assert torch.equal(paged_attention_triton(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.125,
                                              max_query_len=1), out)


def test_per_head_block_tables():
    """[B, Hkv, nb] tables: the shared table expanded gives the 2-D result exactly;
    tables whose heads use different blocks match the oracle run head by head."""
    dtype, G, Hkv, D, block_size = torch.float16, 3, 3, 64, 16
    chunks = [(0, 20), (18, 1), (40, 30), (16, 1)]
    q, cu_seqlens_q, context_lens = varlen_batch(chunks, Hkv * G, D, dtype, KERNEL_DEVICE)
    num_blocks = 64
    k_cache, v_cache = make_cache(num_blocks, Hkv, block_size, D, dtype, KERNEL_DEVICE)
    args = (cu_seqlens_q, context_lens, D ** -0.5)

    shared = scattered_tables(context_lens.tolist(), block_size, num_blocks, 6)
    out_2d, lse_2d = paged_attention_triton(q, k_cache, v_cache, shared, *args, return_lse=True)
    expanded = shared[:, None].expand(-1, Hkv, -1)
    out_3d, lse_3d = paged_attention_triton(q, k_cache, v_cache, expanded, *args, return_lse=True)
    assert torch.equal(out_3d, out_2d) and torch.equal(lse_3d, lse_2d)
    copied = paged_attention_triton(q, k_cache, v_cache, expanded.contiguous(), *args)
    assert torch.equal(copied, out_2d)

    per_head = scattered_tables(context_lens.tolist(), block_size, num_blocks, 6, num_kv_heads=Hkv)
    out, lse = paged_attention_triton(q, k_cache, v_cache, per_head, *args, return_lse=True)
    ref_out, ref_lse = reference_per_head(q, k_cache, v_cache, per_head, *args)
    assert_close(out, ref_out, TOL[dtype][0], "out")
    assert_close(lse, ref_lse, TOL[dtype][1], "lse")


# ----------------------------------------------------------------------------
# Decode: split + merge, and key scores
# ----------------------------------------------------------------------------

def check_decode(dtype, G, head_dim, block_size, num_kv_heads, num_splits, device,
                 context_lens=None, per_head_tables=False):
    """Decode with key scores added onto a nonzero score cache, against the
    oracle (out, lse) and a dense float64 softmax (scores). Rows with
    context_len 0 must come out 0, without NaN."""
    if context_lens is None:
        context_lens = [0, 1, block_size - 1, block_size, block_size + 1, 150, 0]
    B, Hkv, Hq = len(context_lens), num_kv_heads, num_kv_heads * G
    width = max(-(-n // block_size) for n in context_lens) + 1
    num_blocks = (Hkv if per_head_tables else 1) * B * width + 3      # some blocks stay unused
    k_cache, v_cache = make_cache(num_blocks, Hkv, block_size, head_dim, dtype, device)
    tables = scattered_tables(context_lens, block_size, num_blocks, width,
                              num_kv_heads=Hkv if per_head_tables else None, device=device)
    tables_3d = tables if per_head_tables else tables[:, None].expand(-1, Hkv, -1)
    context_lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    q = torch.randn(B, Hq, head_dim, device=device).to(dtype)
    scale = head_dim ** -0.5
    score_cache = torch.rand(num_blocks, Hkv, block_size, device=device) + 1.0
    before = score_cache.clone()

    out, lse = paged_decode_attention_triton(q, k_cache, v_cache, tables, context_lens, scale, num_splits,
                                             return_lse=True, score_cache=score_cache)

    live = context_lens > 0
    cu_seqlens_q = torch.arange(B + 1, dtype=torch.int32, device=device)
    if per_head_tables:
        ref_out, ref_lse = reference_per_head(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale)
    else:
        ref_out, ref_lse = paged_attention_ref(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale,
                                               return_lse=True)
    out_tol, lse_tol = TOL[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out[live], ref_out[live], out_tol, "out")
    assert_close(lse[live], ref_lse[live], lse_tol, "lse")
    assert torch.equal(out[~live], torch.zeros_like(out[~live])), "context_len 0 rows must be 0"
    assert (lse[~live] == float("-inf")).all()

    added = dense_key_scores(q, k_cache, tables_3d, context_lens, scale)
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


def test_decode_per_head_tables():
    check_decode(torch.float16, 3, 64, 16, num_kv_heads=3, num_splits=3, device=KERNEL_DEVICE,
                 context_lens=[17, 0, 100, 1], per_head_tables=True)


def test_decode_without_scores_matches():
    """The score path only adds work: out and lse are the same without it."""
    Hkv, G, D, block_size = 2, 4, 64, 16
    context_lens = torch.tensor([5, 70, 33], dtype=torch.int32)
    k_cache, v_cache = make_cache(20, Hkv, block_size, D, torch.float32, KERNEL_DEVICE)
    tables = scattered_tables(context_lens.tolist(), block_size, 20, 6)
    q = torch.randn(3, Hkv * G, D)
    scores = torch.zeros(20, Hkv, block_size)
    with_scores = paged_decode_attention_triton(q, k_cache, v_cache, tables, context_lens, 0.125, 3,
                                                return_lse=True, score_cache=scores)
    without = paged_decode_attention_triton(q, k_cache, v_cache, tables, context_lens, 0.125, 3, return_lse=True)
    assert torch.equal(with_scores[0], without[0]) and torch.equal(with_scores[1], without[1])
    assert not isinstance(paged_decode_attention_triton(q, k_cache, v_cache, tables, context_lens, 0.125, 3),
                          tuple)


def test_decode_scores_only_where_score_from_allows():
    """score_from > 0: the sequence's one query is before its window, so it adds no score
    (windowed rankings); its output is the same either way."""
    Hkv, G, D, block_size = 2, 3, 64, 16
    context_lens = torch.tensor([5, 70, 33, 300], dtype=torch.int32, device=KERNEL_DEVICE)
    score_from = torch.tensor([0, 1, -3, 2**31 - 1], dtype=torch.int32, device=KERNEL_DEVICE)
    k_cache, v_cache = make_cache(40, Hkv, block_size, D, torch.float32, KERNEL_DEVICE)
    tables = scattered_tables(context_lens.tolist(), block_size, 40, 20, device=KERNEL_DEVICE)
    q = torch.randn(4, Hkv * G, D, device=KERNEL_DEVICE)
    scores = torch.zeros(40, Hkv, block_size, device=KERNEL_DEVICE)
    out = paged_decode_attention_triton(q, k_cache, v_cache, tables, context_lens, 0.125, 3, score_cache=scores,
                                        score_from=score_from)
    without = paged_decode_attention_triton(q, k_cache, v_cache, tables, context_lens, 0.125, 3)
    assert torch.equal(out, without)
    counted = torch.where(score_from <= 0, context_lens, 0)
    expected = dense_key_scores(q, k_cache, tables[:, None].expand(-1, Hkv, -1), counted, 0.125)
    assert_close(scores, expected, SCORE_TOL[torch.float32], "scores")


def test_decode_workspace_reuse():
    """As under CUDA-graph replay: one workspace and one logits scratch, sized for a
    bigger batch, serve calls whose context lengths change; they are never cleared."""
    Hkv, G, D, block_size, num_splits, width = 2, 3, 64, 16, 4, 8
    workspace = decode_workspace(6 * Hkv * G * num_splits, D, device=KERNEL_DEVICE)
    logits = logits_scratch(32, Hkv * G, block_size, KERNEL_DEVICE)
    k_cache, v_cache = make_cache(32, Hkv, block_size, D, torch.float16, KERNEL_DEVICE)
    tables = scattered_tables([width * block_size] * 3, block_size, 32, width)
    q = torch.randn(3, Hkv * G, D).to(torch.float16)
    cu_seqlens_q = torch.arange(4, dtype=torch.int32)
    for lens in ([100, 0, 3], [7, 128, 64]):
        context_lens = torch.tensor(lens, dtype=torch.int32)
        scores = torch.zeros(32, Hkv, block_size)
        out = paged_decode_attention_triton(q, k_cache, v_cache, tables, context_lens, 0.125, num_splits,
                                            score_cache=scores, logits=logits, workspace=workspace)
        ref = paged_attention_ref(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.125)
        live = context_lens > 0
        assert_close(out[live], ref[live], TOL[torch.float16][0], "out")
        expected = dense_key_scores(q, k_cache, tables[:, None].expand(-1, Hkv, -1), context_lens, 0.125)
        assert_close(scores, expected, SCORE_TOL[torch.float16], "scores")
    with pytest.raises(ValueError, match="decode workspace holds"):
        paged_decode_attention_triton(q, k_cache, v_cache, tables, context_lens, 0.125, 64, workspace=workspace)


def test_decode_splits_follow_each_context():
    """Each sequence cuts its own context into splits of at least MIN_SPLIT slots, whatever
    the table's width: a table as wide as a long max_model_len does not leave all the work
    to one split, and a short context uses only its first splits."""
    Hkv, G, D, block_size, num_splits = 1, 2, 16, 16, 8
    width = 1024   # a 16k-slot table
    lens = [0, 100, MIN_SPLIT, MIN_SPLIT + 1, 3 * MIN_SPLIT, 8 * MIN_SPLIT + 5]
    num_blocks = sum(-(-n // block_size) for n in lens) + 1
    k_cache, v_cache = make_cache(num_blocks, Hkv, block_size, D, torch.float16, KERNEL_DEVICE)
    tables = scattered_tables(lens, block_size, num_blocks, width)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), Hkv * G, D).half()
    workspace = decode_workspace(len(lens) * Hkv * G * num_splits, D, KERNEL_DEVICE)
    out = paged_decode_attention_triton(q, k_cache, v_cache, tables, context_lens, 0.25, num_splits,
                                        workspace=workspace)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, torch.arange(len(lens) + 1, dtype=torch.int32),
                              context_lens, 0.25)
    assert_close(out[1:], ref[1:], TOL[torch.float16][0], "out")   # row 0: context 0, no keys
    _, partial_lse = workspace.views(len(lens), Hkv * G, num_splits, D)
    used = (partial_lse[:, 0] > float("-inf")).sum(dim=-1).tolist()   # splits that held slots
    # 2053 slots: cdiv(2053, 8) = 257, a whole number of 64-slot fp16 tiles is 320, so 7 splits
    # (cut from the table's 16384 slots instead, split 0 would hold them all).
    assert used == [0, 1, 1, 2, 3, 7]


def test_mixed_step_sends_decodes_to_flash_decoding(monkeypatch):
    """kernels.paged_attention with the decodes first: their rows go to flash-decoding,
    the chunks to the prefill kernel; out and the key scores match the references."""
    block_size, Hkv, G, D = 16, 2, 3, 64
    chunks = [(20, 1), (0, 1), (47, 1), (0, 37), (block_size + 3, 45)]
    q, cu_seqlens_q, context_lens = varlen_batch(chunks, Hkv * G, D, torch.float32, KERNEL_DEVICE)
    width = 6
    k_cache, v_cache = make_cache(len(chunks) * width, Hkv, block_size, D, torch.float32, KERNEL_DEVICE)
    tables = scattered_tables(context_lens.tolist(), block_size, len(chunks) * width, width)
    launched = []
    real_decode = kernels.paged_decode_attention_triton
    monkeypatch.setattr(kernels, "paged_decode_attention_triton",
                        lambda q, *args, **kw: launched.append(q.shape[0]) or real_decode(q, *args, **kw))
    results = {}
    before = kernels.BACKEND
    try:
        for backend in ("torch", "triton"):
            kernels.set_backend(backend)
            scores = torch.zeros(k_cache.shape[:3])
            out = kernels.paged_attention(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.125,
                                          max_query_len=45, max_context_len=64, num_decodes=3, score_cache=scores)
            results[backend] = out, scores
    finally:
        kernels.set_backend(before)
    assert launched == [3]
    assert_close(results["triton"][0], results["torch"][0], TOL[torch.float32][0], "out")
    assert_close(results["triton"][1], results["torch"][1], SCORE_TOL[torch.float32], "scores")


# ----------------------------------------------------------------------------
# The same comparisons on a GPU, at sizes the interpreter could not afford
# ----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=param_id)
@pytest.mark.parametrize("G,head_dim,block_size", [(1, 128, 16), (3, 64, 16), (4, 128, 32), (8, 128, 256)])
def test_mixed_batch_gpu(dtype, G, head_dim, block_size):
    chunks = mixed_chunks(block_size) + [(1000, 300), (0, 513), (2047, 1)]
    check_mixed_batch(dtype, G, head_dim, block_size, num_kv_heads=4, device="cuda", chunks=chunks)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=param_id)
@pytest.mark.parametrize("G,head_dim,block_size,num_splits", [(3, 64, 16, 16), (4, 128, 32, 7), (8, 128, 256, 32)])
@pytest.mark.parametrize("per_head_tables", [False, True])
def test_decode_gpu(dtype, G, head_dim, block_size, num_splits, per_head_tables):
    lens = [0, 1, block_size - 1, block_size, block_size + 1, 700, 4000, 0]
    check_decode(dtype, G, head_dim, block_size, num_kv_heads=4, num_splits=num_splits, device="cuda",
                 context_lens=lens, per_head_tables=per_head_tables)


@pytest.mark.gpu
def test_decode_cuda_graph_replay():
    """Captured once, replayed with other context lengths: the static grid at work."""
    Hkv, G, D, block_size, num_splits, width = 4, 3, 64, 16, 8, 64
    k_cache, v_cache = make_cache(4 * width, Hkv, block_size, D, torch.bfloat16, "cuda")
    tables = scattered_tables([width * block_size] * 4, block_size, 4 * width, width, device="cuda")
    q = torch.randn(4, Hkv * G, D, device="cuda").to(torch.bfloat16)
    context_lens = torch.tensor([1, 1, 1, 1], dtype=torch.int32, device="cuda")
    scores = torch.zeros(4 * width, Hkv, block_size, device="cuda")
    workspace = decode_workspace(4 * Hkv * G * num_splits, D, device="cuda")
    logits = logits_scratch(4 * width, Hkv * G, block_size, "cuda")

    def run():
        return paged_decode_attention_triton(q, k_cache, v_cache, tables, context_lens, 0.125, num_splits,
                                             score_cache=scores, logits=logits, workspace=workspace)

    run()   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    cu_seqlens_q = torch.arange(5, dtype=torch.int32, device="cuda")
    for lens in ([1000, 0, 17, 64], [3, 1024, 512, 999]):
        context_lens.copy_(torch.tensor(lens))
        scores.zero_()
        graph.replay()
        ref = paged_attention_ref(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, 0.125)
        live = context_lens > 0
        assert_close(out[live], ref[live], TOL[torch.bfloat16][0], "out")
        assert torch.equal(out[~live], torch.zeros_like(out[~live]))
        expected = dense_key_scores(q, k_cache, tables[:, None].expand(-1, Hkv, -1), context_lens, 0.125)
        assert_close(scores, expected, SCORE_TOL[torch.bfloat16], "scores")
