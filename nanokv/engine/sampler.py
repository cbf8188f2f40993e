"""The batched sampler: one token per row of logits, every row with its own parameters;
the sampled tokens' way to the host; and the log-probabilities of given tokens under rows
of logits (a request's logprobs)."""
from __future__ import annotations

from itertools import chain

import numpy as np
import torch

import kernels
from nanokv.engine.grammar import apply_masks, fill_masks
from nanokv.engine.sequence import (EVERY_NEED, GRAMMAR, LOGIT_BIAS, LOGPROBS, PENALTIES, RANDOM, SEEDED, Sequence,
                                     TokenLogprob)
from nanokv.sampling_params import SamplingParams

FAILED = -1   # the token of a row that could not be sampled (its error is in Sampler.errors)
PENALTY_FIELDS = ("frequency_penalty", "presence_penalty", "repetition_penalty")
LOGPROB_SLICE = 512   # prompt rows turned into vocabulary logits at a time


class SampledTokens:
    """A step's sampled tokens, one per sequence of seqs (None: it sampled none): on the device,
    where the next step reads those it feeds, and copied to the host behind the step: read()
    waits for that copy only, not for what was launched after it. errors: the rows that could
    not be sampled (Sampler.errors). Copied with the tokens: the logprob_tensors of the rows
    whose request asks for logprobs, from the step's logits (a row that could not be sampled
    gets some, never read: its request ends with an error), and prompt: the prompt tokens the
    step scored, (sequence, position) each, and their logprob_tensors (read_logprobs). needs:
    what the step's sequences need, at least (sequence.py)."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor | None, errors: dict[int, Exception],
                 logits: torch.Tensor | None = None,
                 prompt: tuple[list[tuple[Sequence, int]], tuple[torch.Tensor, ...]] = ([], ()),
                 needs: int = EVERY_NEED):
        self.seqs, self.on_device, self.errors, self.needs = seqs, tokens, errors, needs
        self.logprob_rows = [i for i, seq in enumerate(seqs) if seq.logprobs is not None] \
            if logits is not None and needs & LOGPROBS else []
        found = ()
        if self.logprob_rows:
            at = kernels.from_host(self.logprob_rows, logits.device)
            found = logprob_tensors(logits[at], tokens[at].clamp(min=0),
                                    max(seqs[i].params.logprobs for i in self.logprob_rows))
        self.prompt_targets, prompt_found = prompt
        parts = (() if tokens is None else (tokens,), found, prompt_found)
        on_host, self.ready = kernels.to_host(sum(parts, ()))
        on_host = iter(on_host)
        self.on_host = [tuple(next(on_host) for _ in part) for part in parts]
        self.tokens: list[int] | None = None   # read

    def read(self) -> list[int]:
        """The tokens, on the host (read once: the next step's sampler may read them first)."""
        if self.tokens is None:
            if self.ready is not None:
                self.ready.synchronize()
            self.tokens = self.on_host[0][0].tolist() if self.on_host[0] else []
        return self.tokens

    def read_logprobs(self, tokens: list[int]) -> dict[int, TokenLogprob]:
        """After read() gave tokens: each scored prompt token's TokenLogprob put in its sequence's
        prompt_logprobs; returns the TokenLogprob of each sampled row that asked."""
        targets = self.prompt_targets
        if targets:
            found = as_token_logprobs([seq.prompt_token_ids[i] for seq, i in targets],
                                      *(t.tolist() for t in self.on_host[2]),
                                      [seq.params.logprobs or 0 for seq, _ in targets])
            for (seq, i), logprob in zip(targets, found):
                seq.prompt_logprobs[i] = logprob
        rows = self.logprob_rows
        if not rows:
            return {}
        found = as_token_logprobs([tokens[i] for i in rows], *(t.tolist() for t in self.on_host[1]),
                                  [self.seqs[i].params.logprobs for i in rows])
        return dict(zip(rows, found))


class Sampler:
    """Picks one token per row of logits, every row with its own parameters.

    All rows go through the same tensor ops. Random rows use the exponential
    race (argmax of p / E with E ~ Exp(1) draws from p); rows with a seed draw
    their E from their own generator, so their tokens do not depend on what
    else is in the batch.

    A failure cannot be pinned on a row of the batched pass, so after one every
    row is sampled again on its own: a row that fails alone gets the token
    FAILED and its error in `errors`; greedy and seeded rows get the token the
    batched pass would have given them (seeded streams are rewound first).
    """

    def __init__(self, device: torch.device, seed: int):
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.errors: dict[int, Exception] = {}   # row -> why it got FAILED, in row order

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None], seqs: list[Sequence] | None = None,
                 pending: SampledTokens | None = None, needs: int = EVERY_NEED) -> torch.Tensor:
        """seqs: the rows' sequences, whose tokens so far the penalties count and the grammars
        read; pending: the step before, whose tokens they read first where they are not read
        yet (overlapped steps: that step has finished by then, or soon will); needs: what the
        rows need, at least (sequence.py): no pass over them for what none needs."""
        self.errors = {}
        reads = pending is not None and seqs is not None and needs & (GRAMMAR | PENALTIES)
        unread = self._unread(seqs, pending) if reads else {}
        states = {row: gen.get_state() for row, gen in enumerate(generators) if gen is not None} \
            if needs & SEEDED else {}   # before this call
        try:
            return self._sample(logits, params, generators, seqs, unread, needs)
        except Exception:
            return self._sample_rows_alone(logits, params, generators, seqs, unread, states, needs)

    @staticmethod
    def _unread(seqs: list[Sequence], pending: SampledTokens) -> dict[Sequence, int]:
        """The pending token of each sequence whose sampling reads its output; the
        grammars take theirs now."""
        behind = [seq for seq in seqs if seq.num_pending and (seq.grammar is not None or seq.params.penalizes)]
        if not behind:
            return {}
        rows, tokens = {seq: row for row, seq in enumerate(pending.seqs)}, pending.read()
        unread = {seq: tokens[rows[seq]] for seq in behind}
        for seq in behind:
            if seq.grammar is not None:
                seq.grammar.take(unread[seq], len(seq.output_token_ids))
        return unread

    def _sample_rows_alone(self, logits: torch.Tensor, params: list[SamplingParams],
                           generators: list[torch.Generator | None], seqs: list[Sequence] | None,
                           unread: dict[Sequence, int], states: dict, needs: int) -> torch.Tensor:
        tokens = []
        for row, (p, gen) in enumerate(zip(params, generators)):
            try:
                if row in states:   # rows without a state had drawn nothing yet
                    gen.set_state(states[row])
                tokens.append(int(self._sample(logits[row:row + 1], [p], [gen], seqs and seqs[row:row + 1],
                                               unread, needs)[0]))
            except Exception as error:
                self.errors[row] = error
                tokens.append(FAILED)
        return torch.tensor(tokens, device=logits.device)

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None], seqs: list[Sequence] | None,
                unread: dict[Sequence, int], needs: int) -> torch.Tensor:
        if needs & (PENALTIES | LOGIT_BIAS | RANDOM):   # what computes with the logits does it in float32
            logits = logits.float()
        constrained = [row for row, seq in enumerate(seqs or ()) if seq.grammar is not None] if needs & GRAMMAR else []
        if constrained:   # the masks are filled here, on the host, while the device runs the forward
            masks = fill_masks([seqs[row].grammar for row in constrained], logits.shape[-1])
            logits = apply_masks(logits, constrained, masks)
        if needs & (PENALTIES | LOGIT_BIAS):
            logits = self._penalize(logits, params, seqs, unread)
        greedy = logits.argmax(dim=-1)
        if not needs & RANDOM or all(p.temperature == 0 for p in params):
            return greedy
        vocab = logits.shape[-1]
        host = dict(temperature=np.array([p.temperature or 1.0 for p in params], dtype=np.float32),
                    greedy=np.array([p.temperature == 0 for p in params]))
        if any(p.top_k or p.top_p < 1 or p.min_p for p in params):
            host.update(top_k=np.array([p.top_k or vocab for p in params]),
                        top_p=np.array([p.top_p for p in params], dtype=np.float32),
                        min_p=np.array([p.min_p for p in params], dtype=np.float32))
        rows = kernels.from_host_many(host, logits.device)
        probs = (logits / rows["temperature"][:, None]).softmax(dim=-1)
        if "top_k" in rows:
            probs = self._truncate(probs, rows["top_k"], rows["top_p"], rows["min_p"])
        races = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in enumerate(generators):
            if gen is not None:
                races[row].exponential_(generator=gen)
        sampled = (probs / races).argmax(dim=-1)
        return torch.where(rows["greedy"], greedy, sampled)

    @staticmethod
    def _penalize(logits: torch.Tensor, params: list[SamplingParams], seqs: list[Sequence] | None,
                  unread: dict[Sequence, int]) -> torch.Tensor:
        """The logits with each row's logit_bias added and its penalties applied, as vLLM orders
        them: repetition (HF's: a seen token's logit divided by it if positive, else multiplied,
        over prompt and output), then frequency and presence (OpenAI's: minus the penalty times
        the token's count in the output, minus the other once it is there); the output counts
        its unread token. A copy, made only for a batch with a row that asks: the caller's
        logits stay raw (logprobs read them)."""
        biased = [(row, token, bias) for row, p in enumerate(params) if p.logit_bias
                  for token, bias in p.logit_bias.items()]
        if biased:   # one scatter for every row's biases
            rows, tokens, biases = (kernels.from_host(list(column), logits.device) for column in zip(*biased))
            logits = logits.index_put((rows, tokens), biases.to(logits.dtype), accumulate=True)
        rows = [row for row, p in enumerate(params) if p.penalizes]
        if not rows:
            return logits
        device, picked = logits.device, [seqs[row] for row in rows]

        def counts(lists: list[list[int]]) -> torch.Tensor:   # [R, vocab]: each row's count of each token
            found = torch.zeros(len(rows), logits.shape[-1], device=device)
            where = (np.repeat(np.arange(len(lists)), [len(ids) for ids in lists]),
                     np.fromiter(chain(*lists), np.int64))
            return found.index_put_(tuple(kernels.from_host(w, device) for w in where), torch.ones(1, device=device),
                                    accumulate=True)
        output = counts([seq.output_token_ids + ([unread[seq]] if seq in unread else []) for seq in picked])
        frequency, presence, repetition = (kernels.from_host([getattr(params[row], name) for row in rows], device)
                                           [:, None].to(logits.dtype) for name in PENALTY_FIELDS)
        index = kernels.from_host(rows, device)
        penalized = logits[index]
        if any(params[row].repetition_penalty != 1 for row in rows):   # the prompt's tokens count only for it
            seen = (output + counts([seq.prompt_token_ids for seq in picked])) > 0
            penalized = torch.where(seen, torch.where(penalized > 0, penalized / repetition, penalized * repetition),
                                    penalized)
        penalized = penalized - frequency * output - presence * (output > 0)
        return logits.index_copy(0, index, penalized)

    @staticmethod
    def _truncate(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
        """Zero every token outside each row's top-k and top-p set, and those less likely than
        min_p times its top token (which always stays): each row's settings [R], on the device."""
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (rank[None] >= top_k[:, None]) | (mass_before >= top_p[:, None]) \
            | (sorted_probs < min_p[:, None] * sorted_probs[:, :1])
        return probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> tuple[torch.Tensor, ...]:
    """Each row's log-probability of its token [R], and its num_top (at least 1) most likely
    log-probabilities and tokens [R, num_top]: log_softmax of the raw logits, before temperature
    and truncation (as OpenAI reports them), in float32. On the device: nothing waits."""
    logprobs = logits.float().log_softmax(dim=-1)
    return (logprobs.gather(1, tokens[:, None])[:, 0], *logprobs.topk(max(num_top, 1), dim=-1))


def prompt_logprobs(compute_logits, hidden: torch.Tensor, rows: list[int], targets: list[tuple[Sequence, int]]
                    ) -> tuple[list[tuple[Sequence, int]], tuple[torch.Tensor, ...]]:
    """The prompt tokens a step scores (targets: sequence, position), each by the logits of the
    row of hidden before it (rows; compute_logits: the model's), and their logprob_tensors, a
    slice of rows at a time (a [rows, vocab] matrix of a long chunk would be large):
    SampledTokens' prompt."""
    if not targets:
        return [], ()
    rows = kernels.from_host(np.array(rows, dtype=np.int64), hidden.device)
    tokens = kernels.from_host(np.array([seq.prompt_token_ids[i] for seq, i in targets], dtype=np.int64), hidden.device)
    num_top = max(seq.params.logprobs or 0 for seq, _ in targets)
    found = [logprob_tensors(compute_logits(hidden[rows[at:at + LOGPROB_SLICE]]), tokens[at:at + LOGPROB_SLICE],
                             num_top) for at in range(0, len(rows), LOGPROB_SLICE)]
    return targets, tuple(torch.cat(column) for column in zip(*found))


def as_token_logprobs(tokens: list[int], chosen: list[float], top_logprobs: list[list[float]],
                      top_tokens: list[list[int]], num_top: list[int]) -> list[TokenLogprob]:
    """logprob_tensors' values, read on the host, as each row's TokenLogprob with its own num_top."""
    return [TokenLogprob(token, logprob, tops[0], top_lps[0], list(zip(tops[:k], top_lps[:k])))
            for token, logprob, top_lps, tops, k in zip(tokens, chosen, top_logprobs, top_tokens, num_top)]
