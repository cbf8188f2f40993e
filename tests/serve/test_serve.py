"""The OpenAI-compatible server, driven by the official openai client over loopback."""
import asyncio
import contextlib
import gc
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import kvpress
import pytest

from nanokv import LLM, SamplingParams
from serving import ENGINE, MODEL, greedy, running_server, wait_until_busy, wait_until_idle

KEY = "sk-test"
PROMPTS = [f"Request {i}: the story of {'ab' * (i % 5)} goes" for i in range(32)]


def test_completions_and_chat_match_generate(client, reference):
    prompt = "The capital of France is"
    expected = reference.generate(prompt, greedy(12))[0]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(expected.prompt_token_ids), 12)
    assert whole.usage.prompt_tokens_details.cached_tokens == 0   # a fresh server: nothing cached
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 16   # the prompt's one full block, again

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    text = reference.tokenizer.apply_chat_template(messages)   # as chat.py builds a prompt
    expected = reference.generate([reference.tokenizer.encode(text, add_special_tokens=False)], greedy(10))[0]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == expected.text and reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    deltas = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == expected.text
    assert deltas[-1].choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list()] == [MODEL]


def test_several_prompts_and_choices(client, reference):
    """A list of prompts (strings, or token ids) and n choices each: one choice per prompt and
    draw, indexed in order; greedy choices equal generate's, seeded ones a seed each."""
    prompts = ["Once upon", "The sea is", "A list of prompts"]
    expected = [o.text for o in reference.generate(prompts, greedy(8))]
    whole = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.text for c in whole.choices] == [e for e in expected for _ in range(2)]
    lengths = [len(reference.tokenizer.encode(p)) for p in prompts]
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (sum(lengths), 6 * 8)
    ids = [reference.tokenizer.encode(p) for p in prompts]
    as_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert [c.text for c in as_ids.choices] == expected

    sampled = client.completions.create(model=MODEL, prompt=prompts[0], n=3, max_tokens=8, temperature=1.0,
                                        seed=11, extra_body={"ignore_eos": True})
    texts = [c.text for c in sampled.choices]
    seeded = [reference.generate(prompts[0], SamplingParams(temperature=1.0, seed=11 + j, max_tokens=8,
                                                            ignore_eos=True))[0].text for j in range(3)]
    assert texts == seeded and len(set(texts)) > 1

    messages = [{"role": "user", "content": "Two replies, please."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1] and reply.choices[0].message.content == \
        reply.choices[1].message.content and reply.usage.completion_tokens == 12


def test_choices_stream_interleaved_by_index(server, reference):
    base, _ = server
    prompts = ["First prompt", "Second"]
    expected = [o.text for o in reference.generate(prompts, greedy(10))]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    texts, finished, indexes = ["", "", "", ""], set(), []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        indexes.append(choice["index"])
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finished.add(choice["index"])
    assert texts == [e for e in expected for _ in range(2)] and finished == {0, 1, 2, 3}
    assert indexes != sorted(indexes)   # the choices' chunks come as they are made, not one choice after another
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 40


def test_32_concurrent_streams_share_steps_and_match_solo_outputs(server, reference):
    base, app = server
    solo = [reference.generate(p, greedy(16))[0].text for p in PROMPTS]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                      timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in PROMPTS)), 120)

    assert asyncio.run(all_of_them()) == solo
    health = wait_until_idle(base)
    assert health["largest_batch"] > 1, health
    assert health["free_blocks"] == health["total_blocks"], health
    assert health["host_blocks"] == health["swaps"] == health["host_copied_bytes"] == 0, health   # no host tier


