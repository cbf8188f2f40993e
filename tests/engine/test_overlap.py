"""Overlapped steps: the next step is scheduled and launched before the tokens of the one
before it are read. Requests get exactly what they get with overlap off: a request that
stopped has its one extra token dropped, never shown."""
import traceback

import numpy as np
import pytest
import torch

import kernels
from helpers import KERNEL_DEVICE, VOCAB, device_waits, preemption_prompts
from nanokv import LLM, SamplingParams
from nanokv.engine import sampler as sampler_module
from nanokv.outputs import Request

METHODS = ["full", "batchmax", "kvcompress", "snapkv", "h2o", "streamingllm", "ed"]
HOST_GB = 0.002


def engine(tiny_dir, overlap: bool, **options) -> LLM:
    return LLM(str(tiny_dir), dtype="float32", max_model_len=128, overlap_steps=overlap, **options)


def requests(method: str, reference: list | None = None) -> list[SamplingParams]:
    """A full-cache request that grows (in a short pool it preempts the newer ones), then five
    of method, which stop at different steps: by max_tokens, by a stop token or a stop string
    taken from what they generate without them (reference), one seeded and sampled, and two
    short ones, with logprobs and returning their kept positions (those steps do not overlap).
    The requests stopped by a stop string and a stop token ask for logprobs too: their extra
    token's must be dropped with it."""
    evicts = {} if method == "full" else dict(kv_method=method, kv_budget=32, evict_every=16,
                                              **({"kv_window": 8} if method == "snapkv" else {}))
    params = [SamplingParams(temperature=0, max_tokens=80)]
    params += [SamplingParams(temperature=0, max_tokens=n, **evicts) for n in (31, 45, 10, 12, 27)]
    params[2] = SamplingParams(temperature=0.8, seed=7, max_tokens=45, **evicts)
    params[1].logprobs = params[3].logprobs = params[5].logprobs = 2
    params[4].return_kept_positions = method != "full"
    if reference is not None:
        params[1].stop = [reference[1].text[9:11]]
        params[2].stop_token_ids = [reference[2].token_ids[:18][-1]]
        params[5].stop_token_ids = [reference[5].token_ids[:4][-1]]
    return params


def results(outputs) -> list[tuple]:
    return [(o.token_ids, o.text, o.finish_reason, o.kept_positions is None or o.kept_positions.tolist(),
             None if o.logprobs is None else [(lp.token, round(lp.logprob, 4)) for lp in o.logprobs])
            for o in outputs]


@pytest.mark.parametrize("pool, method", [("roomy", method) for method in METHODS] + [
    (pool, method) for pool in ("recompute", "swap") for method in ("full", "batchmax", "kvcompress", "streamingllm")])
def test_overlap_on_and_off_give_the_same_requests_the_same_results(tiny_dir, method, pool):
    """Stops land at different steps, prompts share cached blocks, and a short pool preempts
    (recomputed, or swapped to the host tier) where the method's requests grow into it."""
    options = {"roomy": dict(num_kv_blocks=160), "recompute": dict(num_kv_blocks=9, preemption_mode="recompute"),
               "swap": dict(num_kv_blocks=9, preemption_mode="swap", kv_offload_gb=HOST_GB)}[pool]
    prompts = preemption_prompts()
    off = engine(tiny_dir, False, **options)
    reference = off.generate(prompts, requests(method))
    params = requests(method, reference)
    expected = results(off.generate(prompts, params))
    assert [expected[i][2] for i in (1, 2, 5)] == ["stop"] * 3   # the stop string and stop tokens were hit
    on = engine(tiny_dir, True, **options)
    outputs = on.generate(prompts, params)
    assert results(outputs) == expected
    # an extra token's logprob is dropped with it, not kept past the last token
    assert all(len(o.request.seq.logprobs) == len(o.token_ids) for o in outputs if o.logprobs is not None)
    if pool != "roomy":
        assert on.stats().preemptions > 0
    assert on.blocks.num_free == on.blocks.num_blocks and not on.has_unfinished()


