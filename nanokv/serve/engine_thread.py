"""The server's engine thread: one thread owns the LLM and steps it.

LLM is not thread-safe, so the asyncio side never calls it. Adds and aborts go
to the engine thread through a queue; the results of a group of requests (the
choices of one API request) come back to the group's asyncio.Queue through
loop.call_soon_threadsafe, a step's outputs in one call per event loop (each call wakes
the loop). Every request in flight takes part in every step, which is what makes
concurrent clients share decode steps (continuous batching).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections import defaultdict
from dataclasses import dataclass

from nanokv.llm import LLM
from nanokv.sampling_params import SamplingParams

log = logging.getLogger("nanokv.serve")


class EngineError(RuntimeError):
    """The engine could not finish a request: a failed step, or the server stopping."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    results: asyncio.Queue          # its group's: items arrive as (index, item)
    index: int                      # the request's place in its group
    request_id: int | None = None   # the LLM's id, once added


class EngineThread:
    """Runs `llm` on a background thread; `submit` and `abort` are called from the event loop."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._keys = itertools.count()
        self._streams: dict[int, _Stream] = {}      # key -> stream; the engine thread's alone
        self._keys_by_request: dict[int, int] = {}  # LLM request id -> key
        self._thread = threading.Thread(target=self._run, name="nanokv-engine", daemon=True)
        self.largest_batch = 0   # most requests given a token by one step: > 1 means shared steps
        self.num_steps = 0
        self.stats = self._snapshot()   # replaced (never changed) by the engine thread: safe to read

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step; requests still in flight end with an EngineError."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)

    def submit(self, requests: list[tuple[list[int], SamplingParams]]) -> tuple[list[int], asyncio.Queue]:
        """Queue a group of requests (prompt ids, params). Returns their keys (for abort) and
        the queue their results arrive on, each as (index in the group, item): first one item
        for the whole group, its request ids or the exception add_request raised for one of
        them (then none runs); then each request's RequestOutputs up to its finished one, or
        an EngineError."""
        keys = [next(self._keys) for _ in requests]
        loop, results = asyncio.get_running_loop(), asyncio.Queue()
        self._commands.put(("add", keys, requests, [_Stream(loop, results, i) for i in range(len(requests))]))
        return keys, results

    def abort(self, keys: list[int]) -> None:
        """End requests and free their blocks (a no-op for those that have finished)."""
        self._commands.put(("abort", keys))

    def end_all(self, why: str) -> None:
        """End every request in flight with an EngineError that says why; the thread goes on."""
        self._commands.put(("end all", why))

    # ----- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            idle = not self.llm.has_unfinished()
            try:
                while True:   # every command queued so far; wait for one only when idle
                    command = self._commands.get(block=idle)
                    idle = False
                    if command[0] == "stop":
                        self._fail_all("the server is shutting down")
                        self.stats = self._snapshot()
                        return
                    if command[0] == "end all":
                        self._fail_all(command[1])
                    else:
                        self._apply(*command)
            except queue.Empty:
                pass
            if self.llm.has_unfinished():
                self._step()
            self.stats = self._snapshot()

    def _apply(self, kind: str, *args) -> None:
        if kind == "add":
            keys, requests, streams = args
            try:
                for key, (prompt_ids, params), stream in zip(keys, requests, streams):
                    stream.request_id = self.llm.add_request(prompt_ids, params)
                    self._streams[key] = stream
                    self._keys_by_request[stream.request_id] = key
            except Exception as error:   # a bad request changes nothing in the engine
                for key in keys:
                    if key in self._streams:
                        self.llm.abort(self._forget(key).request_id)
                self._post(streams[0], error)
                return
            self._post(streams[0], [stream.request_id for stream in streams])
        elif kind == "abort":
            for key in args[0]:
                if key in self._streams:
                    self.llm.abort(self._forget(key).request_id)

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception as error:   # the engine's state is unknown: end what is in it, keep serving
            log.exception("engine step failed")
            self._fail_all(f"the engine failed a step: {type(error).__name__}: {error}")
            return
        self.num_steps += 1
        self.largest_batch = max(self.largest_batch, len(outputs))
        by_loop = defaultdict(list)
        for out in outputs:
            key = self._keys_by_request[out.request_id]
            stream = self._forget(key) if out.finished else self._streams[key]
            by_loop[stream.loop].append((stream.results, (stream.index, out)))
        for loop, items in by_loop.items():
            self._hand_over(loop, items)

    def _fail_all(self, message: str) -> None:
        for key in list(self._streams):
            stream = self._forget(key)
            try:
                self.llm.abort(stream.request_id)
            except Exception:
                log.exception("abort after a failure failed")
            self._post(stream, EngineError(message))

    def _forget(self, key: int) -> _Stream:
        stream = self._streams.pop(key)
        del self._keys_by_request[stream.request_id]
        return stream

    def _post(self, stream: _Stream, item) -> None:
        self._hand_over(stream.loop, [(stream.results, (stream.index, item))])

    @staticmethod
    def _hand_over(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, tuple]]) -> None:
        """Put each (queue, item) on its queue, in one call to loop's thread."""
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:   # its event loop has closed: nobody is waiting
            pass

    def _snapshot(self) -> dict:
        stats = self.llm.stats()
        return dict(running=stats.running, waiting=stats.waiting, free_blocks=stats.free_blocks,
                    total_blocks=stats.total_blocks, steps=self.num_steps, largest_batch=self.largest_batch,
                    preemptions=stats.preemptions, swaps=stats.swaps, host_blocks=stats.host_blocks,
                    host_blocks_used=stats.host_blocks_used, host_cached_blocks=stats.host_cached_blocks,
                    host_hits=stats.host_hits,
                    host_copied_bytes=stats.host_block_bytes * (stats.blocks_saved + stats.blocks_loaded
                                                                + stats.blocks_streamed),
                    offloaded_blocks=stats.offloaded_blocks, positions_recomputed=stats.positions_recomputed)


def _put_all(items: list[tuple[asyncio.Queue, tuple]]) -> None:
    for results, item in items:
        results.put_nowait(item)
