"""The whole engine on the Triton kernels against the same engine on the references.

On the CPU the kernels run in Triton's interpreter; on a GPU (marked tests)
compiled, with and without CUDA graphs.
"""
from collections import Counter

import pytest
import torch

import kernels
from helpers import KERNEL_DEVICE, VOCAB, make_tiny_model
from nanokv import LLM, SamplingParams


@pytest.fixture
def backend():
    """Switch the kernel backend for one test, then restore it."""
    before = kernels.forced_backend()
    yield kernels.set_backend
    kernels.set_backend(before)


def mixed_prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 70, (n,), generator=gen).tolist()
    return [torch.randint(0, VOCAB, (k,), generator=gen).tolist() for k in lengths]


def generate_both(path, backend, prompts, device=KERNEL_DEVICE, dtype="float32", max_tokens=12, **options):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = {}
    for name in ("torch", "triton"):
        backend(name)
        llm = LLM(str(path), dtype=dtype, device=device, num_kv_blocks=96, max_model_len=160,
                  max_num_batched_tokens=48, **options)
        outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
    return outs["torch"], outs["triton"]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_triton_engine_matches_reference_engine(tmp_path, backend, family):
    make_tiny_model(tmp_path, family)
    reference, triton = generate_both(tmp_path, backend, mixed_prompts(5, seed=3), max_tokens=8)
    assert triton == reference


# Graphed and eager decodes pick their flash-decoding split counts from different context
# bounds (max_model_len against the step's longest context, kernels.decode_num_splits), so at
# contexts past MIN_SPLIT they can sum the splits in another order and differ in the last bits;
# these contexts (max_model_len 160) take one split either way, so tokens compare exactly.
@pytest.mark.gpu
def test_cuda_graphs_match_eager_and_reference(tmp_path, backend):
    make_tiny_model(tmp_path, "llama3")
    prompts = mixed_prompts(11, seed=4)
    reference, eager = generate_both(tmp_path, backend, prompts, enforce_eager=True)
    assert eager == reference
    backend("triton")
    llm = LLM(str(tmp_path), dtype="float32", device=KERNEL_DEVICE, num_kv_blocks=96, max_model_len=160,
              max_num_batched_tokens=48)
    assert llm.runner.graphs is not None
    graphed = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                                          ignore_eos=True))]
    assert graphed == eager


@pytest.mark.gpu
def test_bf16_triton_engine_agrees_with_reference(tmp_path, backend):
    """bf16 rounding differs between the paths, so compare next-token agreement, not equality."""
    make_tiny_model(tmp_path, "qwen2")
    reference, triton = generate_both(tmp_path, backend, mixed_prompts(8, seed=5), dtype="bfloat16")
    first = [r[0] == t[0] for r, t in zip(reference, triton)]
    assert sum(first) >= 7


@pytest.mark.gpu
def test_evicting_requests_in_cuda_graphs_match_eager(tmp_path, backend):
    """Decode graphs accumulate the eviction scores inside the captured kernels."""
    make_tiny_model(tmp_path, "llama")
    backend("triton")
    prompts = mixed_prompts(6, seed=6)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, kv_method="batchmax",
                            kv_budget=32, evict_every=16, return_kept_positions=True)
    runs = []
    for eager in (True, False):
        llm = LLM(str(tmp_path), dtype="float32", device=KERNEL_DEVICE, num_kv_blocks=96, max_model_len=160,
                  enforce_eager=eager)
        runs.append(llm.generate(prompts, params))
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids and torch.equal(a.kept_positions, b.kept_positions)


