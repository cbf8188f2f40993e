"""The CPU backend's paged attention against the references: output, and the key
scores it adds to the cache (kernels/attention/reference.py, kernels/attention/key_scores.py)."""
import pytest
import torch

from batches import make_cache, mixed_chunks, mixed_squares, scattered_tables, skip_inputs, varlen_batch
from kernels.attention.cpu import paged_attention_cpu
from kernels.attention.key_scores import accumulate_key_scores_ref
from kernels.attention.reference import paged_attention_ref

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def run_both(chunks, dtype, G, head_dim=64, block_size=16, num_kv_heads=2, scores=True, even=False, skip=False):
    """even: every head of a sequence holds the same slots (uniform methods); else ragged (uneven ones).
    skip: KVC-full's score_skip (skip_inputs: some sequences skip nothing), with score_from."""
    torch.manual_seed(0)
    q, cu_seqlens_q, context_lens = varlen_batch(chunks, num_kv_heads, G, head_dim, dtype, "cpu")
    if even:
        context_lens = context_lens[:, :1].repeat(1, num_kv_heads)
    width = int(context_lens.max()) // block_size + 2
    num_pages = context_lens.numel() * width
    k_cache, v_cache = make_cache(num_pages, block_size, head_dim, dtype, "cpu")
    tables = scattered_tables(context_lens, block_size, num_pages, width)
    scale = head_dim ** -0.5
    squares = mixed_squares(len(chunks), "cpu")
    initial = torch.rand(num_pages, block_size)
    ref_scores, cpu_scores = initial.clone(), initial.clone()
    skipping = {}
    if skip:
        score_skip, positions, pos_cache = skip_inputs(len(chunks), len(q), (num_pages, block_size), "cpu")
        score_from = torch.arange(len(chunks), dtype=torch.int32) % 4   # some chunks count from a later query
        skipping = dict(score_from=score_from, score_skip=score_skip, positions=positions, pos_cache=pos_cache)
    ref, lse = paged_attention_ref(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale, return_lse=True)
    accumulate_key_scores_ref(q, k_cache, ref_scores, tables, cu_seqlens_q, context_lens, lse, scale,
                              square_scores=squares, **skipping)
    out = paged_attention_cpu(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale,
                              score_cache=cpu_scores if scores else None, square_scores=squares, **skipping)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if scores:
        torch.testing.assert_close(cpu_scores, ref_scores, atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(cpu_scores, initial)


@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("scores", [False, True])
@pytest.mark.parametrize("dtype,G,block_size", [(torch.float32, 1, 16), (torch.float32, 3, 16),
                                                (torch.float32, 4, 32), (torch.bfloat16, 3, 16)])
def test_mixed_batch(dtype, G, block_size, scores, even):
    """Fresh and chunked prefills around decode rows of ragged lengths."""
    run_both(mixed_chunks(block_size), dtype, G, block_size=block_size, scores=scores, even=even)


@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("scores", [False, True])
@pytest.mark.parametrize("lengths", [[40, 40, 40], [1, 15, 16, 17, 70]])
def test_decode_step(lengths, scores, even):
    """A pure decode step, contexts equal (no mask) and ragged."""
    run_both([(n - 1, 1) for n in lengths], torch.float32, 3, scores=scores, even=even)


@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("scores", [False, True])
def test_long_chunk_after_context(scores, even):
    """A chunk longer than a score tile, after earlier context: the offset causal mask."""
    run_both([(300, 600)], torch.float32, 3, scores=scores, even=even)


@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("chunks", [mixed_chunks(16), [(300, 600), (20, 1)]], ids=["mixed", "long"])
def test_only_pairs_far_enough_apart_count(chunks, even):
    """KVC-full's score_skip and score_from, in prefills (a chunk over several score tiles)
    and decodes, beside sequences that skip nothing."""
    run_both(chunks, torch.float32, 3, even=even, skip=True)


def test_a_new_step_gets_a_new_plan():
    """The per-step plan is rebuilt when the metadata tensors change."""
    run_both([(20, 5), (9, 1)], torch.float32, 3)
    run_both([(3, 1), (50, 7)], torch.float32, 3)
