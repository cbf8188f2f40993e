"""Log-probabilities of sampled and prompt tokens, against HF transformers on the bundled model."""
import pytest
import torch

from nanokv import LLM, SamplingParams

PROMPT = "The Eiffel Tower is a wrought-iron lattice tower in Paris. It was built"
K = 5


@pytest.fixture(scope="module")
def llm(bundled_dir):
    return LLM(str(bundled_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)


@pytest.fixture(scope="module")
def hf_logprobs(bundled_dir):
    """log_softmax of HF's fp32 logits at every position of a token sequence."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(bundled_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].log_softmax(dim=-1)
    return run


def check_entry(entry, token: int, expected: torch.Tensor) -> None:
    """entry is token's log-probability under expected (a row of log-probabilities), with its top K."""
    top_lps, top_tokens = expected.topk(K)
    assert entry.token == token
    assert entry.logprob == pytest.approx(expected[token].item(), abs=1e-4)
    assert (entry.top_token, entry.top_logprob) == (top_tokens[0].item(), pytest.approx(top_lps[0].item(), abs=1e-4))
    assert [t for t, _ in entry.top] == top_tokens.tolist()
    assert [lp for _, lp in entry.top] == pytest.approx(top_lps.tolist(), abs=1e-4)
    assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.7, top_p=0.8, seed=3)],
                         ids=["greedy", "sampled"])
def test_output_and_prompt_logprobs_equal_hf_full_model(llm, hf_logprobs, params):
    """Before temperature and top-p: the model's own distribution at each step, as OpenAI reports it."""
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=K, prompt_logprobs=True,
                                              **params))[0]
    prompt = out.prompt_token_ids
    expected = hf_logprobs(prompt + out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == 8
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        check_entry(entry, token, expected[len(prompt) - 1 + i])
    assert out.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        check_entry(out.prompt_logprobs[j], prompt[j], expected[j - 1])
    if params["temperature"] == 0:   # greedy: the sampled token is the most likely one
        assert all(entry.top[0][0] == entry.token for entry in out.logprobs)


def test_logprobs_zero_gives_the_token_alone_and_none_gives_nothing(llm):
    asked, not_asked = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=3, temperature=0, logprobs=0),
                                                       SamplingParams(max_tokens=3, temperature=0)])
    assert [e.top for e in asked.logprobs] == [[], [], []]
    assert [e.token for e in asked.logprobs] == asked.token_ids
    assert not_asked.logprobs is None and not_asked.prompt_logprobs is None
    assert asked.token_ids == not_asked.token_ids


def test_streamed_outputs_carry_the_logprobs_so_far(llm):
    request = llm.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=0, logprobs=2))
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
    # read once the request has ended: each output still holds what it had when it was handed out
    assert [out.request_id for out in outs] == [request] * 4
    assert [len(out.logprobs) for out in outs] == [len(out.token_ids) for out in outs] == [1, 2, 3, 4]
    assert all([e.token for e in out.logprobs] == out.token_ids for out in outs)


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (21, ValueError), (1.5, TypeError), (True, TypeError)])
def test_logprobs_outside_its_range_is_refused(bad, error):
    with pytest.raises(error, match=r"logprobs must be None or an integer in \[0, 20\], got"):
        SamplingParams(logprobs=bad)


def test_under_eviction_they_are_the_evicted_caches(llm):
    """kv_schedule decode: the prompt is read whole (the first token's logprobs equal full's),
    then the cache is cut to 32 pairs a head and what follows is the evicted cache's."""
    prompt = PROMPT * 4
    full = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True))[0]
    evicted = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True,
                                                  kv_method="tova", kv_budget=32, evict_every=8,
                                                  kv_schedule="decode"))[0]
    assert (evicted.logprobs[0].token, evicted.logprobs[0].logprob) == (full.logprobs[0].token,
                                                                      pytest.approx(full.logprobs[0].logprob, abs=1e-4))
    assert all(e.token == e.top[0][0] for e in evicted.logprobs)
    assert max(abs(e.logprob - f.logprob) for e, f in zip(evicted.logprobs[1:], full.logprobs[1:])) > 1e-3
