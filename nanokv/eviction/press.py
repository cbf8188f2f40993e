"""kvpress's presses as rankings: a ScorerPress scores the pairs a sequence holds in one layer,
called as kvpress calls it after a prompt (keys and values [1, Hkv, n, head_dim] in position
order, dequantized), and the pairs kvpress would keep (the top n - k of its scores) rank above
those it would drop. The schedule decides when and how many, as for every ranking.
AdaKVPress(press) is the press's scores ranked across heads, as KV-Compress's page eviction
ranks them across heads and layers (uneven): each head scored on its own pairs, its top
alpha_safeguard share of the pairs kept on average protected, as AdaKV protects them.

A press that reads a window of hidden states (SnapKV's, TOVA's; any of the user's own when the
engine keeps some) is handed the layer's inputs of the sequence's latest positions and their
position_embeddings, which the engine keeps for it (press_window: nanokv/engine/press_window.py),
and a view of nanokv's attention layer as the module. kvpress's presses that read more (the
hidden states of the whole prompt, the attention matrix, weights from the hub) are refused,
naming what they read. Nothing here imports kvpress (an optional dependency: pip install
'nanokv[kvpress]')."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from nanokv.eviction.rankings import HeldPairs, Ranking

# kvpress's ScorerPresses that read nothing but the keys and values (checked with kvpress 0.5).
RUNS_AS_IS = ("CURPress", "KeyDiffPress", "KnormPress", "LagKVPress", "RandomPress", "StreamingLLMPress")
# kvpress's ScorerPresses that read the hidden states of their last positions: how many.
READS_WINDOW = {"SnapKVPress": lambda press: press.window_size + 1,   # it asserts more than its window
                "TOVAPress": lambda press: 1}
WHOLE_PROMPT = "the hidden states of every position of the prompt"
READS = {   # kvpress's other ScorerPresses: what each reads beyond the pairs (and nanokv's rule that is theirs)
    "PyramidKVPress": "its own per-layer budgets",
    "ExpectedAttentionPress": WHOLE_PROMPT,
    "ExpectedAttentionStatsPress": WHOLE_PROMPT + " and statistics from the hub",
    "LeverageScorePress": WHOLE_PROMPT, "CompactorPress": WHOLE_PROMPT, "NonCausalAttnPress": WHOLE_PROMPT,
    "CapPress": WHOLE_PROMPT, "QFilterPress": "Q-filters downloaded from the Hugging Face hub",
    "KVzapPress": "a scorer model downloaded from the Hugging Face hub and the hidden states",
    "ObservedAttentionPress": "the attention matrix of the prompt (kv_method='batchmax', kv_schedule='once' is its "
                              "rule: attention averaged over the queries that saw each key)",
    "CriticalKVPress": "the press it wraps, and the output projection's weights",
}


def is_scorer_press_class(cls) -> bool:
    """Whether cls is kvpress's ScorerPress or a subclass (found by its bases, not by importing kvpress)."""
    return isinstance(cls, type) and any(c.__name__ == "ScorerPress" and c.__module__.startswith("kvpress.")
                                         for c in cls.__mro__)


def press_by_name(spec: dict):
    """The press {"name": a kvpress ScorerPress's class name, "args": {its fields}} names; an
    AdaKVPress's args name the press it wraps the same way (or by its name alone)."""
    if set(spec) - {"name", "args"} or not isinstance(spec.get("name"), str) or \
            not isinstance(spec.get("args", {}), dict):
        raise TypeError(f'kv_press as an object must be {{"name": a ScorerPress class name, "args": {{...}}}}, '
                        f'got {spec!r}')
    try:
        import kvpress
    except ImportError:
        raise ValueError("kv_press needs kvpress, which is not installed: pip install 'nanokv[kvpress]'") from None
    scorers = sorted(name for name in kvpress.__all__
                     if name != "ScorerPress" and is_scorer_press_class(getattr(kvpress, name)))
    if spec["name"] not in (*scorers, "AdaKVPress"):
        raise ValueError(f"kv_press name must be one of kvpress's ScorerPresses ({', '.join(scorers)}) or "
                         f"AdaKVPress, got {spec['name']!r}")
    args = dict(spec.get("args", {}))
    if spec["name"] == "AdaKVPress" and isinstance(args.get("press"), (str, dict)):
        inner = args["press"]
        args["press"] = press_by_name({"name": inner} if isinstance(inner, str) else inner)
    try:
        return getattr(kvpress, spec["name"])(**args)
    except (TypeError, ValueError, AssertionError) as error:
        raise ValueError(f"kv_press {spec['name']} args {spec.get('args')!r}: {error}") from None


