"""DecodeGraphs' bookkeeping (static buffers, padding to a bucket, the graph with or
without scores) checked on the CPU: "capturing" records the forward pass and
"replaying" runs it again on whatever the static buffers then hold, which is what
a CUDA graph does. The real capture runs in the gpu-marked tests."""
import contextlib

import pytest
import torch

from helpers import VOCAB, make_tiny_model
from nanokv import LLM, SamplingParams
from nanokv.cuda_graphs import DecodeGraphs, graph_batch_sizes


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
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (5, 30, 47, 64, 90)]
    params = [SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, kv_method=m, kv_budget=32,
                             evict_every=16) for m in ("full", "batchmax", "full", "ed", "decode_only")]
    outs = []
    for graphed in (False, True):
        llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, max_model_len=160, max_num_seqs=12,
                  kv_cache_dtype=kv_cache_dtype)
        if graphed:
            llm.runner.graphs = DecodeGraphs(llm.runner.model, llm.runner.kv_cache, llm.runner.decode_workspace, 12, 10, 160)
            assert set(llm.runner.graphs.graphs) == {(bs, s) for bs in (1, 2, 4, 8, 12) for s in (True, False)}
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
        outs.append([o.token_ids for o in llm.generate(prompts[::2], params[::2])])   # full only: no scores
    assert outs[2:] == outs[:2]
