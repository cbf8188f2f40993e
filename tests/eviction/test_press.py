"""kvpress's presses as nanokv rankings (nanokv/eviction/press.py), against kvpress itself.

kvpress compresses a prompt in its own forward hooks on an HF model; nanokv, run on the same
weights, must keep the same positions in every (layer, KV head) and then generate the same
greedy tokens. Under the schedules kvpress does not have (block-wise prefill, decode), a press
must keep and free as nanokv's own equivalent ranking does, and a press that reads hidden
states must be handed those of its sequence's last positions (nanokv/engine/press_window.py).
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import kvpress
import pytest
import torch
import transformers
from kvpress.utils import compute_n_kept

from helpers import VOCAB, preemption_params, preemption_prompts
from oracle import distinct_prompt
from nanokv import LLM, SamplingParams
from nanokv.engine import evict
from nanokv.eviction import HeldPairs
from kernels.eviction_order import lowest_ref as lowest
from nanokv.eviction.press import READS_WINDOW, RUNS_AS_IS, PressRanking, check_press

PRESSES = [getattr(kvpress, name)(**({"seed": 0} if name == "RandomPress" else {}))
           for name in (*RUNS_AS_IS, *READS_WINDOW)]
WINDOW = 65   # the engines' press_window: SnapKVPress reads its 64 positions and one more
STEPS = 16


def prompt_keys(hf, prompt: list[int]) -> list[torch.Tensor]:
    """Each layer's keys [Hkv, n, head_dim] of the prompt, with no press."""
    with torch.no_grad():
        return [layer.keys[0] for layer in hf.model(torch.tensor([prompt])).past_key_values.layers]


def kvpress_generate(hf, press, prompt: list[int], keys: list[torch.Tensor],
                     steps: int) -> tuple[torch.Tensor, list[int]]:
    """kvpress's kept positions [L, Hkv, n_kept] (ascending) after compressing the prompt in its
    own hooks (found among the prompt's keys), and the greedy tokens: the prompt's, then `steps`
    more over the compressed cache (as kvpress's pipeline generates)."""
    with torch.no_grad():
        cache = transformers.DynamicCache()
        with press(hf):
            out = hf(torch.tensor([prompt]), past_key_values=cache)
        kept = []
        for layer, whole in zip(cache.layers, keys):   # a kept key is one of the prompt's, unchanged
            same = (layer.keys[0][:, :, None] == whole[:, None]).all(-1)   # [H, kept, n]
            assert (same.sum(-1) == 1).all()
            kept.append(same.int().argmax(-1).sort(-1).values)
        tokens = [int(out.logits[0, -1].argmax())]
        for i in range(steps):
            out = hf(torch.tensor([tokens[-1:]]), past_key_values=cache, position_ids=torch.tensor([[len(prompt) + i]]))
            tokens.append(int(out.logits[0, -1].argmax()))
    return torch.stack(kept), tokens


def check_as_kvpress(llm: LLM, hf, prompt: list[int], ratio: float = 0.25, steps: int = STEPS) -> None:
    """Every press of PRESSES: nanokv's (all in one batch) against kvpress's own, and `steps` tokens
    generated over what each kept; more than SnapKV's window kept, which it keeps whole."""
    n_kept = compute_n_kept(len(prompt), ratio)
    outs = llm.generate([prompt] * len(PRESSES), [
        SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True, kv_press=press, kv_budget=n_kept,
                       return_kept_positions=True) for press in PRESSES], use_tqdm=False)
    keys = prompt_keys(hf, prompt)
    for press, out in zip(PRESSES, outs):
        kept, tokens = kvpress_generate(hf, dataclasses.replace(press, compression_ratio=ratio), prompt, keys, steps)
        assert torch.equal(out.kept_positions[..., :n_kept].long(), kept.long()), press   # then the new tokens'
        assert out.token_ids == tokens, press


