"""Structured output in the engine: the masks, what constrained requests produce, and a
constrained request beside others under eviction, prefix caching and preemption."""
import json
import re

import pytest
import torch

import nanokv.engine.sampler as sampler_module
from helpers import VOCAB, preemption_prompts
from nanokv import LLM, SamplingParams
from nanokv.engine.grammar import BITS, apply_masks
from nanokv.eviction import METHODS
from nanokv.sampling_params import StructuredOutput

WORDS = r"[a-z]{6}( [a-z]{2,5}){3,6}\."
SCHEMA = {"type": "object", "properties": {
    "word": {"type": "string", "pattern": "^[a-z]{3,8}$"},
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["word", "n", "tags", "ok"], "additionalProperties": False}
SMALL = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "ok": {"type": "boolean"}},
         "required": ["n", "ok"], "additionalProperties": False}
ANSWER = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[1-9][0-9]?/'


def engine(directory, **options) -> LLM:
    return LLM(str(directory), **{"dtype": "float32", "max_model_len": 128, **options})


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"word", "n", "tags", "ok"} and re.fullmatch("[a-z]{3,8}", value["word"])
    assert type(value["n"]) is int and 0 <= value["n"] <= 999 and isinstance(value["ok"], bool)
    assert len(value["tags"]) <= 3 and set(value["tags"]) <= {"red", "green"}


def test_masks_put_exactly_the_tokens_they_do_not_allow_at_minus_infinity():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=g)
    masks = torch.randint(-2**31, 2**31 - 1, (2, -(-VOCAB // BITS)), dtype=torch.int32, generator=g)
    masked = apply_masks(logits, [1, 3], masks)
    expected = logits.clone()
    for mask, row in zip(masks, [1, 3]):
        for token in range(VOCAB):
            if not (int(mask[token // BITS]) >> (token % BITS)) & 1:
                expected[row, token] = float("-inf")
    assert torch.equal(masked, expected) and not logits.isinf().any()   # a copy: the raw logits stay
    assert torch.equal(apply_masks(logits[[1, 3]], [0, 1], masks), expected[[1, 3]])   # every row masked


@pytest.mark.parametrize("temperature", [0, 1])
def test_every_kind_of_constraint_is_met_and_ends_the_request_when_complete(tiny_dir, temperature):
    """A random model, which left alone writes bytes at random: each output matches its
    regex, schema or grammar, and ends there ("stop", with tokens to spare)."""
    llm = engine(tiny_dir, num_kv_blocks=160)
    specs = [StructuredOutput(regex=WORDS), StructuredOutput(json=SCHEMA), StructuredOutput(json=json.dumps(SCHEMA)),
             StructuredOutput(grammar=ANSWER), StructuredOutput(json_object=True)]
    params = [SamplingParams(temperature=temperature, seed=seed, max_tokens=120, structured_output=spec)
              for spec in specs for seed in range(3)]
    prompts = [[1 + i, 2, 3] for i in range(len(params))]
    outs = llm.generate(prompts, params)
    for out, p in zip(outs, params):
        spec = p.structured_output
        if spec.regex:
            assert re.fullmatch(WORDS, out.text)
        elif spec.json:
            check_schema(out.text)
        elif spec.grammar:
            assert re.fullmatch("yes|no|maybe [1-9][0-9]?", out.text)
        elif out.finish_reason == "stop":   # any object: its strings may run to max_tokens
            assert isinstance(json.loads(out.text), dict)
        assert out.finish_reason == "stop" or spec.json_object
    assert llm.blocks.num_free == llm.blocks.num_blocks


@pytest.mark.parametrize("pool", ["recompute", "swap"])
def test_constrained_requests_beside_others_under_eviction_and_preemption_match_alone(tiny_dir, pool):
    """Six requests in a pool that preempts (their grammars' states survive recompute and
    swap), prompts sharing cached blocks, a different method each, overlapped steps: every
    constrained request gives what it gives alone in a roomy engine."""
    long_words = StructuredOutput(regex=r"[a-z ]{50,58}")
    plain = dict(temperature=0, ignore_eos=True)
    evicting = dict(kv_budget=32, evict_every=16)
    params = [SamplingParams(**plain, max_tokens=60),
              SamplingParams(**plain, max_tokens=60, kv_method="batchmax", **evicting, structured_output=long_words),
              SamplingParams(**plain, max_tokens=60, kv_method="kvcompress", **evicting,
                             structured_output=StructuredOutput(json=SMALL)),
              SamplingParams(**plain, max_tokens=45, kv_method="snapkv", kv_window=8, **evicting),
              SamplingParams(**plain, max_tokens=60, kv_method="h2o", **evicting, structured_output=long_words),
              SamplingParams(**plain, max_tokens=60, structured_output=long_words, seed=3)]
    options = {"recompute": dict(num_kv_blocks=8, preemption_mode="recompute"),
               "swap": dict(num_kv_blocks=8, preemption_mode="swap", kv_offload_gb=0.01)}[pool]
    llm = engine(tiny_dir, overlap_steps=True, **options)
    outs = llm.generate(preemption_prompts(), params)
    assert llm.stats().preemptions > 0
    roomy = engine(tiny_dir, num_kv_blocks=160)
    for prompt, p, out in zip(preemption_prompts(), params, outs):
        alone = roomy.generate([prompt], p)[0]
        assert (out.token_ids, out.finish_reason) == (alone.token_ids, alone.finish_reason)
        if p.structured_output is long_words:
            assert re.fullmatch(r"[a-z ]{50,58}", out.text)
        elif p.structured_output is not None:
            assert set(json.loads(out.text)) == {"n", "ok"}
    assert llm.blocks.num_free == llm.blocks.num_blocks


def test_every_method_constrained_in_one_batch_gives_what_it_gives_alone(tiny_dir):
    """Each eviction method evicts a constrained request's pairs as it evicts any other's."""
    words = StructuredOutput(regex=r"[a-z ]{50,58}")
    params = [SamplingParams(temperature=0, max_tokens=60, structured_output=words, kv_method=method,
                             **({} if method == "full" else dict(kv_budget=32, evict_every=16)),
                             **({"kv_window": 8} if method in ("snapkv", "kvcompress") else {}))
              for method in METHODS]
    prompts = [[11 + i] * (20 + 3 * i) for i in range(len(params))]
    llm = engine(tiny_dir, num_kv_blocks=160)
    outs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        assert out.token_ids == llm.generate([prompt], p)[0].token_ids and re.fullmatch(r"[a-z ]{50,58}", out.text)
    assert llm.stats().pairs_evicted > 0


def test_a_constrained_request_streams_as_it_generates(tiny_dir):
    """Through step(): its tokens come one by one and add up to generate()'s."""
    llm = engine(tiny_dir, num_kv_blocks=160)
    params = SamplingParams(temperature=0, max_tokens=100, structured_output=StructuredOutput(json=SCHEMA))
    expected = llm.generate([[5, 6, 7]], params)[0]
    request = llm.add_request([5, 6, 7], params)
    streamed = []
    while llm.has_unfinished():
        streamed += [out.new_text for out in llm.step() if out.request_id == request]
    assert "".join(streamed) == expected.text and len(streamed) == len(expected.token_ids)


@pytest.mark.parametrize("spec, message", [
    (dict(regex="[a-"), "structured_output.regex does not compile"),
    (dict(json={"type": "objekt"}), "structured_output.json does not compile: Invalid type: objekt"),
    (dict(json="{not json"), "structured_output.json is not valid JSON"),
    (dict(grammar="start: (("), "structured_output.grammar does not compile"),
    (dict(regex="a", json_object=True), "exactly one of json, json_object, regex and grammar, got json_object, regex"),
    (dict(), "exactly one of json, json_object, regex and grammar, got none"),
    (dict(pattern="a"), "structured_output: "),
])
def test_a_bad_constraint_is_a_clear_error_and_the_engine_goes_on(tiny_dir, spec, message):
    llm = engine(tiny_dir, num_kv_blocks=160)
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=4), SamplingParams(structured_output=spec)])
    assert not llm.has_unfinished()
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, structured_output={"regex": "ab"}))[0].text) \
        == 2


