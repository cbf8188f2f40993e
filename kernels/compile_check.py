"""Compile the Triton kernels nanokv launches for real GPUs, on a machine without one.

    python -m kernels.compile_check [--arch 90 80] [--json]

A stand-in Triton driver reports a CUDA target (sm_90: H100/H200, sm_80:
A100) and every launch goes to `JITFunction.run(..., warmup=True)`, which
specialises and compiles exactly as a real launch would, then stops before
loading anything. The public wrappers themselves are called, on small CPU
tensors with the dtypes and strides of real models, so what compiles is what
the engine launches. For every kernel the check reads registers, spills and
local memory (cuobjdump on the cubin), shared memory, warps and stages, and
whether the attention kernels double-buffer K and V (two K/V tiles allocated
in shared memory in the TTGIR: loads of the next tile overlap the math on
this one), and whether the loads whose row offsets can pass 2**31 elements
(a step of ~350k tokens, a pool of 2**31 slots) compute them in 64 bits (the
TTIR, whose values carry the source's names). `problems()` says what is wrong;
tests/kernels/test_compile_check.py asserts there is nothing.

Needs the real (not interpreted) Triton: run it without TRITON_INTERPRET.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Callable

import torch

# Shared memory one program may use (the opt-in per-block maximum).
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
ATTENTION_KERNELS = ("_paged_attention_kernel", "_decode_kernel")
# Per kernel, the loaded tensors whose address has a row (token or page) times a stride
# that can pass 2**31 elements: the offset must be built in 64 bits.
WIDE_ROWS = {"_paged_attention_kernel": ("q", "k", "v"), "_accumulate_key_scores_kernel": ("q", "k"),
             "_decode_kernel": ("k", "v")}


@dataclass
class CompiledKernel:
    case: str            # what the wrapper was asked to do
    kernel: str          # the Triton function compiled
    arch: int
    registers: int       # per thread
    local_bytes: int     # per thread: spills and stack (0 when nothing spills)
    shared_bytes: int    # per program
    num_warps: int
    num_stages: int
    kv_buffers: int      # K/V tiles in shared memory, per operand (0: loaded straight to registers)
    narrow_rows: list[str]   # of WIDE_ROWS, the tensors whose row offsets are not built in 64 bits


class StandInDriver:
    """What Triton asks of its driver to compile for `arch`; nothing here can launch."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, local memory bytes) of the one function in a cubin, from cuobjdump."""
    import triton
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
    if match is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output:\n{usage}")
    registers, stack, local = map(int, match.groups())
    return registers, stack + local


def _kv_buffers(ttgir: str) -> int:
    """How many K (and V) tiles the kernel keeps in shared memory: the leading dimension
    of its 3-D mutable local allocations [buffers, BLOCK_N, head_dim]."""
    depths = re.findall(r"local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x\d+x\d+x", ttgir)
    return min(map(int, depths)) if len(depths) >= 2 else 0


def _narrow_rows(kernel: str, ttir: str) -> list[str]:
    """The tensors of WIDE_ROWS[kernel] whose pointers take no 64-bit offset anywhere."""
    return [name for name in WIDE_ROWS.get(kernel, ())
            if not re.search(rf"%{name}\w* = tt\.addptr [^\n]*[x ]i64>?( |$)", ttir, re.MULTILINE)]