@pytest.mark.parametrize("chunk", [2048, 32])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_each_press_keeps_what_kvpress_keeps_on_a_tiny_model_of_each_family(tiny_models, family, chunk):
    """The prompt read in one chunk, and in chunks of 32: a window of hidden states spans three."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_models(family), dtype=torch.float32).eval()
    llm = LLM(str(tiny_models(family)), dtype="float32", num_kv_blocks=32, max_model_len=256, press_window=WINDOW,
              max_num_batched_tokens=chunk)
    check_as_kvpress(llm, hf, distinct_prompt(100, seed=1))


def test_each_press_keeps_what_kvpress_keeps_on_the_bundled_model(bundled_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(bundled_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(bundled_dir)
    llm = LLM(str(bundled_dir), dtype="float32", num_kv_blocks=32, max_model_len=256, press_window=WINDOW)
    text = tokenizer("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is "
                     "named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 "
                     "to 1889, as the centrepiece of the World's Fair. Visitors climb its stairs or ride lifts to "
                     "three levels, where restaurants and an observation deck look over the river Seine, the gardens "
                     "below and the rooftops of the city. Every seven years, painters cover the iron in a new coat of "
                     "bronze paint, a job that takes a team of fifty people more than a year and sixty tonnes of "
                     "paint.")["input_ids"]
    # repeating no token, as distinct_prompt: 92 of them; few steps, each ~0.1 s for HF on a CPU
    check_as_kvpress(llm, hf, list(dict.fromkeys(text)), steps=4)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models("qwen2")), dtype="float32", num_kv_blocks=64, max_model_len=256, press_window=24)


def evicting(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 40, "ignore_eos": True, "kv_budget": 32,
                             "evict_every": 16, "return_kept_positions": True, **kwargs})


@pytest.mark.parametrize("press, native, schedule, max_tokens, kv_cache_dtype", [
    (kvpress.StreamingLLMPress(n_sink=4), "streamingllm", "prefill", 40, "auto"),
    (kvpress.StreamingLLMPress(n_sink=4), "streamingllm", "decode", 40, "auto"),
    (kvpress.KnormPress(), "knorm", "prefill", 1, "auto"),   # distinct_prompt: only the prompt is ranked
    (kvpress.KnormPress(), "knorm", "prefill", 1, "int8"),   # the keys dequantized, as knorm reads them
])
def test_a_press_under_nanokv_s_schedules_keeps_what_its_nanokv_equal_keeps(llm, tiny_models, press, native, schedule,
                                                                            max_tokens, kv_cache_dtype):
    """Blocks freed as the prompt is read, and on a quantized cache too."""
    if kv_cache_dtype != "auto":
        llm = LLM(str(tiny_models("qwen2")), dtype="float32", num_kv_blocks=64, max_model_len=256,
                  kv_cache_dtype=kv_cache_dtype)
    prompts = [distinct_prompt(n, seed=n) for n in (70, 100)]
    theirs = llm.generate(prompts, evicting(kv_method=native, kv_schedule=schedule, max_tokens=max_tokens),
                          use_tqdm=False)
    ours = llm.generate(prompts, evicting(kv_press=press, kv_schedule=schedule, max_tokens=max_tokens), use_tqdm=False)
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.kept_positions, b.kept_positions)
        assert a.kept_positions.shape[-1] <= 32
    assert llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks


def test_a_batch_mixing_a_press_a_nanokv_rule_and_the_full_cache_runs_each_as_alone(llm):
    prompts = [torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(5)]
    params = [evicting(kv_press=kvpress.LagKVPress(lag_size=8)), evicting(kv_method="batchmax"),
              evicting(kv_press=kvpress.KeyDiffPress(), kv_schedule="decode"),
              evicting(kv_press=kvpress.SnapKVPress(window_size=16), kv_schedule="prefill"),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    together = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, together):
        alone = llm.generate([prompt], p, use_tqdm=False)[0]
        assert out.token_ids == alone.token_ids
        assert (out.kept_positions is None and alone.kept_positions is None
                or torch.equal(out.kept_positions, alone.kept_positions))


@dataclasses.dataclass
class LayerHeadKnorm(kvpress.KnormPress):
    """K-norm plus 1000 x the layer and 100 x the head: the later a head, the more it is worth."""

    def score(self, module, *args):
        scores = super().score(module, *args)
        return scores + 1000 * module.layer_idx + 100 * torch.arange(scores.shape[1])[None, :, None]


@pytest.mark.parametrize("alpha, held", [(0.0, [[16, 16], [32, 64]]), (0.2, [[16, 16], [32, 64]]),
                                         (1.0, [[32, 32], [32, 32]])])
def test_adakv_ranks_the_press_s_scores_across_heads_and_layers_in_whole_pages(llm, alpha, held):
    """100 pairs a head (7 pages of 16) down to 32 on average: 20 of the 28 pages go, the
    cheapest first (layer 0's heads down to their floor of one page, then layer 1's head 0),
    unless alpha_safeguard protects each head's best alpha x 32 pairs (all 32 at 1.0)."""
    out = llm.generate([distinct_prompt(100, seed=0)], evicting(
        kv_press=kvpress.AdaKVPress(LayerHeadKnorm(), alpha_safeguard=alpha), max_tokens=2), use_tqdm=False)[0]
    assert ((out.kept_positions >= 0).sum(-1) - 1).tolist() == held   # the pairs kept, and the next token's
    assert llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks


@dataclasses.dataclass
class ExpectedAttentionWithDefaults(kvpress.ExpectedAttentionPress):
    """A press of one's own that keeps ExpectedAttention's score()."""
    n_sink: int = 2


@pytest.mark.parametrize("press, message", [
    (kvpress.PyramidKVPress(), "kv_press PyramidKVPress reads its own per-layer budgets"),   # SnapKV's score()
    (kvpress.ExpectedAttentionPress(), "kv_press ExpectedAttentionPress reads the hidden states of every position"),
    (ExpectedAttentionWithDefaults(), "kv_press ExpectedAttentionPress reads"),   # whose score() runs
    (kvpress.ObservedAttentionPress(), "reads the attention matrix"),
    (kvpress.KnormPress(compression_ratio=0.5), "compression_ratio is not read"),
    ({"name": "ChunkPress"}, "kv_press name must be one of kvpress's ScorerPresses"),
    ({"name": "KnormPress", "args": {"window": 3}}, "kv_press KnormPress args"),
    ({"press": "KnormPress"}, 'kv_press as an object must be {"name"'),
    (kvpress.AdaKVPress(kvpress.CompactorPress()), "kv_press CompactorPress reads the hidden states"),
    (kvpress.ChunkPress(kvpress.KnormPress()), "kv_press must be a kvpress ScorerPress or an AdaKVPress"),
])
def test_a_press_nanokv_cannot_run_is_a_clear_error(press, message):
    with pytest.raises((TypeError, ValueError), match=message.replace("(", r"\(")):
        SamplingParams(kv_press=press)


def test_a_press_that_reads_more_positions_than_the_engine_keeps_is_a_clear_error(llm):
    with pytest.raises(ValueError, match=r"kv_press SnapKVPress reads the layer inputs of its sequence's last 65 "
                                         r"positions, and the engine keeps 24 \(press_window\)"):
        llm.generate([[1, 2, 3]], SamplingParams(kv_press=kvpress.SnapKVPress()), use_tqdm=False)


@dataclasses.dataclass
class InputsRecorder(kvpress.KnormPress):
    """K-norm (which reads no hidden states), noting what each call for layer 0 is handed."""
    seen: list = dataclasses.field(default_factory=list)

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        if module.layer_idx == 0:
            self.seen.append((hidden_states[0], *(x[0] for x in kwargs["position_embeddings"])))
        return super().score(module, hidden_states, keys, values, attentions, kwargs)


