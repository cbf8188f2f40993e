"""Bad input gets a clear error, and the engine goes on serving everyone else."""
import json
import shutil

import pytest
import torch

import kernels
from helpers import VOCAB
from models.config import ModelConfig
from models.shapes import SHAPES
from nanokv import LLM, SamplingParams
from nanokv.config import EngineConfig
from nanokv.tokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tiny_dir(tiny_models):
    return tiny_models("qwen2")


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", num_kv_blocks=64, max_model_len=128)


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt is empty"),
    ([], "prompt is empty"),
    ([5] * 128, "max_model_len=128"),
    ([5, VOCAB, 7], f"token id {VOCAB} is outside the vocabulary"),
    ([5, -1], "token id -1 is outside the vocabulary"),
    (3.5, "string or a list of token ids"),
    ([True, False], r"prompt: token ids are integers, got True \(bool\)"),
    ([5, 2.0], r"prompt: token ids are integers, got 2.0 \(float\)"),
])
def test_bad_prompts_are_refused_and_others_still_complete(llm, prompt, message):
    good = llm.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    with pytest.raises((ValueError, TypeError), match=message):
        llm.add_request(prompt, SamplingParams())
    with pytest.raises((ValueError, TypeError), match=message):
        llm.generate([[1, 2], prompt])
    finished = []
    while llm.has_unfinished():
        finished += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in finished] == [good] and len(finished[0].token_ids) == 4


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(max_tokens=0), ValueError, "max_tokens must be an integer >= 1, got 0"),
    (dict(max_tokens=True), TypeError, "max_tokens must be an integer >= 1, got True"),
    (dict(temperature=-0.1), ValueError, "temperature must be a finite number >= 0, got -0.1"),
    (dict(temperature=float("nan")), ValueError, "temperature must be a finite number >= 0, got nan"),
    (dict(temperature=float("inf")), ValueError, "temperature must be a finite number >= 0, got inf"),
    (dict(temperature="hot"), TypeError, "temperature must be a finite number >= 0, got 'hot'"),
    (dict(temperature=True), TypeError, "temperature must be a finite number >= 0, got True"),
    (dict(top_p=0.0), ValueError, r"top_p must be a finite number in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), ValueError, r"top_p must be a finite number in \(0, 1\], got 1.5"),
    (dict(top_p=float("nan")), ValueError, r"top_p must be a finite number in \(0, 1\], got nan"),
    (dict(top_k=-1), ValueError, "top_k must be an integer >= 0, got -1"),
    (dict(top_k=2.0), TypeError, "top_k must be an integer >= 0, got 2.0"),
    (dict(seed=2**70), ValueError, r"seed must be None or an integer in \[-9223372036854775808, "
                                   r"18446744073709551615\], got 1180591620717411303424"),
    (dict(seed="7"), TypeError, "seed must be None or an integer in"),
    (dict(ignore_eos="yes"), TypeError, "ignore_eos must be True or False, got 'yes'"),
    (dict(stop_token_ids=[True]), TypeError, r"stop_token_ids: token ids are integers, got True \(bool\)"),
    (dict(stop_token_ids=5), TypeError, "stop_token_ids must be a list of token ids, got 5"),
    (dict(stop=[""]), ValueError, r"stop strings must be non-empty, got \[''\]"),
    (dict(stop=""), ValueError, "stop strings must be non-empty"),
    (dict(stop=["a", None]), TypeError, r"stop must be a string or a list of strings, got \['a', None\]"),
    (dict(stop=3), TypeError, "stop must be a string or a list of strings, got 3"),
    (dict(kv_method=3), TypeError, "unknown kv_method 3; use one of full, batchmax, h2o, tova, snapkv, streamingllm, knorm, kvcompress, decode_only, ed or None"),
    (dict(kv_budget=True), TypeError, "kv_budget must be None or an integer >= 1, got True"),
    (dict(kv_budget=0), ValueError, "kv_budget must be None or an integer >= 1, got 0"),
    (dict(evict_every=1.5), TypeError, "evict_every must be None or an integer >= 1, got 1.5"),
    (dict(return_kept_positions=1), TypeError, "return_kept_positions must be True or False, got 1"),
    (dict(prompt_logprobs=None), TypeError, "prompt_logprobs must be True or False, got None"),
])
def test_bad_sampling_params(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_at_the_edges_are_accepted():
    SamplingParams(temperature=0, top_p=1, top_k=0, seed=-2**63, stop="x", stop_token_ids=(1, 2))
    SamplingParams(temperature=2.5, top_p=1e-9, seed=2**64 - 1, kv_method="ed", kv_budget=2, evict_every=1)


def test_stop_token_ids_outside_the_vocabulary_and_params_changed_after_construction(llm):
    with pytest.raises(ValueError, match=fr"stop_token_ids: token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"):
        llm.add_request([1, 2], SamplingParams(stop_token_ids=[5, VOCAB]))
    params = SamplingParams()
    params.temperature = float("nan")   # checked again when queued
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got nan"):
        llm.generate([[1, 2]], params)
    assert not llm.has_unfinished() and not llm.requests


def test_unknown_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a local model directory nor a hub id"):
        LLM(str(tmp_path / "no-such-model"))


def test_hub_id_while_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="could not get 'nobody-here/no-such-model' from the Hugging Face hub"):
        LLM("nobody-here/no-such-model")


