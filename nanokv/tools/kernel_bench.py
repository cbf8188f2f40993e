"""Kernel benchmark against the device's own limits (CUDA only).

    python -m nanokv.tools.kernel_bench [--quick] [--out FILE]

Measures, in one run, the ceilings (device-to-device copy bandwidth, a large
bf16 matmul) and then each kernel as a fraction of the relevant ceiling or
of torch's SDPA (flash backend) on contiguous tensors. Every case is run once
before it is timed (compilation stays out), and timed as replays of a CUDA
graph, as the engine's decode steps run: the device's time, not Python's
launch overhead. Last, whole decode steps of the paper mode's and the workload
mode's shapes against their memory roofline, each with the kernels its time goes
to (torch.profiler). Prints markdown tables for docs/PERF.md; --out appends each
case as a JSON line.
"""
from __future__ import annotations

import argparse
import datetime
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kernels import decode_num_splits, decode_workspace_for, prefill_num_splits
from kernels.activation import silu_and_mul_triton
from kernels.attention.decode import decode_workspace, paged_decode_attention_triton
from kernels.attention.prefill import paged_attention_triton
from kernels.eviction_order import Protected, eviction_order_ref, eviction_order_triton, lowest_ref, lowest_triton
from kernels.kv_store import quantize
from kernels.norm import rms_norm_triton
from kernels.page_choice import choose_pages_ref, choose_pages_triton
from kernels.rope import QKNorms, apply_rope_triton, rope_cos_sin_cache
from models import AttentionMetadata, KVCache
from models.loader import load_model
from models.shapes import shape_config
from nanokv.engine.cuda_graphs import DecodeGraphs
from nanokv.tools.provenance import source_commit


def ms(fn, graph: bool = True) -> float:
    """Median milliseconds of fn, replayed from a CUDA graph captured after one plain call
    (which compiles the kernels and allocates what fn keeps); graph=False: fn replays one."""
    fn()
    torch.cuda.synchronize()
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        fn = captured.replay
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.randn(1 << 28, device="cuda")   # 1 GiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (ms(lambda: dst.copy_(src), graph=False) * 1e-3)


def matmul_flops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / (ms(lambda: a @ b, graph=False) * 1e-3)