def compile_cases(arch: int, cases: dict[str, Callable[[], None]]) -> list[CompiledKernel]:
    """Run each case with every Triton launch compiled for `arch` instead of run.

    One architecture per process: Triton keeps the target of each kernel's first
    launch, and this process never launches anything for real afterwards.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("kernels.compile_check needs the real Triton compiler: unset TRITON_INTERPRET")
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    compiled: list[tuple[str, str, object]] = []
    current = [""]

    def compile_only(self, grid):
        def launch(*args, **kwargs):
            kernel = self.run(*args, grid=grid, warmup=True, **kwargs)
            compiled.append((current[0], self.fn.__name__, kernel))
        return launch

    driver.set_active(StandInDriver(arch))
    JITFunction.__getitem__ = compile_only
    for name, case in cases.items():
        current[0] = name
        case()
    records = []
    for case, kernel_name, kernel in compiled:
        registers, local = _resources(kernel.asm["cubin"])
        records.append(CompiledKernel(case, kernel_name, arch, registers, local, kernel.metadata.shared,
                                      kernel.metadata.num_warps, kernel.metadata.num_stages,
                                      _kv_buffers(kernel.asm["ttgir"]), _narrow_rows(kernel_name, kernel.asm["ttir"])))
    return records


def problems(record: CompiledKernel) -> list[str]:
    """What is wrong with one compiled kernel: spills, too much shared memory, 16-bit
    attention that does not overlap its K/V loads with the math, or 32-bit row offsets."""
    found = []
    where = f"{record.kernel} [{record.case}] on sm_{record.arch}"
    if record.local_bytes:
        found.append(f"{where}: {record.local_bytes} bytes of local memory per thread (spills)")
    if record.shared_bytes > SHARED_LIMIT[record.arch]:
        found.append(f"{where}: {record.shared_bytes} bytes of shared memory, the limit is "
                     f"{SHARED_LIMIT[record.arch]}")
    if record.kernel in ATTENTION_KERNELS and "fp32" not in record.case and record.kv_buffers < 2:
        found.append(f"{where}: K/V single-buffered ({record.kv_buffers} tiles): loads do not overlap the math")
    if record.narrow_rows:
        found.append(f"{where}: the row offsets of {', '.join(record.narrow_rows)} are 32-bit (wrap past 2**31)")
    return found


# ----- the cases: the wrappers at the shapes that matter ------------------------------------

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
QUANTIZED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}   # cache formats (kernels/kv_store.py)
# name: (query heads, KV heads, head_dim, hidden, intermediate)
SHAPES = {"llama-3.1-8b": (32, 8, 128, 4096, 14336), "smollm2-135m": (9, 3, 64, 576, 1536),
          "qwen3-0.6b": (16, 8, 128, 1024, 3072), "mha-128": (8, 8, 128, 1024, 2048),
          "gqa8-128": (64, 8, 128, 8192, 28672), "phi-3.5-mini": (32, 32, 96, 3072, 8192),
          "llama-3.1-8b/16": (2, 1, 128, 4096, 896)}   # one rank's part split 16 ways: 1 KV head, replicated


def _qkv(tokens: int, hq: int, hkv: int, d: int, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model makes them: views of one fused projection output."""
    qkv = torch.zeros(tokens, (hq + 2 * hkv) * d, dtype=dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)


def _attention_case(kind: str, shape: str, dtype: str, block_size: int, query_len: int = 1,
                    scores: bool = False, cache: str | None = None, square: bool = False,
                    skip: bool = False, splits: int = 1) -> Callable[[], None]:
    """On the page layout (kernels/kv_store.py). cache: "int8" or "fp8" for a quantized cache,
    None for one in the model's dtype; square: pass square_scores (the key scores' SQUARE variant);
    skip: pass score_skip and the positions (KVC-full's SKIP variant); splits: the prefill's
    contexts cut into that many (its SPLIT variant and the merge)."""
    from kernels import decode_num_splits
    from kernels.attention.decode import paged_decode_attention_triton
    from kernels.attention.key_scores import accumulate_key_scores_triton
    from kernels.attention.prefill import paged_attention_triton

    def run():
        hq, hkv, d = SHAPES[shape][:3]
        dt = DTYPES[dtype]
        num_pages, width = 8, 4
        k_cache = torch.zeros(num_pages, block_size, d, dtype=QUANTIZED[cache] if cache else dt)
        v_cache = torch.zeros_like(k_cache)
        score_cache = torch.zeros(num_pages, block_size)
        kv_scales = torch.zeros(num_pages, block_size, 2) if cache else None
        tables = torch.zeros(2, hkv, width, dtype=torch.int32)
        lens = torch.ones(2, hkv, dtype=torch.int32)
        squares = torch.zeros(2, dtype=torch.bool) if square else None
        tokens = 2 * query_len   # decode: query_len 1
        skipping = dict(score_skip=torch.zeros(2, dtype=torch.int32), positions=torch.zeros(tokens, dtype=torch.long),
                        pos_cache=torch.zeros(num_pages, block_size, dtype=torch.int32)) if skip else {}
        q = _qkv(tokens, hq, hkv, d, dt)[0]
        if kind == "decode":
            paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 0.1, decode_num_splits(2, hkv, 4096, torch.device("cpu")),
                                          score_cache=score_cache if scores else None, kv_scales=kv_scales,
                                          square_scores=squares, **skipping)
            return
        cu_seqlens = torch.tensor([0, query_len, 2 * query_len], dtype=torch.int32)
        out, lse = paged_attention_triton(q, k_cache, v_cache, tables, cu_seqlens, lens, 0.1, return_lse=True,
                                          max_query_len=query_len, kv_scales=kv_scales, num_splits=splits)
        if kind == "key_scores":
            accumulate_key_scores_triton(q, k_cache, score_cache, tables, cu_seqlens, lens, lse, 0.1,
                                         max_query_len=query_len, max_context_len=4096, kv_scales=kv_scales,
                                         square_scores=squares, **skipping)
    return run


