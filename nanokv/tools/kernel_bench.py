"""Kernel benchmark against the device's own limits (CUDA only).

    python -m nanokv.tools.kernel_bench [--quick]

Measures, in one run, the ceilings (device-to-device copy bandwidth, a large
bf16 matmul) and then each kernel as a fraction of the relevant ceiling or
of torch's SDPA (flash backend) on contiguous tensors. Prints markdown
tables for docs/PERF.md.
"""
from __future__ import annotations

import argparse
import datetime
import subprocess

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kernels import decode_num_splits, decode_workspace_for
from kernels.activation import silu_and_mul_triton
from kernels.attention.decode import decode_workspace, paged_decode_attention_triton
from kernels.attention.prefill import paged_attention_triton
from kernels.kv_store import quantize
from kernels.norm import rms_norm_triton
from kernels.rope import apply_rope_triton, rope_cos_sin_cache
from models import AttentionMetadata, KVCache
from models.loader import load_model
from models.shapes import shape_config
from nanokv.engine.cuda_graphs import DecodeGraphs


def ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.randn(1 << 28, device="cuda")   # 1 GiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (ms(lambda: dst.copy_(src)) * 1e-3)


def matmul_flops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / (ms(lambda: a @ b) * 1e-3)


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
    splits = decode_num_splits(batch, hkv, ctx, q.device)
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