def test_unsupported_architecture(tmp_path, tiny_dir):
    shutil.copytree(tiny_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supports LlamaForCausalLM, MistralForCausalLM, "
                                         "Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("change, message", [
    (dict(partial_rotary_factor=0.75), "partial_rotary_factor 0.75 is not supported: nanokv rotates every dimension"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0}), "unsupported rope_scaling type 'yarn'; nanokv supports "
                                                         "default, linear, llama3, longrope")])
def test_unsupported_rope(change, message):
    config = dict(SHAPES["phi-3.5-mini"], **change)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(config)


def test_phi3_s_first_name_for_long_rope_and_its_factor():
    """Phi-3's first configs say "su"; the length factor, when not given, is the ratio of the lengths."""
    config = dict(SHAPES["phi-3.5-mini"])
    config["rope_scaling"] = {k: v for k, v in config["rope_scaling"].items() if k != "rope_type"} | {"type": "su"}
    scaling = ModelConfig.from_hf(config).rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["factor"] == 131072 / 4096
    assert scaling["original_max_position_embeddings"] == 4096


def test_missing_tokenizer(tmp_path, tiny_dir):
    shutil.copytree(tiny_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(tmp_path, tiny_dir, damage):
    shutil.copytree(tiny_dir, tmp_path, dirs_exist_ok=True)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64 + data[64:])
    with pytest.raises(ValueError, match="model.safetensors.*truncated or corrupt"):
        LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, max_model_len=128)


def test_running_out_of_memory_while_loading_is_not_a_corrupt_file(tiny_dir, monkeypatch):
    """torch.OutOfMemoryError is a RuntimeError, which a damaged file raises too: it must
    still say memory, not blame the checkpoint."""
    import models.loader

    real_open = models.loader.safe_open

    class FullDevice:
        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_slice(self, name):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(models.loader, "safe_open", FullDevice)
    with pytest.raises(torch.OutOfMemoryError, match="out of memory while loading model.safetensors onto the "
                                                     "device: the model does not fit") as raised:
        LLM(str(tiny_dir), dtype="float32", num_kv_blocks=64, max_model_len=128)
    assert "corrupt" not in str(raised.value)


def test_missing_weights(tmp_path, tiny_dir):
    from safetensors.torch import load_file, save_file
    shutil.copytree(tiny_dir, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks weights for layers.1.mlp.gate_up_proj.weight"):
        LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, max_model_len=128)