@pytest.mark.parametrize("schedule, evictions", [("prefill", [32, 48, 64, 80, 96]), ("decode", [70, 86, 102])])
def test_a_press_is_handed_the_layer_inputs_of_its_sequence_s_last_positions(llm, tiny_models, schedule, evictions):
    """A press of one's own gets all the engine keeps (24 positions) before each eviction:
    layer 0's inputs are the input norm of the tokens' embeddings, whatever was evicted, and
    their position embeddings are HF's."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_models("qwen2"), dtype=torch.float32).eval()
    press = InputsRecorder()
    out = llm.generate([distinct_prompt(70, seed=3)], evicting(kv_press=press, kv_schedule=schedule),
                       use_tqdm=False)[0]
    tokens = torch.tensor([out.prompt_token_ids + out.token_ids])
    with torch.no_grad():
        inputs = hf.model.layers[0].input_layernorm(hf.model.embed_tokens(tokens))[0]
        cos, sin = (x[0] for x in hf.model.rotary_emb(inputs, torch.arange(tokens.shape[1])[None]))
    assert len(press.seen) == len(evictions)
    for (hidden, seen_cos, seen_sin), end in zip(press.seen, evictions):
        torch.testing.assert_close(hidden, inputs[end - 24:end])
        torch.testing.assert_close((seen_cos, seen_sin), (cos[end - 24:end], sin[end - 24:end]))
    assert out.kept_positions.shape[-1] <= 32 and llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks


def test_a_press_reading_hidden_states_takes_from_the_prefix_cache_only_what_comes_before_them(llm):
    """Its blocks cached by a full-cache request (evicting ones share none)."""
    params = evicting(kv_press=kvpress.SnapKVPress(window_size=16), kv_schedule="once", max_tokens=8)
    prompt = distinct_prompt(100, seed=4)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and 0 < again.num_cached_tokens <= 100 - 17
    assert again.token_ids == first.token_ids and torch.equal(again.kept_positions, first.kept_positions)


@dataclasses.dataclass
class WindowRecorder(kvpress.SnapKVPress):
    """SnapKV, noting the layer inputs each call for layer 0 is handed."""
    seen: list = dataclasses.field(default_factory=list)

    def score(self, module, hidden_states, *args):
        if module.layer_idx == 0:
            self.seen.append(hidden_states[0])
        return super().score(module, hidden_states, *args)


def test_a_press_reading_hidden_states_swapped_out_and_back_goes_on_as_in_a_roomy_pool(tiny_dir):
    """Decode-time evictions every 8 tokens read 9 positions' inputs: a sequence swapped out
    between two evictions comes back, in another row, with its window."""
    def run(**pool) -> tuple[list, list[WindowRecorder]]:
        presses = [WindowRecorder(window_size=8) for _ in range(5)]   # one per request: its copy shares the list
        params = preemption_params("knorm")
        params[1:] = [dataclasses.replace(p, kv_method=None, kv_press=press, kv_schedule="decode", evict_every=8)
                      for p, press in zip(params[1:], presses)]
        llm = LLM(str(tiny_dir), dtype="float32", max_model_len=112, press_window=9, **pool)
        return llm.generate(preemption_prompts(), params, use_tqdm=False), presses, llm.stats()
    roomy, roomy_presses, _ = run(num_kv_blocks=256)
    outs, presses, stats = run(num_kv_blocks=9, kv_offload_gb=0.01, preemption_mode="swap")
    assert stats.swaps > 0 and [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert all(torch.equal(a.kept_positions, b.kept_positions) for a, b in zip(outs[1:], roomy[1:]))
    for press, expected in zip(presses, roomy_presses):
        assert len(press.seen) == len(expected.seen) > 0
        for seen, want in zip(press.seen, expected.seen):
            torch.testing.assert_close(seen, want)


def test_a_press_is_the_ranking_not_a_method_s(llm):
    with pytest.raises(ValueError, match="kv_press is the request's ranking: kv_method must be None, got 'h2o'"):
        llm.generate([[1, 2, 3]], SamplingParams(kv_press=kvpress.KnormPress(), kv_method="h2o"), use_tqdm=False)


def test_a_press_by_name_and_args_as_json_gives_it():
    params = SamplingParams(kv_press={"name": "LagKVPress", "args": {"lag_size": 8}})
    assert params.kv_press == kvpress.LagKVPress(lag_size=8)
    adakv = {"name": "AdaKVPress", "args": {"press": {"name": "KnormPress"}, "alpha_safeguard": 0.5}}
    assert SamplingParams(kv_press=adakv).kv_press == kvpress.AdaKVPress(kvpress.KnormPress(), alpha_safeguard=0.5)


@dataclasses.dataclass
class NewestByIndex(kvpress.ScorerPress):
    """A press of one's own: keeps the pairs it is handed last, and checks that they come in
    position order (in the test below, each key's first element is its position)."""
    layers: list = dataclasses.field(default_factory=list)   # the layer_idx of each call

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        assert hidden_states is None and attentions is None and kwargs == {}
        assert (keys[..., 0].diff(dim=-1) > 0).all() and torch.equal(keys, values)
        assert module.config.num_attention_heads == 6 and module.head_dim == keys.shape[-1]
        self.layers.append(module.layer_idx)
        return torch.arange(keys.shape[2], dtype=keys.dtype).expand(keys.shape[:3])


def test_a_press_of_one_s_own_is_handed_the_pairs_in_position_order_and_its_choice_kept():
    """The pairs in slot order, which evictions that fill holes leave shuffled."""
    positions = torch.stack([torch.randperm(12) for _ in range(2 * 4 * 3)]).view(2, 4, 3, 12).int()   # [S, L, H, n]
    keys = positions[..., None].float().expand(*positions.shape, 8)
    check_press(NewestByIndex())
    ranking = PressRanking(NewestByIndex())
    held = HeldPairs(positions, torch.zeros(positions.shape), current=torch.full((2, 1, 1, 1), 11), key_norms=None,
                     num_evicted=5, keys_values=lambda: (keys, keys),
                     press_args=lambda s, i: (SimpleNamespace(layer_idx=2 + i, head_dim=8,
                                                              config=SimpleNamespace(num_attention_heads=6)), None, {}))
    evicted = lowest(ranking.keep_priority(held), positions, 5)
    assert (positions.gather(-1, evicted).sort(-1).values == torch.arange(5)).all()   # the oldest go
    assert ranking.press.layers == [2, 3, 4, 5] * 2   # each sequence's layers, as the model numbers them


@dataclasses.dataclass
class LayerRecorder(kvpress.KnormPress):
    """K-norm, noting the layer_idx of each call."""
    layers: list = dataclasses.field(default_factory=list)

    def score(self, module, *args):
        self.layers.append(module.layer_idx)
        return super().score(module, *args)


def test_a_press_ranked_a_layer_at_a_time_is_told_each_layer_s_index(tiny_models, monkeypatch):
    """Eviction in pieces of one layer of one sequence (the least memory): each call names the
    model's layer, not the piece's."""
    monkeypatch.setattr(evict, "PIECE_BYTES", 1)
    llm = LLM(str(tiny_models("qwen2")), dtype="float32", num_kv_blocks=64, max_model_len=256)
    press = LayerRecorder()   # each request ranks with its own copy, which shares the list
    llm.generate([distinct_prompt(70, seed=0), distinct_prompt(90, seed=1)], evicting(kv_press=press, max_tokens=2),
                 use_tqdm=False)
    assert press.layers == [0, 1, 0, 1]


def test_the_engine_s_press_is_every_request_s_ranking_unless_it_names_its_own(tiny_models):
    llm = LLM(str(tiny_models("qwen2")), dtype="float32", num_kv_blocks=64, max_model_len=256,
              kv_press={"name": "KnormPress"}, kv_budget=32)
    prompt = [distinct_prompt(70, seed=0)]
    pressed, knorm = (llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, return_kept_positions=True,
                                                          **method), use_tqdm=False)[0]
                      for method in ({}, {"kv_method": "knorm"}))   # a request's own method takes no press
    assert torch.equal(pressed.kept_positions, knorm.kept_positions) and pressed.kept_positions.shape[-1] == 34
