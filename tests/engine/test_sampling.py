"""The batched sampler, and how stop conditions and streaming behave in the engine."""
import dataclasses
import time

import pytest
import torch

from helpers import make_tiny_model
from nanokv import LLM, SamplingParams, StructuredOutput
from nanokv.engine.sampler import FAILED, Sampler
from nanokv.config import EngineConfig
from nanokv.engine import sequence
from nanokv.engine.sequence import Sequence, step_needs
from nanokv.eviction import method_for


def sample_many(logits_row, params, n=4000, seed=0):
    sampler = Sampler(torch.device("cpu"), seed)
    logits = logits_row.expand(n, -1).clone()
    return sampler(logits, [params] * n, [None] * n)


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    out = Sampler(torch.device("cpu"), 0)(logits, [SamplingParams(temperature=0)] * 5, [None] * 5)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    for temperature in (0.5, 1.0, 2.0):
        tokens = sample_many(logits, SamplingParams(temperature=temperature), n=20000)
        freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
        expected = (logits / temperature).softmax(-1)
        assert (freq - expected).abs().max() < 0.015, (temperature, freq, expected)


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    assert set(sample_many(logits, SamplingParams(top_k=2)).tolist()) == {0, 1}
    probs = logits.softmax(-1)   # [0.64, 0.24, 0.09, ...]: top_p 0.8 keeps tokens 0 and 1
    assert set(sample_many(logits, SamplingParams(top_p=0.8)).tolist()) == {0, 1}
    assert set(sample_many(logits, SamplingParams(top_p=float(probs[0]) - 1e-3)).tolist()) == {0}
    assert set(sample_many(logits, SamplingParams(top_k=1, temperature=5.0)).tolist()) == {0}


def test_rows_keep_their_own_parameters_in_one_batch():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).expand(3000, -1).clone()
    params = [SamplingParams(temperature=0), SamplingParams(top_k=2), SamplingParams()] * 1000
    out = Sampler(torch.device("cpu"), 0)(logits, params, [None] * 3000).view(1000, 3)
    assert set(out[:, 0].tolist()) == {0}
    assert set(out[:, 1].tolist()) == {0, 1}
    assert set(out[:, 2].tolist()) == {0, 1, 2, 3}


def test_min_p_keeps_the_tokens_at_least_that_fraction_as_likely_as_the_top_one():
    logits = torch.tensor([2.0, 1.5, 0.0, -3.0])
    probs = logits.softmax(-1)   # relative to the top token: 1, 0.61, 0.14, 0.007
    freq = torch.bincount(sample_many(logits, SamplingParams(min_p=0.1), n=20000), minlength=4).float() / 20000
    kept = probs[:3] / probs[:3].sum()   # what is left, renormalised
    assert freq[3] == 0 and (freq[:3] - kept).abs().max() < 0.015
    assert set(sample_many(logits, SamplingParams(min_p=0.7)).tolist()) == {0}
    assert set(sample_many(logits, SamplingParams(min_p=1.0)).tolist()) == {0}   # the top token always stays


def test_logit_bias_moves_its_tokens_and_only_its_own_row_s():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).expand(4, -1).clone()
    params = [SamplingParams(temperature=0, logit_bias={3: 100}), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logit_bias={0: -100, 1: -100}), SamplingParams(temperature=0)]
    assert Sampler(torch.device("cpu"), 0)(logits, params, [None] * 4).tolist() == [3, 0, 2, 0]
    assert logits[0].tolist() == [3.0, 2.0, 1.0, 0.0]   # the logits logprobs are read from are not biased
    forced = sample_many(logits[0], SamplingParams(logit_bias={2: 100.0}))
    assert set(forced.tolist()) == {2}
    banned = sample_many(logits[0], SamplingParams(logit_bias={0: -100, 1: -100, 2: -100}))
    assert set(banned.tolist()) == {3}


@pytest.mark.parametrize("field, value, error, message", [
    ("min_p", 1.5, ValueError, "min_p"), ("logit_bias", {5: 101}, ValueError, "logit_bias"),
    ("logit_bias", {"5": 1}, TypeError, "logit_bias: token ids are integers"),
    ("logit_bias", {i: 1 for i in range(301)}, TypeError, "at most 300"), ("logit_bias", [5], TypeError, "dict"),
    ("presence_penalty", 2.5, ValueError, "presence_penalty"), ("frequency_penalty", -3, ValueError, "frequency"),
    ("repetition_penalty", 0, ValueError, "repetition_penalty")])
