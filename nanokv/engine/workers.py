"""Tensor parallelism's processes (how the model is split: models/tensor_parallel.py).

Rank 0 is the engine: scheduler, block manager, prefix cache, sampling and outputs. Ranks
1..N-1 are workers: each owns its part of the weights, of the KV pool and of the host tier
(the same block ids, its own KV heads) and runs every step as rank 0 describes it. The
description says what changed since the last step, as one pickled message broadcast on a CPU
process group (gloo): the sequences that left; each scheduled sequence's Update (its counts,
the tail of its block table that changed, its tokens not yet sent and the host blocks it
decodes from since); the evictions; the blocks to copy to the host tier, from it, and from
cached blocks. A worker keeps a mirror of every running sequence and gives its runner the
batch rank 0 runs: the two all-reduces of each layer keep the ranks in step.

The engine starts the workers (spawned processes, one per rank) and connects them to
itself by torch.distributed: gloo on CPUs, NCCL on GPUs (rank r on the r-th GPU after the
engine's). Under torchrun (one machine or several) every rank runs the same script: rank 0's
LLM is the engine, and the others' LLM() runs this worker loop and ends the process.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.config import ModelConfig
from models.loader import load_model
from models.tensor_parallel import Shard, check_split
from nanokv.config import EngineConfig
from nanokv.engine.block_table import BlockTables
from nanokv.engine.runner import ModelRunner
from nanokv.engine.scheduler import Eviction, ScheduledBatch
from nanokv.engine.sequence import Sequence, Status, Swap
from nanokv.eviction import method_for
from nanokv.sampling_params import SamplingParams

STEP, KEPT, STOP = 0, 1, 2   # what a description asks: run a step, gather kept positions, end
TIMEOUT = datetime.timedelta(minutes=5)   # a collective of a step that waits longer ends the engine with an error
IDLE = datetime.timedelta(days=3650)   # how long a worker waits for the next step: an engine may idle for days
#                                        (a rank 0 that dies closes its connections, which ends the wait at once)


class Update(NamedTuple):
    """What a worker's mirror of one sequence lacks since rank 0 last described it (all of it,
    the first time), and the tokens it runs this step. Sent as a plain tuple: pickled several
    times faster than a named one, which counts at a large batch's every step."""
    seq_id: int
    params: SamplingParams | None   # its request's, the first time (its method is made from them)
    num_prompt_tokens: int
    max_slots: int
    num_computed_tokens: int
    num_kv_slots: int
    num_new_tokens: int
    changed_from: int               # its block table from here on is table_tail
    table_tail: list[int]
    tokens: list[int]               # its tokens not sent before
    offloaded: list[int]            # the host blocks it decodes from, not sent before


def connect(rank: int, size: int, address: str, device: torch.device,
            num_kv_heads: int) -> tuple[Shard, dist.ProcessGroup]:
    """Join the ranks: the model's all-reduces on the device's backend, the steps' descriptions on
    a gloo group that waits as long as the engine idles; with KV heads replicated, one group per
    KV head for its replicas' scores (every rank creates every group, in the same order)."""
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=address, rank=rank,
                            world_size=size, timeout=TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE)
    replicas, per_head = None, size // num_kv_heads
    for head in range(num_kv_heads if per_head > 1 else 0):
        group = dist.new_group(list(range(head * per_head, (head + 1) * per_head)), timeout=TIMEOUT)
        if rank // per_head == head:
            replicas = group
    return Shard(rank, size, replicas=replicas), control


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def torchrun_rank(config: EngineConfig) -> int | None:
    """This process's rank if torchrun started it (it sets RANK and WORLD_SIZE), else None; a
    ValueError if it started another number of processes than the ranks the engine splits over."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world != config.tensor_parallel_size:
        raise ValueError(f"torchrun started WORLD_SIZE={world} processes but tensor_parallel_size="
                         f"{config.tensor_parallel_size}: they must be equal (--tensor-parallel-size {world})")
    return int(os.environ["RANK"])


def start_workers(config: EngineConfig, model: str, cfg: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype,
                  device: torch.device) -> Workers | None:
    """The workers of a split model, started and connected (None on one rank). A process that
    torchrun started as a rank > 0 runs rank 0's steps here instead, and ends when the engine does."""
    rank = torchrun_rank(config)
    if config.tensor_parallel_size == 1:
        return None
    check_split(cfg, config.tensor_parallel_size)
    if rank:
        run_worker(rank, "env://", config, model, cfg, dtype, kv_dtype, worker_device(device, rank))
        raise SystemExit(0)
    return Workers(config, model, cfg, dtype, kv_dtype, device)


