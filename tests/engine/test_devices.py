"""Where the engine runs and the memory it plans for, checked on the CPU: the kernel backend
follows the engine's device, everything goes to the engine's own CUDA device, flash-decoding's
workspace holds every split count the GPU's SMs ask for, and the pool sizing counts what a
run allocates beyond the K/V (page tables, graph inputs, eviction in bounded pieces)."""
import contextlib
import functools

import pytest
import torch

import kernels
from helpers import VOCAB
from kernels.attention import splits
from kernels.attention.decode import MIN_SPLIT
from nanokv import LLM, SamplingParams
from nanokv.engine import evict, memory, runner
from nanokv.engine.cuda_graphs import DecodeGraphs
from nanokv.llm import engine_device

H100_WAVE = 3 * 132   # the 16-bit decode kernel's programs an SM holds x SMs


@pytest.fixture
def forced(monkeypatch):
    """Force a kernel backend for one test (set_backend), then restore the one before."""
    before = kernels.forced_backend()
    yield kernels.set_backend
    kernels.set_backend(before)


def test_a_cpu_engine_beside_a_gpu_runs_the_cpu_kernels(tiny_dir, monkeypatch):
    """The backend follows the tensors' device, not torch.cuda.is_available()."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def refuse(*args, **kwargs):
        raise AssertionError("a Triton kernel ran for a CPU engine")
    monkeypatch.setitem(kernels._OPS, "triton", kernels.Ops(*[refuse] * len(kernels.Ops._fields)))
    monkeypatch.setattr(kernels, "paged_attention_triton", refuse)
    monkeypatch.setattr(kernels, "paged_decode_attention_triton", refuse)
    assert kernels.backend(torch.device("cpu")) == "cpu" and kernels.backend(torch.device("cuda", 0)) == "triton"
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", num_kv_blocks=32, max_model_len=128)
    assert llm.runner.decode_workspace is None and llm.runner.kv_cache.logits is None and llm.runner.graphs is None
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_a_forced_backend_that_cannot_serve_the_device_is_a_clear_error(tiny_dir, forced, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    forced("triton")
    with pytest.raises(ValueError, match=r"the Triton kernels \(NANOKV_KERNELS=triton\) run on CUDA devices or in "
                                         r"Triton's interpreter .*; the engine's device is cpu"):
        LLM(str(tiny_dir), device="cpu")
    forced("cpu")
    with pytest.raises(ValueError, match=r"the CPU kernels \(NANOKV_KERNELS=cpu\) run on the CPU; the engine's "
                                         r"device is cuda:1"):
        LLM(str(tiny_dir), device="cuda:1")
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        kernels.set_backend("cuda")


def test_the_engine_works_on_its_own_device(tiny_dir, monkeypatch):
    """cuda:N: the engine's device is made current around everything it runs (Triton launches,
    graph capture and memory statistics use the current device), and the SM count is that
    device's. On the CPU the device context is recorded instead of entered."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert engine_device("cuda") == torch.device("cuda", 2) and engine_device("cuda:1").index == 1
    context = runner.on_device(torch.device("cuda", 1))
    assert isinstance(context, torch.cuda.device) and context.idx == 1

    asked = []

    class Properties:
        major, multi_processor_count = 9, 132
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: asked.append(device) or Properties())
    kernels.decode_wave.cache_clear()
    try:
        assert kernels.decode_wave(torch.device("cuda", 1)) == H100_WAVE and asked == [torch.device("cuda", 1)]
    finally:
        kernels.decode_wave.cache_clear()

    entered = []

    @contextlib.contextmanager
    def record(device):
        entered.append(device)
        yield
    monkeypatch.setattr(runner, "on_device", record)
    llm = LLM(str(tiny_dir), dtype="float32", num_kv_blocks=32, max_model_len=128)
    built = len(entered)
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, kv_method="batchmax",
                                             kv_budget=32, evict_every=16, return_kept_positions=True))
    assert built == 1 and len(entered) == 1 + 3 + 1   # construction, three steps, the kept positions
    assert set(entered) == {llm.runner.device}


