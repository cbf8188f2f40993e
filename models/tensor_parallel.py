"""Tensor parallelism: one model split across ranks by attention heads and MLP columns.

Rank r of N holds query heads r Hq/N .. (r+1) Hq/N - 1 and the KV heads they read; when KV
heads are fewer than ranks, each is replicated on N/Hkv ranks (vLLM's rule). Its rows of
q/k/v and of gate/up are its heads and its share of the MLP's columns (column-parallel: no
communication); its columns of o and down turn them back into a partial sum of the hidden
state (row-parallel), which one all-reduce after each adds over the ranks: two per layer.
The embedding, the norms and the LM head are replicated: every rank ends the forward pass
with the whole hidden state, rank 0 computes the logits alone, and no all-gather of the
vocabulary is needed (a vocabulary-parallel head would save its memory on the other ranks).
Each rank's KV cache holds its own KV heads: models/kv_cache.py sees the local shape.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from models.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """Which part of the model this process holds: rank of size (its collectives are over every
    rank: torch.distributed's default group); replicas: the ranks holding the same KV head as
    this one, when KV heads are replicated (None when each lives on one rank)."""
    rank: int = 0
    size: int = 1
    replicas: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (one rank: x)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def sum_over_replicas(self, scores: torch.Tensor) -> torch.Tensor:
        """A replicated KV head's attention scores: each replica's are summed over its own query
        heads only, so the head's are the sum over its replicas (what one rank would hold)."""
        if self.replicas is not None:
            scores = scores.contiguous()   # a collective reads the memory in order, whatever the strides
            dist.all_reduce(scores, group=self.replicas)
        return scores

    def from_rank_0(self, values: list[float], device: torch.device) -> list[float]:
        """Rank 0's values on every rank (the others give as many placeholders)."""
        if self.size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        dist.broadcast(tensor, 0)
        return tensor.tolist()

    @property
    def num_replicas(self) -> int:
        """Ranks holding each of this rank's KV heads (1 unless KV heads are replicated)."""
        return 1 if self.replicas is None else dist.get_world_size(self.replicas)

    def own_heads(self, num_kv_heads: int) -> slice:
        """This rank's KV heads among the model's num_kv_heads."""
        local = max(num_kv_heads // self.size, 1)
        first = self.rank // self.num_replicas * local
        return slice(first, first + local)

    def all_heads(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, L, H, ...] of this rank's H KV heads -> the same of every KV head of the model
        (one replica of each), in the model's order, on every rank."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts[::self.num_replicas], dim=2)

    def min(self, n: int, device: torch.device) -> int:
        """The smallest of every rank's n."""
        return self._reduce(n, device, dist.ReduceOp.MIN)

    def max(self, n: int, device: torch.device) -> int:
        """The largest of every rank's n."""
        return self._reduce(n, device, dist.ReduceOp.MAX)

    def _reduce(self, n: int, device: torch.device, op) -> int:
        if self.size == 1:
            return n
        value = torch.tensor([n], device=device)
        dist.all_reduce(value, op=op)
        return int(value)


def check_split(cfg: ModelConfig, size: int) -> None:
    """A ValueError naming the numbers if the model cannot be split over size ranks."""
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
    allowed = [n for n in range(1, heads + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)
               and cfg.intermediate_size % n == 0]
    if size not in allowed:
        raise ValueError(f"tensor_parallel_size={size} cannot split this model's {heads} query heads, {kv_heads} KV "
                         f"heads and {cfg.intermediate_size} MLP columns evenly; it allows "
                         f"{', '.join(map(str, allowed))}")


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shape one rank of size holds (heads and MLP columns; the rest is replicated)."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=max(cfg.num_kv_heads // size, 1),
                               intermediate_size=cfg.intermediate_size // size)


def shard_index(name: str, cfg: ModelConfig, shard: Shard) -> tuple[slice, ...]:
    """Where a checkpoint tensor's part on shard lies (HF names; cfg: the whole model's shape):
    its rows for q/k/v and gate/up, its columns for o and down, all of it for the rest."""
    every = slice(None)
    if shard.size == 1:
        return (every,)
    local = local_config(cfg, shard.size)
    D, r = cfg.head_dim, shard.rank
    first_kv = r * local.num_kv_heads if cfg.num_kv_heads >= shard.size else r * cfg.num_kv_heads // shard.size
    q = slice(r * local.num_heads * D, (r + 1) * local.num_heads * D)
    kv = slice(first_kv * D, (first_kv + local.num_kv_heads) * D)
    mlp = slice(r * local.intermediate_size, (r + 1) * local.intermediate_size)
    parts = {"q_proj": (q,), "k_proj": (kv,), "v_proj": (kv,), "gate_proj": (mlp,), "up_proj": (mlp,),
             "o_proj": (every, q), "down_proj": (every, mlp)}
    return next((index for part, index in parts.items() if f".{part}." in name), (every,))
