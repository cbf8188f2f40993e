"""The hot ops of the model, each a plain function on tensors.

Every op has a torch reference (`*_ref`), which runs on any device and is the
oracle its Triton kernel is tested against. Three backends serve the ops:
"triton" (the kernels), "cpu" (the references where they are already fast,
and kernels/*_cpu.py where a CPU wants another formulation, tested against the
same references) and "torch" (the references alone). An op takes the backend
of the device its tensors are on: Triton on CUDA, "cpu" elsewhere, so a CPU
engine on a machine with a GPU runs the CPU path. NANOKV_KERNELS (or
set_backend) forces one backend for every device. This package is the only
place that knows which backend runs: the engine asks the questions below
(check_device, decode_workspace_for, plan_step, ...) and never reads the name.
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple

import torch

from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.attention.cpu import StepPlan, make_plan, paged_attention_cpu
from kernels.attention.decode import (DecodeWorkspace, decode_workspace, logits_scratch as _logits_scratch,
                                      paged_decode_attention_triton)
from kernels.attention.key_scores import accumulate_key_scores_ref, accumulate_key_scores_triton
from kernels.attention.prefill import PREFILL_BLOCK_M, paged_attention_triton
from kernels.attention.reference import paged_attention_ref
from kernels.attention.splits import (DECODE_WAVES, decode_num_splits, decode_partials, decode_programs_per_sm,
                                      decode_wave, prefill_num_splits, prefill_wave, split_count)
from kernels.compact import move_slots_ref, move_slots_triton
from kernels.eviction_order import Protected, eviction_order_ref, eviction_order_triton, lowest_ref, lowest_triton
from kernels.head_slots import head_slots_ref, head_slots_triton
from kernels.hole_filling import hole_moves_ref, hole_moves_triton
from kernels.kv_store import QUANT_MAX, dequantize, store_kv_ref, store_kv_triton
from kernels.kv_store_cpu import store_kv_cpu
from kernels.linear_cpu import PackedLinear, can_prepack, prepack_linears
from kernels.norm import add_rms_norm_ref, add_rms_norm_triton, rms_norm_ref, rms_norm_triton
from kernels.page_choice import choose_pages_ref, choose_pages_triton
from kernels.repaging import repage_ref, repage_triton
from kernels.rope import QKNorms, apply_rope_ref, apply_rope_triton, long_rope_rows, rope_cos_sin_cache
from kernels.rope_cpu import apply_rope_cpu
from kernels.transfer import from_host, from_host_many, pack_arrays, to_host

BACKENDS = ("torch", "triton", "cpu")
TRITON_MIN_BLOCK_SIZE = 16   # the smallest tile tl.dot compiles on a GPU


class Ops(NamedTuple):
    silu_and_mul: Callable
    store_kv: Callable
    rms_norm: Callable
    add_rms_norm: Callable
    apply_rope: Callable
    move_slots: Callable
    hole_moves: Callable
    repage: Callable
    eviction_order: Callable
    lowest: Callable
    choose_pages: Callable
    head_slots: Callable


_OPS = {
    "torch": Ops(silu_and_mul_ref, store_kv_ref, rms_norm_ref, add_rms_norm_ref, apply_rope_ref, move_slots_ref,
                 hole_moves_ref, repage_ref, eviction_order_ref, lowest_ref, choose_pages_ref, head_slots_ref),
    "cpu": Ops(silu_and_mul_ref, store_kv_cpu, rms_norm_ref, add_rms_norm_ref, apply_rope_cpu, move_slots_ref,
               hole_moves_ref, repage_ref, eviction_order_ref, lowest_ref, choose_pages_ref, head_slots_ref),
    "triton": Ops(silu_and_mul_triton, store_kv_triton, rms_norm_triton, add_rms_norm_triton, apply_rope_triton,
                  move_slots_triton, hole_moves_triton, repage_triton, eviction_order_triton, lowest_triton,
                  choose_pages_triton, head_slots_triton),
}
_forced: str | None = None


def set_backend(name: str | None) -> None:
    """Force one backend ("torch", "triton" or "cpu") for every device; None: each device's own."""
    global _forced
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; use one of {', '.join(BACKENDS)} (or None: by device)")
    _forced = name


def forced_backend() -> str | None:
    return _forced


