"""DecodeGraphs' bookkeeping (static buffers, padding to a bucket, the graph with or
without scores) checked on the CPU: "capturing" records the forward pass and
"replaying" runs it again on whatever the static buffers then hold, which is what
a CUDA graph does. The real capture runs in the gpu-marked tests."""
import contextlib

import pytest
import torch

from helpers import VOCAB, make_tiny_model
from nanokv import LLM, SamplingParams
from nanokv.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes


class RecordedGraph:
    def __init__(self):
        self.forward = None

    def pool(self):
        return None

    def replay(self):
        self.forward()


@pytest.fixture
def recorded_graphs(monkeypatch):
    capturing = []

    @contextlib.contextmanager
    def capture(graph, pool=None):
        capturing.append(graph)
        yield
        capturing.pop()

    real_forward = DecodeGraphs._forward

    def forward(self, bs, scores):
        if capturing:
            capturing[-1].forward = lambda: real_forward(self, bs, scores)
        real_forward(self, bs, scores)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", RecordedGraph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(DecodeGraphs, "_forward", forward)


def test_bucket_sizes():
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(3) == [1, 2, 3]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_replayed_decode_steps_match_eager(tmp_path, recorded_graphs, kv_cache_dtype):
    make_tiny_model(tmp_path, "llama")
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (5, 30, 47, 64, 90, 70)]
    methods = [dict(kv_method=m) for m in ("full", "batchmax", "full", "ed", "decode_only")]
    methods.append(dict(kv_method="kvcompress", kv_score_all=True))   # squared scores, score_skip
    params = [SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, kv_budget=32, evict_every=16,
                             return_kept_positions=m["kv_method"] != "full", **m) for m in methods]

    def run(llm, prompts, params):   # the tokens, and the positions each evicting request kept
        return [(o.token_ids, o.kept_positions is not None and o.kept_positions.tolist())
                for o in llm.generate(prompts, params)]
    outs, scores = [], []
    for graphed in (False, True):
        llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, max_model_len=160, max_num_seqs=12,
                  kv_cache_dtype=kv_cache_dtype)
        if graphed:
            llm.runner.graphs = DecodeGraphs(llm.runner.model, llm.runner.kv_cache, llm.runner.decode_workspace, 12, 10, 160)
            assert set(llm.runner.graphs.graphs) == {(bs, s) for bs in (1, 2, 4, 8, 12) for s in (True, False)}
        outs.append(run(llm, prompts, params))
        scores.append(llm.runner.kv_cache.scores.clone())   # what every slot was last scored
        outs.append(run(llm, prompts[::2], params[::2]))   # full only: no scores
    assert outs[2:] == outs[:2]
    # Page 0 also takes the padding rows' scores (NaN on this CPU stand-in; the GPU kernels skip them).
    torch.testing.assert_close(scores[1][1:], scores[0][1:], rtol=1e-5, atol=1e-6)