@pytest.mark.parametrize("method", ["full", "batchmax"])
def test_streamed_outputs_match_and_none_follows_a_finished_one(tiny_dir, method):
    """Through step(), with one request aborted mid-stream: each request's outputs add up to
    what generate() gives (the aborted one's to a prefix of it), and after a request's
    finished output no other comes."""
    prompts = preemption_prompts()
    params = requests(method, engine(tiny_dir, False, num_kv_blocks=160).generate(prompts, requests(method)))
    llm = engine(tiny_dir, True, num_kv_blocks=160)
    expected = llm.generate(prompts, params)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    tokens, finished, aborted, handed_out = {i: [] for i in ids}, set(), ids[2], []
    while llm.has_unfinished():
        for out in llm.step():
            assert out.request_id not in finished
            tokens[out.request_id] += out.new_token_ids
            assert tokens[out.request_id] == out.token_ids
            handed_out.append((out, out.token_ids, out.text))
            if out.finished:
                finished.add(out.request_id)
            if out.request_id == aborted and len(out.token_ids) == 5:
                llm.abort(aborted)
                finished.add(aborted)
    for i, out in zip(ids, expected):
        assert tokens[i] == (out.token_ids[:5] if i == aborted else out.token_ids)
    assert all([out.token_ids, out.text] == then for out, *then in handed_out)   # as they were
    assert llm.blocks.num_free == llm.blocks.num_blocks


def test_a_request_read_as_token_ids_streams_what_the_text_path_would_give(monkeypatch):
    """A model without a tokenizer: a step's output for a request that goes on is made at once from
    its token (Request.tokens_only: no text to decode, no stop strings), and every output of step()
    is the one LLM._emit makes, field by field, finishing ones and one aborted mid-stream too."""
    fields = ("request_id", "new_token_ids", "token_ids", "text", "new_text", "finished", "finish_reason",
              "num_tokens")
    streams = []
    for tokens_only in (True, False):
        if not tokens_only:
            monkeypatch.setattr(Request, "__post_init__", lambda request: setattr(request, "tokens_only", False))
        llm = LLM("random:tiny", dtype="float32", num_threads=1, max_num_seqs=4)
        ids = [llm.add_request([1 + i, 2, 3], SamplingParams(temperature=0, max_tokens=6 + 3 * i,
                                                             ignore_eos=i % 2 == 1)) for i in range(6)]
        assert {request.tokens_only for request in llm.requests.values()} == {tokens_only}
        seen = []
        while llm.has_unfinished():
            outputs = llm.step()
            seen.append([tuple(getattr(out, name) for name in fields) for out in outputs])
            if any(out.request_id == ids[3] and out.num_tokens == 4 for out in outputs):
                llm.abort(ids[3])
        streams.append(seen)
    assert streams[0] == streams[1] and sum(map(len, streams[0])) > 30


def test_generate_hands_a_step_s_tokens_on_only_for_the_requests_that_end_in_it(tiny_dir, monkeypatch):
    """Through generate(), with no stop strings, logprobs or failed rows in a step, only a request
    that ends in it has anything to detokenize or report: LLM._emit is called once a request."""
    llm, reasons = engine(tiny_dir, True, num_kv_blocks=160), []
    emit = llm._emit
    monkeypatch.setattr(llm, "_emit", lambda request, token, every_token, reason:
                        reasons.append(reason) or emit(request, token, every_token, reason))
    lengths = (5, 9, 14)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate([[1, 2, 3]] * 3, params)
    assert [len(out.token_ids) for out in outs] == list(lengths) and reasons == ["length"] * 3


@pytest.mark.parametrize("overlap", [True, False])
def test_a_step_launches_before_the_tokens_of_the_one_before_are_read(tiny_dir, monkeypatch, overlap):
    """The host reads step n's tokens after step n + 1 is launched (overlap; logprobs too: they
    come with the tokens), or before it is scheduled (overlap off; and any step of a request
    that returns its kept positions)."""
    llm = engine(tiny_dir, overlap, num_kv_blocks=160)
    events = []
    run, read = llm.runner.run, sampler_module.SampledTokens.read

    def launch(batch, clock=None):
        sampled = run(batch, clock)
        sampled.step = sum(kind == "launch" for kind, _ in events)
        events.append(("launch", sampled.step))
        return sampled

    def reading(sampled):
        events.append(("read", sampled.step))
        return read(sampled)
    monkeypatch.setattr(llm.runner, "run", launch)
    monkeypatch.setattr(sampler_module.SampledTokens, "read", reading)
    prompts = preemption_prompts()[:3]
    for extra in ({}, {"logprobs": 1}):
        events.clear()
        llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **extra)] * 3)
        launches = [kind for kind, _ in events].count("launch")
        assert launches == 8 and sorted(step for kind, step in events if kind == "read") == list(range(launches))
        for step in range(launches - 1):
            read_at, next_at = events.index(("read", step)), events.index(("launch", step + 1))
            assert (next_at < read_at) == overlap
    events.clear()
    kept = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, kv_method="h2o", kv_budget=32, evict_every=16,
                          return_kept_positions=True)
    llm.generate(prompts, [kept] * 3)
    assert all(events[i][0] != events[i + 1][0] for i in range(len(events) - 1))   # launch, read, launch, ...


