"""What an eviction costs: it writes at most the pairs it drops (the survivors above each
head's new length fill the holes below it), plus one block per head, for every method,
counted as the K slots whose contents it changes; it allocates no more than its pieces are
sized by; and a step's eviction runs the same torch ops whatever the batch and the layers,
none of which waits for the device."""
import traceback
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import VOCAB, device_waits, make_tiny_model
from nanokv import LLM, SamplingParams
from nanokv.engine import evict as evict_module

METHODS = ["batchmax", "h2o", "tova", "snapkv", "streamingllm", "knorm", "kvcompress", "decode_only", "ed",
           "batchmax@decode", "h2o@once"]


PRESSES = ("KnormPress", "SnapKVPress", "AdaKVPress")


def press(name: str):
    """One of PRESSES, kvpress imported only here: the GPU report runs this file's gpu test on a
    machine without the kvpress extra."""
    import kvpress
    return {"KnormPress": kvpress.KnormPress, "SnapKVPress": lambda: kvpress.SnapKVPress(window_size=16),
            "AdaKVPress": lambda: kvpress.AdaKVPress(kvpress.KnormPress())}[name]()


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models("llama")), dtype="float32", num_kv_blocks=160, max_model_len=512, press_window=17)


def evicting(method: str) -> SamplingParams:
    """method: RANKING[@SCHEDULE], a ranking nanokv's or a press of PRESSES."""
    ranking, _, schedule = method.partition("@")
    rule = {"kv_press": press(ranking)} if ranking in PRESSES else {"kv_method": ranking}
    return SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, kv_budget=128, evict_every=16,
                          kv_schedule=schedule or None, **rule, **({"kv_window": 8} if ranking == "snapkv" else {}))


@pytest.mark.parametrize("method", METHODS)
def test_an_eviction_writes_at_most_what_it_drops_plus_a_block_per_head(llm, method, monkeypatch):
    ranking, params = method.partition("@")[0], evicting(method)
    cache, evictor = llm.runner.kv_cache, llm.runner.evictor
    L, H, bs = cache.num_layers, cache.num_kv_heads, cache.block_size
    counts, addressed = [], []

    def counted(evictions):
        before = cache.k.clone()
        addressed.append(0)
        evict(evictions)
        written = int((cache.k != before).any(-1).sum())   # K [pages, bs, D]: slots changed
        dropped = sum(e.num_evicted for e in evictions) * L * H
        counts.append((written, dropped, len(evictions)))

    def move_slots(buffers, tables, src, dst):   # the slots it writes, a slot onto itself too
        addressed[-1] += dst.numel()
        move(buffers, tables, src, dst)

    evict, move = evictor.evict, evict_module.kernels.move_slots
    monkeypatch.setattr(evictor, "evict", counted)
    monkeypatch.setattr(evict_module.kernels, "move_slots", move_slots)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (300, 180, 250)]
    before = llm.stats()
    llm.generate(prompts, params)
    after = llm.stats()
    assert sum(dropped for _, dropped, _ in counts) > 0, "nothing was evicted"
    for (written, dropped, sequences), writes in zip(counts, addressed):
        assert max(written, writes) <= dropped + sequences * L * H * bs, (written, writes, dropped)
    # LLM.stats counts them too (kvcompress: whole pages dropped, and repaged pages whole)
    moved, evicted = after.pairs_moved - before.pairs_moved, after.pairs_evicted - before.pairs_evicted
    assert moved >= sum(written for written, _, _ in counts) and evicted >= sum(dropped for _, dropped, _ in counts)
    if ranking != "kvcompress":
        assert (moved, evicted) == tuple(map(sum, zip(*counts)))[:2]


# Ops whose result the host must wait for: a value read back, a shape that depends on data, or
# a value of the host's assigned into a tensor (on a GPU, a copy from pageable memory).
MASKED = " (a boolean mask)"
FROM_HOST = " (a host value)"
WAITS = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select", "aten.unique")


def waits(ops: list[str]) -> list[str]:
    return [op for op in ops if op.startswith(WAITS) or op.endswith((MASKED, FROM_HOST))]


