"""The OpenAI API's requests: a body in, checked, becomes the engine's requests (prompt token
ids and a SamplingParams each); errors out in the API's format. Nothing here touches the
engine; responses.py turns its outputs into JSON.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jinja2

from nanokv.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutput
from nanokv.serve.tools import ToolError, Tools, parse_tools, template_messages
from nanokv.tokenizer import Tokenizer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
MAX_N = 128          # choices per prompt, as OpenAI allows
MAX_REQUESTS = 512   # engine requests one API request may make: prompts x choices
ROLES = ("system", "developer", "user", "assistant", "tool")   # the chat roles the API defines

# Fields of the OpenAI API nanokv does not implement, accepted only at a value that asks
# for nothing (None always is one); anything else is a 400 that names the field.
NEUTRAL_VALUES = {"best_of": (1,), "suffix": ("",)}
# OpenAI's fields of the same name in SamplingParams
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop", "logit_bias", "presence_penalty",
                   "frequency_penalty")
COMMON_FIELDS = {"model", "stream", "stream_options", "user", "n", "response_format", *SAMPLING_FIELDS,
                 *NEUTRAL_VALUES}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "logprobs"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
                               "logprobs", "top_logprobs"}
# SamplingParams fields a client does not pass by name: the API has no place for their output
# (kept positions), or its own fields set them (logprobs, top_logprobs and echo).
NOT_BY_NAME = {"return_kept_positions", "prompt_logprobs", "logprobs"}
# Every other SamplingParams field is a nanokv extension, passed through by name (top_k,
# ignore_eos, stop_token_ids, kv_method, kv_budget, evict_every, structured_output (its
# fields: json, json_object, regex, grammar), and whatever is added).
EXTENSIONS = {f.name for f in dataclasses.fields(SamplingParams)} - set(SAMPLING_FIELDS) - NOT_BY_NAME


class APIError(Exception):
    """An error the client gets in OpenAI's format, with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def context_exceeded(max_model_len: int, prompt: int, completion: int, chat: bool, param: str) -> APIError:
    """A request longer than the model's context, as OpenAI words it and with its code (what
    clients such as LiteLLM look for to fall back to a model with a longer context)."""
    part = "messages" if chat else "prompt"
    return APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                    f"{prompt + completion} tokens ({prompt} in the {part}, {completion} in the completion). "
                    f"Please reduce the length of the {part} or completion.", param, code="context_length_exceeded")


def from_engine(error: Exception, fields: list[str]) -> APIError:
    """What the engine raised for a request: TypeError and ValueError are the client's (400,
    param: the first field the message names), anything else the server's (500)."""
    if not isinstance(error, (TypeError, ValueError)):
        return APIError(500, f"{type(error).__name__}: {error}", type="server_error")
    words = str(error).replace(":", " ").split()
    return bad_request(str(error), next((w for w in words if w in fields), None))


@dataclass
class ParsedRequest:
    requests: list[tuple[list[int], SamplingParams]]   # the engine's, one per choice: prompt i's n at i*n..
    n: int                                               # choices per prompt
    stream: bool
    include_usage: bool         # stream_options.include_usage: a last chunk with the usage
    logprobs: int | None = None  # each token's log-probability, with this many alternatives
    echo: bool = False          # completions: the prompt comes first in the text (and the logprobs)
    prompt_only: bool = False   # echo with max_tokens 0: the one token the engine ran is not shown
    tools: Tools | None = None  # chat: the tools the model may call (their calls are read from its text)