def test_bad_sampling_knobs_are_refused(field, value, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**{field: value})


def penalized(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """The penalties' definitions, token by token: HF's repetition penalty over prompt and output,
    then OpenAI's frequency and presence penalties over the output."""
    x = logits.clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


PENALTIES = [dict(presence_penalty=1.5), dict(frequency_penalty=0.7), dict(repetition_penalty=1.8),
             dict(repetition_penalty=0.6, frequency_penalty=-0.5, presence_penalty=0.3)]


def test_penalties_are_their_definitions_row_by_row():
    """Greedy rows with and without penalties in one batch, on random logits and histories."""
    g = torch.Generator().manual_seed(0)
    sampler = Sampler(torch.device("cpu"), 0)
    for _ in range(50):
        logits = torch.randn(6, 30, generator=g) * 3
        params = [SamplingParams(temperature=0, **kind) for kind in PENALTIES] + [SamplingParams(temperature=0)] * 2
        seqs = [Sequence(i, torch.randint(0, 30, (5,), generator=g).tolist(), p,
                         output_token_ids=torch.randint(0, 30, (8,), generator=g).tolist())
                for i, p in enumerate(params)]
        expected = [int(penalized(row, s.prompt_token_ids, s.output_token_ids, s.params).argmax()) if s.params.penalizes
                    else int(row.argmax()) for row, s in zip(logits, seqs)]
        before = logits.clone()
        assert sampler(logits, params, [None] * 6, seqs).tolist() == expected
        assert torch.equal(logits, before)   # logprobs read the raw logits


def test_a_penalized_row_samples_from_its_penalized_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.2)
    seq = Sequence(0, [3], params, output_token_ids=[0, 0, 1])
    sampler, n = Sampler(torch.device("cpu"), 0), 20000
    tokens = sampler(logits.expand(n, -1).clone(), [params] * n, [None] * n, [seq] * n)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert (freq - penalized(logits, [3], [0, 0, 1], params).softmax(-1)).abs().max() < 0.015


def test_a_sequence_needs_what_its_request_asks_for_and_a_step_what_any_of_its_sequences_needs():
    """Sequence.needs has a bit for each thing its steps do beyond a greedy token (a step makes no
    pass over its sequences for what none needs); step_needs is their union."""
    greedy = SamplingParams(temperature=0)
    evicting = dict(kv_method="kvcompress", kv_budget=32, evict_every=16)
    asked = {"RANDOM": dict(params=SamplingParams(temperature=0.7)),
             "SEEDED": dict(generator=torch.Generator()),
             "PENALTIES": dict(params=SamplingParams(temperature=0, repetition_penalty=1.2)),
             "LOGIT_BIAS": dict(params=SamplingParams(temperature=0, logit_bias={3: 1.0})),
             "GRAMMAR": dict(grammar=object()),
             "LOGPROBS": dict(logprobs=[]),
             "PROMPT_LOGPROBS": dict(prompt_logprobs=[None, None]),
             "KEPT_POSITIONS": dict(params=SamplingParams(temperature=0, return_kept_positions=True)),
             "STOPS": dict(params=SamplingParams(temperature=0, stop=["."])),
             "SCORES UNEVEN": dict(method=method_for(SamplingParams(**evicting), EngineConfig(), 16))}
    seqs = [Sequence(0, [1, 2], **{"params": greedy, **kind}) for kind in asked.values()]
    for names, seq in zip(asked, seqs):
        assert seq.needs == sum(getattr(sequence, name) for name in names.split()), names
    assert Sequence(0, [1, 2], greedy).needs == 0
    assert step_needs(seqs) == sequence.EVERY_NEED and step_needs([]) == 0


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model(path, "llama")
    return LLM(str(path), dtype="float32", num_kv_blocks=128, max_model_len=256)


def test_a_biased_request_beside_plain_ones_gets_its_own_tokens(llm):
    """logit_bias +100 forces its token; the plain requests in the batch get what they get alone; a
    token outside the vocabulary is refused when the request is queued."""
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    forced = SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, logit_bias={65: 100})
    alone = llm.generate([[1, 2, 3], [9] * 20], plain)
    mixed = llm.generate([[1, 2, 3], [5, 6, 7], [9] * 20], [plain, forced, plain])
    assert mixed[1].token_ids == [65] * 8
    assert [mixed[0].token_ids, mixed[2].token_ids] == [out.token_ids for out in alone]
    with pytest.raises(ValueError, match="logit_bias: token id 99999 is outside the vocabulary"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={99999: 5}))