set_backend(os.environ.get("NANOKV_KERNELS") or None)


def backend(device: torch.device | str) -> str:
    """The backend that serves tensors on device."""
    return _forced or ("triton" if torch.device(device).type == "cuda" else "cpu")


def _ops(x: torch.Tensor) -> Ops:
    return _OPS[_forced or ("triton" if x.is_cuda else "cpu")]


def check_device(device: torch.device, block_size: int) -> None:
    """A ValueError if the backend of device cannot serve an engine there with this block size."""
    name = backend(device)
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the Triton kernels (NANOKV_KERNELS=triton) run on CUDA devices or in Triton's "
                         f"interpreter (TRITON_INTERPRET=1); the engine's device is {device}: "
                         "use NANOKV_KERNELS=cpu or torch, or leave it unset")
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"the CPU kernels (NANOKV_KERNELS=cpu) run on the CPU; the engine's device is {device}: "
                         "use NANOKV_KERNELS=triton or torch, or leave it unset")
    if name == "triton" and block_size < TRITON_MIN_BLOCK_SIZE:
        raise ValueError(f"block_size must be >= {TRITON_MIN_BLOCK_SIZE} with the Triton kernels, got {block_size} "
                         "(NANOKV_KERNELS=torch takes any power of two)")


def captures_graphs(device: torch.device) -> bool:
    """Whether decode steps on device can replay CUDA graphs: the Triton kernels never
    synchronise with the host; the references do."""
    return device.type == "cuda" and backend(device) == "triton"


def packs_weights(device: torch.device) -> bool:
    """Whether the backend of device wants the linears' weights prepacked (kernels/linear_cpu.py)."""
    return backend(device) == "cpu"


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _ops(gate_up).silu_and_mul(gate_up)


def store_kv(k, v, k_cache, v_cache, pos_cache, score_cache, slot_mapping, positions, kv_scales=None) -> None:
    _ops(k).store_kv(k, v, k_cache, v_cache, pos_cache, score_cache, slot_mapping, positions, kv_scales=kv_scales)


def head_slots(tables: torch.Tensor, lens: torch.Tensor, block_size: int, row_seq: torch.Tensor | None = None,
               from_end: torch.Tensor | None = None) -> torch.Tensor:
    """Where a step's new pairs go in heads with pages of their own (kernels/head_slots.py)."""
    return _ops(lens).head_slots(tables, lens, block_size, row_seq, from_end)