def test_kv_budget_too_small_for_one_sequence(tiny_dir):
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=128"):
        LLM(str(tiny_dir), dtype="float32", num_kv_blocks=7, block_size=16, max_model_len=128)


def test_unknown_engine_option_and_dtype(tiny_dir):
    with pytest.raises(TypeError, match="unknown engine option.*max_batch"):
        LLM(str(tiny_dir), max_batch=3)
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        LLM(str(tiny_dir), dtype="float8")


@pytest.mark.parametrize("options, error, message", [
    (dict(block_size=12), ValueError, "block_size must be a power of two, got 12"),
    (dict(block_size=0), ValueError, "block_size must be an integer >= 1, got 0"),
    (dict(block_size=True), TypeError, "block_size must be an integer >= 1, got True"),
    (dict(num_kv_blocks=0), ValueError, "num_kv_blocks must be None or an integer >= 1, got 0"),
    (dict(kv_cache_gb=0), ValueError, "kv_cache_gb must be None or a finite number > 0, got 0"),
    (dict(kv_cache_gb=float("nan")), ValueError, "kv_cache_gb must be None or a finite number > 0, got nan"),
    (dict(kv_cache_gb="1"), TypeError, "kv_cache_gb must be None or a finite number > 0, got '1'"),
    (dict(gpu_memory_utilization=1.5), ValueError, r"gpu_memory_utilization must be a finite number in \(0, 1\]"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs must be an integer >= 1, got 0"),
    (dict(max_num_seqs=2.5), TypeError, "max_num_seqs must be an integer >= 1, got 2.5"),
    (dict(max_num_batched_tokens=8), ValueError, "max_num_batched_tokens must be at least block_size = 16, got 8"),
    (dict(max_model_len=1), ValueError, "max_model_len must be None or an integer >= 2, got 1"),
    (dict(seed=2**64), ValueError, r"seed must be an integer in \[-9223372036854775808, 18446744073709551615\]"),
    (dict(seed=None), TypeError, "seed must be an integer in"),
    (dict(enforce_eager="no"), TypeError, "enforce_eager must be True or False, got 'no'"),
    (dict(enable_prefix_caching=1), TypeError, "enable_prefix_caching must be True or False, got 1"),
    (dict(kv_method=1), TypeError, "unknown kv_method 1; use one of full, batchmax, h2o, tova, snapkv, streamingllm, knorm, kvcompress, decode_only, ed or None"),
    (dict(kv_budget=True), TypeError, "kv_budget must be None or an integer >= 1, got True"),
    (dict(evict_every=0), ValueError, "evict_every must be None or an integer >= 1, got 0"),
    (dict(device=0), TypeError, r"device must be None or a device \('cuda', 'cpu', ...\), got 0"),
    (dict(dtype=16), TypeError, "dtype must be a torch.dtype or its name, got 16"),
    (dict(kv_cache_dtype="int4"), ValueError, "unknown kv_cache_dtype 'int4'; use one of auto, int8, fp8"),
    (dict(kv_cache_dtype=torch.int8), TypeError, "unknown kv_cache_dtype torch.int8; use one of auto, int8, fp8"),
])
def test_bad_engine_options(tiny_dir, options, error, message):
    with pytest.raises(error, match=message):
        EngineConfig(**options)
    with pytest.raises(error, match=message):   # before anything is loaded
        LLM(str(tiny_dir), **options)


def test_an_fp8_cache_needs_torch_float8(monkeypatch, tiny_dir):
    import nanokv.config

    monkeypatch.setitem(nanokv.config.KV_CACHE_DTYPES, "fp8", None)   # as a torch built without float8
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs torch.float8_e4m3fn, which torch .* lacks; "
                                         "use 'int8' or 'auto'"):
        LLM(str(tiny_dir), kv_cache_dtype="fp8")