def test_a_model_without_a_tokenizer_refuses_a_constraint():
    llm = LLM("random:tiny", dtype="float32", num_kv_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="structured_output needs the model's tokenizer"):
        llm.add_request([1, 2, 3], SamplingParams(structured_output=StructuredOutput(regex="a")))


def test_a_failed_match_fails_its_request_alone(tiny_dir):
    """A matcher driven off its grammar (as a bug would): its request ends with an error that
    says so, the others in the batch go on."""
    llm = engine(tiny_dir, num_kv_blocks=160)
    bad = llm.add_request([1, 2, 3], SamplingParams(max_tokens=8, structured_output={"regex": "ab+"}))
    good = llm.add_request([4, 5, 6], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    llm.requests[bad].seq.grammar.matcher.consume_token(llm.tokenizer.encode("z")[0])   # not what "ab+" starts with
    outs = {}
    while llm.has_unfinished():
        outs.update((out.request_id, out) for out in llm.step() if out.finished)
    assert outs[bad].finish_reason == "error" and "left its structured_output grammar" in outs[bad].error
    assert outs[good].finish_reason == "length" and len(outs[good].token_ids) == 8
    assert llm.blocks.num_free == llm.blocks.num_blocks


def test_constrained_steps_overlap_the_grammar_taking_the_token_the_step_before_sampled(tiny_dir, monkeypatch):
    """With overlap_steps, step n + 1's forward pass is launched before step n's tokens are
    read: its sampler reads them (as the device finishes step n) for the grammars, and the
    outputs are those of overlap off."""
    specs = [StructuredOutput(regex=WORDS), StructuredOutput(json=SCHEMA), StructuredOutput(grammar=ANSWER)]
    params = [SamplingParams(temperature=1, seed=i, max_tokens=100, structured_output=spec)
              for i, spec in enumerate(specs * 2)]
    prompts = [[7 + i, 8, 9] for i in range(len(params))]
    expected = engine(tiny_dir, num_kv_blocks=160, overlap_steps=False).generate(prompts, params)
    llm = engine(tiny_dir, num_kv_blocks=160)
    events, run, forward = [], llm.runner.run, llm.runner.model.forward
    read = sampler_module.SampledTokens.read

    def launch(batch, clock=None):
        sampled = run(batch, clock)
        sampled.step = sum(kind == "forward" for kind, _ in events) - 1
        return sampled

    def forwarding(*args, **kwargs):
        events.append(("forward", sum(kind == "forward" for kind, _ in events)))
        return forward(*args, **kwargs)

    def reading(sampled):
        events.append(("read", sampled.step))
        return read(sampled)
    monkeypatch.setattr(llm.runner, "run", launch)
    monkeypatch.setattr(llm.runner.model, "forward", forwarding)
    monkeypatch.setattr(sampler_module.SampledTokens, "read", reading)
    outs = llm.generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(o.token_ids, o.finish_reason) for o in expected]
    steps = sum(kind == "forward" for kind, _ in events)
    assert steps > 20
    for step in range(steps - 1):   # the step after had its forward launched before this one's tokens were read
        assert events.index(("forward", step + 1)) < events.index(("read", step))