def move_slots(buffers: tuple[torch.Tensor, ...], tables: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Slots of heads moved in every per-slot buffer of the cache (kernels/compact.py)."""
    _ops(tables).move_slots(buffers, tables, src, dst)


def move_pages(buffers: tuple[torch.Tensor, ...], moves: torch.Tensor) -> None:
    """Whole pages moves[s, 0] [S, 2, m] into pages moves[s, 1] in every per-slot buffer: the slots
    of each row's pages moved, its pages its table."""
    bs, num_pages = buffers[0].shape[1], moves.shape[-1]
    slots = torch.arange(2 * num_pages * bs, device=moves.device).view(2, 1, num_pages * bs)
    _ops(moves).move_slots(buffers, moves.flatten(1), slots[0], slots[1])


def hole_moves(order: torch.Tensor, lens: torch.Tensor, num_leaving: torch.Tensor, num_slots: int, max_moves: int,
               counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The survivors that fill the holes evicted pairs leave, packed per sequence, and the heads'
    new lengths (kernels/hole_filling.py)."""
    return _ops(order).hole_moves(order, lens, num_leaving, num_slots, max_moves, counts)


def eviction_order(priority: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor, pages: torch.Tensor,
                   block_size: int, floor_pages: int, protected: Protected | None = None):
    """KV-Compress's heads' slots in eviction order, and their pages' costs (kernels/eviction_order.py)."""
    return _ops(priority).eviction_order(priority, positions, lens, pages, block_size, floor_pages, protected)


def lowest(priority: torch.Tensor, positions: torch.Tensor, k: int, protected: Protected | None = None):
    """Each head's k slots of lowest priority, ties to the lower position (kernels/eviction_order.py)."""
    return _ops(priority).lowest(priority, positions, k, protected)


def choose_pages(costs: torch.Tensor, pages: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """KV-Compress's pages each head gives up, the cheapest of a sequence's (kernels/page_choice.py)."""
    return _ops(costs).choose_pages(costs, pages, target)


def repage(tables: torch.Tensor, kept: torch.Tensor, staying: torch.Tensor, max_moves: int, num_pages: int,
           share_cap: torch.Tensor, width: int, moved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KV-Compress's pages moved out of the blocks given back, the unused shared (kernels/repaging.py)."""
    return _ops(tables).repage(tables, kept, staying, max_moves, num_pages, share_cap, width, moved)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _ops(x).rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    return _ops(x).add_rms_norm(x, residual, weight, eps)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
               norms: QKNorms | None = None) -> None:
    _ops(q).apply_rope(q, k, positions, cos_sin, norms)


# ----- attention's scratch: flash-decoding's and a split prefill's ---------------------------

def prefill_split_bytes(head_dim: int, device: torch.device) -> int:
    """The most a split prefill's fp32 partial results take: splits > 1 only while tiles x Hkv
    < a wave, so tokens x splits < 2 x block_q x wave / Hkv, and as block_q <= PREFILL_BLOCK_M
    / G, token-heads x splits < 2 x PREFILL_BLOCK_M x wave."""
    if backend(device) != "triton":
        return 0
    return 2 * PREFILL_BLOCK_M * prefill_wave(device) * (head_dim + 1) * 4


def decode_workspace_for(max_num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                         device: torch.device, quantized: bool = False) -> DecodeWorkspace | None:
    """Flash-decoding's split partials for every decode batch of up to max_num_seqs sequences
    (a few MB), allocated once; None where the Triton kernels do not run."""
    if backend(device) != "triton":
        return None
    partials = decode_partials(max_num_seqs, num_kv_heads, device, quantized)
    return decode_workspace(partials * num_heads, head_dim, device)


def logits_scratch(num_pages: int, group: int, block_size: int, device: torch.device) -> torch.Tensor | None:
    """Where a scored Triton decode keeps its raw logits (kernels/attention/decode.py); None elsewhere."""
    if backend(device) != "triton":
        return None
    return _logits_scratch(num_pages, group, block_size, device)


def scratch_bytes_per_slot(group: int, device: torch.device) -> int:
    """What logits_scratch takes per slot of the pool on device."""
    return 4 * group if backend(device) == "triton" else 0


def plan_step(page_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
              block_size: int, dtype: torch.dtype, scores: bool) -> StepPlan | None:
    """The CPU backend's gathers and masks for every layer of a step (kernels/attention/cpu.py),
    built once per step; None for the other backends, which need none."""
    if backend(page_tables.device) != "cpu":
        return None
    return make_plan(page_tables, cu_seqlens_q, context_lens, block_size, dtype, scores)


def paged_attention(q, k_cache, v_cache, page_tables, cu_seqlens_q, context_lens, scale, *,
                    max_query_len: int, max_context_len: int, num_decodes: int = 0,
                    score_cache=None, score_from=None, logits=None, workspace=None, cpu_plan=None,
                    kv_scales=None, square_scores=None, score_skip=None, positions=None, pos_cache=None):
    """Attention of q [T, Hq, D] over one layer of the paged cache (semantics: kernels/attention/reference.py).

    The cache is the pool of pages of every layer (layout: kernels/kv_store.py): k_cache,
    v_cache [P, bs, D], score_cache [P, bs], kv_scales [P, bs, 2]; the layer's
    page_tables [B, Hkv, nb] pick its pages, and context_lens [B, Hkv] says how many
    slots each (sequence, KV head) holds, this step's tokens last.

    With score_cache, also add to it, for every key, the softmax probability each query
    gave it (its square for sequence b if square_scores [B] bool says so), summed over the
    query heads of its group: the eviction scores. score_from [B] int32, if given: only
    sequence b's queries from index score_from[b] of its chunk count. score_skip [B] int32,
    if given: only the (query, key) pairs whose positions (the queries' positions [T], the
    keys' in pos_cache [P, bs]) are at least score_skip[b] apart count (KVC-full).
    max_query_len and max_context_len are host-side upper bounds, so that no kernel
    needs a device sync to size its grid. The first num_decodes sequences have one
    query each (the runner orders them first): they go to flash-decoding, the rest
    to the prefill kernel. logits and workspace: flash-decoding's scratch
    (kernels/attention/decode.py), allocated per call if None; cpu_plan: the CPU
    backend's plan of this layer (plan_step, StepPlan.layer), built per call if None.
    kv_scales: the scales of an int8 or fp8 cache (kernels/kv_store.py), None for an unquantized one.
    """
    name = _forced or ("triton" if q.is_cuda else "cpu")
    if name == "cpu":
        return paged_attention_cpu(q, k_cache, v_cache, page_tables, cu_seqlens_q, context_lens, scale,
                                   score_cache=score_cache, score_from=score_from, plan=cpu_plan,
                                   kv_scales=kv_scales, square_scores=square_scores, score_skip=score_skip,
                                   positions=positions, pos_cache=pos_cache)
    want_lse = score_cache is not None
    if name == "torch":
        result = paged_attention_ref(q, k_cache, v_cache, page_tables, cu_seqlens_q, context_lens, scale,
                                     return_lse=want_lse, kv_scales=kv_scales)
        if want_lse:
            out, lse = result
            accumulate_key_scores_ref(q, k_cache, score_cache, page_tables, cu_seqlens_q, context_lens,
                                      lse, scale, score_from, kv_scales, square_scores, score_skip, positions,
                                      pos_cache)
            return out
        return result
    out = torch.empty_like(q)

    def part(per_seq, which: slice):   # the decodes' or the chunks' part of a per-sequence tensor, or None
        return None if per_seq is None else per_seq[which]
    if num_decodes:
        quantized = kv_scales is not None
        splits = decode_num_splits(num_decodes, page_tables.shape[1], max_context_len, q.device, quantized)
        decodes = slice(None, num_decodes)
        paged_decode_attention_triton(q[decodes], k_cache, v_cache, page_tables[decodes],
                                      context_lens[decodes], scale, splits, score_cache=score_cache,
                                      logits=logits, workspace=workspace, out=out[decodes],
                                      score_from=part(score_from, decodes), kv_scales=kv_scales,
                                      square_scores=part(square_scores, decodes),
                                      score_skip=part(score_skip, decodes), positions=part(positions, decodes),
                                      pos_cache=pos_cache)
    if num_decodes == len(context_lens):
        return out
    # The chunks: their rows of q, out and lse are addressed through cu_seqlens_q.
    chunks = slice(num_decodes, None)
    cu_seqlens, tables, lens = cu_seqlens_q[chunks], page_tables[chunks], context_lens[chunks]
    splits = prefill_num_splits(len(lens), max_query_len, tables.shape[1], q.shape[1] // tables.shape[1], q.dtype,
                                max_context_len, q.device, kv_scales is not None)
    result = paged_attention_triton(q, k_cache, v_cache, tables, cu_seqlens, lens, scale, return_lse=want_lse,
                                    max_query_len=max_query_len, out=out, kv_scales=kv_scales, num_splits=splits)
    if want_lse:
        accumulate_key_scores_triton(q, k_cache, score_cache, tables, cu_seqlens, lens, result[1], scale,
                                     part(score_from, chunks), max_query_len=max_query_len,
                                     max_context_len=max_context_len, kv_scales=kv_scales,
                                     square_scores=part(square_scores, chunks), score_skip=part(score_skip, chunks),
                                     positions=positions, pos_cache=pos_cache)
    return out


__all__ = ["BACKENDS", "DECODE_WAVES", "DecodeWorkspace", "PackedLinear", "Protected", "QKNorms", "QUANT_MAX",
           "StepPlan", "add_rms_norm", "apply_rope", "backend", "can_prepack", "captures_graphs", "check_device",
           "choose_pages", "decode_num_splits", "decode_partials", "decode_programs_per_sm", "decode_wave",
           "decode_workspace_for", "dequantize", "eviction_order", "forced_backend", "from_host", "from_host_many",
           "head_slots", "hole_moves", "logits_scratch", "long_rope_rows", "lowest", "move_pages", "move_slots",
           "pack_arrays", "packs_weights", "paged_attention", "plan_step", "prefill_num_splits", "prefill_split_bytes",
           "prefill_wave", "prepack_linears", "repage", "rms_norm", "rope_cos_sin_cache", "scratch_bytes_per_slot",
           "set_backend", "silu_and_mul", "split_count", "store_kv", "to_host"]