def parse(body, chat: bool, tokenizer: Tokenizer | None, max_model_len: int) -> ParsedRequest:
    """Check a /v1/completions or /v1/chat/completions body; APIError(400) names what is wrong."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    tools = None
    if chat:
        try:
            tools = parse_tools(body)
        except ToolError as error:
            raise bad_request(str(error), error.param) from None
        prompts = [_chat_prompt(body.get("messages"), tokenizer, tools)]
    else:
        prompts = _completion_prompts(body.get("prompt"), tokenizer)
    longest = max(map(len, prompts))
    if longest >= max_model_len:   # at least one token of output must fit
        asked = (chat and body.get("max_completion_tokens")) or body.get("max_tokens")
        completion = asked if type(asked) is int and asked > 0 else 1
        raise context_exceeded(max_model_len, longest, completion, chat, "messages" if chat else "prompt")
    n = 1 if body.get("n") is None else body["n"]
    if type(n) is not int or not 1 <= n <= MAX_N:
        raise bad_request(f"n must be an integer in [1, {MAX_N}], got {n!r}", "n")
    if len(prompts) * n > MAX_REQUESTS:
        raise bad_request(f"{len(prompts)} prompts x n={n} choices is more than {MAX_REQUESTS} at once",
                          "n" if n > 1 else "prompt")
    logprobs, echo = _asked_logprobs(body, chat), body.get("echo") or False
    if not isinstance(echo, bool):
        raise bad_request(f"echo must be true or false, got {echo!r}", "echo")
    prompt_only = echo and type(body.get("max_tokens")) is int and body["max_tokens"] == 0
    structured = _structured_output(body, tools)
    if structured is not None:
        body = {**body, "structured_output": structured}
    params = _sampling_params({**body, "max_tokens": 1} if prompt_only else body, chat, max_model_len, longest,
                              logprobs=logprobs, prompt_logprobs=echo and logprobs is not None)
    stream, options = body.get("stream") or False, body.get("stream_options") or {}
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be true or false, got {stream!r}", "stream")
    if not isinstance(options, dict):
        raise bad_request(f"stream_options must be an object, got {options!r}", "stream_options")
    if options.get("continuous_usage_stats"):
        raise bad_request("stream_options.continuous_usage_stats is not supported: include_usage sends the usage "
                          "in a last chunk", "stream_options")
    requests = [(ids, _choice(params, j, n)) for ids in prompts for j in range(n)]
    return ParsedRequest(requests, n, stream, bool(options.get("include_usage")), logprobs, echo, prompt_only, tools)


def _structured_output(body: dict, tools: Tools | None) -> StructuredOutput | None:
    """What the output must match: response_format's JSON (json_object: any object;
    json_schema: its schema, strict or not), or a forced tool call's; at most one of those
    and the structured_output extension."""
    value, found = body.get("response_format"), {}
    kind = value.get("type") if isinstance(value, dict) else None
    if value is not None and kind not in ("text", "json_object", "json_schema"):
        raise bad_request(f'response_format must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": '
                          f'"json_schema", "json_schema": {{"name": ..., "schema": {{...}}}}}}, got {value!r}',
                          "response_format")
    if kind == "json_object":
        found["response_format"] = StructuredOutput(json_object=True)
    elif kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad_request(f"response_format.json_schema must be an object with a schema object, got {spec!r}",
                              "response_format")
        found["response_format"] = StructuredOutput(json=spec.get("schema") or {"type": "object"})
    forced = tools and tools.structured_output()
    if forced:
        found["tool_choice"] = forced
    if body.get("structured_output") is not None:
        found["structured_output"] = body["structured_output"]
    if len(found) > 1:
        raise bad_request(f"{' and '.join(found)} both constrain the output: give one", list(found)[-1])
    return next(iter(found.values()), None)


def _asked_logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's log-probability comes with, None for no logprobs:
    completions' logprobs=k; chat's logprobs=true with top_logprobs=k."""
    name = "top_logprobs" if chat else "logprobs"
    k = body.get(name)
    if k is not None and (type(k) is not int or not 0 <= k <= MAX_LOGPROBS):
        raise bad_request(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}", name)
    if not chat:
        return k
    asked = body.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise bad_request(f"logprobs must be true or false, got {asked!r}", "logprobs")
    if k and not asked:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return (k or 0) if asked else None


def _choice(params: SamplingParams, j: int, n: int) -> SamplingParams:
    """The params of a prompt's j-th choice: with a seed and n > 1, its own seed (seed + j),
    so that sampled choices differ and each can be reproduced."""
    if params.seed is None or n == 1:
        return params
    return dataclasses.replace(params, seed=(params.seed + j) % 2**64)


def _check_fields(body: dict, allowed: set[str]) -> None:
    for name, value in body.items():
        if name in EXTENSIONS:
            continue
        if name not in allowed:
            raise bad_request(f"Unrecognized request argument supplied: {name} (nanokv's extensions are "
                              f"{', '.join(sorted(EXTENSIONS))})", name)
        if name in NEUTRAL_VALUES and value is not None and value not in NEUTRAL_VALUES[name]:
            raise bad_request(f"{name}={value!r} is not supported by nanokv "
                              f"(supported: {' or '.join(map(repr, NEUTRAL_VALUES[name]))})", name)