def adakv_inner(press):
    """The press an AdaKVPress wraps, or None for any other press."""
    kind = type(press)
    return press.press if kind.__name__ == "AdaKVPress" and kind.__module__.startswith("kvpress.") else None


def scorer_of(press) -> type:
    """The class whose score() press runs."""
    return next(c for c in type(press).__mro__ if "score" in vars(c))


def inputs_read(press, press_window: int) -> int:
    """How many of a sequence's latest positions' layer inputs press is handed at each call: what
    kvpress's SnapKV and TOVA read (a ValueError if the engine keeps fewer), none for its other
    presses, all the engine keeps (press_window, maybe 0) for a press of the user's own."""
    scorer = scorer_of(press)
    if not scorer.__module__.startswith("kvpress."):
        return press_window
    need = READS_WINDOW[scorer.__name__](press) if scorer.__name__ in READS_WINDOW else 0
    if need > press_window:
        raise ValueError(f"kv_press {type(press).__name__} reads the layer inputs of its sequence's last {need} "
                         f"positions, and the engine keeps {press_window} (press_window): start the engine with "
                         f"press_window >= {need}")
    return need


def check_press(press) -> None:
    """A TypeError or ValueError naming what is wrong with press as a request's ranking."""
    if adakv_inner(press) is not None:
        if not 0 <= press.alpha_safeguard <= 1:
            raise ValueError(f"kv_press AdaKVPress alpha_safeguard must be in [0, 1], got {press.alpha_safeguard!r}")
        press = adakv_inner(press)
    if not is_scorer_press_class(type(press)):
        raise TypeError(f"kv_press must be a kvpress ScorerPress or an AdaKVPress of one (pip install "
                        f"'nanokv[kvpress]'), got {type(press).__name__}")
    for kind in (type(press), scorer_of(press)):   # a subclass of kvpress's that keeps its score() is judged by it
        name = kind.__name__
        if kind.__module__.startswith("kvpress.") and (name in READS or name not in (*RUNS_AS_IS, *READS_WINDOW)):
            reads = READS.get(name, "what nanokv has not checked it reads")
            raise ValueError(f"kv_press {name} reads {reads}: kvpress's presses nanokv runs are "
                             f"{', '.join(sorted((*RUNS_AS_IS, *READS_WINDOW)))}, and any ScorerPress of your own")
    if press.compression_ratio:
        raise ValueError(f"kv_press compression_ratio is not read (kv_budget and kv_schedule decide how many "
                         f"pairs go): it must be 0, got {press.compression_ratio!r}")