def test_block_size_any_power_of_two_on_the_references_at_least_16_with_triton(tiny_dir):
    before = kernels.forced_backend()
    try:
        kernels.set_backend("torch")
        small = LLM(str(tiny_dir), dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=128)
        assert len(small.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids) == 8
        kernels.set_backend("triton")
        with pytest.raises(ValueError, match="block_size must be >= 16 with the Triton kernels, got 8"):
            LLM(str(tiny_dir), block_size=8)
    finally:
        kernels.set_backend(before)


# ----- a request that fails inside the engine ends alone ---------------------------------

PROMPTS = [[1, 2, 3], [7, 7, 7], [4, 5, 6, 8, 9]]   # the middle one is made to fail
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def break_detokenizer(monkeypatch, prompt, after):
    """The detokenizer of requests with this prompt raises on their output token after+1."""
    add = IncrementalDetokenizer.add

    def failing_add(self, new_ids):
        if self.ids[:len(prompt)] == prompt and len(self.ids) + len(new_ids) > len(prompt) + after:
            raise RuntimeError("detokenizer broke")
        return add(self, new_ids)
    monkeypatch.setattr(IncrementalDetokenizer, "add", failing_add)


def assert_engine_is_clean(llm):
    assert llm.blocks.num_free == llm.blocks.num_blocks
    assert not llm.has_unfinished() and not llm.requests


def test_a_request_that_fails_while_detokenizing_ends_alone(llm, monkeypatch):
    """Streamed, it fails at the token that breaks the detokenizer; under generate() its text
    is decoded when it finishes, so it fails then, with all its tokens."""
    clean = llm.generate(PROMPTS, GREEDY)
    break_detokenizer(monkeypatch, PROMPTS[1], after=4)
    outs = llm.generate(PROMPTS, GREEDY)   # returns, with the failed request's output
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    streamed = {}
    while llm.has_unfinished():
        streamed.update({o.request_id: o for o in llm.step() if o.finished})
    for broken, tokens in ((outs[1], clean[1].token_ids), (streamed[ids[1]], clean[1].token_ids[:5])):
        assert broken.finished and broken.finish_reason == "error"
        assert broken.error == "RuntimeError: detokenizer broke"
        assert broken.token_ids == tokens and clean[1].text.startswith(broken.text)
    for i in (0, 2):
        for out in (outs[i], streamed[ids[i]]):
            assert (out.token_ids, out.text, out.error) == (clean[i].token_ids, clean[i].text, None)
    assert_engine_is_clean(llm)
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in clean]


def test_a_request_whose_stop_string_check_raises_ends_alone_while_streaming(llm):
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["\x00\x01"]) for _ in PROMPTS]
    clean = llm.generate(PROMPTS, params)
    ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    streamed = [o for _ in range(3) for o in llm.step()]
    seen = max(len(o.token_ids) for o in streamed if o.request_id == ids[1])
    params[1].stop = [None]   # matching it raises TypeError
    finished = [o for o in streamed if o.finished]
    while llm.has_unfinished():
        finished += [o for o in llm.step() if o.finished]
    outs = {o.request_id: o for o in finished}
    assert len(finished) == 3 and outs[ids[1]].finish_reason == "error"
    assert outs[ids[1]].error.startswith("TypeError") and len(outs[ids[1]].token_ids) == seen + 1
    assert [outs[ids[i]].token_ids for i in (0, 2)] == [clean[0].token_ids, clean[2].token_ids]
    assert_engine_is_clean(llm)


def test_a_request_the_sampler_fails_on_ends_alone(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    broken = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    clean = llm.generate(PROMPTS, [greedy, broken, seeded])
    ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, [greedy, broken, seeded])]
    llm.step()
    broken.top_k = "five"   # a bug that makes sampling its row raise
    outs = {}
    while llm.has_unfinished():
        outs |= {o.request_id: o for o in llm.step() if o.finished}
    assert outs[ids[1]].finish_reason == "error" and len(outs[ids[1]].token_ids) == 1
    assert outs[ids[0]].token_ids == clean[0].token_ids and outs[ids[2]].token_ids == clean[2].token_ids
    assert_engine_is_clean(llm)
