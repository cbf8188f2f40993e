"""Structured output and tool calling through the openai client, on the bundled model
(SmolLM2-135M-Instruct, float32): response_format, nanokv's structured_output, tools with
every tool_choice, and how tools and calls render into the prompt."""
import json
import re
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from functools import partial
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from nanokv import LLM
from nanokv.serve.openai_api import parse
from nanokv.serve.tools import Tools
from nanokv.tokenizer import Tokenizer
from serving import MODEL as NAME, running_server


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int = Field(ge=0, le=10**9)   # a small model may repeat a digit forever


class Point(BaseModel):
    x: int
    y: int


class Shape(BaseModel):
    kind: Literal["triangle", "square"]
    corners: list[Point] = Field(max_length=4)


class Pet(BaseModel):
    name: str = Field(max_length=16)
    color: Color
    age: int = Field(ge=0, le=100)
    owner: City


class Answer(BaseModel):
    ok: bool
    tags: list[Literal["fast", "slow", "cheap"]] = Field(max_length=3)
    score: float


SCHEMAS = [(City, "Describe Paris."), (Point, "A point on the plane."), (Shape, "Describe a square."),
           (Pet, "Describe a pet and its owner's city."), (Answer, "Is a bike fast?")]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
NUMBER = {"type": "integer", "minimum": -1000, "maximum": 1000}   # a small model may repeat a digit forever
ADD = {"type": "object", "properties": {"a": NUMBER, "b": NUMBER}, "required": ["a", "b"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Adds two numbers", "parameters": ADD}}]


class WeatherArguments(BaseModel, extra="forbid"):
    city: str
    unit: Literal["celsius", "fahrenheit"]


class AddArguments(BaseModel, extra="forbid"):
    a: int
    b: int


ARGUMENTS = {"get_weather": WeatherArguments, "add": AddArguments}   # the tools' schemas, as Pydantic checks them
QUESTIONS = ["What is the weather in Paris?", "Add 2 and 3.", "Is it cold in Oslo?", "What is 10 plus 32?",
             "Tell me the weather in Rome in fahrenheit."]


@pytest.fixture(scope="module")
def client(bundled_dir):
    with running_server(LLM(str(bundled_dir), dtype="float32", max_model_len=1024, num_kv_blocks=256)) as (base, _):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def together(*calls):
    """Each call's result, the calls made at once from threads (the engine batches them)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_parse_returns_an_object_of_each_schema(client):
    cases = [(model, question, temperature) for model, question in SCHEMAS for temperature in (0, 1)]
    replies = together(*[partial(client.chat.completions.parse, model=NAME, messages=ask(question),
                                 response_format=model, temperature=temperature, seed=7, max_tokens=200)
                         for model, question, temperature in cases])
    for (model, _, _), reply in zip(cases, replies):
        assert isinstance(reply.choices[0].message.parsed, model), reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop"


def test_json_object_output_always_parses(client):
    replies = together(*[partial(client.chat.completions.create, model=NAME, messages=ask("Give me a user record as "
                                 "JSON."), response_format={"type": "json_object"}, seed=seed, max_tokens=300)
                         for seed in range(4)])
    for reply in replies:
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_a_regex_and_a_grammar_constrain_the_output(client):
    for body, pattern in [({"regex": "[A-Z]{3}-[0-9]{4}"}, "[A-Z]{3}-[0-9]{4}"),
                          ({"grammar": 'start: "yes" | "no"'}, "yes|no")]:
        for seed in range(3):
            reply = client.completions.create(model=NAME, prompt="Answer:", max_tokens=20, seed=seed,
                                              extra_body={"structured_output": body})
            assert re.fullmatch(pattern, reply.choices[0].text) and reply.choices[0].finish_reason == "stop"


def test_streamed_and_whole_outputs_are_equal(client):
    common = dict(model=NAME, messages=ask("Describe a pet."), response_format=Pet, temperature=0, max_tokens=200)
    def stream():
        with client.chat.completions.stream(**common) as events:
            return events.get_final_completion()
    whole, streamed = together(partial(client.chat.completions.parse, **common), stream)
    assert streamed.choices[0].message.content == whole.choices[0].message.content
    assert streamed.choices[0].message.parsed == whole.choices[0].message.parsed


def test_forced_tool_calls_have_arguments_that_validate(client):
    cases = [(question, choice) for question in QUESTIONS for choice in ("required", "named")]
    named = {question: {"type": "function", "function": {"name": "add" if "dd" in question or "plus" in question
                                                         else "get_weather"}} for question in QUESTIONS}
    replies = together(*[partial(client.chat.completions.create, model=NAME, messages=ask(question), tools=TOOLS,
                                 tool_choice=named[question] if choice == "named" else "required", temperature=0,
                                 max_tokens=100, parallel_tool_calls=False)   # (at 135M parameters, a list of
                         for question, choice in cases])                      # calls may repeat one to max_tokens)
    for (question, choice), reply in zip(cases, replies):
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
        assert len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.id.startswith("call_") and call.type == "function"
        if choice == "named":
            assert call.function.name == named[question]["function"]["name"]
        ARGUMENTS[call.function.name].model_validate_json(call.function.arguments, strict=True)


def test_streamed_tool_calls_reassemble_into_the_whole_response_s(client):
    common = dict(model=NAME, messages=ask("Add 2 and 3, and tell me the weather in Paris."), tools=TOOLS,
                  tool_choice="required", temperature=0, max_tokens=150)
    whole = client.chat.completions.create(**common).choices[0]
    calls, reasons = {}, []
    for chunk in client.chat.completions.create(**common, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                 for c in whole.message.tool_calls]
    assert reasons[-1] == whole.finish_reason == "tool_calls"


def test_with_tool_choice_none_or_auto_the_model_may_answer_in_text(client):
    for choice in ("none", "auto"):
        reply = client.chat.completions.create(model=NAME, messages=ask("Say hello."), tools=TOOLS,
                                               tool_choice=choice, temperature=0, max_tokens=20)
        assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None


def test_a_bad_tools_field_is_a_400_naming_it(client):
    for extra, param in [(dict(tools=[{"type": "function"}]), "tools"),
                         (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
                         (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
                          "tool_choice"),
                         (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
                          "tool_choice"),
                         (dict(response_format={"type": "xml"}), "response_format"),
                         (dict(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=NAME, messages=ask("hi"), max_tokens=4, **extra)
        assert caught.value.body["param"] == param, caught.value.body


# ----- rendering and reading, without the server ------------------------------------------------

HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
HERMES = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
          "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
          "<tool_call>{{ c.function.name }} {{ c.function.arguments.city }}</tool_call>{% endfor %}"
          "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{% endfor %}<assistant>")


def rendered(tokenizer: Tokenizer, body: dict) -> str:
    ids = parse({"messages": HISTORY, **body}, True, tokenizer, 4096).requests[0][0]
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_a_template_that_renders_tools_gets_them_and_the_calls_as_objects(bundled_dir):
    tokenizer = Tokenizer.from_dir(bundled_dir)
    tokenizer.chat_template = HERMES
    text = rendered(tokenizer, {"tools": TOOLS})
    assert text == ("<tools>get_weather;add;</tools><user>Weather in Paris?<assistant><tool_call>get_weather "
                    "Paris</tool_call><tool>21 degrees[call_1]<assistant>")


def test_the_fallback_writes_the_tools_and_the_calls_into_the_messages(bundled_dir):
    tokenizer = Tokenizer.from_dir(bundled_dir)   # SmolLM2's template knows no tools
    text = rendered(tokenizer, {"tools": TOOLS})
    assert "<|im_start|>system\nYou can call these functions:\n" + json.dumps(TOOLS[0]["function"]) in text
    assert 'answer with only a JSON array of calls' in text
    assert '<|im_start|>assistant\n[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]' \
           '<|im_end|>' in text
    assert "<|im_start|>user\nThe result of get_weather: 21 degrees<|im_end|>" in text
    assert "You can call" not in rendered(tokenizer, {"tools": TOOLS, "tool_choice": "none"})


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "", [("add", {"a": 1, "b": 2})]),
    ('Let me see.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>{"name": '
     '"get_weather", "arguments": {"city": "Oslo"}}</tool_call>', "Let me see.",
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [("add", {"a": 1, "b": 2})]),
    ('[{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}]', "", [("add", {"a": 1, "b": 2})]),
    ('{"name": "subtract", "arguments": {"a": 1}}', None, None),   # not an offered function: text
    ('<tool_call>{"name": "add", "arguments": {"a": 1,', None, None),   # cut off
    ('Hello there', None, None),
])
def test_calls_are_read_in_the_forms_models_write(text, content, calls):
    found = Tools(TOOLS, "auto").read(text)
    if calls is None:
        assert found is None
    else:
        assert found[0] == content
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found[1]] == calls


@pytest.mark.parametrize("text, sure", [("Hello <tool_", "Hello"), ("Hello <tool_call>{", "Hello"), ("  {", ""),
                                        ("Hi there  ", "Hi there"), ("Hi <b>", "Hi <b>")])
def test_a_stream_holds_back_only_what_may_still_be_a_call(text, sure):
    assert text[:Tools(TOOLS, "auto").undecided(text)] == sure
    assert Tools(TOOLS, "required").undecided(text) == 0
