"""The public API: LLM.generate() for batches, add_request() + step() for streaming,
stats() for what the engine holds.

generate() is nothing but a loop over step(). One step: the scheduler picks
the batch, the runner runs the model and samples, the scheduler records the
new tokens, and here the tokens become text (with stop strings applied).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref
from collections.abc import Iterator
from itertools import count

import torch
from tqdm import tqdm

import kernels
from models import HostKVCache, ModelConfig, shapes
from models.loader import load_model, resolve_model_path
from models.tensor_parallel import Shard
from nanokv.checks import check_token_ids
from nanokv.config import KV_CACHE_DTYPES, EngineConfig, resolve_dtype
from nanokv.engine.block_manager import BlockManager
from nanokv.engine.grammar import Grammar, Grammars
from nanokv.engine.offload_costs import SwapCost
from nanokv.engine.prefix_cache import PrefixCache
from nanokv.engine.runner import ModelRunner
from nanokv.engine.sampler import SampledTokens
from nanokv.engine.scheduler import ScheduledBatch, Scheduler
from nanokv.engine.sequence import KEPT_POSITIONS, STOPS, Sequence
from nanokv.engine.timing import StepClock, Timings
from nanokv.engine.workers import cpu_threads, start_workers
from nanokv.eviction import EvictionSettings, KVMethod, method_for
from nanokv.outputs import EngineStats, Request, RequestOutput
from nanokv.sampling_params import SamplingParams
from nanokv.tokenizer import IncrementalDetokenizer, Tokenizer

Prompt = str | list[int]


def engine_device(name: str | torch.device | None) -> torch.device:
    """The engine's device: as given (None: cuda if available, else cpu), a CUDA one with its
    index, which everything on it is launched on (a bare "cuda" is the current device)."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class LLM:
    def __init__(self, model: str | None = None, dtype: torch.dtype | str = "auto", **options):
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; "
                            f"the options are {', '.join(sorted(fields - {'model', 'dtype'}))}")
        self.config = EngineConfig(model=model, dtype=dtype, **options)
        cfg = self.config
        method_for(EvictionSettings(), cfg, cfg.block_size, cfg.press_window)   # the defaults' combination, checked now
        self.device = device = engine_device(self.config.device)
        kernels.check_device(device, cfg.block_size)
        if cfg.num_threads is not None or (cfg.tensor_parallel_size > 1 and device.type == "cpu"):
            torch.set_num_threads(cpu_threads(cfg))
        self.dtype = resolve_dtype(self.config.dtype, device)
        if model is not None and model.startswith(shapes.RANDOM_PREFIX):   # timing: no files, no tokenizer
            shape = model.removeprefix(shapes.RANDOM_PREFIX)
            self.model_config, self.tokenizer, path = shapes.shape_config(shape), None, None
        else:
            path = resolve_model_path(model)
            self.model_config, self.tokenizer = ModelConfig.from_dir(path), Tokenizer.from_dir(path)
        self.config.max_model_len = self._max_model_len()
        self.kv_dtype = kv_dtype = KV_CACHE_DTYPES[self.config.kv_cache_dtype] or self.dtype
        self.workers = start_workers(cfg, str(path or model), self.model_config, self.dtype, kv_dtype, device)
        if self.workers is not None:
            self._stop_workers = weakref.finalize(self, self.workers.stop)
        try:   # this rank's part of the model, and its runner (the pool, the host tier)
            decoder = load_model(path or model, self.model_config, self.dtype, device, cfg.max_model_len,
                                 self.workers.shard if self.workers else Shard())
            self.runner = ModelRunner(cfg, decoder, self.dtype, device, kv_dtype)
        except BaseException:
            if self.workers is not None:   # a worker that failed says so; none is left behind
                self._stop_workers.detach()
                self.workers.fail()
                self.workers = None
            raise
        # A cached block's contents depend on the model and the cache's dtype.
        cache = PrefixCache(cfg.block_size, (str(path or model), str(kv_dtype))) if cfg.enable_prefix_caching else None
        self.blocks = BlockManager(self.runner.host_tier.num_pool_blocks, self.config.block_size, cache,
                                   self.runner.host_tier.cache.num_blocks)
        swap_cost = None
        if cfg.preemption_mode == "auto":
            link, flops = self.runner.link_and_device   # a split model's ranks move and compute a part each
            swap_cost = SwapCost.of(self.model_config, HostKVCache.bytes_per_block(self.runner.kv_cache), link,
                                    flops * cfg.tensor_parallel_size)
        eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos_token_ids.add(self.tokenizer.eos_token_id)
        self.scheduler = Scheduler(self.config, self.blocks, eos_token_ids, swap_cost,
                                   self.runner.host_tier.staging_pages.shape[1])
        self.grammars = Grammars(self.tokenizer and self.tokenizer.to_json, self.model_config.vocab_size, eos_token_ids)
        self.requests: dict[int, Request] = {}
        self._ids = count()
        self._timings: Timings | None = None   # inside timing()
        self._in_flight: SampledTokens | None = None   # launched, its tokens not read yet (overlap_steps)

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:   # nanokv attends to the whole context: stay inside the window
            limit = min(limit, self.model_config.sliding_window)
        wanted = self.config.max_model_len or limit
        if not 1 < wanted <= limit:
            raise ValueError(f"max_model_len={wanted} is outside the model's context (2..{limit})")
        return wanted

    # ----- requests -----------------------------------------------------------------------

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, or a ValueError that says what is wrong with it."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (random weights): give prompts as token ids")
            ids = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, (list, tuple)):
            check_token_ids("prompt", prompt, self.model_config.vocab_size)
            ids = list(prompt)
        else:
            raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len={self.config.max_model_len} "
                             "leaves no room to generate")
        return ids

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. A bad request raises and changes nothing."""
        return self._queue(prompt, self._prompt_ids(prompt), params)

    def _checked(self, params: SamplingParams) -> tuple[KVMethod, Grammar | None]:
        """The request's eviction method, its unset settings taken from the engine's, and its
        structured output's matcher. Checks params again first: a dataclass can be changed
        after it was built."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
        params.check()
        check_token_ids("stop_token_ids", params.stop_token_ids, self.model_config.vocab_size)
        check_token_ids("logit_bias", list(params.logit_bias), self.model_config.vocab_size)
        method = method_for(params, self.config, self.config.block_size, self.config.press_window)
        if params.return_kept_positions and method.name == "full":
            raise ValueError("return_kept_positions needs an evicting kv_method (any but full); "
                             "with full every position is kept")
        return method, params.structured_output and self.grammars.grammar(params.structured_output)

    def close(self) -> None:
        """End the tensor-parallel workers and leave their process group (nothing to do on one
        rank); the engine cannot run after."""
        if self.workers is not None:
            self.workers = None
            self._stop_workers()

    def _queue(self, prompt: Prompt, ids: list[int], params: SamplingParams | None) -> int:
        params = params or SamplingParams()
        method, grammar = self._checked(params)
        request_id = next(self._ids)
        generator = None if params.seed is None else torch.Generator(self.device).manual_seed(params.seed)
        seq = Sequence(request_id, ids, params, method=method, generator=generator,
                       max_slots=min(len(ids) + params.max_tokens, self.config.max_model_len) - 1,
                       prompt_logprobs=[None] * len(ids) if params.prompt_logprobs else None,
                       logprobs=[] if params.logprobs is not None else None, grammar=grammar)
        self.requests[request_id] = Request(seq, prompt if isinstance(prompt, str) else None,
                                            self.tokenizer and IncrementalDetokenizer(self.tokenizer, ids))
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: int) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request.seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()   # a step in flight holds none that is not there

    def stats(self) -> EngineStats:
        """A snapshot of what the engine holds: requests, KV blocks, preemptions (and, inside
        timing(), where the steps' time went). Never waits for the device: a caller may take
        one at every step and the steps still overlap."""
        sched, blocks, host = self.scheduler, self.blocks, self.runner.host_tier.cache
        return EngineStats(len(sched.running), len(sched.waiting), sum(seq.num_kv_slots for seq in sched.running),
                           blocks.num_free, blocks.num_blocks, blocks.block_size, self.runner.kv_cache.block_bytes,
                           sched.num_preemptions, copy.deepcopy(self._timings), sched.num_swaps,
                           host.num_blocks - blocks.num_host_free, len(blocks.host_reclaimable), host.num_blocks,
                           host.bytes_per_block(self.runner.kv_cache), *sched.host_copies, sched.host_hits,
                           sum(len(seq.offloaded) for seq in sched.running), sched.num_offloaded,
                           self.runner.host_tier.blocks_streamed, self.runner.host_tier.positions_recomputed,
                           *self.runner.evictor.pair_totals(), self.runner.evictor.num_pieces)

    @contextlib.contextmanager
    def timing(self, synchronize: bool = True) -> Iterator[Timings]:
        """Time the phases of every step inside the block; yields the running totals, also in
        stats(). synchronize: the device synchronised around each phase, so that each is its own
        (the steps no longer overlap); without, the steps run as they do untimed and the phases
        are the host's (nanokv/engine/timing.py)."""
        self._timings = timings = Timings(synchronized=synchronize)
        try:
            yield timings
        finally:
            self._timings = None

    # ----- stepping -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns an output for every request that got a new token. With
        overlap_steps the tokens a step samples are read in the next one, after it has
        launched the step after: its outputs are those of the step before."""
        return self._step(every_token=True)

    def _step(self, every_token: bool) -> list[RequestOutput]:
        """One step: schedule and launch the next batch, then read the tokens of the one before
        it (or of this one, when it does not overlap); outputs of the requests that got a token
        (every_token) or finished."""
        clock = StepClock(self._timings, self.device)
        previous, self._in_flight = self._in_flight, None
        batch = self.scheduler.schedule()
        clock.lap("schedule")
        if not batch and previous is None:
            if self.scheduler.has_unfinished():
                raise RuntimeError("requests are waiting but none can be scheduled")
            return []
        launched = None
        if batch:
            try:
                launched = self._launch(batch, clock)
            except Exception:
                self._in_flight = previous   # read by the next step: nothing sampled is lost
                raise
        outputs = self._read(previous, every_token, clock) if previous is not None else []
        if launched is not None:
            if self._overlaps(launched):
                self._in_flight = launched
            else:
                outputs += self._read(launched, every_token, clock)
        clock.lap("outputs")
        clock.end(decode=not batch or max(batch.num_new_tokens) == 1, launched=bool(batch))
        return outputs

    def _launch(self, batch: ScheduledBatch, clock: StepClock) -> SampledTokens:
        """Run the batch: the device has the step queued when this returns, and the scheduler
        has counted it, its sampled tokens pending."""
        try:
            if self.workers is not None:
                self.workers.send(batch)
            clock.lap("describe")
            sampled = self.runner.run(batch, clock)
        except Exception:
            if self.blocks.cache is not None:
                self.blocks.cache.forget_pending()
            if self.workers is not None:   # the ranks are out of step: a worker that ended says so; all end
                self.workers.fail()
            raise
        self.scheduler.advance(batch, sampled.seqs)
        clock.lap("update")
        return sampled

    def _overlaps(self, sampled: SampledTokens) -> bool:
        """Whether the next step may be scheduled before these tokens are read: not with
        overlap_steps off; not with tensor-parallel workers (each is sent the tokens it feeds);
        nor where a request must not run past its last token: a row that failed, kept positions
        (read when it ends). Penalties and grammars read the token the step before sampled
        themselves (Sampler); logprobs come with the tokens (SampledTokens)."""
        return self.config.overlap_steps and self.workers is None and not sampled.errors and not (
            sampled.needs & KEPT_POSITIONS and any(seq.params.return_kept_positions for seq in sampled.seqs))

    def _read(self, sampled: SampledTokens, every_token: bool, clock: StepClock) -> list[RequestOutput]:
        """The step's tokens read and recorded: stops checked, text detokenized, outputs made.
        A token of a request that finished since (a stop the step before, an abort) is dropped."""
        tokens = sampled.read()
        clock.lap("wait")
        done = {seq.seq_id: reason for seq, reason in self.scheduler.record(sampled.seqs, tokens)}
        logprobs = sampled.read_logprobs(tokens)
        clock.lap("update")
        errors = sampled.errors   # the rows that could not be sampled
        rows = range(len(tokens))
        if not (every_token or errors or logprobs or sampled.needs & STOPS):   # only an end has news
            rows = [row for row, seq in enumerate(sampled.seqs) if seq.seq_id in done]
        outputs, requests, seqs = [], self.requests, sampled.seqs
        for row in rows:
            seq = seqs[row]
            request = requests.get(seq.seq_id)
            if request is None or seq.finish_reason is not None:   # aborted, or ended by a stop string since
                continue
            token = tokens[row]
            if errors and row in errors:
                outputs.append(self._fail(request, errors[row]))
                continue
            if logprobs and row in logprobs:
                seq.logprobs.append(logprobs[row])
            reason = done.get(seq.seq_id)
            if reason is None and request.tokens_only and every_token:   # its token is all the news
                outputs.append(RequestOutput(request, 0, "", [token], False, None, len(seq.output_token_ids)))
                continue
            try:
                out = self._emit(request, token, every_token, reason)
                if out is not None:
                    outputs.append(out)
            except Exception as error:   # this request's own failure: it ends, the others go on
                outputs.append(self._fail(request, error, token))
        return outputs

    def _fail(self, request: Request, error: Exception, token: int | None = None) -> RequestOutput:
        """End a request whose own processing raised (after it was accepted): it finishes
        with finish_reason "error" and its blocks go back to the pool."""
        seq = request.seq
        self.scheduler.finish(seq, "error")   # a no-op if it had finished before the error
        seq.finish_reason = "error"
        self.requests.pop(seq.seq_id, None)
        return self._output(request, request.streamed, "", [] if token is None else [token],
                            f"{type(error).__name__}: {error}")

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.params.return_kept_positions:   # read before the blocks go back to the pool
            seq.kept_positions = self.runner.kept_positions(seq)
            if self.workers is not None:   # the other ranks' KV heads
                seq.kept_positions = self.workers.kept_positions(seq, seq.kept_positions)
        self.scheduler.finish(seq, reason)

    def _emit(self, request: Request, token: int, every_token: bool, reason: str | None) -> RequestOutput | None:
        """Detokenize the request's new tokens, check its stop strings, and end it if it ends
        here: the one place a request's end and its reason are decided. reason: why the step
        found it done (EOS, a stop token: "stop"; max_tokens, max_model_len: "length"), None if
        it goes on; a stop string in its text makes it "stop" whatever else ended it. Its
        output, if it finished or every_token asks for one. With neither stop strings nor a
        caller waiting for every token (generate), its text is decoded once, when it finishes."""
        seq = request.seq
        stops = seq.params.stop
        if not (every_token or reason or stops):
            return None   # nothing to say yet, and no text to follow
        text, detokenizer = request.text, request.detokenizer
        if detokenizer is not None:
            text += detokenizer.add(seq.output_token_ids[len(detokenizer.ids) - seq.num_prompt_tokens:])
            if reason is not None:   # no more tokens will complete a held-back partial character
                text += detokenizer.flush()
        if stops:
            hit = [i for i in (text.find(s) for s in stops) if i >= 0]
            if hit:
                text, reason = text[:min(hit)], "stop"
        request.text = text
        if reason is not None:
            self._finish(seq, reason)
            del self.requests[seq.seq_id]
            upto = len(text)
        elif not every_token:
            return None
        else:   # hold back a tail that might still grow into a stop string
            upto = max(request.streamed, len(text) - max(map(len, stops)) + 1) if stops else len(text)
        new_text, request.streamed = text[request.streamed:upto], upto
        return self._output(request, upto, new_text, [token])

    @staticmethod
    def _output(request: Request, upto: int, new_text: str, new_token_ids: list[int],
                error: str | None = None) -> RequestOutput:
        """The request's output: its text up to upto, what the step added, and what it asked for."""
        seq = request.seq
        # positional: a step builds one for every request it streams, and keywords cost a third more
        return RequestOutput(request, upto, new_text, new_token_ids, seq.is_finished, seq.finish_reason,
                             len(seq.output_token_ids), error)

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in the order of `prompts`."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        for sp in params:   # check everything before queueing anything
            self._checked(sp or SamplingParams())
        token_ids = [self._prompt_ids(p) for p in prompts]
        ids = [self._queue(p, t, sp) for p, t, sp in zip(prompts, token_ids, params)]
        pending, results = set(ids), {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generating") as bar:
            while pending:
                for out in self._step(every_token=False):
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        return [results[i] for i in ids]