def test_a_step_s_inputs_reach_the_device_in_one_copy(tiny_dir, monkeypatch):
    """What a step's forward pass reads from the host (token ids, positions, lengths, block
    tables and the rows of heads' own pages, the rows sampled, the score settings, where its
    pending tokens come from) reaches the device in one copy: prompt chunks and decodes, full,
    windowed, squared and skipping scores in one batch, heads with pages of their own
    (kvcompress, once it has evicted) beside those reading their blocks'. So does what a step's
    evictions read (blocks, positions, own rows, pairs and blocks kept), whatever evicts in it:
    kvcompress's first eviction and later ones, batchmax's, snapkv's, several methods at once
    (and a step with no eviction, none); and each row's sampling settings."""
    llm = engine(tiny_dir, True, num_kv_blocks=160, max_num_batched_tokens=48)
    steps, inside = [], [False]

    def counting(copy):   # a copy to the device: from_host, or from_host_many's one
        def made(values, device):
            steps[-1][0] += inside[0]
            return copy(values, device)
        return made

    def counted(name, phase, marks):   # phase's copies counted, with marks(its arguments), a set
        def run(*args):
            steps.append([0, name, marks(*args)])
            inside[0] = True
            try:
                return phase(*args)
            finally:
                inside[0] = False
        return run

    def own(seqs) -> set[bool]:   # whether each sequence's heads have pages of their own
        return {seq.own_pages is not None for seq in seqs}
    monkeypatch.setattr(kernels, "from_host", counting(kernels.from_host))
    monkeypatch.setattr(kernels, "from_host_many", counting(kernels.from_host_many))
    monkeypatch.setattr(llm.runner, "prepare", counted("prepare", llm.runner.prepare,
                                                       lambda batch, cache=None: own(batch.seqs)))
    monkeypatch.setattr(llm.runner.evictor, "evict", counted("evict", llm.runner.evictor.evict,
                                                             lambda evictions: own(e.seq for e in evictions)))
    monkeypatch.setattr(llm.runner.sampler, "_sample", counted("sample", llm.runner.sampler._sample,
                                                               lambda logits, params, *rest: {
                                                                   p.temperature > 0 for p in params}))
    evicts = dict(kv_budget=32, evict_every=16, max_tokens=40, temperature=0, ignore_eos=True)
    params = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, top_k=20, ignore_eos=True),
              SamplingParams(kv_method="batchmax", **evicts), SamplingParams(kv_method="snapkv", kv_window=8, **evicts),
              *[SamplingParams(kv_method="kvcompress", kv_score_all=True, kv_window=8, **evicts)] * 3]
    llm.generate(preemption_prompts(), params)
    prepares = [(copies, own) for copies, name, own in steps if name == "prepare"]
    evictions = [(copies, own) for copies, name, own in steps if name == "evict" and own]
    assert {True, False} in [own for _, own in prepares] and {False} in [own for _, own in prepares]
    assert all(copies == 1 for copies, _ in prepares)
    # heads with pages of their own beside those without (kvcompress's first eviction), and without any
    assert {True, False} in [own for _, own in evictions] and {False} in [own for _, own in evictions]
    assert all(copies == 1 for copies, _ in evictions)
    assert all(copies == 0 for copies, name, own in steps if name == "evict" and not own)   # a step with none
    sampled = [(copies, random) for copies, name, random in steps if name == "sample"]
    assert {True, False} in [random for _, random in sampled]   # a random row's temperature, top-k, top-p, min-p
    assert all(copies == (True in random) for copies, random in sampled)   # greedy rows alone: none


