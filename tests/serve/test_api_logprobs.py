"""Log-probabilities over the API: completions' logprobs and echo, chat's logprobs and
top_logprobs, whole and streamed, against the engine's own (tests/engine/test_logprobs.py
checks those against HF transformers)."""
import httpx
import pytest

from nanokv import SamplingParams
from serving import MODEL

PROMPT = "The capital of France is"


def engine_logprobs(reference, prompt, k: int, max_tokens: int, **extra):
    return reference.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                       logprobs=k, **extra))[0]


def test_completions_logprobs_are_the_engines_with_the_top_k_and_the_token(client, reference):
    expected = engine_logprobs(reference, PROMPT, 3, 6)
    choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                       extra_body={"ignore_eos": True}).choices[0]
    logprobs, decode = choice.logprobs, reference.tokenizer.decode
    assert logprobs.tokens == [decode([t], False) for t in expected.token_ids]
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-5)
    for top, entry, token in zip(logprobs.top_logprobs, expected.logprobs, logprobs.tokens):
        wanted = {decode([t], False): lp for t, lp in entry.top} | {token: entry.logprob}
        assert top == pytest.approx(wanted, abs=1e-5)
        assert max(top.values()) == pytest.approx(top[token], abs=1e-6)   # greedy: the token is the top one
    pieces = [choice.text[a:b] for a, b in zip(logprobs.text_offset, logprobs.text_offset[1:] + [len(choice.text)])]
    assert "".join(pieces) == choice.text and logprobs.text_offset[0] == 0


def test_echo_gives_the_prompt_logprobs_as_evaluation_harnesses_read_them(client, reference):
    """max_tokens 0: the prompt alone; max_tokens 1 with token-id prompts (as lm-eval's
    local-completions sends them): the prompt, then the one token."""
    ids = reference.tokenizer.encode(PROMPT)
    expected = engine_logprobs(reference, ids, 2, 1, prompt_logprobs=True)
    scored = [e.logprob for e in expected.prompt_logprobs[1:]]
    only = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = only.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(scored, abs=1e-5)
    assert choice.logprobs.tokens == [reference.tokenizer.decode([t], False) for t in ids]
    assert (only.usage.prompt_tokens, only.usage.completion_tokens) == (len(ids), 0)

    other = reference.tokenizer.encode("Paris is the capital")
    both = client.completions.create(model=MODEL, prompt=[ids, other], max_tokens=1, echo=True, logprobs=1,
                                     temperature=0).choices
    assert both[0].text == PROMPT + expected.text
    assert both[0].logprobs.token_logprobs[1:] == pytest.approx(scored + [expected.logprobs[0].logprob], abs=1e-5)
    assert len(both[1].logprobs.tokens) == len(other) + 1
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, temperature=0)
    assert echoed.choices[0].text.startswith(PROMPT) and echoed.choices[0].logprobs is None


def test_chat_logprobs_and_top_logprobs(client, reference):
    messages = [{"role": "user", "content": "Hello!"}]
    ids = reference.tokenizer.encode(reference.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    expected = engine_logprobs(reference, ids, 2, 5)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-5)
    for c, e in zip(content, expected.logprobs):
        assert c.token == reference.tokenizer.decode([e.token], False) and c.bytes == list(c.token.encode())
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([lp for _, lp in e.top], abs=1e-5)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=True)
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).choices[0].logprobs is None


def test_streamed_logprobs_add_up_to_the_whole(client):
    """Chunk by chunk, every token's log-probability comes once, in order, for each choice."""
    options = dict(model=MODEL, prompt=[PROMPT, "Paris"], max_tokens=6, temperature=0, logprobs=2, echo=True,
                   extra_body={"ignore_eos": True})
    whole = client.completions.create(**options).choices
    streamed = {0: [], 1: []}
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **options):
        for choice in chunk.choices:
            streamed[choice.index] += choice.logprobs.token_logprobs if choice.logprobs else []
            texts[choice.index] += choice.text
    for index, choice in enumerate(whole):
        assert streamed[index] == choice.logprobs.token_logprobs and texts[index] == choice.text

    messages = [{"role": "user", "content": "Hi"}]
    chat = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=1,
                extra_body={"ignore_eos": True})
    content = client.chat.completions.create(**chat).choices[0].logprobs.content
    chunks = [c.choices[0].logprobs for c in client.chat.completions.create(stream=True, **chat)]
    assert [t for lp in chunks if lp for t in lp.content] == content


def test_a_raw_echo_body_with_max_tokens_zero(server):
    """Over raw HTTP: what a client gets field by field, the logprobs' lists all of one length."""
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 0}
    choice = httpx.post(f"{server[0]}/v1/completions", json=body, timeout=30).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == "abc" and logprobs["tokens"] == ["a", "b", "c"] and logprobs["text_offset"] == [0, 1, 2]
    assert logprobs["token_logprobs"][0] is None and all(lp < 0 for lp in logprobs["token_logprobs"][1:])
    assert logprobs["top_logprobs"][0] is None and [list(t) for t in logprobs["top_logprobs"][1:]] == [["b"], ["c"]]
