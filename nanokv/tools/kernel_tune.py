"""Launch variants of the attention kernels, timed side by side on a GPU (CUDA only): the
measurements a change to a launch rule (kernels/__init__.py's split count, tiles.py's and
prefill.py's tiles) is made from.

    python -m nanokv.tools.kernel_tune [--out FILE] [--budget-s SECONDS]

Decode (bf16 cache at batch 1, 16 and 64, contexts 1k and 4k; int8 at batch 16 and 64):
the split count (the rule's, then 1, 2, 3, 4, 6 and powers of two to 64; over 1k, splits
shorter than MIN_SPLIT too), then key tile x warps x pipeline stages.
Prefill (a 64-token chunk over 1k and 4k, a full 4k prefill): the split count (the rule's, then
powers of two; over 1k, shorter splits too), then query tile x key tile x warps x stages.
Chunk (the 64-token chunk over 1k and 4k): query tile x key tile x split count together. Each
variant's output is checked against the shipped launch's before it is timed (kernel_bench.ms:
graph replays); a variant that does not compile (shared memory) is
listed as such. Lines print, and append to --out, as they are measured, so a run cut short
keeps what it has; past --budget-s no new group starts.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from unittest import mock

import torch

from kernels import decode_num_splits, prefill_num_splits
from kernels.attention import decode, prefill
from kernels.attention.decode import decode_workspace, paged_decode_attention_triton
from kernels.attention.prefill import paged_attention_triton
from kernels.kv_store import quantize
from nanokv.tools.kernel_bench import ms, paged_kv
from nanokv.tools.provenance import source_commit

HQ, HKV, D, BLOCK = 32, 8, 128, 16


class Staged:
    """A Triton kernel launched with num_stages set (the wrappers leave Triton's default)."""

    def __init__(self, kernel, num_stages: int):
        self.kernel, self.num_stages = kernel, num_stages

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, num_stages=self.num_stages, **kwargs)


def decode_case(batch: int, ctx: int, int8: bool):
    """A decode call's inputs and a function of (num_splits) that runs it."""
    k, v, tables, lens = paged_kv(batch, ctx, HKV, D, BLOCK, torch.bfloat16)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    cache, scales = (k, v), None
    if int8:
        (k8, k_scale), (v8, v_scale) = quantize(k, torch.int8), quantize(v, torch.int8)
        cache, scales = (k8, v8), torch.stack([k_scale, v_scale], dim=-1)
    work = decode_workspace(batch * HQ * 64, D, "cuda")
    return lambda splits: paged_decode_attention_triton(q, *cache, tables, lens, D ** -0.5, splits, workspace=work,
                                                        kv_scales=scales)


def prefill_case(q_len: int, ctx: int):
    """A prefill call's inputs and a function of (num_splits) that runs it."""
    k, v, tables, lens = paged_kv(1, ctx, HKV, D, BLOCK, torch.bfloat16)
    q = torch.randn(q_len, HQ, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, q_len], device="cuda", dtype=torch.int32)
    return lambda splits: paged_attention_triton(q, k, v, tables, cu, lens, D ** -0.5, max_query_len=q_len,
                                                 num_splits=splits)


def timed(fn, reference: torch.Tensor) -> dict:
    """fn's time, if it compiles and gives the reference's output (bf16 rounding apart)."""
    try:
        out = fn()
        error = float((out.float() - reference.float()).norm() / reference.float().norm())
        if not error < 1e-2:
            return dict(status=f"wrong (relative error {error:.2e})")
        return dict(status="ok", us=1e3 * ms(fn))
    except Exception as failure:   # a variant past the shared memory, or one Triton refuses
        return dict(status=f"{type(failure).__name__}: {str(failure).splitlines()[0][:120]}")


def shorter_splits(group: str, module, case: str, ctx: int, run, reference):
    """Over a context of 1k or less, whose split count MIN_SPLIT (256 slots a split) bounds:
    splits of 128 and of 64 slots, module's kernel launched with that bound instead."""
    for min_split in (128, 64) if ctx <= 1024 else ():
        def variant(min_split=min_split):
            with mock.patch.object(module, "MIN_SPLIT", min_split):
                return run(ctx // min_split)
        yield group, case, f"splits {ctx // min_split} of {min_split} slots", variant, reference


def decode_groups():
    """(group, case label, variant label, fn, reference) for every decode variant."""
    shapes = [(False, b, c) for b in (1, 16, 64) for c in (1024, 4096)] + [(True, b, 4096) for b in (16, 64)]
    cases = [(f"{'int8' if int8 else 'bf16'} batch {b} ctx {c}", b, c, int8, decode_case(b, c, int8))
             for int8, b, c in shapes]
    for label, b, c, int8, run in cases:
        rule = decode_num_splits(b, HKV, c, torch.device("cuda"), quantized=int8)
        reference = run(rule)
        for splits in dict.fromkeys([rule, 1, 2, 3, 4, 6, 8, 16, 32, 64]):
            yield "decode splits", label, f"splits {splits}{' (rule)' if splits == rule else ''}", \
                (lambda run=run, splits=splits: run(splits)), reference
        yield from shorter_splits("decode splits", decode, label, c, run, reference)
    for label, b, c, int8, run in cases:
        rule = decode_num_splits(b, HKV, c, torch.device("cuda"), quantized=int8)
        reference = run(rule)
        for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)):
            def variant(run=run, rule=rule, block_n=block_n, warps=warps, stages=stages):
                with mock.patch.object(decode, "decode_tile", lambda dtype, quantized: (block_n, warps)), \
                        mock.patch.object(decode, "_decode_kernel", Staged(decode._decode_kernel, stages)):
                    return run(rule)
            yield "decode tiles", label, f"BLOCK_N {block_n} warps {warps} stages {stages}", variant, reference