class CountOps(TorchDispatchMode):
    """Every torch op dispatched inside, by name, and the bytes of the tensors they allocate; the
    launches: the ops but views (which a GPU does not run: their count depends on shapes)."""
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.launches: list[str] = []
        self.allocated = 0
        self.host_values = weakref.WeakSet()   # tensors made of Python values (`t[i] = True` makes one)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masked = func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default) and \
            any(i is not None and i.dtype == torch.bool for i in args[1])
        from_host = func is torch.ops.aten.copy_.default and args[1] in self.host_values
        self.ops.append(f"{func}{MASKED if masked else FROM_HOST if from_host else ''}")
        if not all(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            self.launches.append(self.ops[-1])
        out = func(*args, **(kwargs or {}))
        for result, returned in zip(out if isinstance(out, (tuple, list)) else (out,), func._schema.returns):
            if isinstance(result, torch.Tensor) and returned.alias_info is None:   # not a view
                self.allocated += result.numel() * result.element_size()
        if func is torch.ops.aten.lift_fresh.default:
            self.host_values.add(out)
        return out


@pytest.mark.parametrize("method", METHODS + ["KnormPress@prefill", "SnapKVPress@prefill", "AdaKVPress@prefill"])
def test_an_eviction_allocates_no_more_than_its_pieces_are_sized_by(llm, method, monkeypatch):
    """Every tensor an eviction allocates, summed (more than its peak), is within what its pieces
    count: each held pair ranked and each evicted pair moved (evict.ranked_pair_bytes,
    moved_pair_bytes)."""
    params = evicting(method)
    evictor, cache = llm.runner.evictor, llm.runner.kv_cache
    calls, counted_pieces = [], []

    def pieces(num_seqs, method, num_slots, num_evicted=0, num_moved=0):
        group = llm.runner.model.config.num_heads // cache.num_kv_heads
        moved = evict_module.moved_pair_bytes(cache.k.shape[-1], cache.k.dtype)
        per_head = num_slots * evict_module.ranked_pair_bytes(cache.k.shape[-1], cache.k.dtype, method, group)
        counted_pieces.append(num_seqs * (cache.num_layers * cache.num_kv_heads * (per_head + num_evicted * moved)
                                          + num_moved * moved))
        return sized(num_seqs, method, num_slots, num_evicted, num_moved)

    def counted(evictions):
        counted_pieces.clear()
        with CountOps() as counter:
            evict(evictions)
        if evictions:
            calls.append((counter.allocated, sum(counted_pieces)))

    sized, evict = evictor._pieces, evictor.evict
    monkeypatch.setattr(evictor, "_pieces", pieces)
    monkeypatch.setattr(evictor, "evict", counted)
    g = torch.Generator().manual_seed(1)
    llm.generate([torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (300, 180, 250)], params)
    assert calls and all(allocated <= bound for allocated, bound in calls), calls


def test_a_paper_sized_eviction_takes_few_pieces():
    """Batch-Max at the paper's setting on the Llama-3.1-8B shape (bf16, 32 layers, 8 KV heads of
    128): 28 sequences holding 1088 pairs a head and dropping 64 are ranked in a few pieces (each
    runs the same ops), every (sequence, layer) exactly once."""
    from nanokv.eviction import make_method
    method = make_method("batchmax", "prefill", 1024, 64, 16)
    per_head = (1088 * evict_module.ranked_pair_bytes(128, torch.bfloat16, method, 4)
                + 64 * evict_module.moved_pair_bytes(128, torch.bfloat16))
    taken = evict_module.cut_pieces(28, 32, 8 * per_head, evict_module.PIECE_BYTES)
    assert len(taken) <= 4
    covered = [(s, l) for seqs, layers in taken for s in range(28)[seqs] for l in range(32)[layers]]
    assert sorted(covered) == [(s, l) for s in range(28) for l in range(32)]


def test_kvcompress_on_a_large_gpu_takes_few_pieces(monkeypatch):
    """kvcompress at the workload mode's Qwen3-0.6B shape (bf16, 28 layers, 8 KV heads of 128,
    group 2): a sequence whose widest head holds 1024 pairs is ~90 MB to rank, and what it moves is
    bounded by what its blocks hold beyond the pairs it keeps (38 blocks of 16, 512 pairs a head
    kept: ~13 MB), not by what its heads hold (~136 MB). Within PIECE_BYTES that is 8 pieces for 16
    sequences (16 with every held pair counted as moved); an 80 GB GPU's bound takes them in 2, and
    the pool sizing sets that bound aside. A piece of a sequence's layers leaves room for its moves."""
    from nanokv.eviction import make_method
    method = make_method("kvcompress", "prefill", 512, 64, 16)
    ranked = 1024 * evict_module.ranked_pair_bytes(128, torch.bfloat16, method, 2)
    moved = evict_module.moved_pair_bytes(128, torch.bfloat16)
    most_moved = ((38 * 16 - 512) * 28 * 8 + 16) * moved
    assert len(evict_module.cut_pieces(16, 28, 8 * ranked, evict_module.PIECE_BYTES, most_moved)) == 8
    assert len(evict_module.cut_pieces(16, 28, 8 * (ranked + 1024 * moved), evict_module.PIECE_BYTES)) == 16
    gpu = torch.device("cuda", 0)
    eighty_gb = SimpleNamespace(total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: eighty_gb)
    bound = evict_module.piece_bytes(gpu)
    assert len(evict_module.cut_pieces(16, 28, 8 * ranked, bound, most_moved)) == 2
    assert evict_module.reserve_bytes(8, 128, torch.bfloat16, 2048, 2, 0, bound) == bound
    assert evict_module.piece_bytes(torch.device("cpu")) == evict_module.PIECE_BYTES
    assert evict_module.cut_pieces(2, 10, 100, 500, 200) == [(slice(s, s + 1), slice(first, first + 3))
                                                             for s in range(2) for first in range(0, 10, 3)]


@pytest.mark.parametrize("method", ["batchmax", "h2o@prefill", "streamingllm", "knorm@decode", "snapkv@prefill",
                                    "kvcompress"])
def test_an_eviction_step_runs_the_same_ops_whatever_the_batch_and_layers(tmp_path, method):
    """Counted as launches. kvcompress: a step with a first eviction writes its blocks' pages
    into the head tables first, one that widens them copies them (a few times in all): others
    run the same ops."""
    ranking, _, schedule = method.partition("@")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, kv_method=ranking, kv_budget=64,
                            evict_every=16, kv_schedule=schedule or None, **({"kv_window": 8} if ranking == "snapkv" else {}))
    g = torch.Generator().manual_seed(0)
    seen = {}
    for layers, batch in ((2, 8), (2, 64), (12, 8)):
        if not (tmp_path / str(layers)).exists():
            make_tiny_model(tmp_path / str(layers), "llama", layers=layers)
        llm = LLM(str(tmp_path / str(layers)), dtype="float32", num_kv_blocks=8 * batch + 16, max_model_len=256,
                  max_num_seqs=batch, num_threads=1)
        steps, evict, head_tables = [], llm.runner.evictor.evict, llm.runner.head_tables

        def counted(evictions):
            width = head_tables.tables.shape[-1]
            first = any(e.seq.method.uneven and e.seq.own_pages is None for e in evictions)
            with CountOps() as counter:
                evict(evictions)
            if evictions and not first and head_tables.tables.shape[-1] == width:
                steps.append(counter.launches)
        llm.runner.evictor.evict = counted
        llm.generate([torch.randint(0, VOCAB, (150,), generator=g).tolist() for _ in range(batch)], params)
        assert steps and not [op for ops in steps for op in waits(ops)]
        seen[layers, batch] = {len(ops) for ops in steps}
    assert seen[2, 8] == seen[2, 64] == seen[12, 8], seen