def test_penalized_requests_match_transformers_step_by_step(llm):
    """Greedy under each penalty, overlapped steps on, beside plain requests: the tokens HF's model
    gives when its logits at each step are penalized by the definitions above."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(llm.config.model, dtype=torch.float32).eval()
    prompts = [[5, 6, 7, 5, 6], [9, 8, 9, 8], [1, 2, 3], [40, 41]]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kind) for kind in PENALTIES]
    outs = llm.generate(prompts + [[1, 2, 3]], params + [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)])
    for prompt, p, out in zip(prompts, params, outs):
        tokens = []
        with torch.no_grad():
            for _ in range(12):
                logits = hf(torch.tensor([prompt + tokens])).logits[0, -1]
                tokens.append(int(penalized(logits, prompt, tokens, p).argmax()))
        assert out.token_ids == tokens, p
    assert outs[-1].token_ids == llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=12,
                                                                           ignore_eos=True))[0].token_ids


def test_seeded_requests_do_not_depend_on_their_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], params)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate([[1, 2, 3, 4], [5, 6, 7], [9] * 30], [others, params, others])
    assert batch[1].token_ids == alone
    unseeded = llm.generate([[5, 6, 7]] * 4, others)
    assert len({tuple(o.token_ids) for o in unseeded}) > 1


def test_stop_token_ids_and_eos(llm):
    free_run = llm.generate([[10, 11]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    stop_at = free_run.token_ids[5]
    out = llm.generate([[10, 11]], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_at]))[0]
    first = free_run.token_ids.index(stop_at)
    assert out.token_ids == free_run.token_ids[:first + 1] and out.finish_reason == "stop"
    llm.scheduler.eos_token_ids.add(stop_at)   # the same token as EOS
    try:
        out = llm.generate([[10, 11]], SamplingParams(temperature=0, max_tokens=30))[0]
        assert out.token_ids == free_run.token_ids[:first + 1] and out.finish_reason == "stop"
        out = llm.generate([[10, 11]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
        assert out.token_ids == free_run.token_ids and out.finish_reason == "length"
    finally:
        llm.scheduler.eos_token_ids.discard(stop_at)


def test_stop_strings_cut_the_text_and_streaming_adds_up(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate([[40, 41, 42]], params)[0].text
    stop = full[10:13]
    cut = full.find(stop)
    params.stop = [stop]
    rid = llm.add_request([40, 41, 42], params)
    pieces, last = [], None
    while llm.has_unfinished():
        for out in llm.step():
            assert out.request_id == rid
            pieces.append(out.new_text)
            last = out
    assert last.finished and last.finish_reason == "stop"
    assert last.text == full[:cut] == "".join(pieces)


def test_generate_gives_what_streaming_gives(llm):
    """generate() builds an output only when a request finishes; streaming builds one every step.
    Text, tokens and reasons are the same, stop strings, stop tokens and lengths alike."""
    prompts = [[40, 41, 42], [7, 8], [1, 2, 3, 4, 5], [60] * 9]
    full = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[full[0].text[8:11]]),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[full[0].token_ids[3]]),
              SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)]
    generated = llm.generate(prompts, params)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    streamed = {}
    while llm.has_unfinished():
        for out in llm.step():
            streamed[out.request_id] = out
    for got, request in zip(generated, ids):
        want = streamed[request]
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)


@pytest.mark.parametrize("ended_by", ["max_tokens", "stop_token_ids", "max_model_len"])
def test_a_stop_string_in_the_last_token_finishes_the_request_once_as_stop(llm, ended_by):
    """The step that reaches max_tokens (or a stop token, or max_model_len) also completes a
    stop string: the request ends once, by the stop string, its kept positions read before its
    blocks go back; through generate() and through step() alike."""
    base = dict(temperature=0, max_tokens=8, ignore_eos=True, kv_method="streamingllm", kv_budget=32, evict_every=16)
    for first in range(40, 80):   # a prompt whose 8th token's text first appears at the end
        prompt = [first] * 4 + ([7] * 244 if ended_by == "max_model_len" else [])   # 248 + 8: max_model_len
        plain = llm.generate(prompt, SamplingParams(**base))[0]
        stop = plain.text[-1:]
        if stop and plain.text.find(stop) == len(plain.text) - 1 and plain.token_ids[-1] < 256:
            break
    ends = dict(max_tokens={}, stop_token_ids=dict(max_tokens=50, stop_token_ids=[plain.token_ids[-1]]),
                max_model_len=dict(max_tokens=50))[ended_by]
    for kept in (False, True):
        params = SamplingParams(**{**base, **ends, "stop": [stop], "return_kept_positions": kept})
        rid = llm.add_request(prompt, params)
        streamed = {}
        while llm.has_unfinished():
            streamed.update({o.request_id: o for o in llm.step()})
        for out in (llm.generate(prompt, params)[0], streamed[rid]):
            assert (out.finish_reason, out.error, out.text) == ("stop", None, plain.text[:-1]), ended_by
            assert out.token_ids == plain.token_ids
            assert (out.kept_positions is not None) == kept
    assert llm.blocks.num_free == llm.blocks.num_blocks


@pytest.mark.parametrize("synchronize", [True, False])
def test_timing_records_every_phase_of_the_steps_inside(llm, synchronize):
    assert llm.stats().timings is None
    start = time.perf_counter()
    with llm.timing(synchronize) as timings:
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        inside = llm.stats()
    wall = time.perf_counter() - start
    assert llm.stats().timings is None and inside.timings == timings   # a copy, taken inside
    assert timings.prefill_steps == 1 and timings.decode_steps == 5 and timings.synchronized == synchronize
    assert all(seconds > 0 for seconds in timings.decode.values())
    assert sum(timings.decode.values()) + sum(timings.prefill.values()) <= wall   # the steps' time, no more
    assert timings.host_s("decode") == pytest.approx(
        sum(timings.decode.values()) - timings.decode["forward"] - timings.decode["wait"])
    assert inside.running == inside.waiting == 0 and inside.free_blocks == inside.total_blocks


def test_abort_frees_the_request(llm):
    rid = llm.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    llm.step()
    llm.abort(rid)
    assert not llm.has_unfinished() and llm.blocks.num_free == llm.blocks.num_blocks


class BrokenGenerator:
    """Passes for a generator until it is drawn from."""
    def get_state(self):
        return None

    def set_state(self, state):
        pass


def test_a_row_that_fails_gets_FAILED_and_the_others_their_own_tokens():
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0), SamplingParams(seed=7), SamplingParams(), SamplingParams(seed=7)]
    alone = Sampler(torch.device("cpu"), 0)(logits[:2], params[:2], [None, torch.Generator().manual_seed(7)])
    sampler = Sampler(torch.device("cpu"), 0)
    # Row 1 draws from its stream before row 3 fails: it is rewound before being sampled again.
    out = sampler(logits, params, [None, torch.Generator().manual_seed(7), None, BrokenGenerator()])
    assert out[:2].tolist() == alone.tolist() and out[3] == FAILED
    assert list(sampler.errors) == [3] and isinstance(sampler.errors[3], TypeError)
    assert sampler(logits[:2], params[:2], [None, torch.Generator().manual_seed(7)]).tolist() == alone.tolist()
    assert sampler.errors == {}


def test_logits_stay_in_the_model_s_dtype_until_something_computes_with_them(tiny_dir, monkeypatch):
    """In bfloat16 a greedy step takes the argmax of the logits as the model gives them (no
    float32 copy of [rows, vocab]); sampling, penalties, logit bias, grammars and logprobs give
    what they give on logits taken to float32 first, token for token and logprob for logprob."""
    llm = LLM(str(tiny_dir), dtype="bfloat16", num_kv_blocks=64, max_model_len=160, num_threads=1)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [greedy, dataclasses.replace(greedy, logprobs=2, prompt_logprobs=True),
              dataclasses.replace(greedy, temperature=0.8, seed=3, top_p=0.9),
              dataclasses.replace(greedy, repetition_penalty=1.3, presence_penalty=0.5),
              dataclasses.replace(greedy, logit_bias={5: 3.0}),
              dataclasses.replace(greedy, structured_output=StructuredOutput(regex=r"[a-z ]{5,30}"))]
    prompts = [[(7 * i + j) % 250 for j in range(10 + 9 * i)] for i in range(len(params))]

    def outputs():
        return [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in llm.generate(prompts, params)]
    as_given = outputs()
    compute_logits = llm.runner.model.compute_logits
    monkeypatch.setattr(llm.runner.model, "compute_logits", lambda hidden: compute_logits(hidden).float())
    assert outputs() == as_given
    monkeypatch.undo()
    dtypes = []
    argmax = torch.Tensor.argmax
    monkeypatch.setattr(torch.Tensor, "argmax", lambda t, *a, **k: dtypes.append(t.dtype) or argmax(t, *a, **k))
    llm.generate([[1, 2, 3]] * 3, greedy)
    assert dtypes and set(dtypes) == {torch.bfloat16}
