"""Structured output with llguidance: a request's StructuredOutput compiled into a matcher
that follows its output token by token, and the masks of the tokens each matcher allows
next, filled on the host (in parallel) and applied to a batch's logits in one operation."""
from __future__ import annotations

import functools
import json

import llguidance
import llguidance.torch
import torch

import kernels
from nanokv.sampling_params import StructuredOutput
from nanokv.tokenizer import Tokenizer

# JSON as OpenAI's models write it: ", " and ": " between items, no other whitespace (a
# model that may add whitespace anywhere can loop on it until max_tokens). A schema's own
# "x-guidance" options override these.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
BITS = 32   # tokens per word of a mask


class Grammars:
    """Compiles StructuredOutputs for one tokenizer and vocabulary (the logits' width); the
    tokenizer's llguidance form is built at the first one (it takes a while: ~0.35 s for a
    49k-token vocabulary)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, sorted(eos_token_ids)
        self._compiled_tokenizer = None

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A matcher at the start of spec's language; ValueError naming what is wrong with it."""
        if self.tokenizer is None:
            raise ValueError("structured_output needs the model's tokenizer (this model has none)")
        if self._compiled_tokenizer is None:
            self._compiled_tokenizer = llguidance.LLTokenizer(self.tokenizer.to_json(), n_vocab=self.vocab_size,
                                                              eos_token=self.eos_token_ids)
        if spec.json_object or spec.json:
            schema = {"type": "object"} if spec.json_object else spec.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as error:
                    raise ValueError(f"structured_output.json is not valid JSON: {error}") from None
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
        elif spec.regex is not None:
            grammar = llguidance.LLMatcher.grammar_from_regex(spec.regex)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(spec.grammar)
        matcher = llguidance.LLMatcher(self._compiled_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            kind = next(name for name in ("json", "json_object", "regex", "grammar") if getattr(spec, name))
            raise ValueError(f"structured_output.{kind} does not compile: {matcher.get_error()}")
        return matcher



@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()   # its threads fill many masks at once


def fill_masks(matchers: list[llguidance.LLMatcher], vocab_size: int) -> torch.Tensor:
    """[R, words] int32 on the host: bit t % 32 of word t // 32 of row r is set if matchers[r]
    allows token t next. A matcher that has left its grammar raises (its row fails)."""
    for matcher in matchers:
        if matcher.is_error():
            raise ValueError(f"the output left its structured_output grammar: {matcher.get_error()}")
    masks = torch.empty(len(matchers), -(-vocab_size // BITS), dtype=torch.int32)
    llguidance.torch.fill_next_token_bitmask_par(_executor(), [(m, row) for row, m in enumerate(matchers)], masks)
    return masks


def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> torch.Tensor:
    """The logits with every token the rows' masks (fill_masks) do not allow at -inf: a copy."""
    device, vocab = logits.device, logits.shape[-1]
    shifts = torch.arange(BITS, dtype=torch.int32, device=device)
    allowed = ((kernels.from_host(masks, device)[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
    index = kernels.from_host(rows, device)
    return logits.index_copy(0, index, logits[index].masked_fill(~allowed, float("-inf")))