def test_a_mixed_step_puts_its_decodes_first(tmp_path):
    """Flash-decoding takes the leading one-query sequences (AttentionMetadata.num_decodes),
    so the runner orders them first, whatever order the scheduler chose."""
    from nanokv.engine.scheduler import ScheduledBatch
    from nanokv.engine.sequence import Sequence

    make_tiny_model(tmp_path, "llama")
    llm = LLM(str(tmp_path), dtype="float32", device=KERNEL_DEVICE, num_kv_blocks=32, max_model_len=160)
    tables = llm.scheduler.block_tables
    chunk = Sequence(0, list(range(40)), SamplingParams(), block_table=tables.new([0, 1, 2]))
    decode = Sequence(1, [5, 6, 7], SamplingParams(), output_token_ids=[9], block_table=tables.new([3]),
                      num_computed_tokens=3, num_kv_slots=3)
    step = llm.runner.prepare(ScheduledBatch(seqs=[chunk, decode], num_new_tokens=[40, 1]))
    assert step.meta.num_decodes == 1
    assert step.meta.cu_seqlens_q.tolist() == [0, 1, 41]
    L, H = llm.runner.kv_cache.num_layers, llm.runner.kv_cache.num_kv_heads
    assert step.meta.context_lens.shape == (L, 2, H)
    assert (step.meta.context_lens[:, 0] == 4).all() and (step.meta.context_lens[:, 1] == 40).all()
    blocks = step.meta.page_tables.div(H, rounding_mode="floor") % 32   # each head's pages are its blocks'
    assert (blocks[:, 0, :, :1] == 3).all() and (blocks[:, 1] == torch.tensor([0, 1, 2], device=blocks.device)).all()
    assert step.input_ids[0].item() == 9 and step.positions[:2].tolist() == [3, 0]
    assert step.sample_rows == [0, 40] and step.sampled_seqs == [decode, chunk]
    # Each row's pair goes from_end slots from its sequence's end, in the page its head's table names.
    # The runner took it from the pages' layout (KVCache.token_slots), not from the tables.
    bs, lens, pages = llm.config.block_size, step.meta.context_lens.tolist(), step.meta.page_tables.tolist()
    rows = [(0, 1)] + [(1, 40 - i) for i in range(40)]   # (sequence, from_end)
    expected = [[[pages[l][b][h][(lens[l][b][h] - k) // bs] * bs + (lens[l][b][h] - k) % bs for h in range(H)]
                 for b, k in rows] for l in range(L)]
    assert step.meta.slot_mapping.tolist() == expected


def test_qwen3_s_q_and_k_norms_run_in_the_rope_kernel(tmp_path, backend, monkeypatch):
    """A Qwen3 layer normalises q's and k's heads in the launch that rotates them (kernels.QKNorms):
    per forward, one RoPE launch a layer, and the RMSNorm kernel only for the layer norms (two a
    layer and the last), not for q and k as well."""
    import kernels.rope

    make_tiny_model(tmp_path, "qwen3")
    backend("triton")
    llm = LLM(str(tmp_path), dtype="float32", device=KERNEL_DEVICE, num_kv_blocks=32, max_model_len=160)
    kernel_type, launches = type(kernels.rope._rope_kernel), Counter()
    run = kernel_type.run

    def counted(self, *args, **kwargs):
        launches[self.__name__] += 1
        return run(self, *args, **kwargs)
    monkeypatch.setattr(kernel_type, "run", counted)
    llm.generate([list(range(1, 20))], SamplingParams(temperature=0, max_tokens=1))   # one forward
    layers = llm.runner.kv_cache.num_layers
    assert (launches["_rope_kernel"], launches["_rms_norm_kernel"]) == (layers, 2 * layers + 1), launches


@pytest.mark.gpu
def test_an_engine_on_another_gpu_than_the_current_one(tmp_path):
    """Everything the engine launches (kernels, graphs, memory statistics) goes to its own device."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    make_tiny_model(tmp_path, "llama")
    last = torch.cuda.device_count() - 1
    llm = LLM(str(tmp_path), dtype="bfloat16", device=f"cuda:{last}", max_model_len=160, gpu_memory_utilization=0.3)
    assert llm.runner.kv_cache.k.device == torch.device("cuda", last) and torch.cuda.current_device() == 0
    out = llm.generate(mixed_prompts(4, seed=7), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                kv_method="batchmax", kv_budget=32, evict_every=16))
    assert all(len(o.token_ids) == 8 for o in out)
