"""From a model name to a ready Decoder: resolve the checkpoint, stream its weights.

Weights are read tensor by tensor from the safetensors files straight into
the model's (pre-allocated, uninitialised) parameters, cast on the way, so
memory never holds two full copies of the model.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from models import Decoder
from models.config import ModelConfig
from models.shapes import RANDOM_PREFIX, fill_random
from models.tensor_parallel import Shard, local_config, shard_index

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def resolve_model_path(model: str | None) -> Path:
    """None -> the bundled model; an existing directory -> itself; 'org/name' -> the hub."""
    if model is None:
        from models.gguf_convert import bundled_model_dir
        return bundled_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or not HUB_ID.match(str(model)):
        raise FileNotFoundError(
            f"model {model!r} is neither a local model directory nor a hub id like 'org/name'")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(
            str(model), allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"]))
    except Exception as e:  # offline, unknown repo, gated repo: all end here
        raise OSError(f"could not get {model!r} from the Hugging Face hub: {e}. "
                      "Pass a local model directory instead, or check the network.") from e


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    return files


def _destination(name: str, cfg: ModelConfig) -> tuple[str, int] | None:
    """HF tensor name -> (our parameter name, row offset into it), or None to skip.

    q/k/v land in the fused qkv_proj and gate/up in the fused gate_up_proj, at
    their row offsets.
    """
    name = name.removeprefix("model.")
    if "rotary_emb" in name:
        return None
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", q), "v_proj": ("qkv_proj", q + kv),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", cfg.intermediate_size)}
    for part, (whole, offset) in fused.items():
        if f".{part}." in name:
            return name.replace(part, whole), offset
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None
    return name, 0


def _parts(name: str, cfg: ModelConfig) -> list[tuple[str, range | None]]:
    """A checkpoint tensor as the tensors _destination knows, each with its rows in it (None:
    all): Phi-3's fused qkv_proj and gate_up_proj are cut into q/k/v and gate/up, so that a rank
    of a split model takes its heads' rows of each (cfg: the whole model's shape)."""
    q, kv, mlp = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    if ".qkv_proj." in name:
        return [(name.replace("qkv_proj", "q_proj"), range(q)), (name.replace("qkv_proj", "k_proj"), range(q, q + kv)),
                (name.replace("qkv_proj", "v_proj"), range(q + kv, q + 2 * kv))]
    if ".gate_up_proj." in name:
        return [(name.replace("gate_up_proj", "gate_proj"), range(mlp)),
                (name.replace("gate_up_proj", "up_proj"), range(mlp, 2 * mlp))]
    return [(name, None)]


def load_weights(model: Decoder, path: Path, whole: ModelConfig) -> None:
    """Copy every checkpoint tensor (or, for a rank of a split model, its part of it: whole is
    the model's shape, models/tensor_parallel.py) into its place; fail clearly on a bad file
    or a gap."""
    params = dict(model.named_parameters())
    rows_loaded = {name: 0 for name in params}
    for file in _safetensors_files(path):
        try:
            with safe_open(file, framework="pt") as f:
                for name, part, rows in ((name, *part) for name in f.keys() for part in _parts(name, whole)):
                    dest = _destination(part, model.config)
                    if dest is None:
                        continue
                    target, offset = dest
                    if target not in params:
                        raise ValueError(f"{file.name}: unexpected tensor {name!r} for this architecture")
                    index = shard_index(part, whole, model.shard)
                    if rows is not None:   # this rank's rows of the part, in the fused tensor
                        rows = rows[index[0]]
                        index = (slice(rows.start, rows.stop),)
                    tensor = f.get_slice(name)[index]
                    param = params[target]
                    piece = param.data[offset:offset + tensor.shape[0]]
                    if piece.shape != tensor.shape:
                        raise ValueError(f"{file.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                         f"the config implies {tuple(piece.shape)}")
                    piece.copy_(tensor)
                    rows_loaded[target] += tensor.shape[0]
        except torch.OutOfMemoryError as e:   # a RuntimeError too, but not the file's fault
            raise torch.OutOfMemoryError(
                f"out of memory while loading {file.name} onto the device: the model does not fit next to what is "
                f"already there; use a smaller dtype or model, or free memory ({e})") from e
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"cannot read weights from {file}: {e}. The file may be truncated "
                             "or corrupt: delete it and download it again.") from e
    missing = [n for n, p in params.items() if rows_loaded[n] != p.shape[0]]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks weights for {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def load_model(source: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               max_len: int, shard: Shard = Shard()) -> Decoder:
    """The model of cfg's shape, or shard's part of it, with the weights of source: a checkpoint
    directory, or "random:<shape>" for random ones (models/shapes.py)."""
    with torch.device("meta"):  # shapes only: no memory, no random init
        model = Decoder(local_config(cfg, shard.size), max_len, shard).to(dtype)
    model = model.to_empty(device=device)
    if str(source).startswith(RANDOM_PREFIX):
        fill_random(model)
    else:
        load_weights(model, Path(source), cfg)
    model.cos_sin = model.cos_sin.to(device)
    return model.eval().requires_grad_(False)
