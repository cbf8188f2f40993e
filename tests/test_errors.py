"""Bad input gets a clear error, and the engine goes on serving everyone else."""
import json
import shutil

import pytest

from helpers import VOCAB, make_tiny_model
from nanokv import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model(path, "qwen2")
    return path


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


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(stop=[""]), "stop strings must be non-empty"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


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
                                         "Qwen2ForCausalLM, Qwen3ForCausalLM"):
        LLM(str(tmp_path))


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