def _store_case(shape: str, dtype: str, cache: str) -> Callable[[], None]:
    """store_kv into a quantized cache."""
    from kernels.kv_store import store_kv_triton

    def run():
        hq, hkv, d = SHAPES[shape][:3]
        k_cache = torch.zeros(8, 16, d, dtype=QUANTIZED[cache])
        _, k, v = _qkv(4, hq, hkv, d, DTYPES[dtype])
        store_kv_triton(k, v, k_cache, torch.zeros_like(k_cache), torch.zeros(8, 16, dtype=torch.int32),
                        torch.zeros(8, 16), torch.zeros(4, hkv, dtype=torch.long), torch.zeros(4, dtype=torch.long),
                        kv_scales=torch.zeros(8, 16, 2))
        _move_case(k_cache, torch.zeros(8, 16, 2))
    return run


def _move_case(k_cache: torch.Tensor, *scales: torch.Tensor) -> None:
    """Eviction's moves of a head's slots, in every per-slot buffer of a cache whose K is k_cache."""
    from kernels.compact import move_slots_triton
    moves = torch.zeros(2, 3, 5, dtype=torch.long)
    move_slots_triton((k_cache, torch.zeros_like(k_cache), torch.zeros(8, 16, dtype=torch.int32), torch.zeros(8, 16),
                       *scales), torch.zeros(2, 3, 4, dtype=torch.int32), moves, moves)


def _elementwise_case(shape: str, dtype: str) -> Callable[[], None]:
    from kernels.activation import silu_and_mul_triton
    from kernels.kv_store import store_kv_triton
    from kernels.norm import add_rms_norm_triton, rms_norm_triton
    from kernels.rope import QKNorms, apply_rope_triton

    def run():
        hq, hkv, d, hidden, inter = SHAPES[shape]
        dt, tokens = DTYPES[dtype], 4
        x, residual = torch.zeros(tokens, hidden, dtype=dt), torch.zeros(tokens, hidden, dtype=dt)
        rms_norm_triton(x, torch.ones(hidden, dtype=dt), 1e-5)
        add_rms_norm_triton(x, residual, torch.ones(hidden, dtype=dt), 1e-5)
        q, k, v = _qkv(tokens, hq, hkv, d, dt)
        rms_norm_triton(q, torch.ones(d, dtype=dt), 1e-5)   # Qwen3's per-head q/k norm (what a press reads)
        for norms in (None, QKNorms(torch.ones(d, dtype=dt), torch.ones(d, dtype=dt), 1e-5)):   # with it, fused
            apply_rope_triton(q, k, torch.zeros(tokens, dtype=torch.long), torch.zeros(64, d), norms)
        silu_and_mul_triton(torch.zeros(tokens, 2 * inter, dtype=dt))
        k_cache = torch.zeros(8, 16, d, dtype=dt)
        store_kv_triton(k, v, k_cache, torch.zeros_like(k_cache), torch.zeros(8, 16, dtype=torch.int32),
                        torch.zeros(8, 16), torch.zeros(tokens, hkv, dtype=torch.long),
                        torch.zeros(tokens, dtype=torch.long))
        _move_case(k_cache)
    return run