def test_a_decode_advanced_from_the_last_is_the_step_prepared_in_full(tiny_dir, monkeypatch):
    """ModelRunner._advanced: every step it makes from the one before (the same decodes) has the
    inputs that preparing its batch in full gives. Sequences of different lengths reach a new
    block at different steps (planned in full: their lengths and the pages read again), new ones
    are admitted as others end, and evicting methods count scores (h2o every query; snapkv
    evicting as it decodes, a window before each eviction: score_from changes); kvcompress's
    heads, once evicted, read pages of their own."""
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=200, max_num_seqs=6, num_threads=1)
    runner, advance, compared = llm.runner, llm.runner._advanced, []

    def checked(batch):
        last = runner.last_step
        own = last is not None and last.decode is not None and last.decode[2] is None   # every head's pages its own
        step = advance(batch)
        if step is not None:
            runner.last_step = None   # prepare in full (it calls this first: None)
            full = runner.prepare(batch)
            meta, full_meta = step.meta, full.meta
            for name in ("sampled_seqs", "sample_rows", "needs"):
                assert getattr(step, name) == getattr(full, name), name
            for name in ("slot_mapping", "context_lens", "page_tables", "score_from", "square_scores", "score_skip"):
                assert (getattr(meta, name) is None) == (getattr(full_meta, name) is None), name
                if getattr(meta, name) is not None:
                    assert torch.equal(getattr(meta, name), getattr(full_meta, name)), name
            assert torch.equal(step.input_ids, full.input_ids) and torch.equal(step.positions, full.positions)
            assert (meta.max_context_len, meta.num_decodes) == (full_meta.max_context_len, full_meta.num_decodes)
            compared.append(({seq.params.kv_method for seq in batch.seqs}, len(batch.planned_in_full),
                             bool(batch.evictions), own))
        return step
    monkeypatch.setattr(runner, "_advanced", checked)
    rng = np.random.default_rng(5)
    evicts = dict(kv_budget=48, evict_every=16)
    methods = [{}, dict(kv_method="h2o", **evicts),
               dict(kv_method="snapkv", kv_window=8, kv_schedule="decode", **evicts)]
    params = [SamplingParams(temperature=0, max_tokens=int(rng.integers(20, 70)), ignore_eos=True, **methods[i % 3])
              for i in range(10)]
    llm.generate([rng.integers(0, VOCAB, int(rng.integers(5, 60))).tolist() for _ in range(10)], params)
    assert len(compared) > 50 and {"h2o", "snapkv", None} <= set().union(*(methods for methods, *_ in compared))
    assert any(0 < n < 6 for _, n, *_ in compared) and any(evicting for _, _, evicting, _ in compared)
    # kvcompress: every head with pages of its own once it has evicted (the step's pages kept until
    # the next eviction), alone and beside sequences that read their blocks' pages (full).
    compared.clear()
    for mix in ([dict(kv_method="kvcompress", **evicts)], [dict(kv_method="kvcompress", **evicts), {}]):
        params = [SamplingParams(temperature=0, max_tokens=int(rng.integers(40, 70)), ignore_eos=True,
                                 **mix[i % len(mix)]) for i in range(6)]
        llm.generate([rng.integers(0, VOCAB, int(rng.integers(50, 60))).tolist() for _ in range(6)], params)
    assert sum(own for *_, own in compared) > 20


def test_arrays_copied_together_come_back_as_they_were_each_at_a_16_byte_boundary():
    """kernels.from_host_many: values, dtype and shape, empty arrays too, on KERNEL_DEVICE; the
    copy to a GPU packs them each at a multiple of 16 bytes from the start (pack_arrays), so a
    kernel reading one is compiled as for any tensor of its own."""
    arrays = [np.arange(5), np.array([1, 2, 3], dtype=np.int32), np.zeros((2, 3), dtype=np.int32),
              np.array([True, False]), np.array([], dtype=np.int64), np.arange(6, dtype=np.int64).reshape(3, 2)]
    arrived = list(kernels.from_host_many(dict(enumerate(arrays)), torch.device(KERNEL_DEVICE)).values())
    assert all(torch.equal(torch.from_numpy(a), t.cpu()) and t.dtype == torch.from_numpy(a).dtype
               for a, t in zip(arrays, arrived))
    packed, starts = kernels.pack_arrays(dict(enumerate(arrays)))
    assert all(start % 16 == 0 for start in starts)
    assert all((packed[start:start + a.nbytes] == a.reshape(-1).view(np.uint8)).all()
               for a, start in zip(arrays, starts))


def test_prompt_logprobs_are_read_with_the_tokens_not_at_launch(tiny_dir, monkeypatch):
    """A prompt read in chunks: each chunk's logprobs stay on the device when its step is
    launched (nothing waits for them there), and are all there when the request ends."""
    llm = engine(tiny_dir, True, num_kv_blocks=160, max_num_batched_tokens=32)
    run, at_launch = llm.runner.run, []

    def launch(batch, clock=None):
        sampled = run(batch, clock)
        at_launch.extend(seq.prompt_logprobs[i] for seq, i in sampled.prompt_targets)
        return sampled
    monkeypatch.setattr(llm.runner, "run", launch)
    out = llm.generate(preemption_prompts()[0], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=True,
                                                               logprobs=1))[0]
    assert len(at_launch) == len(out.prompt_token_ids) - 1 > 32 and set(at_launch) == {None}
    assert all(lp is not None for lp in out.prompt_logprobs[1:]) and len(out.logprobs) == 4


