"""The CPU backend's prepacked linear layers against F.linear (their reference)."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import kernels
from helpers import make_tiny_model
from kernels.linear_cpu import PACKED_ROWS, PackedLinear, _onednn_runs, can_prepack, prepack_linears
from models.config import ModelConfig
from models.loader import load_model
from nanokv import LLM

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")

# (rtol, atol) for outputs of magnitude ~sqrt(in_features): the two libraries sum in different orders.
TOL = {torch.float32: (1e-5, 2e-5), torch.bfloat16: (1.6e-2, 5e-2)}
ROWS = [1, 3, PACKED_ROWS.start, 8, PACKED_ROWS.stop - 1, PACKED_ROWS.stop, 200]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("rows", ROWS)
def test_packed_linear_matches_f_linear(rows, dtype, bias):
    """Both of its paths: F.linear outside PACKED_ROWS, oneDNN's packed weight inside."""
    if not _onednn_runs(dtype):
        pytest.skip(f"this CPU's oneDNN refuses {dtype}")
    weight = torch.randn(96, 80, dtype=dtype)
    b = torch.randn(96, dtype=dtype) if bias else None
    x = torch.randn(rows, 80, dtype=dtype)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(PackedLinear(weight, b)(x), F.linear(x, weight, b), rtol=rtol, atol=atol)


def test_prepack_replaces_the_linears_it_can():
    """Nested linears are packed in place; a float64 one (oneDNN has no float64) stays as it is."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 4, bias=False)),
                          nn.Linear(4, 4).double())
    x = torch.randn(8, 8)
    expected = model[1](model[0](x))
    prepack_linears(model)
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][1], PackedLinear)
    assert isinstance(model[2], nn.Linear) and not can_prepack(model[2].weight)
    torch.testing.assert_close(model[1](model[0](x)), expected, rtol=1e-5, atol=1e-5)


def test_a_cpu_that_refuses_a_dtype_keeps_its_weights_plain(monkeypatch):
    """oneDNN refuses bfloat16 and float16 on CPUs without the instructions for them (a
    RuntimeError): the probe finds out once, and those linears stay as they are."""
    def refuse(*args):
        raise RuntimeError("mkldnn_linear: bf16 path needs the cpu support avx_ne_convert or avx512bw, ...")
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", refuse)
    _onednn_runs.cache_clear()
    try:
        model = nn.Sequential(nn.Linear(8, 8).bfloat16())
        prepack_linears(model)
        assert type(model[0]) is nn.Linear
    finally:
        _onednn_runs.cache_clear()   # the next test probes the real op again


def test_a_prepacked_model_computes_the_same_logits(tmp_path):
    """Every projection (qkv with its bias) and the tied output head: a packed copy of the
    embedding table, which itself stays a plain parameter for the lookups."""
    make_tiny_model(tmp_path, "qwen2", tied=True)
    cfg = ModelConfig.from_dir(tmp_path)
    plain, packed = (load_model(tmp_path, cfg, torch.float32, torch.device("cpu"), 64) for _ in range(2))
    packed.prepack_linears()
    assert isinstance(packed.lm_head, PackedLinear) and packed.lm_head.weight is packed.embed_tokens.weight
    hidden = torch.randn(8, cfg.hidden_size)
    for module in ("compute_logits", "layers.0.self_attn.qkv_proj", "layers.1.mlp"):
        ours, theirs = (m.get_submodule(module) if "." in module else getattr(m, module) for m in (packed, plain))
        torch.testing.assert_close(ours(hidden), theirs(hidden), rtol=1e-5, atol=1e-5)


def test_only_the_cpu_backend_packs(tmp_path):
    make_tiny_model(tmp_path, "llama")
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_gb=0.01)
    assert isinstance(llm.runner.model.layers[0].mlp.down_proj, PackedLinear) == kernels.packs_weights(llm.runner.device)