def test_a_client_that_disconnects_frees_its_request(server, monkeypatch):
    base, app = server
    engine, steps = app.state.engine, app.state.engine.num_steps
    step = engine.llm.step

    def slow_step():   # 230 tokens take 4.6 s: far longer than the clients wait
        time.sleep(0.02)
        return step()
    monkeypatch.setattr(engine.llm, "step", slow_step)
    body = {"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 230, "temperature": 0,
            "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))   # it is generating
    with pytest.raises(httpx.ReadTimeout):   # a non-streaming client that gives up
        httpx.post(f"{base}/v1/completions", json=body, timeout=0.3)
    health = wait_until_idle(base)
    assert health["free_blocks"] == health["total_blocks"], health
    assert health["steps"] - steps < 100, "the requests ran to the end instead of being aborted"


BAD_REQUESTS = [   # (endpoint, body, status, param)
    ("completions", "{not json", 400, None),
    ("completions", [1, 2], 400, None),
    ("completions", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ("completions", {"prompt": "hi", "kv_no_such_field": 1}, 400, "kv_no_such_field"),
    ("completions", {"prompt": "hi", "return_kept_positions": True}, 400, "return_kept_positions"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": ["a", 3]}, 400, "prompt"),
    ("completions", {"prompt": ["a", ""]}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": "x" * 300}, 400, "prompt"),
    ("completions", {"prompt": [1, 2, 99999]}, 400, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 1000}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "hi", "top_k": "many"}, 400, "top_k"),
    ("completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "n": 129}, 400, "n"),
    ("completions", {"prompt": ["hi"] * 5, "n": 128}, 400, "n"),
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "echo": 1}, 400, "echo"),
    ("completions", {"prompt": "hi", "top_logprobs": 2}, 400, "top_logprobs"),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
     "stream_options"),
    ("completions", {"prompt": "hi", "kv_method": "magic"}, 400, "kv_method"),
    ("completions", {"prompt": "hi", "kv_method": "batchmax", "kv_budget": 3}, 400, "kv_budget"),
    ("completions", {"prompt": "hi", "kv_press": {"name": "MagicPress"}}, 400, "kv_press"),
    ("completions", {"prompt": "hi", "kv_press": {"name": "SnapKVPress"}}, 400, "kv_press"),   # no press_window
    ("completions", {"prompt": "hi", "kv_press": {"name": "KnormPress", "args": {"compression_ratio": 0.5}}}, 400,
     "kv_press"),
    ("completions", {"prompt": "hi", "kv_press": "KnormPress"}, 400, "kv_press"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400,
     "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, 400, "logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, 400, "echo"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "hi"}]},
     400, "messages[1].role"),
]


@pytest.mark.parametrize("endpoint, body, status, param", BAD_REQUESTS)
def test_a_bad_request_gets_its_error_and_changes_nothing(server, endpoint, body, status, param):
    base, _ = server
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{base}/v1/{endpoint}", content=content, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    health = httpx.get(f"{base}/health").json()
    assert health["running"] == health["waiting"] == 0 and health["free_blocks"] == health["total_blocks"]


def test_bad_requests_do_not_disturb_one_in_flight(server, client, reference):
    base, _ = server
    prompt = "A request that runs while others fail:"
    expected = reference.generate(prompt, greedy(40))[0].text
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as running:
        lines = running.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        for endpoint, bad, status, _ in BAD_REQUESTS:
            content = bad if isinstance(bad, str) else json.dumps(bad)
            assert httpx.post(f"{base}/v1/{endpoint}", content=content, timeout=30).status_code == status
        with pytest.raises(openai.BadRequestError, match="top_p"):
            client.completions.create(model=MODEL, prompt="hi", top_p=7)
        events = [first, *(line for line in lines if line.startswith("data:"))]
    assert events[-1] == "data: [DONE]"
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == expected
    with pytest.raises(openai.NotFoundError):
        client.get("/no/such/route", cast_to=object)
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0,
                                    extra_body={"kv_method": "full", "top_k": 5, "ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_a_failed_step_ends_its_requests_with_an_error_and_the_engine_goes_on(server, client, monkeypatch):
    engine = server[1].state.engine
    step = engine.llm.step

    def broken_step():
        monkeypatch.setattr(engine.llm, "step", step)   # fails once
        raise RuntimeError("simulated failure")
    monkeypatch.setattr(engine.llm, "step", broken_step)
    with pytest.raises(openai.APIStatusError, match="simulated failure") as failure:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    assert failure.value.status_code == 503
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).choices[0].finish_reason