def test_overlap_steps_is_checked(tiny_dir):
    with pytest.raises((TypeError, ValueError), match="overlap_steps"):
        LLM(str(tiny_dir), dtype="float32", overlap_steps="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["full", "batchmax", "kvcompress"])
def test_a_step_is_launched_without_waiting_for_the_gpu(tiny_dir, method):
    """What the CPU tests cannot see: from the swap to the sampled tokens' copy, a step makes
    the host wait for the device nowhere (a sync-debug warning would say where), with logprobs
    of the prompt and of the tokens sampled, and with its phases timed unsynchronised."""
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256, num_kv_blocks=200, device="cuda")
    run, waits, launches = llm.runner.run, [], []

    def watched(batch, clock=None):
        launches.append(len(batch))
        with device_waits(lambda: waits.append(traceback.extract_stack()[-4:])):
            return run(batch, clock)
    evicts = {} if method == "full" else dict(kv_method=method, kv_budget=64, evict_every=16)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, ignore_eos=True, logprobs=2,
                            prompt_logprobs=True, **evicts)
    llm.generate(preemption_prompts(), params)   # the decode graphs captured (that waits) before
    llm.runner.run = watched
    with llm.timing(synchronize=False):   # as the workload mode times its steps
        llm.generate(preemption_prompts(), params)
    assert len(launches) >= 40 and waits == []   # a launch for each of the 40 tokens at least


class _NotYet:
    """An event standing for copies to the host that have not landed until `landed` holds True."""

    def __init__(self, landed: list):
        self.landed = landed

    def query(self) -> bool:
        return bool(self.landed)

    def synchronize(self) -> None:   # a read that must wait (the sampled tokens) has its values: clones
        pass


def device_pair_counts(llm: LLM) -> list[int]:
    """The evictor's counters as the device holds them now: [pairs evicted, pairs moved] (a page
    repaged: its slots)."""
    evicted, moved, pages = llm.runner.evictor.counts.tolist()
    return [evicted, moved + pages * llm.runner.evictor.block_size]


@pytest.mark.parametrize("method", ["batchmax", "kvcompress"])
def test_engine_stats_take_the_eviction_counts_from_a_copy_on_its_way(tiny_dir, monkeypatch, method):
    """stats() (which the server's engine thread, chat.py and bench.py's continuous runs take at
    every step) never reads the device's counters: it reports the copy of them made behind the
    last eviction once that has landed, and what had landed before until then. Copies here are
    clones that land when told."""
    landed = []
    monkeypatch.setattr(kernels, "to_host", lambda tensors: (tuple(t.clone() for t in tensors), _NotYet(landed)))
    llm = engine(tiny_dir, True)
    params = SamplingParams(temperature=0, max_tokens=40, kv_method=method, kv_budget=32, evict_every=16)
    llm.generate(preemption_prompts(), params)
    counts = device_pair_counts(llm)
    assert counts[0] > 0 and llm.stats().pairs_evicted == llm.stats().pairs_moved == 0   # none landed yet
    landed.append(True)
    stats = llm.stats()
    assert [stats.pairs_evicted, stats.pairs_moved] == counts   # the copy holds the last eviction's counts


@pytest.mark.gpu
def test_a_run_that_takes_stats_at_every_step_waits_only_for_its_tokens(tiny_dir):
    """A run stepped as bench.py's continuous runs step it (stats() after every step, phases timed
    unsynchronised) makes the host wait for the device only where it reads a step's tokens, and
    once it is over stats() holds the exact eviction counts."""
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256, num_kv_blocks=200, device="cuda")
    waits = []

    def waited():
        stack = traceback.extract_stack()
        if not any(frame.name == "read" and frame.filename.endswith("sampler.py") for frame in stack):
            waits.append(stack[-6:])
    methods = [SamplingParams(max_tokens=40, ignore_eos=True, kv_method=method, kv_budget=64, evict_every=16)
               for method in ("batchmax", "kvcompress")]
    prompts, params = [prompt for prompt in preemption_prompts() for _ in methods], methods * 6
    llm.generate(prompts, params)   # the decode graphs captured, the kernels compiled (those wait) before
    for prompt, p in zip(prompts, params):
        llm.add_request(prompt, p)
    with llm.timing(synchronize=False), device_waits(waited):
        while llm.has_unfinished():
            llm.step()
            llm.stats()
    assert waits == []
    assert [llm.stats().pairs_evicted, llm.stats().pairs_moved] == device_pair_counts(llm)
