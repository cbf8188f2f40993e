"""What a request asks for: SamplingParams."""
from __future__ import annotations

from dataclasses import dataclass, field

from nanokv.checks import SEED_RANGE, check_bool, check_float, check_int, check_token_ids
from nanokv.eviction import EvictionSettings

MAX_LOGPROBS = 20   # the most alternatives a token's log-probability comes with, as OpenAI allows
MAX_LOGIT_BIAS = 300   # tokens a request may bias, as OpenAI allows, each by at most 100 either way


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match, exactly one of: a JSON schema (a dict or its text),
    any JSON object, a regular expression, or a Lark grammar (llguidance's dialect). Sampling
    only ever picks tokens that keep the output a prefix of a match, and the request ends
    when the match is complete (or at max_tokens, then unfinished)."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self):
        check_bool("json_object", self.json_object)
        for name in ("regex", "grammar"):
            if not isinstance(getattr(self, name), (str, type(None))):
                raise TypeError(f"structured_output.{name} must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.json, (dict, str, type(None))):
            raise TypeError(f"structured_output.json must be a JSON schema (an object or its text), got {self.json!r}")
        given = [name for name in ("json", "json_object", "regex", "grammar") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(f"structured_output takes exactly one of json, json_object, regex and grammar, "
                             f"got {', '.join(given) or 'none'}")


@dataclass
class SamplingParams(EvictionSettings):
    """How one request samples, and its KV-cache method (the eviction settings, keyword
    arguments: nanokv/eviction/settings.py), whose unset settings take the engine's."""
    max_tokens: int = 256
    temperature: float = 1.0        # 0 = greedy
    top_p: float = 1.0              # nucleus: keep the smallest set of tokens with this much mass
    top_k: int = 0                  # keep the k most likely tokens; 0 = all
    min_p: float = 0.0              # keep the tokens at least min_p times as likely as the most likely one
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit (OpenAI's)
    presence_penalty: float = 0.0   # OpenAI's: off a token's logit once it is in the output, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI's: off a token's logit for each time it is in the output, in [-2, 2]
    repetition_penalty: float = 1.0  # HF's: a logit of a token in the prompt or output divided by it (> 0), 1 = off
    seed: int | None = None         # a request's own random stream, independent of its batch
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings, not included in the text
    return_kept_positions: bool = False  # output: positions each (layer, KV head) kept at the end
    logprobs: int | None = None         # output: each output token's log-probability, and the k most likely
    prompt_logprobs: bool = False       # output: every prompt token's (with logprobs=k, its k most likely too)
    structured_output: StructuredOutput | None = None   # what the output must match (a dict: its fields)

    def __post_init__(self):
        self.check()

    @property
    def penalizes(self) -> bool:
        """Whether sampling counts the tokens so far."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    def check(self) -> None:
        """Raise a TypeError or ValueError naming the first bad field. Run at construction
        and again when a request is queued (the fields may have been changed since)."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        check_int("max_tokens", self.max_tokens, 1)
        check_float("temperature", self.temperature, 0)
        check_float("top_p", self.top_p, 0, 1, low_open=True)
        check_int("top_k", self.top_k, 0)
        check_float("min_p", self.min_p, 0, 1)
        check_float("presence_penalty", self.presence_penalty, -2, 2)
        check_float("frequency_penalty", self.frequency_penalty, -2, 2)
        check_float("repetition_penalty", self.repetition_penalty, 0, low_open=True)
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise TypeError(f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} token ids to biases, "
                            f"got {self.logit_bias!r}")
        check_token_ids("logit_bias", list(self.logit_bias))
        for bias in self.logit_bias.values():
            check_float("logit_bias", bias, -100, 100)
        check_int("seed", self.seed, *SEED_RANGE, optional=True)
        check_bool("ignore_eos", self.ignore_eos)
        check_token_ids("stop_token_ids", self.stop_token_ids)
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not all(self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")
        self.check_eviction_settings()
        check_bool("return_kept_positions", self.return_kept_positions)
        check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, optional=True)
        check_bool("prompt_logprobs", self.prompt_logprobs)
        if isinstance(self.structured_output, dict):   # as JSON gives it
            try:
                self.structured_output = StructuredOutput(**self.structured_output)
            except TypeError as error:
                raise TypeError(f"structured_output: {error} (its fields are json, json_object, regex and grammar)")\
                    from None
        if not isinstance(self.structured_output, (StructuredOutput, type(None))):
            raise TypeError(f"structured_output must be a StructuredOutput or None, got {self.structured_output!r}")