def cpu_threads(config: EngineConfig) -> int:
    """A rank's CPU threads: the option, or the cores shared out between the ranks."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return config.num_threads or max(1, cores // config.tensor_parallel_size)


def _padded(positions: torch.Tensor, control) -> torch.Tensor:
    """Kept positions [L, H, n] padded with -1 to the largest n of any rank: the same shape on
    every rank, for one gather."""
    longest = torch.tensor([positions.shape[-1]])
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=control)
    return torch.nn.functional.pad(positions, (0, int(longest) - positions.shape[-1]), value=-1)


def broadcast(message, group):
    """Rank 0's message (any picklable object; None on the other ranks) on every rank."""
    box = [message]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class Workers:
    """Rank 0's side: starts the workers and describes each step to them."""

    def __init__(self, config: EngineConfig, model: str, cfg: ModelConfig, dtype: torch.dtype,
                 kv_dtype: torch.dtype, device: torch.device):
        size = config.tensor_parallel_size
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel LLM is open in this process already: close it (LLM.close()) "
                               "before starting another")
        address, self.processes = "env://", []   # under torchrun the other ranks are running already
        if torchrun_rank(config) is None:
            address, context = free_address(), mp.get_context("spawn")
            self.processes = [context.Process(target=run_worker, daemon=True, name=f"nanokv-rank-{rank}",
                                              args=(rank, address, config, model, cfg, dtype, kv_dtype,
                                                    worker_device(device, rank)))
                              for rank in range(1, size)]
        for process in self.processes:
            process.start()
        self.shard, self.control = connect(0, size, address, device, cfg.num_kv_heads)
        self.stopped = False
        self.mirrored: dict[int, list] = {}   # seq_id -> [seq, tokens sent, offloaded blocks sent]: the mirrors
        self.parked: dict[int, Sequence] = {}   # swapped out: the workers keep their own page tables aside

    def check(self, wait_s: float = 0.0) -> None:
        """A RuntimeError if a worker has ended (it said why on its standard error), waiting up to
        wait_s for one to end (after a collective failed, one is ending), or if the ranks were
        ended. Under torchrun the processes are torchrun's: it ends the others when one fails."""
        if self.stopped:
            raise RuntimeError("tensor parallelism: the ranks were ended after a step failed (its error was raised "
                               "then); the engine cannot go on: close it (LLM.close) and start a new one")
        for process in self.processes:
            process.join(timeout=wait_s)
        dead = [p.name for p in self.processes if p.exitcode is not None]
        if dead:
            raise RuntimeError(f"tensor parallelism: {', '.join(dead)} ended (its error is above); the engine "
                               "cannot go on without it: close it (LLM.close) and start a new one")

    def send(self, batch: ScheduledBatch) -> None:
        """Describe the step rank 0 is about to run."""
        self.check()
        gone = [seq_id for seq_id, (seq, *_) in self.mirrored.items() if seq.status != Status.RUNNING]
        for seq_id in gone:   # finished, or preempted (admitted again, it is sent whole again)
            del self.mirrored[seq_id]
        swapped = [seq.seq_id for seq in batch.swapped_out]
        resumed = [(swap.seq.seq_id, swap.device, swap.device_before) for swap in batch.resumed]
        self.parked.update((seq.seq_id, seq) for seq in batch.swapped_out)
        for seq_id in [seq_id for seq_id, _, _ in resumed] + [i for i, seq in self.parked.items() if seq.is_finished]:
            del self.parked[seq_id]   # resumed, or finished while out: the workers keep those still parked
        updates = [tuple(self._describe(seq, n)) for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        evictions = [(e.seq.seq_id, e.num_evicted, e.num_slots, e.num_blocks_kept) for e in batch.evictions]
        broadcast((STEP, gone, swapped, list(self.parked), updates, evictions, batch.saves, batch.loads, batch.copies,
                   resumed), self.control)

    def _describe(self, seq: Sequence, n: int) -> Update:
        """What a worker's mirror of seq lacks, and its n new tokens."""
        first = seq.seq_id not in self.mirrored
        mirror = self.mirrored.setdefault(seq.seq_id, [seq, 0, 0])
        table = seq.block_table
        update = Update(seq.seq_id, seq.params if first else None, seq.num_prompt_tokens, seq.max_slots,
                        seq.num_computed_tokens, seq.num_kv_slots, n, table.changed_from,
                        table.ids[table.changed_from:], seq.tokens(mirror[1], seq.num_tokens - mirror[1]),
                        seq.offloaded[mirror[2]:])
        table.changed_from = len(table.ids)
        mirror[1:] = seq.num_tokens, len(seq.offloaded)
        return update

    def kept_positions(self, seq: Sequence, own: torch.Tensor) -> torch.Tensor:
        """[L, H, n]: seq's kept positions, own (rank 0's KV heads) and the workers' (one replica
        of each KV head), -1 after a head's last (an uneven method's heads hold different numbers)."""
        self.check()
        broadcast((KEPT, tuple(self._describe(seq, 0))), self.control)
        own = _padded(own, self.control)
        parts = [torch.empty_like(own) for _ in range(self.shard.size)]
        dist.gather(own, parts, dst=0, group=self.control)
        every = torch.cat(parts[::self.shard.num_replicas], dim=1)
        return every[..., :int((every >= 0).sum(-1).max())]

    def fail(self) -> None:
        """After the start or a step failed on any rank, the ranks are out of step and none can go
        on: a worker that ended says so (a RuntimeError); the others are ended at once (they may be
        waiting in a collective that will not come)."""
        try:
            self.check(wait_s=2.0)   # a worker that failed leaves as its collective fails
        finally:
            self.stop(tell=False)

    def stop(self, tell: bool = True) -> None:
        """Tell the workers to end (tell: they are waiting for a step), end those that do not,
        and leave the process group; once."""
        if self.stopped:
            return
        self.stopped = True
        try:
            if tell and all(p.exitcode is None for p in self.processes):
                broadcast((STOP,), self.control)
        finally:
            for process in self.processes:
                process.join(timeout=10 if tell else 0)
                if process.is_alive():
                    process.kill()
                    process.join()
            dist.destroy_process_group()


class Mirror:
    """A worker's side: the running sequences as rank 0 described them, and the batch of a step."""

    def __init__(self, runner: ModelRunner, config: EngineConfig):
        self.runner, self.config = runner, config
        self.tables = BlockTables(config.max_num_seqs, -(-config.max_model_len // config.block_size))
        self.seqs: dict[int, Sequence] = {}
        self.parked: dict[int, Sequence] = {}   # swapped out on rank 0: their own page tables kept aside

    def batch(self, gone: list[int], swapped: list[int], parked: list[int], updates: list[tuple],
              evictions: list[tuple], saves: list, loads: list, copies: list, resumed: list[tuple]) -> ScheduledBatch:
        """The batch of the step rank 0 described (Workers.send). A sequence swapped out is
        parked until it resumes: its mirror is sent whole again, and takes the parked one's own
        page tables."""
        for seq_id in gone:
            self.tables.release(self.seqs[seq_id].block_table)
            self.parked[seq_id] = self.seqs.pop(seq_id)
        swapped_out = [self.parked[seq_id] for seq_id in swapped]
        updates = [Update(*fields) for fields in updates]
        seqs = [self.update(update) for update in updates]
        resumed = [Swap(self.seqs[seq_id], [], device, before) for seq_id, device, before in resumed]
        self.parked = {seq_id: self.parked[seq_id] for seq_id in parked}
        evictions = [Eviction(self.seqs[seq_id], *counts) for seq_id, *counts in evictions]
        return ScheduledBatch(seqs, [u.num_new_tokens for u in updates], evictions, saves, loads, copies,
                              swapped_out, resumed)

    def update(self, update: Update) -> Sequence:
        """Bring a sequence's mirror up to date (Workers._describe)."""
        if update.params is not None:
            method = method_for(update.params, self.config, self.config.block_size, self.config.press_window)
            self.seqs[update.seq_id] = Sequence(update.seq_id, [], update.params, method=method,
                                                max_slots=update.max_slots, block_table=self.tables.new([]))
            if update.seq_id in self.parked:   # resumed: with what it kept aside
                parked, seq = self.parked.pop(update.seq_id), self.seqs[update.seq_id]
                seq.own_pages, seq.inputs_aside = parked.own_pages, parked.inputs_aside
        seq = self.seqs[update.seq_id]
        seq.num_prompt_tokens = update.num_prompt_tokens
        seq.num_computed_tokens, seq.num_kv_slots = update.num_computed_tokens, update.num_kv_slots
        seq.block_table.cut(update.changed_from)
        seq.block_table.extend(update.table_tail)
        prompt_part = max(0, min(len(update.tokens), seq.num_prompt_tokens - len(seq.prompt_token_ids)))
        seq.prompt_token_ids += update.tokens[:prompt_part]
        seq.output_token_ids += update.tokens[prompt_part:]
        seq.offloaded += update.offloaded
        return seq


def worker_device(engine: torch.device, rank: int) -> torch.device:
    """Rank's device: on CUDA the rank-th after the engine's (under torchrun its LOCAL_RANK-th,
    on whichever machine it runs), on a CPU the CPU."""
    if engine.type != "cuda":
        return engine
    if "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cuda", (engine.index + rank) % torch.cuda.device_count())


def run_worker(rank: int, address: str, config: EngineConfig, model: str, cfg: ModelConfig, dtype: torch.dtype,
               kv_dtype: torch.dtype, device: torch.device) -> None:
    """A worker process: load its part, then run steps until rank 0 says stop. On an error it
    says what went wrong and leaves at once: rank 0's next collective fails instead of waiting."""
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.set_num_threads(cpu_threads(config))
        shard, control = connect(rank, config.tensor_parallel_size, address, device, cfg.num_kv_heads)
        runner = ModelRunner(config, load_model(model, cfg, dtype, device, config.max_model_len, shard), dtype,
                             device, kv_dtype)
        mirror = Mirror(runner, config)
        while True:
            kind, *message = broadcast(None, control)
            if kind == STOP:
                break
            if kind == KEPT:
                positions = runner.kept_positions(mirror.update(Update(*message[0])))
                dist.gather(_padded(positions, control), dst=0, group=control)
            else:
                runner.run(mirror.batch(*message))
        dist.destroy_process_group()
    except BaseException:
        print(f"nanokv: tensor-parallel rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)