def _completion_prompts(prompt, tokenizer: Tokenizer | None) -> list[list[int]]:
    """The prompts as token ids: a string, a list of token ids, or a list of either."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("prompt must be a string, a list of token ids, or a non-empty list of either", "prompt")
    return [_completion_prompt(p, f"prompt[{i}]" if len(prompt) > 1 else "prompt", tokenizer)
            for i, p in enumerate(prompt)]


def _completion_prompt(prompt, where: str, tokenizer: Tokenizer | None) -> list[int]:
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise bad_request("this model has no tokenizer: give the prompt as token ids", "prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt   # the engine checks them against the vocabulary
    raise bad_request(f"{where} must be a non-empty string or list of token ids", "prompt")


def _chat_prompt(messages, tokenizer: Tokenizer | None, tools: Tools | None) -> list[int]:
    """The templated conversation as token ids, built as chat.py builds it, with the tools and
    the calls in it rendered as tools.py says."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    plain = [_plain_message(m, i) for i, m in enumerate(messages)]
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so no chat template: use /v1/completions", "messages")
    offered = tools and tools.tools
    try:
        text = tokenizer.apply_chat_template(template_messages(plain, offered, tokenizer.renders_tools),
                                             tools=offered if tokenizer.renders_tools else None)
    except (ValueError, jinja2.TemplateError) as error:   # no template, or the template refused them
        raise bad_request(f"the chat template failed on these messages: {error}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def _plain_message(message, index: int) -> dict:
    """A message with its content as one string (text parts joined), and an assistant's
    tool_calls or a tool result's tool_call_id."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad_request(f"{where} must be an object with a string role", "messages")
    if message["role"] not in ROLES:
        raise bad_request(f"{where}.role {message['role']!r} is not a role of the chat API: use one of "
                          f"{', '.join(ROLES)}", f"{where}.role")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad_request(f"{where}: only text content parts are supported", "messages")
        content = "".join(p["text"] for p in content)
    if content is None and message["role"] == "assistant":
        content = ""
    if not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or a list of text parts", "messages")
    plain = {"role": message["role"], "content": content}
    calls = message.get("tool_calls")
    if calls and message["role"] == "assistant":
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) and isinstance(c["function"].get("arguments"), str)
                for c in calls):
            raise bad_request(f'{where}.tool_calls must be a list of {{"id": ..., "type": "function", "function": '
                              f'{{"name": ..., "arguments": "<JSON>"}}}}', "messages")
        plain["tool_calls"] = calls
    if message["role"] == "tool" and message.get("tool_call_id") is not None:
        plain["tool_call_id"] = message["tool_call_id"]
    return plain


def _sampling_params(body: dict, chat: bool, max_model_len: int, prompt: int, **outputs) -> SamplingParams:
    """SamplingParams from the body (prompt: the longest prompt's tokens), with the outputs the
    API's own fields ask for; its own checks name a bad field (-> 400)."""
    fields = {name: body[name] for name in (*SAMPLING_FIELDS, *EXTENSIONS) if body.get(name) is not None}
    if chat and body.get("max_completion_tokens") is not None:   # the newer name of max_tokens
        fields["max_tokens"] = body["max_completion_tokens"]
    if isinstance(fields.get("logit_bias"), dict):   # JSON's keys are strings: token ids as text
        try:
            fields["logit_bias"] = {int(token): bias for token, bias in fields["logit_bias"].items()}
        except ValueError:
            raise bad_request(f"logit_bias maps token ids to biases, got {fields['logit_bias']!r}",
                              "logit_bias") from None
    requested, room = fields.get("max_tokens"), max_model_len - prompt
    if type(requested) is int and requested > room:
        raise context_exceeded(max_model_len, prompt, requested, chat, "max_tokens")
    fields.setdefault("max_tokens", room if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room))
    try:
        return SamplingParams(**fields, **outputs)
    except (TypeError, ValueError) as error:
        raise from_engine(error, list(fields)) from None