def test_a_wrong_api_key_gets_401(model_dir):
    with running_server(LLM(str(model_dir), **ENGINE), api_key=KEY) as (base, _):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0, timeout=30).models.list()
        missing = httpx.post(f"{base}/v1/completions", json={"prompt": "hi"})
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{base}/health").status_code == 200   # open to health checks
        good = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=30)
        assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_the_command_line_serves_and_stops_on_sigterm(model_dir):
    server, base = start_server(model_dir, "--num-kv-blocks", "32", "--max-model-len", "128")
    try:
        models = httpx.get(f"{base}/v1/models").json()
        assert models["data"][0]["id"] == str(model_dir) and models["data"][0]["max_model_len"] == 128
        server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=30)[0]
    finally:
        server.kill()
    assert "engine stopped" in output and "Application shutdown complete" in output, output


def test_every_role_of_the_api_is_taken(client):
    """system, developer, user, assistant and tool render; the error for another names it (above)."""
    messages = [{"role": role, "content": f"a {role} message"} for role in ("system", "developer", "user",
                                                                              "assistant", "tool", "user")]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens >= 1


def start_server(model_dir, *flags) -> tuple[subprocess.Popen, str]:
    """`python -m nanokv.serve` on a free port, once /health answers; (process, base URL)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = subprocess.Popen([sys.executable, "-m", "nanokv.serve", "--model", str(model_dir), "--port", str(port),
                               *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=Path(__file__).resolve().parents[2])
    deadline = time.monotonic() + 120
    while server.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return server, f"http://127.0.0.1:{port}"
        time.sleep(0.2)
    server.kill()
    raise RuntimeError(f"the server did not start:\n{server.communicate()[0]}")


def stream_until_signal(server: subprocess.Popen, base: str, max_tokens: int) -> list[str]:
    """Stream a completion and send the server SIGTERM after its first event; the events."""
    events = []
    body = {"model": MODEL, "prompt": "Drain me:", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line:
                events.append(line)
                if len(events) == 1:
                    server.send_signal(signal.SIGTERM)
    return events


def refuses_connections(base: str, within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{base}/health", timeout=1)
        except httpx.TransportError:
            return True
        time.sleep(0.05)
    return False


def test_sigterm_lets_requests_in_flight_finish_and_refuses_new_ones(model_dir):
    server, base = start_server(model_dir, "--served-model-name", MODEL, "--num-kv-blocks", "128",
                                "--max-model-len", "512")
    try:
        whole = {}
        body = {"model": MODEL, "prompt": "Finish me:", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
        plain = threading.Thread(target=lambda: whole.update(
            response=httpx.post(f"{base}/v1/completions", json=body, timeout=60)))
        plain.start()
        wait_until_busy(base)   # in flight before the signal: a connection not yet taken would be refused
        events = stream_until_signal(server, base, 480)
        assert refuses_connections(base)   # shutting down: no new connections
        plain.join(60)
        output = server.communicate(timeout=60)[0]
    finally:
        server.kill()
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert events[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length", output
    assert whole["response"].status_code == 200 and whole["response"].json()["usage"]["completion_tokens"] == 480
    assert "engine stopped" in output


def test_requests_past_the_drain_time_end_with_an_error(model_dir):
    server, base = start_server(model_dir, "--served-model-name", MODEL, "--num-kv-blocks", "128",
                                "--max-model-len", "512", "--drain-timeout", "0.05")
    try:
        started = time.monotonic()
        events = stream_until_signal(server, base, 480)
        ended = time.monotonic() - started
        output = server.communicate(timeout=60)[0]
    finally:
        server.kill()
    assert events[-1] == "data: [DONE]" and ended < 30, output
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert "ran past the drain time of 0.05 s" in error["message"] and error["type"] == "server_error"
    assert len(events) < 480   # cut short


def test_serve_bench_drives_the_server_and_measures_it(server):
    from nanokv.tools import serve_bench

    requests = serve_bench.scaled_requests(8, scale=0.05, vocab=300, seed=0)
    assert all(len(p) + n <= ENGINE["max_model_len"] for p, n in requests)
    result = asyncio.run(serve_bench.run(server[0], clients=4, requests=requests))
    assert result["requests"] == 8 and result["output_tokens"] == sum(n for _, n in requests)
    assert result["ttft_s_p50"] > 0 and result["itl_s_p99"] >= result["itl_s_p50"] > 0
    assert "requests/s" in serve_bench.report(result)


@pytest.mark.parametrize("chat, body", [
    (False, {"prompt": "x" * 300}), (False, {"prompt": "hi", "max_tokens": 1000}),
    (True, {"messages": [{"role": "user", "content": "x" * 300}], "max_completion_tokens": 5})])
def test_a_request_over_the_context_gets_openai_s_code_and_wording(server, chat, body):
    """What clients such as LiteLLM look for to fall back to a model with a longer context."""
    response = httpx.post(f"{server[0]}/v1/{'chat/completions' if chat else 'completions'}", json=body, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded"
    asked = re.fullmatch(r"This model's maximum context length is 256 tokens\. However, you requested (\d+) tokens "
                         r"\((\d+) in the (messages|prompt), (\d+) in the completion\)\. Please reduce the length "
                         r"of the \3 or completion\.", error["message"])
    total, prompt, part, completion = asked.groups()
    assert int(total) == int(prompt) + int(completion) and part == ("messages" if chat else "prompt")
    assert int(completion) == body.get("max_tokens", body.get("max_completion_tokens", 1))


def test_the_model_is_found_by_its_id_and_responses_say_which_engine_made_them(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.code == "model_not_found"
    whole = client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, stream=True))
    assert whole.system_fingerprint.startswith("fp_nanokv-")
    assert {chunk.system_fingerprint for chunk in chunks} == {whole.system_fingerprint}


def test_web_pages_of_the_allowed_origins_alone_may_call_the_server(model_dir, server):
    """CORS is off unless origins are given: a browser's preflight then gets the headers for an
    allowed origin only."""
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    response = httpx.options(f"{server[0]}/v1/chat/completions", headers={"Origin": "http://ui.example", **preflight})
    assert "access-control-allow-origin" not in response.headers
    with running_server(LLM(str(model_dir), **ENGINE), allowed_origins=["http://ui.example"]) as (base, _):
        allowed = httpx.options(f"{base}/v1/chat/completions", headers={"Origin": "http://ui.example", **preflight})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "http://ui.example"
        other = httpx.options(f"{base}/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight})
        assert "access-control-allow-origin" not in other.headers
        models = httpx.get(f"{base}/v1/models", headers={"Origin": "http://ui.example"})
        assert models.headers["access-control-allow-origin"] == "http://ui.example"


def test_the_sampling_knobs_as_clients_send_them(client, reference):
    """OpenAI's logit_bias (token ids as JSON's string keys) and penalties; min_p and
    repetition_penalty by name, as Open WebUI sends them."""
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, logit_bias={"65": 100},
                                    extra_body={"min_p": 0.05})
    assert out.choices[0].text == reference.tokenizer.decode([65] * 4)
    knobs = dict(frequency_penalty=0.8, presence_penalty=0.4, repetition_penalty=1.3)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi hi hi"}],
                                          max_tokens=12, temperature=0, extra_body={"repetition_penalty": 1.3},
                                          frequency_penalty=0.8, presence_penalty=0.4)
    template = reference.tokenizer.apply_chat_template([{"role": "user", "content": "hi hi hi"}])
    prompt = reference.tokenizer.encode(template, add_special_tokens=False)
    expected = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=12, **knobs))[0]
    assert chat.choices[0].message.content == expected.text


def test_a_press_named_in_the_body_runs_as_in_generate(client, reference):
    prompt = "A press of kvpress ranks the pairs nanokv keeps."
    expected = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, kv_budget=16,
                                                         kv_press=kvpress.LagKVPress(lag_size=4)))[0].text
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={
        "ignore_eos": True, "kv_budget": 16, "kv_press": {"name": "LagKVPress", "args": {"lag_size": 4}}})
    assert out.choices[0].text == expected != reference.generate(prompt, greedy(8))[0].text   # it evicted


def test_the_command_line_freezes_what_start_up_left_before_it_serves(model_dir, monkeypatch):
    """Python's full collections in the server pass over the requests' objects, not the engine's
    and the libraries' (gc.freeze), so that none stalls every stream for ~0.2 s."""
    import uvicorn

    from nanokv.serve.server import main
    frozen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: frozen.append(gc.get_freeze_count()))
    try:
        main(["--model", str(model_dir), "--num-kv-blocks", "32", "--max-model-len", "128"])
    finally:
        gc.unfreeze()
    assert frozen and frozen[0] > 10_000
