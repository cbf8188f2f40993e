"""Our decoder, run through the paged cache, against HF transformers (fp32)."""
import pytest
import torch

from helpers import FAMILIES, VOCAB, make_tiny_model
from nanokv import LLM, SamplingParams
from nanokv.eviction import METHODS, RANKINGS
from nanokv.engine.scheduler import ScheduledBatch
from nanokv.engine.sequence import Sequence

TOL = 1e-3


def engine_logits(llm: LLM, seq: Sequence, n: int) -> torch.Tensor:
    """Run seq's next n tokens through the real runner path; logits of every row."""
    need = llm.blocks.blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
    seq.block_table.extend(llm.blocks.allocate(need))
    step = llm.runner.prepare(ScheduledBatch([seq], [n]))
    with torch.inference_mode():
        hidden = llm.runner.model(step.input_ids, step.positions, llm.runner.kv_cache, step.meta)
        logits = llm.runner.model.compute_logits(hidden)
    seq.num_computed_tokens += n
    seq.num_kv_slots += n
    return logits


def hf_greedy(hf, prompt: list[int], n: int, logprobs: list[float] | None = None) -> list[int]:
    """transformers' greedy decoding with its own KV cache, never stopping at EOS (as its
    generate() runs: the prompt in one forward pass, then a token a pass); logprobs, if given,
    gets each token's log-probability."""
    tokens = []
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            if logprobs is not None:
                logprobs.append(out.logits[0, -1].float().log_softmax(-1)[tokens[-1]].item())
            out = hf(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def check_prefill_and_decode(llm: LLM, hf, prompt: list[int], steps: int = 16) -> None:
    seq = Sequence(0, prompt, SamplingParams(temperature=0), block_table=llm.scheduler.block_tables.new([]))
    ours = engine_logits(llm, seq, len(prompt))
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0].float()
    assert (ours - theirs).abs().max().item() <= TOL
    for _ in range(steps):
        seq.output_token_ids.append(int(ours[-1].argmax()))
        ours = engine_logits(llm, seq, 1)
        with torch.no_grad():
            theirs = hf(torch.tensor([seq.token_ids])).logits[0, -1:].float()
        assert (ours - theirs).abs().max().item() <= TOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_models_match_transformers(tmp_path, family):
    hf = make_tiny_model(tmp_path, family, tied=family in ("llama", "qwen3"))
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=32, max_model_len=256)
    prompt = torch.randint(0, VOCAB, (64,)).tolist()
    check_prefill_and_decode(llm, hf, prompt)


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_tiny_model(tmp_path, "qwen2", max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=32, max_model_len=256)
    check_prefill_and_decode(llm, hf, torch.randint(0, VOCAB, (40,)).tolist(), steps=2)


def test_bundled_model_matches_transformers(bundled_dir):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(bundled_dir, dtype=torch.float32).eval()
    llm = LLM(str(bundled_dir), dtype="float32", num_kv_blocks=64, max_model_len=512)
    prompt = llm.tokenizer.encode("The history of the Roman Empire spans many centuries, from the "
                                  "founding of the city to the fall of Constantinople. " * 3)[:64]
    assert len(prompt) == 64
    check_prefill_and_decode(llm, hf, prompt)


def test_greedy_matches_transformers_in_a_mixed_batch(bundled_dir):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(bundled_dir, dtype=torch.float32).eval()
    llm = LLM(str(bundled_dir), dtype="float32", num_kv_blocks=128, max_model_len=512)
    prompts = ["The capital of France is", "def fibonacci(n):\n    ",
               "Once upon a time, in a land far away, there lived a dragon who",
               "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, llm.tokenizer.encode(prompt), 32), prompt


def test_phi3_long_rope_picks_its_factors_as_transformers_generate_does(tmp_path):
    """Phi-3's fused q/k/v and gate/up, and LongRoPE (original length 32): a prompt within it runs
    on the short factors and its tokens from position 32 on on the long ones; a longer prompt on
    the long ones throughout, read in one pass or in chunks of 16, alone or in one batch."""
    hf = make_tiny_model(tmp_path, "phi3")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (20, 32, 33, 70)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    expected = []
    for prompt in prompts:
        logprobs = []
        expected.append((hf_greedy(hf, prompt, 24, logprobs), logprobs))
    for chunk in (256, 16):
        llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=chunk)
        batched = llm.generate(prompts, params)
        alone = [llm.generate([prompt], params)[0] for prompt in prompts]
        for outs in (batched, alone):
            for out, (tokens, logprobs) in zip(outs, expected):
                assert out.token_ids == tokens
                assert max(abs(e.logprob - lp) for e, lp in zip(out.logprobs, logprobs)) <= 1e-4


def test_phi3_runs_every_eviction_method(tiny_models):
    """Multi-head (a query head a KV head), every method in one batch: each runs, and under
    Batch-Max's schedule each ranking keeps at most |kv| pairs per head (kvcompress: on average
    over its heads)."""
    llm = LLM(str(tiny_models("phi3")), dtype="float32", num_kv_blocks=128, max_model_len=256)
    methods = [m for m in METHODS if m != "full"]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, kv_method=method, kv_budget=32,
                             evict_every=16, return_kept_positions=True,
                             **(dict(kv_window=8) if method == "snapkv" else {}),
                             **(dict(kv_schedule="prefill") if method in RANKINGS else {}))
              for method in methods for _ in range(2)]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for _ in methods for n in (30, 60)]
    for method, out in zip([m for m in methods for _ in range(2)], llm.generate(prompts, params)):
        assert len(out.token_ids) == 20
        kept = (out.kept_positions >= 0).sum(-1)   # [layers, kv heads]
        assert kept.min() > 0
        if method in RANKINGS:
            assert (kept.float().mean() if method == "kvcompress" else kept.max()) <= 32, method
    assert llm.blocks.num_free == llm.blocks.num_blocks
