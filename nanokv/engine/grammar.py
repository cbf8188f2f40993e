"""Structured output with llguidance: a request's StructuredOutput compiled into a matcher
that follows its output token by token, and the masks of the tokens each matcher allows
next, filled on the host (in parallel) and applied to a batch's logits in one operation."""
from __future__ import annotations

import functools
import json
from collections.abc import Callable

import llguidance
import torch

import kernels
from nanokv.sampling_params import StructuredOutput

# JSON as OpenAI's models write it: ", " and ": " between items, no other whitespace (a
# model that may add whitespace anywhere can loop on it until max_tokens). A schema's own
# "x-guidance" options override these.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
BITS = 32   # tokens per word of a mask


class Grammar:
    """A request's matcher, and how many of its output tokens it has taken: each token is
    taken once, in order, by whichever comes first of the step that records it and the
    sampler of the next step (which needs it before the token is recorded, under overlap)."""
    __slots__ = ("matcher", "num_taken")

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher, self.num_taken = matcher, 0

    def take(self, token: int, index: int) -> bool:
        """Output token index is token; whether the match is now complete (nothing can follow)."""
        if index == self.num_taken:
            self.matcher.consume_token(token)   # a token it refuses leaves it in error: the next mask says so
            self.num_taken += 1
        return self.matcher.is_stopped() and not self.matcher.is_error()


class Grammars:
    """Compiles StructuredOutputs for one tokenizer and vocabulary (the logits' width); the
    tokenizer's llguidance form is built at the first one (it takes a while: ~0.35 s for a
    49k-token vocabulary). tokenizer_json: the tokenizer's tokenizer.json text (None: the
    model has no tokenizer)."""

    def __init__(self, tokenizer_json: Callable[[], str] | None, vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer_json, self.vocab_size, self.eos_token_ids = tokenizer_json, vocab_size, sorted(eos_token_ids)
        self._compiled_tokenizer = None

    def grammar(self, spec: StructuredOutput) -> Grammar:
        """spec's matcher, at the start of its language; a ValueError that says what is wrong with it."""
        if self.tokenizer_json is None:
            raise ValueError("structured_output needs the model's tokenizer (this model has none)")
        if self._compiled_tokenizer is None:
            self._compiled_tokenizer = llguidance.LLTokenizer(self.tokenizer_json(), n_vocab=self.vocab_size,
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
        return Grammar(matcher)


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()   # its threads fill many masks at once


def fill_masks(grammars: list[Grammar], vocab_size: int) -> torch.Tensor:
    """[R, words] int32 on the host: bit t % 32 of word t // 32 of row r is set if grammars[r]
    allows token t next. A matcher that has left its grammar raises (its row fails)."""
    matchers = [grammar.matcher for grammar in grammars]
    for matcher in matchers:
        if matcher.is_error():
            raise ValueError(f"the output left its structured_output grammar: {matcher.get_error()}")
    masks = torch.empty(len(matchers), -(-vocab_size // BITS), dtype=torch.int32)
    # What llguidance.torch.fill_next_token_bitmask_par does; that module, importing torch.compile's
    # machinery, would add seconds to every start of the engine.
    _executor().unsafe_compute_mask_ptr([(m, row) for row, m in enumerate(matchers)], masks.data_ptr(),
                                        4 * masks.shape[1], len(matchers))
    return masks


@functools.cache
def _byte_biases(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: what each byte of a mask adds to the logits of its 8 tokens (bit j of byte b
    set: 0; else -inf)."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.zeros(256, 8, dtype=dtype).masked_fill(bits == 0, float("-inf")).to(device)


def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> torch.Tensor:
    """The logits with every token the rows' masks (fill_masks) do not allow at -inf: a copy.
    The masks' bytes look up their tokens' biases (one embedding lookup, then one add: on a
    CPU 5x faster than expanding the bits and masking with them)."""
    device, vocab = logits.device, logits.shape[-1]
    mask_bytes = kernels.from_host(masks.view(torch.uint8), device).int()   # little-endian: token t is bit t % 8
    biases = torch.nn.functional.embedding(mask_bytes, _byte_biases(device, logits.dtype)).flatten(1)[:, :vocab]
    if len(rows) == len(logits):   # rows are in order: every row
        return logits + biases
    index = kernels.from_host(rows, device)
    return logits.index_copy(0, index, logits[index] + biases)