def _eviction_cases() -> dict[str, Callable[[], None]]:
    """The eviction surgery's kernels: KV-Compress's eviction order over heads of the smallest sort
    (1,024 slots, 4 warps) and the largest (MAX_SLOTS, 16; kernels/eviction_order.py), its page
    choice over Qwen3-0.6B's heads at |kv| 512 and at the most a program takes (ELEMENTS;
    page_choice.py) and its repage (repaging.py), the moves that fill the holes (hole_filling.py),
    and where a step's pairs go in heads with pages of their own: a decode, and prompt chunks
    (head_slots.py; [L, B, H, W] views of the head tables' rows)."""
    from kernels.eviction_order import Protected, eviction_order_triton
    from kernels.head_slots import head_slots_triton
    from kernels.hole_filling import hole_moves_triton
    from kernels.page_choice import choose_pages_triton
    from kernels.repaging import repage_triton
    ints, longs = ((lambda *shape, dtype=dtype: torch.zeros(shape, dtype=dtype)) for dtype in (torch.int32, torch.long))
    tables, lens = ints(3, 2, 8, 5).transpose(0, 1), (ints(3, 2, 8) + 1).transpose(0, 1)
    cases = {f"eviction order, {n} slots": lambda n=n: eviction_order_triton(
        torch.zeros(2, 3, 4, n), ints(2, 3, 4), ints(2, 3, 4), ints(2, 3, 4), 16, 1, Protected(4, 64, longs(2)))
        for n in (1024, 4096)}
    cases |= {f"page choice, {m} pages": lambda m=m: choose_pages_triton(torch.zeros(2, 28, 8, m), ints(2, 28, 8),
                                                                           longs(2)) for m in (36, 2048)}
    cases["repage"] = lambda: repage_triton(ints(2, 3, 4, 5), longs(2, 3, 4), ints(2, 60), 4, 100, longs(2), 6,
                                            longs())
    cases["holes"] = lambda: hole_moves_triton(longs(2, 3, 4, 32), ints(2, 3, 4), ints(2, 3, 4), 32, 40, longs(2))
    cases["head slots"] = lambda: (head_slots_triton(tables, lens, 16),
                                   head_slots_triton(tables, lens, 16, longs(6), longs(6) + 1))
    return cases


