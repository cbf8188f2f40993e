"""Tool calling on chat completions: a request's tools and tool_choice checked; the tools and
the tool-call history rendered into the prompt; the grammar a required call is generated
under; the calls read back from a choice's text.

A model's chat template renders the tools where it reads them (its source names `tools`:
Qwen2/3, Llama 3.1+, Mistral, Hermes); the template then gets the tools, the assistant
turns' `tool_calls` (arguments as objects) and the `tool` turns as HF transformers passes
them. For any other template, nanokv's fallback: the tools are described in a system
message that asks for calls as a JSON array of {"name", "arguments"} objects, an assistant
turn's calls are written into its content that way, and a tool result is a user turn.

A choice's calls are read from its text in either of the forms models write: <tool_call>
blocks holding {"name", "arguments"} (Hermes, Qwen; text before the first block is the
message's content), or a text that is one such object or a JSON array of them (Llama 3's
form, with "parameters" for "arguments", and the fallback's). A call to a function the
request did not offer is not one: the text stays content. With tool_choice "required" or a
named function the output is generated under a JSON schema of the calls allowed (an array
of them when parallel_tool_calls is on, else one), so its arguments always parse.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from nanokv.sampling_params import StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)
CHOICES = ("none", "auto", "required")


class ToolError(ValueError):
    """A bad tools, tool_choice or parallel_tool_calls field; param: which."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class Tools:
    """A request's tools and how it lets the model call them."""
    tools: list[dict]          # as the request gives them: {"type": "function", "function": {...}}
    choice: str | None         # "auto" or "required"; None: the function named
    named: str | None = None   # tool_choice {"type": "function", "function": {"name": ...}}
    parallel: bool = True      # parallel_tool_calls: more than one call per turn

    @property
    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]

    def structured_output(self) -> StructuredOutput | None:
        """The grammar of a forced call: one of the functions (the one named), with arguments
        under its parameters' schema; an array of one or more with parallel calls."""
        if self.choice == "auto":
            return None
        call = {"anyOf": [_call_schema(tool["function"]) for tool in self.tools
                          if self.named in (None, tool["function"]["name"])]}
        many = self.parallel and self.named is None
        return StructuredOutput(json={"type": "array", "items": call, "minItems": 1} if many else call)

    def read(self, text: str) -> tuple[str, list[dict]] | None:
        """The content and the calls (OpenAI's tool_calls, each with a new id) in a choice's
        text; None if it holds none."""
        found = _blocks(text) if OPEN in text else _json_calls(text)
        if found is None:
            return None
        content, calls = found
        if not calls or any(name not in self.names or not isinstance(args, dict) for name, args in calls):
            return None
        calls = calls if self.parallel else calls[:1]
        return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args)}} for name, args in calls]

    def undecided(self, text: str) -> int:
        """How much of a streamed text is surely content: what precedes a call (or what may
        still become one, with the whitespace before it); 0 for a text that may be calls in
        JSON, or when a call is forced (the whole output is calls)."""
        if self.choice != "auto" or text.lstrip()[:1] in ("{", "["):
            return 0
        if OPEN in text:
            return len(text[:text.index(OPEN)].rstrip())
        held = next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-k:])), 0)
        return len(text[:len(text) - held].rstrip())


def _call_schema(function: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": function.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def _blocks(text: str) -> tuple[str, list[tuple]] | None:
    calls = [_call(match.group(1)) for match in BLOCK.finditer(text)]
    return None if None in calls else (text[:text.index(OPEN)].rstrip(), calls)


def _json_calls(text: str) -> tuple[str, list[tuple]] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    calls = [_call(item) for item in (value if isinstance(value, list) else [value])]
    return None if None in calls else ("", calls)


def _call(value) -> tuple[str, object] | None:
    """(name, arguments) of a call written as JSON (or its text), None if it is not one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):   # some models write the arguments as a JSON string, as the API sends them
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return value["name"], arguments


def parse_tools(body: dict) -> Tools | None:
    """The request's tools, or None when it offers none or tool_choice is "none" (the model
    then answers in text; a history of calls still renders). ToolError names a bad field."""
    tools, choice, parallel = body.get("tools") or [], body.get("tool_choice"), body.get("parallel_tool_calls")
    if not isinstance(tools, list) or not all(_is_function(tool) for tool in tools):
        raise ToolError('tools must be a list of {"type": "function", "function": {"name": ..., "parameters": '
                        '{JSON schema}}}', "tools")
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise ToolError(f"tools has a function name twice: {names}", "tools")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(f"parallel_tool_calls must be true or false, got {parallel!r}", "parallel_tool_calls")
    named = None
    if isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if named not in names:
            raise ToolError(f"tool_choice {choice!r} names no function of tools ({', '.join(names) or 'none'})",
                            "tool_choice")
        choice = None
    elif choice is not None and choice not in CHOICES:
        raise ToolError(f"tool_choice must be one of {', '.join(CHOICES)} or {{\"type\": \"function\", "
                        f"\"function\": {{\"name\": ...}}}}, got {choice!r}", "tool_choice")
    if choice == "required" and not tools:
        raise ToolError('tool_choice "required" needs tools', "tool_choice")
    if not tools or choice == "none":
        return None
    return Tools(tools, choice or ("auto" if named is None else None), named, parallel is not False)


def _is_function(tool) -> bool:
    function = tool.get("function") if isinstance(tool, dict) else None
    return isinstance(function, dict) and tool.get("type") == "function" and isinstance(function.get("name"), str) \
        and isinstance(function.get("parameters", {}), dict)


def template_messages(messages: list[dict], tools: list[dict] | None, native: bool) -> list[dict]:
    """The messages as the chat template gets them: native (a template that renders tools)
    with the calls' arguments as objects, as HF passes them; else in the fallback's form."""
    if native:
        return [{**m, "tool_calls": [{**call, "function": {**call["function"], "arguments":
                                                           _arguments(call["function"]["arguments"])}}
                                     for call in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    names = {call["id"]: call["function"]["name"] for m in messages for call in m.get("tool_calls") or ()}
    rendered = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
                     for c in m["tool_calls"]]
            m = {"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + json.dumps(calls)}
        elif m["role"] == "tool":
            name = names.get(m.get("tool_call_id"), "a tool")
            m = {"role": "user", "content": f"The result of {name}: {m['content']}"}
        rendered.append(m)
    if tools:
        described = "\n".join(json.dumps(tool["function"]) for tool in tools)
        system = ("You can call these functions:\n" + described + "\nTo call functions, answer with only a JSON "
                  'array of calls: [{"name": "<function name>", "arguments": {<its arguments>}}].')
        if rendered and rendered[0]["role"] in ("system", "developer"):
            rendered[0] = {**rendered[0], "content": rendered[0]["content"] + "\n\n" + system}
        else:
            rendered.insert(0, {"role": "system", "content": system})
    return rendered


def _arguments(arguments) -> object:
    """A call's arguments as an object (the API sends them as JSON text)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments
