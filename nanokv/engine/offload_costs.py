"""Moving K/V over the link between host memory and the device against computing it again:
whether a preempted sequence swaps (SwapCost), and KVPR's split (its eq. 6-11).

KVPR: for K/V that lives in host memory and is needed on the device, for each layer, the first l of a sequence's s positions are recomputed on the device from
their layer inputs (K = x W_k, V = x W_v, then the norms and RoPE of the forward pass),
which crosses the link first, while the K/V of the other s - l crosses it. One layer takes

    t(l) = l a + max(l c, (s - l) k)        (eq. 10, the batch folded into the per-position costs)

with a = one position's layer input over the link, k = its K/V over the link and c = its
recomputation on the device. The paper counts a multi-head model in one dtype (its eq. 6
and 8: activations h p bytes, K/V 2 h p, 4 h^2 flops); here they are the model's real sizes:
the input is h values of the activation dtype, K/V are 2 Hkv D values of the cache's dtype
(and, quantized, two fp32 scales per head), recomputing is the layer's fused projection,
2 h x (Hq + 2 Hkv) D flops (the q part is computed too, and dropped).

t falls with l while l c < (s - l) k if a < k, and rises after: the best l is 0 when a >= k
(a grouped-query model whose layer input is larger than its K/V, or an 8-bit cache), else
the crossing s k / (c + k), rounded to the better neighbour (best_split). What the link and
the device do is measured once a process (measure_link_and_device): every engine built after
the first, and the bench's tables, weigh the same numbers.

Preemption: swapping moves a sequence's blocks over the link twice (out, and back), while
recomputing runs its computed tokens through the model again, about 2 flops per parameter per
token at the device's matmul rate (a prefill is compute-bound). Per token that is a few KB of
K/V against billions of flops: a swap wins for any model on a CPU, and for large ones over
PCIe; a small model on a fast GPU can prefill a token quicker than the link moves its K/V.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from models import ModelConfig

if TYPE_CHECKING:
    from models import Decoder
    from nanokv.config import EngineConfig


@dataclass(frozen=True)
class PositionCost:
    """Seconds per position of one layer: its layer input over the link (a), its K/V over the
    link (k), recomputing its K/V on the device (c)."""
    a: float
    k: float
    c: float

    @classmethod
    def of(cls, model: ModelConfig, act_dtype: torch.dtype, kv_dtype: torch.dtype, quantized: bool,
           link_bytes_per_s: float, device_flops: float) -> PositionCost:
        kv_bytes = 2 * model.num_kv_heads * model.head_dim * kv_dtype.itemsize
        kv_bytes += 8 * model.num_kv_heads if quantized else 0   # a K and a V scale per head
        flops = 2 * model.hidden_size * (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
        return cls(model.hidden_size * act_dtype.itemsize / link_bytes_per_s, kv_bytes / link_bytes_per_s,
                   flops / device_flops)

    def layer_time(self, l: int, s: int) -> float:
        """eq. 10: the inputs of l positions, then their recomputation beside the others' K/V."""
        return l * self.a + max(l * self.c, (s - l) * self.k)


@dataclass(frozen=True)
class SwapCost:
    """Seconds to move one block over the link and to recompute one token."""
    block_s: float
    token_s: float

    @classmethod
    def of(cls, model: ModelConfig, block_bytes: int, link_bytes_per_s: float, device_flops: float) -> SwapCost:
        """A token's recomputation: 2 flops per weight of the layers' projections it goes through."""
        attention = model.hidden_size * (2 * model.num_heads + 2 * model.num_kv_heads) * model.head_dim
        params = model.num_layers * (attention + 3 * model.hidden_size * model.intermediate_size)
        return cls(block_bytes / link_bytes_per_s, 2 * params / device_flops)

    def pays(self, num_blocks: int, num_tokens: int) -> bool:
        """Swapping num_blocks out and back is quicker than recomputing num_tokens."""
        return 2 * num_blocks * self.block_s < num_tokens * self.token_s


def best_split(s: int, cost: PositionCost) -> int:
    """The l in [0, s] that minimises layer_time (eq. 11), the smallest on a tie."""
    if cost.a >= cost.k:
        return 0
    crossing = s * cost.k / (cost.c + cost.k)
    candidates = {0, min(int(crossing), s), min(int(crossing) + 1, s)}
    return min(sorted(candidates), key=lambda l: cost.layer_time(l, s))


@functools.cache
def measure_link_and_device(device: torch.device, dtype: torch.dtype, hidden: int,
                            kv_width: int) -> tuple[float, float]:
    """(bytes/s from host to device, flops/s of the K/V projection's matmul) on this machine:
    a pinned 64 MB copy (on a CPU, a copy within memory) and a matmul of 1,024 positions,
    each the best of three; measured at the first call for these arguments, remembered after."""
    def best(run) -> float:
        run()
        times = []
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return min(times)

    host = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.empty_like(host, device=device)
    link = host.numel() / best(lambda: target.copy_(host, non_blocking=True))
    x = torch.randn(1024, hidden, dtype=dtype, device=device)
    w = torch.randn(kv_width, hidden, dtype=dtype, device=device)
    flops = 2 * 1024 * hidden * kv_width / best(lambda: torch.nn.functional.linear(x, w))
    return link, flops


def rank_0_link_and_device(config: EngineConfig, model: Decoder, device: torch.device,
                           dtype: torch.dtype) -> tuple[float, float] | None:
    """What decoding from the host (KVPR's split) and preemption_mode "auto" weigh: the link
    and matmul rate of rank 0's machine (measure_link_and_device); None if nothing weighs them.
    Every rank splits by rank 0's numbers, so that all recompute alike."""
    shape, shard = model.config, model.shard
    recomputes = config.decode_from_host and config.partial_recompute
    if not recomputes and not (config.preemption_mode == "auto" and shard.rank == 0):
        return None
    measured = [0.0, 0.0]
    if shard.rank == 0:
        measured = measure_link_and_device(device, dtype, shape.hidden_size, 2 * shape.num_kv_heads * shape.head_dim)
    return tuple(shard.from_rank_0(list(measured), device) if recomputes else measured)