def default_cases() -> dict[str, Callable[[], None]]:
    """A representative subset (the full product of dtypes, head_dims, block sizes and
    groups compiles too, in ~30 minutes): each dtype, head_dim 64, 96 and 128, block 16
    and 256, GQA groups 1, 2, 3, 4 and 8, decode with and without scores, prefill with
    long and short query tiles, key scores, plain and squared, every elementwise kernel, and
    one rank's part of a split model (group 2: tensor parallelism's local shapes)."""
    cases = {}
    for shape, dtype, block_size in (("llama-3.1-8b", "bf16", 16), ("smollm2-135m", "bf16", 16),
                                     ("gqa8-128", "fp16", 256), ("mha-128", "bf16", 16),
                                     ("smollm2-135m", "fp32", 16), ("llama-3.1-8b", "fp32", 16),
                                     ("llama-3.1-8b/16", "bf16", 16)):
        tag = f"{shape} {dtype} block {block_size}"
        for scores in (False, True):
            cases[f"decode{' + scores' if scores else ''}, {tag}"] = _attention_case(
                "decode", shape, dtype, block_size, scores=scores)
        cases[f"prefill 512, {tag}"] = _attention_case("prefill", shape, dtype, block_size, query_len=512)
        cases[f"key scores 512, {tag}"] = _attention_case("key_scores", shape, dtype, block_size, query_len=512)
    for kind in ("decode", "prefill"):   # head_dim 96, multi-head (Phi-3.5-mini)
        cases[f"{kind}, phi-3.5-mini bf16 block 16"] = _attention_case(kind, "phi-3.5-mini", "bf16", 16,
                                                                      query_len=1 if kind == "decode" else 512)
    cases["prefill 2 (short tile), llama-3.1-8b bf16 block 16"] = _attention_case(
        "prefill", "llama-3.1-8b", "bf16", 16, query_len=2)
    for shape, dtype in (("llama-3.1-8b", "bf16"), ("smollm2-135m", "fp32")):   # block-wise prefill's chunks
        cases[f"prefill 64, split 4, {shape} {dtype} block 16"] = _attention_case(
            "prefill", shape, dtype, 16, query_len=64, splits=4)
    # Squared scores (KV-Compress): the SQUARE variants of the score kernels, and with SKIP (KVC-full).
    for shape, dtype in (("llama-3.1-8b", "bf16"), ("smollm2-135m", "fp32")):
        tag = f"{shape} {dtype} block 16"
        for skip in (False, True):
            name = f"squared{' + skip' if skip else ''}, {tag}"
            cases[f"decode + {name}"] = _attention_case("decode", shape, dtype, 16, scores=True, square=True,
                                                        skip=skip)
            cases[f"key scores 512 {name}"] = _attention_case("key_scores", shape, dtype, 16, query_len=512,
                                                              square=True, skip=skip)
    for shape, dtype in (("llama-3.1-8b", "bf16"), ("smollm2-135m", "bf16"), ("qwen3-0.6b", "fp16"),
                         ("smollm2-135m", "fp32"), ("llama-3.1-8b/16", "bf16")):
        cases[f"elementwise, {shape} {dtype}"] = _elementwise_case(shape, dtype)
    # Quantized caches: each format with every attention kernel and the store.
    for shape, dtype, cache in (("llama-3.1-8b", "bf16", "int8"), ("smollm2-135m", "fp16", "fp8")):
        tag = f"{shape} {dtype} block 16, {cache} cache"
        for scores in (False, True) if cache == "int8" else (True,):   # int8 without scores: kernels.bench's
            cases[f"decode{' + scores' if scores else ''}, {tag}"] = _attention_case(
                "decode", shape, dtype, 16, scores=scores, cache=cache)
        cases[f"key scores 512, {tag}"] = _attention_case("key_scores", shape, dtype, 16, query_len=512,
                                                          cache=cache)
        cases[f"store, {tag}"] = _store_case(shape, dtype, cache)
    return cases | _eviction_cases()


def run_in_subprocesses(archs: list[int], only: str = "") -> list[CompiledKernel]:
    """compile_cases for each architecture in its own process (in parallel), with the
    interpreter off and a fresh Triton cache, so everything really compiles."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # Triton's default; set, so 3.9 does not warn
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache
        runs = [subprocess.Popen([sys.executable, "-m", "kernels.compile_check", "--json", "--arch", str(arch),
                                  "--only", only],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
                for arch in archs]
        outputs = [run.communicate() for run in runs]
    for run, (_, err) in zip(runs, outputs):
        if run.returncode:
            raise RuntimeError(f"compiling failed:\n{err}")
    return [CompiledKernel(**json.loads(line)) for out, _ in outputs for line in out.splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=sorted(SHARED_LIMIT))
    parser.add_argument("--only", default="", help="only the cases whose name contains this")
    parser.add_argument("--json", action="store_true", help="one architecture, in this process: a JSON "
                        "record per compiled kernel")
    args = parser.parse_args()
    if args.json:
        (arch,) = args.arch
        cases = {name: case for name, case in default_cases().items() if args.only in name}
        for r in compile_cases(arch, cases):
            print(json.dumps(asdict(r)))
        return
    records = run_in_subprocesses(args.arch, args.only)
    print("| arch | kernel | case | regs | local B | shared KB | warps | stages | K/V tiles |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in records:
        print(f"| sm_{r.arch} | {r.kernel} | {r.case} | {r.registers} | {r.local_bytes} | "
              f"{r.shared_bytes / 1024:.1f} | {r.num_warps} | {r.num_stages} | {r.kv_buffers} |")
    found = [p for r in records for p in problems(r)]
    print("\n" + ("\n".join(found) if found else "no problems"))
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
