"""How many splits an attention launch cuts each context into: enough programs to fill the
GPU's last wave (a wave: the programs its SMs hold at once), from shapes alone, so CUDA graphs
and eager steps of one batch size launch alike (kernels/attention/decode.py, prefill.py).
"""
from __future__ import annotations

import functools

import torch

from kernels.attention.prefill import prefill_tiles
from kernels.attention.tiles import MIN_SPLIT

# On an H200, in every decode and prefill case timed, the fewest splits that filled the last wave
# to 90% ran within 2% of the fastest count, and a last wave under a third full cost 13-19% more
# (docs/PERF.md, the sixth run).
DECODE_WAVES = 4    # a decode launch is split into at most this many waves
FULL_WAVE = 0.9
CPU_WAVE = 4        # the interpreter's "wave" on a CPU: a few programs, so tests see several splits


def decode_programs_per_sm(capability_major: int, quantized: bool = False) -> int:
    """Flash-decoding programs at head_dim 128 that one SM holds at once (kernels/compile_check.py).
    A 16-bit cache's double-buffered K/V tiles take ~72 KB of shared memory: 3 to an H100's SM
    (228 KB), 2 to an A100's (164 KB). An 8-bit cache's program (2 warps) takes ~250 registers a
    thread and ~41 KB: 4 to an H100's SM (its 64K registers), 3 to an A100's."""
    hopper = capability_major >= 9
    if quantized:
        return 4 if hopper else 3
    return 3 if hopper else 2


@functools.cache
def decode_wave(device: torch.device, quantized: bool = False) -> int:
    """The flash-decoding programs device runs at once."""
    if device.type != "cuda":
        return CPU_WAVE
    gpu = torch.cuda.get_device_properties(device)
    return decode_programs_per_sm(gpu.major, quantized) * gpu.multi_processor_count


def split_count(batch_size: int, num_kv_heads: int, max_context_len: int, wave: int, max_waves: int = 1) -> int:
    """Splits per (sequence or query tile, KV head) of a launch on a GPU that runs `wave` programs
    at once: the fewest that fill the last wave to FULL_WAVE (more only add partial results to
    merge); where none does, those that fill it most, the most of them among equals (shorter
    programs: a shorter tail). No more than max_waves waves of programs need, nor than a context
    of max_context_len can use (a split holds at least MIN_SPLIT slots). Decode on an H200
    (wave 396) with 8 KV heads, context 4k: 16 splits at batch 1, 3 at batch 16 and 64."""
    tasks = batch_size * num_kv_heads
    most = max(1, min(-(-max_waves * wave // tasks), -(-max_context_len // MIN_SPLIT)))
    return _fullest_last_wave(tasks, wave, most)


@functools.cache
def _fullest_last_wave(tasks: int, wave: int, most: int) -> int:
    def last_wave_full(splits: int) -> float:   # the programs over the slots of the waves they take
        programs = tasks * splits
        return programs / (wave * -(-programs // wave))
    candidates = range(1, most + 1)
    return next((s for s in candidates if last_wave_full(s) >= FULL_WAVE),
                max(reversed(candidates), key=last_wave_full))


def decode_num_splits(batch_size: int, num_kv_heads: int, max_context_len: int, device: torch.device,
                      quantized: bool = False) -> int:
    """split_count for device's GPU, up to DECODE_WAVES waves. Depends on shapes only, so CUDA
    graphs (which pass max_model_len) and eager steps of one batch size compile and launch
    alike. An eager step's bound can be lower (its longest context: fewer splits) or higher (a
    head whose own pages reach past max_model_len, kvcompress), so at long contexts graphed and
    eager steps can sum their splits in another order: equal up to the last bits."""
    return split_count(batch_size, num_kv_heads, max_context_len, decode_wave(device, quantized), DECODE_WAVES)


@functools.cache
def prefill_wave(device: torch.device) -> int:
    """The prefill kernel's programs device runs at once: one per SM. A program holds a whole
    query tile, and each split writes its tile's partial output in fp32 for the merge; on an
    H200 a 64-token chunk over a 4k context ran fastest in 8 splits (16 tiles x heads: 128
    programs), 1.4x faster than in 16 (docs/PERF.md)."""
    if device.type != "cuda":
        return CPU_WAVE
    return torch.cuda.get_device_properties(device).multi_processor_count


def prefill_num_splits(num_seqs: int, max_query_len: int, num_kv_heads: int, group: int, dtype: torch.dtype,
                       max_context_len: int, device: torch.device, quantized: bool = False) -> int:
    """Splits per (sequence, KV head) of the prefill kernel's contexts: split_count over the
    batch's query tiles, up to one wave, so a few short chunks over long contexts (block-wise
    prefill) fill the GPU's SMs, and a long prefill takes one."""
    block_q = prefill_tiles(dtype, max_query_len, group, quantized)[0] // group
    tiles = num_seqs * -(-max_query_len // block_q)
    return split_count(tiles, num_kv_heads, max_context_len, prefill_wave(device))


def decode_partials(max_num_seqs: int, num_kv_heads: int, device: torch.device, quantized: bool = False) -> int:
    """The most (sequence, split) pairs a flash-decoding call of up to max_num_seqs sequences
    uses on device, whatever their contexts: unbounded contexts take the most splits, so no
    bound is needed, and it is under DECODE_WAVES x decode_wave / Hkv + max_num_seqs."""
    return max(b * decode_num_splits(b, num_kv_heads, 2**62, device, quantized) for b in range(1, max_num_seqs + 1))