def paged_kv(batch: int, ctx: int, hkv: int, d: int, block: int, dtype):
    """A random paged cache (kernels/kv_store.py) holding `batch` contexts of `ctx` slots in
    every KV head, in shuffled pages: K, V [P, bs, D], tables [B, Hkv, nb], context_lens [B, Hkv]."""
    per_head = -(-ctx // block)
    num_pages = batch * hkv * per_head
    k = torch.randn(num_pages, block, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    tables = torch.randperm(num_pages, device="cuda").to(torch.int32).view(batch, hkv, per_head)
    return k, v, tables, torch.full((batch, hkv), ctx, device="cuda", dtype=torch.int32)


def contiguous_kv(k_cache, tables, ctx):
    """The same K (or V) gathered into [B, Hkv, ctx, D] for SDPA."""
    return k_cache[tables.long()].flatten(2, 3)[:, :, :ctx].contiguous()   # [B, Hkv, nb, bs, D] -> ...


def decode_times(batch: int, ctx: int, int8: bool = False) -> tuple[float, float]:
    """(nanokv, SDPA flash) milliseconds of one decode attention, Hq=32, Hkv=8, D=128, block 16,
    bf16 queries; int8: over the cache quantized to int8 (SDPA still reads the bf16 values)."""
    hq, hkv, d, block = 32, 8, 128, 16
    k, v, tables, lens = paged_kv(batch, ctx, hkv, d, block, torch.bfloat16)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    splits = decode_num_splits(batch, hkv, ctx, q.device, quantized=int8)
    work = decode_workspace(batch * hq * splits, d, "cuda")
    cache, scales = (k, v), None
    if int8:
        (k8, k_scale), (v8, v_scale) = quantize(k, torch.int8), quantize(v, torch.int8)
        cache, scales = (k8, v8), torch.stack([k_scale, v_scale], dim=-1)
    t = ms(lambda: paged_decode_attention_triton(q, *cache, tables, lens, d ** -0.5, splits, workspace=work,
                                                 kv_scales=scales))
    kc, vc = contiguous_kv(k, tables, ctx), contiguous_kv(v, tables, ctx)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        t_sdpa = ms(lambda: F.scaled_dot_product_attention(q.view(batch, hq, 1, d), kc, vc, enable_gqa=True))
    return t, t_sdpa


def decode_cases(quick: bool) -> list[tuple[bool, int, int]]:
    """(int8, batch, context) of the decode table; --quick: what the gpu report's time limit allows."""
    contexts = (1024, 4096) if quick else (1024, 4096, 16384)
    bf16 = [(False, b, c) for b in (1, 16, 64, 128) for c in contexts]
    return bf16 + [(True, b, c) for b in ((16, 64, 128) if quick else (1, 16, 64, 128)) for c in contexts]


def bench_decode(bw: float, quick: bool) -> list[dict]:
    """GB/s: the bytes of K and V read (an int8 cache: its values and fp32 scales) over the time."""
    records = []
    for int8, batch, ctx in decode_cases(quick):
        t, t_sdpa = decode_times(batch, ctx, int8)
        torch.cuda.empty_cache()
        nbytes = 2 * batch * ctx * 8 * (128 + 4 if int8 else 128 * 2)   # K and V (+ scales)
        records.append(dict(kind="decode", cache="int8" if int8 else "bf16", batch=batch, context=ctx,
                            us=t * 1e3, gb_s=nbytes / t / 1e6, copy_share=nbytes / (t * 1e-3) / bw,
                            sdpa_us=t_sdpa * 1e3, vs_sdpa=t / t_sdpa))
    return records


def decode_table(records: list[dict]) -> list[str]:
    return ["| cache | batch | context | nanokv µs | GB/s | % of copy bw | SDPA flash (bf16) µs | nanokv / SDPA time |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"] + [
        f"| {r['cache']} | {r['batch']} | {r['context']} | {r['us']:.1f} | {r['gb_s']:.0f} | {100 * r['copy_share']:.0f}% "
        f"| {r['sdpa_us']:.1f} | {r['vs_sdpa']:.2f} |" for r in records]


PREFILL_CASES = (("64-token chunk over 1k context", 64, 1024), ("64-token chunk over 4k context", 64, 4096),
                 ("full 4k prefill", 4096, 4096))


def bench_prefill() -> list[dict]:
    hq, hkv, d, block, dtype = 32, 8, 128, 16, torch.bfloat16
    records = []
    for name, q_len, ctx in PREFILL_CASES:
        k, v, tables, lens = paged_kv(1, ctx, hkv, d, block, dtype)
        q = torch.randn(q_len, hq, d, device="cuda", dtype=dtype)
        cu = torch.tensor([0, q_len], device="cuda", dtype=torch.int32)
        splits = prefill_num_splits(1, q_len, hkv, hq // hkv, dtype, ctx, q.device)
        t = ms(lambda: paged_attention_triton(q, k, v, tables, cu, lens, d ** -0.5, max_query_len=q_len,
                                              num_splits=splits))
        kc, vc = contiguous_kv(k, tables, ctx), contiguous_kv(v, tables, ctx)
        qs = q.transpose(0, 1)[None]   # [1, Hq, q_len, D]
        # causal with the queries at the end of the context: an explicit offset mask is not flash,
        # so time SDPA's causal kernel on the full square and on the chunk without a mask (an upper bound).
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            t_sdpa = ms(lambda: F.scaled_dot_product_attention(qs, kc, vc, is_causal=q_len == ctx,
                                                               enable_gqa=True))
        visible = q_len * ctx - (q_len * (q_len - 1)) // 2   # (query, key) pairs under the causal mask
        flops = 4 * visible * d * hq
        records.append(dict(kind="prefill", case=name, query_len=q_len, context=ctx, splits=splits, us=t * 1e3,
                            tflops=flops / t / 1e9, sdpa_tflops=flops / t_sdpa / 1e9, vs_sdpa=t_sdpa / t))
    return records


def prefill_table(records: list[dict]) -> list[str]:
    return ["| case | splits | nanokv TFLOP/s | SDPA flash TFLOP/s | nanokv / SDPA |", "| --- | --- | --- | --- | --- |"] + [
        f"| {r['case']} | {r['splits']} | {r['tflops']:.0f} | {r['sdpa_tflops']:.0f} | {r['vs_sdpa']:.2f} |"
        for r in records]


def bench_elementwise(bw: float) -> list[dict]:
    """Each op's bytes read and written over its time, against the copy bandwidth."""
    dtype = torch.bfloat16
    x = torch.randn(8192, 4096, device="cuda", dtype=dtype)
    w = torch.randn(4096, device="cuda", dtype=dtype)
    gu = torch.randn(8192, 2 * 14336, device="cuda", dtype=dtype)
    q = torch.randn(8192, 32, 128, device="cuda", dtype=dtype)
    k = torch.randn(8192, 8, 128, device="cuda", dtype=dtype)
    pos = torch.randint(0, 8192, (8192,), device="cuda")
    cos_sin = rope_cos_sin_cache(128, 8192, 500000.0, None).cuda()
    cases = [("rms_norm", "8192x4096", lambda: rms_norm_triton(x, w, 1e-5), 2 * x.numel() * 2),
             ("silu_and_mul", "8192x2x14336", lambda: silu_and_mul_triton(gu), 1.5 * gu.numel() * 2),
             ("apply_rope", "8192 tokens, 32+8 heads x 128", lambda: apply_rope_triton(q, k, pos, cos_sin),
              2 * (q.numel() + k.numel()) * 2),   # rope: q and k read and written in place
             ("apply_rope, q/k norms", "8192 tokens, 32+8 heads x 128",
              lambda: apply_rope_triton(q, k, pos, cos_sin, QKNorms(w[:128], w[128:256], 1e-6)),
              2 * (q.numel() + k.numel()) * 2)]   # Qwen3's: normalised first, in the same pass
    records = []
    for op, shape, fn, nbytes in cases:
        t = ms(fn)
        records.append(dict(kind="elementwise", op=op, shape=shape, us=t * 1e3, copy_share=nbytes / (t * 1e-3) / bw))
    return records


def elementwise_table(records: list[dict]) -> list[str]:
    return ["| op | shape | µs | % of copy bw |", "| --- | --- | --- | --- |"] + [
        f"| {r['op']} | {r['shape']} | {r['us']:.1f} | {100 * r['copy_share']:.0f}% |" for r in records]


def bench_eviction() -> list[dict]:
    """An eviction piece's selection, the Triton kernel against the torch reference: KV-Compress's
    order over 10 sequences of the Qwen3-0.6B shape (28 layers x 8 KV heads, the widest 1,152 slots)
    and its choice of a quarter of their 72 pages a head, and batchmax's 64 of |kv| 1024 + 64 over 8
    sequences of the Llama-3.1-8B shape's 32 x 8 heads, each sequence's sinks and recent pairs
    protected."""
    records = []
    for heads, n, k in ((2240, 1152, 0), (2048, 1088, 64)):
        priority = torch.rand(heads, n, device="cuda")
        positions = torch.rand(heads, n, device="cuda").argsort(-1).int()
        lens = torch.randint(n // 2, n + 1, (heads,), device="cuda", dtype=torch.int32)
        pages = (lens + 15) // 16
        protected = Protected(4, 32, torch.full((heads,), n, device="cuda"))   # a sequence a head
        op, args = (f"lowest {k}", (priority, positions, k, protected)) if k else \
            ("eviction order", (priority, positions, lens, pages, 16, 1, protected))
        for impl, fn in ((("kernel", lowest_triton), ("torch", lowest_ref)) if k else
                         (("kernel", eviction_order_triton), ("torch", eviction_order_ref))):
            records.append(dict(kind="eviction", op=op, shape=f"{heads} heads x {n} slots", impl=impl,
                                us=ms(lambda: fn(*args)) * 1e3))
    costs = torch.rand(10, 28, 8, 72, device="cuda").sort(-1).values
    pages = torch.full((10, 28, 8), 72, dtype=torch.int32, device="cuda")
    target = torch.full((10,), 28 * 8 * 54, device="cuda")
    for impl, fn in (("kernel", choose_pages_triton), ("torch", choose_pages_ref)):
        records.append(dict(kind="eviction", op="page choice", shape="10 x 224 heads x 72 pages", impl=impl,
                            us=ms(lambda: fn(costs, pages, target)) * 1e3))
    return records


def eviction_table(records: list[dict]) -> list[str]:
    return ["| op | shape | kernel µs | torch µs |", "| --- | --- | --- | --- |"] + [
        f"| {a['op']} | {a['shape']} | {a['us']:.1f} | {b['us']:.1f} |" for a, b in zip(records[::2], records[1::2])]


STEP_CASES = (("llama-3.1-8b", 64), ("qwen3-0.6b", 128))   # the paper mode's shape, the workload mode's
STEP_CONTEXT, STEP_MAX_LEN, STEP_BLOCK = 1024, 2048, 16


def decode_step(shape: str, batch: int):
    """A decode step of shape (random bf16 weights) at batch, every sequence at STEP_CONTEXT,
    replayed from a CUDA graph: (a function that runs it, the bytes its memory roofline reads:
    every weight once, the embedding only by row unless it is the output head too, and K and V)."""
    model = load_model(f"random:{shape}", shape_config(shape), torch.bfloat16, torch.device("cuda"), STEP_MAX_LEN)
    cfg = model.config
    per_seq = STEP_MAX_LEN // STEP_BLOCK
    device = torch.device("cuda", torch.cuda.current_device())
    cache = KVCache(cfg, batch * per_seq, STEP_BLOCK, torch.bfloat16, device)
    cache.k.normal_()
    cache.v.normal_()
    workspace = decode_workspace_for(batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, device)
    graphs = DecodeGraphs(model, cache, workspace, batch, per_seq, STEP_MAX_LEN)
    blocks = torch.arange(batch * per_seq, device="cuda").view(batch, per_seq)
    tables = cache.batch_pages(blocks)                                   # [L, B, Hkv, nb]: each head's pages
    ids = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
    last = STEP_CONTEXT - 1
    positions = torch.full((batch,), last, device="cuda")
    slots = tables[..., last // STEP_BLOCK].long() * STEP_BLOCK + last % STEP_BLOCK
    lens = torch.full(tables.shape[:3], STEP_CONTEXT, device="cuda", dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=slots, cu_seqlens_q=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
                             context_lens=lens, page_tables=tables, max_query_len=1, max_context_len=STEP_MAX_LEN)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    kv = 2 * cfg.num_layers * batch * STEP_CONTEXT * cfg.num_kv_heads * cfg.head_dim * 2
    return (lambda: graphs.run(ids, positions, meta)), weights + kv


def kernel_breakdown(run, runs: int = 20) -> list[dict]:
    """The kernels one call of run launches, by device time (torch.profiler over runs calls)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            run()
        torch.cuda.synchronize()
    return largest_kernels([(e.key, e.count, e.device_time_total) for e in prof.key_averages()], runs)


def largest_kernels(events: list[tuple[str, int, float]], runs: int, top: int = 12) -> list[dict]:
    """(kernel, launches, device us) over runs calls -> per call, the longest first: the top ones,
    then the rest as one row; share: of all kernels' time. None seen (a profiler that traces no
    kernel): no rows."""
    events = sorted((e for e in events if e[2] > 0), key=lambda e: -e[2])
    total = sum(e[2] for e in events)
    if not total:
        return []
    shown, rest = events[:top], events[top:]
    if rest:
        shown.append((f"{len(rest)} other kernels", sum(e[1] for e in rest), sum(e[2] for e in rest)))
    return [dict(kernel=name, launches=count / runs, us=us / runs, share=us / total) for name, count, us in shown]


def bench_decode_step(bw: float) -> list[dict]:
    """Each of STEP_CASES' decode steps against its roofline, and where its time goes."""
    records = []
    for shape, batch in STEP_CASES:
        run, roofline_bytes = decode_step(shape, batch)
        t = ms(run, graph=False)   # the step is a graph already
        roofline = roofline_bytes / bw * 1e3
        records.append(dict(kind="decode_step", shape=shape, batch=batch, ms=t, roofline_ms=roofline,
                            vs_roofline=t / roofline, kernels=kernel_breakdown(run),
                            case=f"{shape} shape, bf16, batch {batch}, context 1k, CUDA graph"))
        del run
        torch.cuda.empty_cache()
    return records


def decode_step_table(records: list[dict]) -> list[str]:
    lines = ["| step | ms | roofline ms (weights + KV over copy bw) | ratio |", "| --- | --- | --- | --- |"] + [
        f"| {r['case']} | {r['ms']:.2f} | {r['roofline_ms']:.2f} | {r['vs_roofline']:.2f} |" for r in records]
    for r in records:
        busy = sum(k["us"] for k in r["kernels"])
        lines += ["", f"{r['shape']}, batch {r['batch']}: kernels busy {busy / 1e3:.2f} ms of the {r['ms']:.2f} ms "
                  "step", "| kernel | launches | us | share |", "| --- | --- | --- | --- |"]
        lines += [f"| {k['kernel'][:70]} | {k['launches']:.0f} | {k['us']:.1f} | {k['share']:.0%} |"
                  for k in r["kernels"]]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="skip the 16k contexts and int8 at batch 1")
    parser.add_argument("--out", help="append one JSON line per case here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("nanokv.tools.kernel_bench needs a CUDA device")
    context = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                   commit=source_commit(), torch=torch.__version__)
    print(f"device: {context['device']}, date: {context['date']}, commit: {context['commit'] or 'unknown'}, "
          f"torch {context['torch']}")
    bw, flops = copy_bandwidth(), matmul_flops()
    print(f"\nceilings: copy {bw / 1e9:.0f} GB/s (read + write), bf16 matmul 8192^3 {flops / 1e12:.0f} TFLOP/s\n")
    sections = [("decode attention (bf16 queries, bf16 and int8 caches, Hq=32, Hkv=8, D=128, block 16)",
                 lambda: bench_decode(bw, args.quick), decode_table),
                ("prefill attention (bf16, Hq=32, Hkv=8, D=128, block 16)", bench_prefill, prefill_table),
                ("elementwise", lambda: bench_elementwise(bw), elementwise_table),
                ("decode step", lambda: bench_decode_step(bw), decode_step_table),
                ("an eviction piece's selection (device time)", bench_eviction, eviction_table)]
    save([dict(kind="ceilings", copy_gb_s=bw / 1e9, matmul_tflops=flops / 1e12)], context, args.out)
    for title, bench, table in sections:
        records = bench()
        save(records, context, args.out)
        print(f"### {title}\n" + "\n".join(table(records)) + "\n", flush=True)


def save(records: list[dict], context: dict, path: str | None) -> None:
    if path:
        with open(path, "a") as f:
            f.writelines(json.dumps({**context, **r}) + "\n" for r in records)


if __name__ == "__main__":
    main()