class PressRanking(Ranking):
    """A kvpress ScorerPress, by default under kvpress's own schedule: once, after the prompt;
    an AdaKVPress's, uneven."""
    name = "press"
    default_schedule = "once"
    reads_keys = reads_values = True

    def __init__(self, press, press_window: int = 0):
        """press_window: the latest positions whose layer inputs the engine keeps for a press."""
        inner = adakv_inner(press)
        self.uneven, self.safeguard = (True, press.alpha_safeguard) if inner is not None else (False, 0.0)
        self.press = copy.copy(inner or press)   # its own copy: the compression ratio is set at each call
        self.inputs = inputs_read(self.press, press_window)

    @property
    def settings(self) -> tuple:
        return repr(self.press), self.safeguard

    def keep_priority(self, held: HeldPairs) -> torch.Tensor:
        """The press's scores, each (sequence, layer) handed its pairs in position order, put back in
        slot order (by _as_kvpress, or by _per_head for an uneven method)."""
        slot = torch.arange(held.positions.shape[-1], device=held.positions.device)
        last = torch.iinfo(held.positions.dtype).max   # a head's empty slots go after its pairs
        order = (held.positions if held.lens is None else
                 held.positions.masked_fill(slot >= held.lens[..., None], last)).argsort(dim=-1)
        keys, values = (x.gather(-2, order[..., None].expand_as(x)) for x in held.keys_values())
        priority = (self._as_kvpress if held.lens is None else self._per_head)(held, keys, values)
        return torch.empty_like(priority).scatter_(-1, order, priority)

    def _as_kvpress(self, held: HeldPairs, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Every head drops num_evicted of its n pairs: +inf for those the top n - k of the press's
        scores keep (kvpress's choice, ties as torch.topk breaks them)."""
        S, L, _, n, _ = keys.shape
        kept = n - held.num_evicted
        self.press.compression_ratio = (held.num_evicted - 0.5) / n   # compute_n_kept truncates: n - k exactly
        priority = torch.empty(keys.shape[:-1], device=keys.device)
        for s in range(S):
            for i in range(L):
                module, hidden, kwargs = held.press_args(s, i)
                scores = self.press.score(module, hidden, keys[s, i][None], values[s, i][None], None, kwargs)[0]
                priority[s, i] = scores.float().scatter(-1, scores.topk(kept).indices, float("inf"))
        return priority

    def _per_head(self, held: HeldPairs, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Heads of different lengths, one call each: the scores as they are (the pages' costs
        compare heads), each head's top alpha_safeguard x the pairs kept on average (at least one)
        protected as AdaKV protects them."""
        self.press.compression_ratio = 0.0
        priority = torch.full(keys.shape[:-1], float("-inf"), device=keys.device)
        for s, layers in enumerate(held.lens.tolist()):
            safe = max(int(self.safeguard * held.num_kept[s]), 1) if self.safeguard else 0
            for i, lens in enumerate(layers):
                module, hidden, kwargs = held.press_args(s, i)
                for h, m in enumerate(lens):
                    head = (x[s, i, h:h + 1, :m][None] for x in (keys, values))
                    scores = self.press.score(module, hidden, *head, None, kwargs)[0, 0].float()
                    priority[s, i, h, :m] = scores.scatter(-1, scores.topk(min(safe, m)).indices, torch.finfo().max)
        return priority


def attention_view(attention, cos_sin: torch.Tensor, dtype: torch.dtype) -> SimpleNamespace:
    """What a press reads of an HF attention module, of nanokv's layer `attention` (models/decoder.py
    Attention: this rank's heads, weights of dtype) and RoPE table cos_sin: layer_idx, head_dim,
    config, q_proj and k_proj (before RoPE, Qwen3's q/k norms applied: kvpress applies them to HF's
    own classes only) and rotary_emb (HF's cos and sin)."""
    config = SimpleNamespace(num_attention_heads=attention.num_heads, num_key_value_heads=attention.num_kv_heads,
                             head_dim=attention.head_dim)

    def projection(part: int):
        def project(hidden: torch.Tensor) -> torch.Tensor:   # [..., hidden] -> [..., heads * head_dim]
            flat = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
            return attention.project(flat, None, None)[part].reshape(*hidden.shape[:-1], -1).to(hidden.dtype)
        return project
    return SimpleNamespace(layer_idx=attention.layer_idx, head_dim=attention.head_dim, config=config,
                           q_proj=projection(0), k_proj=projection(1),
                           rotary_emb=lambda x, position_ids: hf_cos_sin(cos_sin, position_ids, x.dtype))


def hf_cos_sin(cos_sin: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's position embeddings (cos, sin), each [..., D], of rows [...] of nanokv's RoPE table
    [rows, D] (cos of the D/2 angles, then their sin)."""
    cos, sin = cos_sin[rows.to(cos_sin.device)].chunk(2, dim=-1)
    return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([sin, sin], dim=-1).to(dtype)
