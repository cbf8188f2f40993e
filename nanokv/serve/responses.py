"""The OpenAI API's responses: the engine's RequestOutputs of one request become its JSON,
whole or as stream chunks, with the log-probabilities in each endpoint's shape and a chat
choice's tool calls (read from its text, tools.py)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from itertools import accumulate

from nanokv import RequestOutput, TokenLogprob
from nanokv.serve.openai_api import ParsedRequest
from nanokv.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class Shown:
    """What a client sees of one choice: its text and its tokens, with their log-probabilities."""
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    context: list[int] = field(default_factory=list)   # the tokens the text continues: a prompt not shown


@dataclass
class _ChoiceStream:
    """How much of one choice has been sent."""
    text: int = 0      # characters
    tokens: int = 0    # of Shown.token_ids
    text_offsets: IncrementalDetokenizer | None = None   # the sent tokens' text, for text_offset
    prompt_text: str | None = None   # with echo: the prompt decoded once, not for every chunk


class Responder:
    """The JSON of one request's response, whole or as stream chunks, a choice each."""

    def __init__(self, chat: bool, model: str, parsed: ParsedRequest, tokenizer: Tokenizer | None,
                 fingerprint: str):
        self.chat, self.model, self.parsed, self.tokenizer = chat, model, parsed, tokenizer
        self.fingerprint = fingerprint   # system_fingerprint: which engine and settings answered
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sent = [_ChoiceStream() for _ in parsed.requests]
        self.kind = "chat.completion" if chat else "text_completion"
        self.chunk_kind = "chat.completion.chunk" if chat else "text_completion"

    def whole(self, outs: list[RequestOutput]) -> dict:
        choices = []
        for index, out in enumerate(outs):
            shown = self._shown(index, out)
            choice = {"index": index, "logprobs": self._logprobs(index, shown), "finish_reason": self._reason(out)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": shown.text}
                calls = self.parsed.tools and self.parsed.tools.read(shown.text)
                if calls:
                    choice["message"] = {"role": "assistant", "content": calls[0] or None, "tool_calls": calls[1]}
                    choice["finish_reason"] = "tool_calls"
            else:
                choice["text"] = shown.text
            choices.append(choice)
        return self._envelope(self.kind, choices, usage=self.usage(outs))

    def role_chunk(self, index: int) -> dict:
        """A chat choice's first chunk: the assistant's role, as OpenAI sends it."""
        return self._chunk(index, {"role": "assistant", "content": ""}, None, None)

    def chunk(self, index: int, out: RequestOutput) -> dict | None:
        """The chunk of what choice index shows now and has not sent; None when nothing is new.
        With tools, text that may be a tool call is held back until the choice ends: then
        its calls come whole, in one chunk."""
        shown, sent, tools = self._shown(index, out), self.sent[index], self.parsed.tools
        reason, calls = self._reason(out) if out.finished else None, None
        upto = len(shown.text)
        if tools is not None and self.chat:
            calls = tools.read(shown.text) if out.finished else None
            upto = len(calls[0]) if calls else upto if out.finished else tools.undecided(shown.text)
        text, new_tokens = shown.text[sent.text:upto], len(shown.token_ids) > sent.tokens
        if not (text or out.finished or (new_tokens and self.parsed.logprobs is not None)):
            return None
        sent.text = max(sent.text, upto)
        content = ({"content": text} if text else {}) if self.chat else text
        if calls:
            content["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls[1])]
            reason = "tool_calls"
        return self._chunk(index, content, self._logprobs(index, shown), reason)

    def usage_chunk(self, outs: list[RequestOutput]) -> dict:
        return self._envelope(self.chunk_kind, [], usage=self.usage(outs))

    def usage(self, outs: list[RequestOutput]) -> dict:
        """Tokens of the whole request: each prompt once (its n choices share it), every choice's output."""
        firsts = outs[::self.parsed.n]
        prompt = sum(len(o.prompt_token_ids) for o in firsts)
        completion = 0 if self.parsed.prompt_only else sum(len(o.token_ids) for o in outs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts)}}

    def _shown(self, index: int, out: RequestOutput) -> Shown:
        """What the client sees of choice index's out: with echo the prompt first (its first
        token has no log-probability); with max_tokens 0 nothing of the one token the engine ran."""
        if self.parsed.echo:
            prompt, sent = out.prompt_token_ids, self.sent[index]
            if sent.prompt_text is None:
                sent.prompt_text = self._decode(prompt)
            shown = Shown(sent.prompt_text, list(prompt), list(out.prompt_logprobs or []))
        else:
            shown = Shown("", [], context=out.prompt_token_ids)
        if not self.parsed.prompt_only:
            shown.text += out.text
            shown.token_ids += out.token_ids
            shown.logprobs += out.logprobs or []
        return shown

    def _reason(self, out: RequestOutput) -> str:
        return "length" if self.parsed.prompt_only else out.finish_reason   # max_tokens 0 is reached

    # ----- log-probabilities ---------------------------------------------------------------

    def _logprobs(self, index: int, shown: Shown) -> dict | None:
        """The log-probabilities of the tokens choice index has not sent, in the endpoint's shape."""
        if self.parsed.logprobs is None:
            return None
        sent = self.sent[index]
        tokens, entries = shown.token_ids[sent.tokens:], shown.logprobs[sent.tokens:]
        sent.tokens = len(shown.token_ids)
        if self.chat:
            return {"content": [self._chat_entry(entry) for entry in entries]}
        texts = [self._token_text(t) for t in tokens]
        tops = [None if e is None else {**{self._token_text(t): lp for t, lp in e.top}, text: e.logprob}
                for text, e in zip(texts, entries)]   # as OpenAI's: the top k and the token itself
        return {"tokens": texts, "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": tops, "text_offset": self._text_offsets(sent, shown.context, tokens)}

    def _text_offsets(self, sent: _ChoiceStream, context: list[int], tokens: list[int]) -> list[int]:
        """Where each of the tokens' text starts in the choice's text, from the pieces a
        detokenizer gives as the tokens come (they add up to the text)."""
        if self.tokenizer is None:   # no text
            return [0] * len(tokens)
        if sent.text_offsets is None:
            sent.text_offsets = IncrementalDetokenizer(self.tokenizer, context)
        start = sent.text_offsets.num_chars
        pieces = [len(sent.text_offsets.add([token])) for token in tokens]
        return list(accumulate(pieces, initial=start))[:-1]

    def _chat_entry(self, entry: TokenLogprob) -> dict:
        return {**self._chat_token(entry.token, entry.logprob),
                "top_logprobs": [self._chat_token(token, logprob) for token, logprob in entry.top]}

    def _chat_token(self, token: int, logprob: float) -> dict:
        text = self._token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _token_text(self, token: int) -> str:
        """One token as text (a piece of a character decodes to U+FFFD); without a tokenizer, its id."""
        return f"token_id:{token}" if self.tokenizer is None else self.tokenizer.decode([token], False)

    def _decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)

    # ----- envelopes -------------------------------------------------------------------------

    def _chunk(self, index: int, content, logprobs: dict | None, finish_reason: str | None) -> dict:
        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason,
                  ("delta" if self.chat else "text"): content}
        extra = {"usage": None} if self.parsed.include_usage else {}
        return self._envelope(self.chunk_kind, [choice], **extra)

    def _envelope(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices, **extra}