def test_a_kvcompress_eviction_never_waits_for_the_device(tmp_path):
    """Pages given up and moved with shapes known on the host: the new tables' width is a
    bound the host knows (exact once the eviction's widths land), and prompts of several
    lengths evict together."""
    make_tiny_model(tmp_path, "llama")
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=200, max_model_len=256, max_num_seqs=16, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, kv_method="kvcompress", kv_budget=64,
                            evict_every=16)
    steps, evict = [], llm.runner.evictor.evict

    def counted(evictions):
        with CountOps() as counter:
            evict(evictions)
        if evictions:
            steps.append(waits(counter.ops))
    llm.runner.evictor.evict = counted
    g = torch.Generator().manual_seed(0)
    llm.generate([torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (150, 90, 120, 200)], params)
    assert len(steps) > 4 and all(ops == [] for ops in steps), steps


def waiting_at() -> str:
    """Where the engine's code waits: its innermost frame, as function:line."""
    frames = [f for f in traceback.extract_stack() if any(f"/{d}/" in f.filename for d in ("nanokv", "kernels", "models"))]
    return f"{frames[-1].name}:{frames[-1].lineno}" if frames else "?"


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["batchmax", "kvcompress"])
def test_evictions_and_step_inputs_do_not_wait_for_the_gpu(tmp_path, method):
    """What the CPU tests cannot see: a copy from pageable host memory waits for the GPU. The
    eviction, the step's inputs and sampling wait for nothing."""
    make_tiny_model(tmp_path, "llama")
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=200, max_model_len=256, max_num_seqs=16)
    runner, synced, calls = llm.runner, {"evict": [], "prepare": [], "sample": []}, []

    def watched(name, run):
        def call(*args):
            calls.append(name)
            with device_waits(lambda: synced[name].append(waiting_at())):
                return run(*args)
        return call
    runner.evictor.evict = watched("evict", runner.evictor.evict)
    runner.prepare = watched("prepare", runner.prepare)
    runner.sampler._sample = watched("sample", runner.sampler._sample)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=40, ignore_eos=True, kv_method=method,
                            kv_budget=64, evict_every=16)
    g = torch.Generator().manual_seed(0)
    llm.generate([torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (150, 90, 120, 200)], params)
    assert calls.count("evict") > 4 and synced["prepare"] == synced["sample"] == synced["evict"] == [], synced
