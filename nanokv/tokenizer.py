"""Tokenizer, chat template and streaming detokenizer for any HF checkpoint directory.

Token ids come from the checkpoint's `tokenizer.json`, run by the `tokenizers`
library exactly as HF transformers runs it. Chat templates are rendered with
Jinja the way transformers renders them, so a prompt built here matches the
one the model was trained on.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# How many prompt tokens the detokenizer decodes ahead of the output, as
# context for decoders that treat a sequence's first token specially.
DETOKENIZER_CONTEXT_TOKENS = 5


class Tokenizer:
    """Encodes and decodes text, and renders chat templates, for one checkpoint."""

    def __init__(self, backend, bos_token: str | None = None, eos_token: str | None = None,
                 chat_template: str | None = None, name: str = "the model"):
        """`backend` is a `tokenizers.Tokenizer`; `name` says which model in error messages."""
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.name = name
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self._token_id(bos_token)
        self.eos_token_id: int | None = self._token_id(eos_token)
        self._compiled_template = None

    @classmethod
    def from_dir(cls, path) -> Tokenizer:
        """Load `tokenizer.json` (required), `tokenizer_config.json` and `chat_template.jinja` from `path`."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {path}: nanokv requires tokenizer.json "
                f"(the fast-tokenizer file that HF checkpoints ship)")
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        return cls(tokenizers.Tokenizer.from_file(str(tokenizer_file)),
                   bos_token=_token_content(config.get("bos_token")),
                   eos_token=_token_content(config.get("eos_token")),
                   chat_template=_chat_template(config, path),
                   name=str(path))

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` lets the tokenizer add e.g. a BOS, if its config says so."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (what other libraries build theirs from)."""
        return self._backend.to_str()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders tools (it reads the `tools` variable)."""
        return "tools" in (self.chat_template or "")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template;
        tools: OpenAI's function tools, for a template that renders them."""
        if self.chat_template is None:
            raise ValueError(
                f"{self.name} has no chat template (none in tokenizer_config.json or chat_template.jinja); "
                f"pass a plain prompt instead of chat messages")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        # tools and documents are None, as transformers passes them when there are none.
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token, tools=tools or None, documents=None)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text pieces for streaming.

    Decoding one token at a time is wrong: a multi-byte UTF-8 character can be
    split over several tokens, and some decoders treat a sequence's first
    token specially. Decoding the whole output every step is right but
    quadratic. So, like vLLM, keep two offsets into the ids: text up to
    `read_offset` has been returned, and decoding starts at `prefix_offset`, a
    few tokens earlier. Each step decodes only ids[prefix_offset:] and returns
    what lies beyond the decoding of ids[prefix_offset:read_offset], unless it
    ends in U+FFFD (an incomplete character that later tokens may complete).

    Call `flush()` when generation ends, to get text held back that way.

    For byte-level BPE tokenizers (GPT-2 style: Llama 3, Qwen, SmolLM, ...)
    the pieces add up to `tokenizer.decode(output_ids)`. SentencePiece-style
    decoders drop the leading space of a sequence's first token; decoding
    after a few prompt tokens keeps it, as a continuation of the prompt should.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - DETOKENIZER_CONTEXT_TOKENS, 0)
        self.num_chars = 0   # of the text handed out (kept by the caller: adding to a string here copies it)

    def add(self, new_ids: list[int]) -> str:
        """Append generated ids; returns the newly completed text (may be "")."""
        self.ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return any text still held back, even an incomplete character (as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        piece = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.num_chars += len(piece)
        return piece


def _token_content(token) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    if token is None or isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    raise ValueError(f"unreadable special token {token!r} in tokenizer_config.json; "
                     f"expected a string or a dict with a 'content' string")


def _chat_template(config: dict, path: Path) -> str | None:
    """The default chat template: tokenizer_config.json's, else chat_template.jinja's, else None."""
    template = config.get("chat_template")
    if isinstance(template, list):   # named templates: [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        if "default" not in named:
            raise ValueError(f"{path}/tokenizer_config.json has chat templates named {sorted(named)} "
                             f"but none named 'default'")
        template = named["default"]
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    return template


def _compile_template(source: str):
    """Compile a chat template in the Jinja environment transformers uses for them."""
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)