def test_the_decode_workspace_holds_every_split_count_a_gpu_asks_for(monkeypatch):
    """Graphs pass max_model_len as the context bound; an eager step passes its own, which an
    uneven method's wide head can push past it (here 2112 of 2048 tokens: 44 decodes x 9
    splits on an H100 with Hkv 2, more than the 392 a workspace sized for 2048 would hold). The
    workspace is sized for any context."""
    monkeypatch.setattr(splits, "decode_wave", lambda device, quantized=False: H100_WAVE)
    gpu = torch.device("cuda", 0)
    sized_for_2048 = max(b * kernels.decode_num_splits(b, 2, 2048, gpu) for b in range(1, 65))
    assert sized_for_2048 == 392 and 44 * kernels.decode_num_splits(44, 2, 2112, gpu) == 396
    partials = kernels.decode_partials(64, 2, gpu)
    for b in range(1, 65):
        for context in (1, 2048, 2112, 8192, 2**20):
            assert b * kernels.decode_num_splits(b, 2, context, gpu) <= partials
    assert partials <= kernels.DECODE_WAVES * H100_WAVE // 2 + 64   # a few MB at most


def test_each_step_page_tables_fit_the_reserve(tiny_dir, monkeypatch):
    """The step's page tables [L, B, Hkv, W], built once per step, at most what memory_reserve
    counts: exactly that when max_num_seqs sequences reach max_model_len."""
    llm = LLM(str(tiny_dir), dtype="float32", num_kv_blocks=64, max_model_len=128, max_num_seqs=4)
    reserve = memory.memory_reserve(llm.model_config, llm.config, torch.float32, graphs=False, total_memory=0,
                                    device=llm.device)
    sizes = []
    prepare = llm.runner.prepare
    monkeypatch.setattr(llm.runner, "prepare", lambda batch, *rest: (
        lambda step: sizes.append(step.meta.page_tables.nbytes) or step)(prepare(batch, *rest)))
    prompts = [torch.randint(0, VOCAB, (110,)).tolist() for _ in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert max(sizes) == reserve["step page tables"] == 2 * 4 * 2 * (128 // 16) * 4
    assert set(reserve) == {"step page tables", "eviction", "split prefill", "allocator margin"}
    assert reserve["split prefill"] == 0   # the CPU backend takes no split


def test_decode_graph_inputs_are_counted_before_the_pool(tiny_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: type("G", (), {"pool": lambda self: None})())
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    llm = LLM(str(tiny_dir), dtype="float32", num_kv_blocks=64, max_model_len=160, max_num_seqs=12)
    graphs = DecodeGraphs(llm.runner.model, llm.runner.kv_cache, None, 12, 10, 160)
    allocated = sum(t.nbytes for t in vars(graphs).values() if isinstance(t, torch.Tensor))
    cfg = llm.model_config
    assert allocated == DecodeGraphs.buffer_bytes(cfg.num_layers, cfg.num_kv_heads, 12, 160, 16, cfg.hidden_size)


@pytest.mark.parametrize("kv_method", ["batchmax", "knorm", "snapkv", "kvcompress"])
def test_eviction_in_small_pieces_keeps_the_same_pairs(tiny_dir, monkeypatch, kv_method):
    """Pieces of one layer of one sequence give exactly what ranking every sequence and layer at
    once gives, and no piece holds more pairs than its bound (or one layer of one sequence)."""
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (70, 90, 50, 100)]
    schedule = "once" if kv_method in ("knorm", "snapkv") else "prefill"
    window = dict(kv_window=8) if kv_method == "snapkv" else {}
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, kv_method=kv_method, kv_schedule=schedule,
                            kv_budget=32, evict_every=16, return_kept_positions=True, **window)
    runs, held = [], []
    for piece_bytes in (evict.PIECE_BYTES, 1):
        monkeypatch.setattr(evict, "PIECE_BYTES", piece_bytes)
        llm = LLM(str(tiny_dir), dtype="float32", num_kv_blocks=64, max_model_len=160)
        original = llm.runner.evictor._held
        monkeypatch.setattr(llm.runner.evictor, "_held", lambda seqs, tables, current, n, lens=None, **rest:
                            held.append((piece_bytes, tables.shape[:3], n)) or original(seqs, tables, current, n, lens,
                                                                                        **rest))
        runs.append([(o.token_ids, o.kept_positions.tolist()) for o in llm.generate(prompts, params)])
    assert runs[0] == runs[1]
    H = llm.model_config.num_kv_heads
    assert any(shape[0] > 1 or shape[1] > 1 for size, shape, _ in held if size > 1)   # whole groups at once
    assert all(shape[:2] == (1, 1) for size, shape, _ in held if size == 1)
    assert all(shape[2] == H for _, shape, _ in held)


@pytest.mark.parametrize("sms", [108, 132])
def test_flash_decoding_keeps_every_sm_busy_where_the_context_allows(sms):
    """split_count: at least two programs per SM, unless the contexts hold fewer splits than
    that (a split is at least MIN_SPLIT slots); never more splits than DECODE_WAVES waves
    need, nor than the context can fill."""
    wave = 3 * sms
    for batch in (1, 2, 3, 7, 16, 64, 256):
        for heads in (1, 2, 8, 32):
            for context in (1, MIN_SPLIT - 1, MIN_SPLIT, 1000, 1024, 4096, 32768):
                splits = kernels.split_count(batch, heads, context, wave, kernels.DECODE_WAVES)
                most = -(-context // MIN_SPLIT)
                assert batch * heads * splits >= min(2 * sms, batch * heads * most), (batch, heads, context)
                assert 1 <= splits <= most
                assert splits == 1 or batch * heads * (splits - 1) < kernels.DECODE_WAVES * wave


# Microseconds by split count, timed side by side on an H200 (132 SMs; nanokv.tools.kernel_tune,
# 2026-11-27, docs/PERF.md): flash-decoding with Hq 32, Hkv 8, head_dim 128, a bf16 or int8
# cache; the prefill kernel over a 64-token chunk or a whole 4k prompt, Hkv 8, G 4.
DECODE_TIMED = {
    ("bf16", 1, 1024): {1: 29.3, 2: 19.6, 3: 18.2, 4: 15.1},
    ("bf16", 1, 4096): {1: 96.0, 2: 53.3, 3: 40.2, 4: 32.2, 6: 26.2, 8: 22.9, 16: 21.0},
    ("bf16", 16, 1024): {1: 37.4, 2: 33.2, 3: 33.6, 4: 35.9},
    ("bf16", 16, 4096): {1: 103.9, 2: 81.0, 3: 82.5, 4: 96.2, 6: 85.7, 8: 87.9, 13: 91.3, 16: 91.6},
    ("bf16", 64, 1024): {1: 95.7, 2: 85.6, 3: 85.9, 4: 86.8},
    ("bf16", 64, 4096): {1: 322.5, 2: 270.5, 3: 264.8, 4: 275.7, 6: 270.6, 8: 275.4, 16: 286.4},
    ("int8", 16, 4096): {1: 135.5, 2: 77.1, 3: 78.7, 4: 67.5, 6: 77.6, 8: 78.1, 13: 78.2, 16: 84.5},
    ("int8", 64, 4096): {1: 214.8, 2: 217.7, 3: 233.8, 4: 221.4, 6: 223.9, 8: 228.0, 16: 264.1},
}
PREFILL_TIMED = {
    (64, 1024): {1: 36.8, 2: 26.9, 4: 23.6},
    (64, 4096): {1: 121.8, 2: 65.0, 4: 43.2, 8: 38.7, 9: 41.7, 16: 54.0},
    (4096, 4096): {1: 482.4, 2: 538.4, 4: 617.9, 8: 795.7, 16: 1163.2},
}


def test_the_split_counts_are_the_fastest_timed_on_an_h200(monkeypatch):
    """The launch rule picks, for each case timed, a split count within 2% of the fastest
    (the rule before it, four waves of programs, was 13% off at batch 16 over 4k)."""
    class H200:
        major, multi_processor_count = 9, 132
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H200())
    for cached in (splits.decode_wave, splits.prefill_wave):   # fresh caches: cuda:0 is an H200 only here
        monkeypatch.setattr(splits, cached.__name__, functools.cache(cached.__wrapped__))
    gpu = torch.device("cuda", 0)
    picked = {case: kernels.decode_num_splits(batch, 8, context, gpu, quantized=cache == "int8")
              for case in DECODE_TIMED for cache, batch, context in [case]}
    picked |= {case: kernels.prefill_num_splits(1, q_len, 8, 4, torch.bfloat16, context, gpu)
               for case in PREFILL_TIMED for q_len, context in [case]}
    for case, times in (DECODE_TIMED | PREFILL_TIMED).items():
        assert times[picked[case]] <= 1.02 * min(times.values()), (case, picked[case])