def bench_decode(bw: float, quick: bool) -> list[str]:
    """GB/s: the bytes of K and V read (an int8 cache: its values and fp32 scales) over the time."""
    rows = ["| cache | batch | context | nanokv µs | GB/s | % of copy bw | SDPA flash (bf16) µs | nanokv / SDPA time |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for int8 in (False, True):
        for batch in (64, 128) if int8 and quick else (1, 16, 64, 128):   # --quick: the gpu report's time limit
            for ctx in ((1024, 4096) if quick else (1024, 4096, 16384)):
                t, t_sdpa = decode_times(batch, ctx, int8)
                torch.cuda.empty_cache()
                nbytes = 2 * batch * ctx * 8 * (128 + 4 if int8 else 128 * 2)   # K and V (+ scales)
                rows.append(f"| {'int8' if int8 else 'bf16'} | {batch} | {ctx} | {t * 1e3:.1f} | "
                            f"{nbytes / t / 1e6:.0f} | {100 * nbytes / (t * 1e-3) / bw:.0f}% | {t_sdpa * 1e3:.1f} | "
                            f"{t / t_sdpa:.2f} |")
    return rows


def bench_prefill() -> list[str]:
    hq, hkv, d, block, dtype = 32, 8, 128, 16, torch.bfloat16
    rows = ["| case | nanokv TFLOP/s | SDPA flash TFLOP/s | nanokv / SDPA |", "| --- | --- | --- | --- |"]
    for name, q_len, ctx in (("64-token chunk over 4k context", 64, 4096), ("full 4k prefill", 4096, 4096)):
        k, v, tables, lens = paged_kv(1, ctx, hkv, d, block, dtype)
        q = torch.randn(q_len, hq, d, device="cuda", dtype=dtype)
        cu = torch.tensor([0, q_len], device="cuda", dtype=torch.int32)
        t = ms(lambda: paged_attention_triton(q, k, v, tables, cu, lens, d ** -0.5, max_query_len=q_len))
        kc, vc = contiguous_kv(k, tables, ctx), contiguous_kv(v, tables, ctx)
        qs = q.transpose(0, 1)[None]   # [1, Hq, q_len, D]
        # causal with the queries at the end of the context: an explicit offset mask is not flash,
        # so time SDPA's causal kernel on the full square and on the chunk without a mask (an upper bound).
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            t_sdpa = ms(lambda: F.scaled_dot_product_attention(qs, kc, vc, is_causal=q_len == ctx,
                                                               enable_gqa=True))
        visible = q_len * ctx - (q_len * (q_len - 1)) // 2   # (query, key) pairs under the causal mask
        flops = 4 * visible * d * hq
        rows.append(f"| {name} | {flops / t / 1e9:.0f} | {flops / t_sdpa / 1e9:.0f} | {t_sdpa / t:.2f} |")
    return rows


def bench_elementwise(bw: float) -> list[str]:
    rows = ["| op | shape | µs | % of copy bw |", "| --- | --- | --- | --- |"]
    dtype = torch.bfloat16
    x = torch.randn(8192, 4096, device="cuda", dtype=dtype)
    w = torch.randn(4096, device="cuda", dtype=dtype)
    t = ms(lambda: rms_norm_triton(x, w, 1e-5))
    rows.append(f"| rms_norm | 8192x4096 | {t * 1e3:.1f} | {100 * 2 * x.numel() * 2 / (t * 1e-3) / bw:.0f}% |")
    gu = torch.randn(8192, 2 * 14336, device="cuda", dtype=dtype)
    t = ms(lambda: silu_and_mul_triton(gu))
    rows.append(f"| silu_and_mul | 8192x2x14336 | {t * 1e3:.1f} | {100 * 1.5 * gu.numel() * 2 / (t * 1e-3) / bw:.0f}% |")
    q = torch.randn(8192, 32, 128, device="cuda", dtype=dtype)
    k = torch.randn(8192, 8, 128, device="cuda", dtype=dtype)
    pos = torch.randint(0, 8192, (8192,), device="cuda")
    cos_sin = rope_cos_sin_cache(128, 8192, 500000.0, None).cuda()
    t = ms(lambda: apply_rope_triton(q, k, pos, cos_sin))
    nbytes = 2 * (q.numel() + k.numel()) * 2   # read and write q and k in place
    rows.append(f"| apply_rope | 8192 tokens, 32+8 heads x 128 | {t * 1e3:.1f} | {100 * nbytes / (t * 1e-3) / bw:.0f}% |")
    return rows


def bench_decode_step(bw: float) -> list[str]:
    """A Llama-3.1-8B-shaped decode step, batch 64, context 1k, replayed from a CUDA graph."""
    batch, ctx, block, max_len = 64, 1024, 16, 2048
    model = load_model("random:llama-3.1-8b", shape_config("llama-3.1-8b"), torch.bfloat16, torch.device("cuda"),
                       max_len)
    cfg = model.config
    per_seq = max_len // block
    device = torch.device("cuda", torch.cuda.current_device())
    cache = KVCache(cfg, batch * per_seq, block, torch.bfloat16, device)
    cache.k.normal_()
    cache.v.normal_()
    workspace = decode_workspace_for(batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, device)
    graphs = DecodeGraphs(model, cache, workspace, batch, per_seq, max_len)
    blocks = torch.arange(batch * per_seq, device="cuda").view(batch, per_seq)
    tables = cache.batch_pages(blocks)                                   # [L, B, Hkv, nb]: each head's pages
    ids = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
    positions = torch.full((batch,), ctx - 1, device="cuda")
    slots = tables[..., (ctx - 1) // block].long() * block + (ctx - 1) % block
    meta = AttentionMetadata(slot_mapping=slots, cu_seqlens_q=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
                             context_lens=torch.full(tables.shape[:3], ctx, device="cuda", dtype=torch.int32),
                             page_tables=tables, max_query_len=1, max_context_len=max_len)
    t = ms(lambda: graphs.run(ids, positions, meta))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights -= model.embed_tokens.weight.numel() * 2   # the embedding is gathered, not read whole
    kv = 2 * cfg.num_layers * batch * ctx * cfg.num_kv_heads * cfg.head_dim * 2
    roofline = (weights + kv) / bw * 1e3
    return ["| step | ms | roofline ms (weights + KV over copy bw) | ratio |", "| --- | --- | --- | --- |",
            f"| llama-3.1-8b shape, bf16, batch 64, context 1k, CUDA graph | {t:.2f} | {roofline:.2f} | "
            f"{t / roofline:.2f} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="skip the 16k contexts")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("nanokv.tools.kernel_bench needs a CUDA device")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"device: {torch.cuda.get_device_name()}, date: {datetime.date.today()}, commit: {commit or 'unknown'}, "
          f"torch {torch.__version__}")
    bw, flops = copy_bandwidth(), matmul_flops()
    print(f"\nceilings: copy {bw / 1e9:.0f} GB/s (read + write), bf16 matmul 8192^3 {flops / 1e12:.0f} TFLOP/s\n")
    for title, rows in (("decode attention (bf16 queries, bf16 and int8 caches, Hq=32, Hkv=8, D=128, block 16)",
                         bench_decode(bw, args.quick)),
                        ("prefill attention (bf16, Hq=32, Hkv=8, D=128, block 16)", bench_prefill()),
                        ("elementwise", bench_elementwise(bw)),
                        ("decode step", bench_decode_step(bw))):
        print(f"### {title}\n" + "\n".join(rows) + "\n", flush=True)


if __name__ == "__main__":
    main()