def prefill_groups():
    cases = [(q_len, ctx, prefill_case(q_len, ctx)) for q_len, ctx in ((64, 1024), (64, 4096), (4096, 4096))]
    rules = {(q_len, ctx): prefill_num_splits(1, q_len, HKV, HQ // HKV, torch.bfloat16, ctx, torch.device("cuda"))
             for q_len, ctx, _ in cases}
    for q_len, ctx, run in cases:
        rule = rules[q_len, ctx]
        reference = run(rule)
        for splits in dict.fromkeys([rule, 1, 2, 4, 8, 16]):
            yield "prefill splits", f"chunk {q_len} ctx {ctx}", f"splits {splits}{' (rule)' if splits == rule else ''}", \
                (lambda run=run, splits=splits: run(splits)), reference
        yield from shorter_splits("prefill splits", prefill, f"chunk {q_len} ctx {ctx}", ctx, run, reference)
    for q_len, ctx, run in cases:
        reference = run(rules[q_len, ctx])
        for block_m, block_n, warps, stages in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (2, 3)):
            def variant(run=run, rule=rules[q_len, ctx], block_m=block_m, block_n=block_n, warps=warps,
                        stages=stages):
                with mock.patch.object(prefill, "prefill_tiles", lambda *a: (block_m, block_n, warps)), \
                        mock.patch.object(prefill, "_paged_attention_kernel",
                                          Staged(prefill._paged_attention_kernel, stages)):
                    return run(rule)
            yield "prefill tiles", f"chunk {q_len} ctx {ctx}", \
                f"BLOCK_M {block_m} BLOCK_N {block_n} warps {warps} stages {stages}", variant, reference


def chunk_groups():
    """A 64-token chunk over 1k and 4k (block-wise prefill): query tile x key tile x split count
    together. The prefill groups above vary one at a time around the rule's choice; a tile of
    fewer query rows makes more programs, so it may want fewer splits (one: no partials to merge)."""
    for ctx in (1024, 4096):
        run = prefill_case(64, ctx)
        reference = run(prefill_num_splits(1, 64, HKV, HQ // HKV, torch.bfloat16, ctx, torch.device("cuda")))
        for block_m, block_n, splits in itertools.product((32, 64, 128), (32, 64), (1, 2, 4, 8)):
            def variant(run=run, block_m=block_m, block_n=block_n, splits=splits):
                tiles = (block_m, block_n, 8 if block_m >= 128 else 4)
                with mock.patch.object(prefill, "prefill_tiles", lambda *a: tiles):
                    return run(splits)
            yield "chunk tiles x splits", f"chunk 64 ctx {ctx}", \
                f"BLOCK_M {block_m} BLOCK_N {block_n} splits {splits}", variant, reference


GROUPS = {"decode": decode_groups, "prefill": prefill_groups, "chunk": chunk_groups}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="append one JSON line per variant here")
    parser.add_argument("--groups", nargs="+", choices=sorted(GROUPS), default=list(GROUPS))
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="start no new group after this")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("nanokv.tools.kernel_tune needs a CUDA device")
    start, context = time.perf_counter(), dict(device=torch.cuda.get_device_name(), commit=source_commit())
    print(f"kernel variants: {context['device']}, commit {context['commit'] or 'unknown'}", flush=True)
    current = None
    for group, case, variant, fn, reference in itertools.chain(*(GROUPS[g]() for g in args.groups)):
        if group != current:
            if time.perf_counter() - start > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: stopped before {group}")
                return
            current = group
            print(f"\n### {group}", flush=True)
        row = dict(context, group=group, case=case, variant=variant, **timed(fn, reference))
        print(f"{case:<22} {variant:<40} " + (f"{row['us']:8.1f} us" if "us" in row else row["status"]), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
