"""DecodeGraphs' bookkeeping (static buffers, padding to a bucket, the graph with or
without scores) checked on the CPU: "capturing" records the forward pass and
"replaying" runs it again on whatever the static buffers then hold, which is what
a CUDA graph does. The real capture runs in the gpu-marked tests."""
import contextlib
from types import SimpleNamespace

import pytest
import torch

from helpers import VOCAB, make_tiny_model
from models import AttentionMetadata
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


def test_the_buffers_hold_each_step_s_inputs_though_copies_the_last_step_made_are_not_made_again(
        tiny_dir, recorded_graphs):
    """A step copies into the static buffers only what the last left otherwise: the padding rows
    when the step has another number of rows, the page tables when they are other tables, the
    score settings unless neither step squares or skips. After each step of a run whose rows,
    tables and scores change, the buffers hold what copying everything would have put there."""
    llm = LLM(str(tiny_dir), dtype="float32", num_kv_blocks=64, max_model_len=160, max_num_seqs=12)
    graphs = DecodeGraphs(llm.runner.model, llm.runner.kv_cache, llm.runner.decode_workspace, 12, 10, 160)
    graphs.graphs = {key: SimpleNamespace(replay=lambda: None) for key in graphs.graphs}   # the buffers only
    L, H = llm.runner.kv_cache.num_layers, llm.runner.kv_cache.num_kv_heads
    g = torch.Generator().manual_seed(0)
    tables = None
    # (rows, new tables, scores: None, "plain", "squared" or "skip")
    for n, new_tables, scores in [(12, True, "plain"), (12, False, "plain"), (7, True, "squared"), (7, False, "plain"),
                                  (12, True, None), (5, True, "plain"), (5, False, "skip"), (5, False, "plain"),
                                  (12, True, "plain"), (3, True, None), (3, False, None)]:
        width = int(torch.randint(1, 11, (), generator=g))
        if new_tables:
            tables = torch.randint(0, 64, (L, n, H, width), dtype=torch.int32, generator=g)
        meta = AttentionMetadata(
            slot_mapping=torch.randint(0, 1000, (L, n, H), generator=g), cu_seqlens_q=torch.arange(n + 1),
            context_lens=torch.randint(1, 160, (L, n, H), dtype=torch.int32, generator=g), page_tables=tables,
            max_query_len=1, max_context_len=160, num_decodes=n, accumulate_scores=scores is not None,
            score_from=torch.randint(0, 9, (n,), dtype=torch.int32, generator=g),
            square_scores=torch.rand(n, generator=g) < 0.5 if scores == "squared" else None,
            score_skip=torch.randint(1, 9, (n,), dtype=torch.int32, generator=g) if scores == "skip" else None)
        ids, positions = torch.randint(0, VOCAB, (n,), generator=g), torch.randint(0, 160, (n,), generator=g)
        graphs.run(ids, positions, meta)
        bs = next(s for s in graphs.batch_sizes if s >= n)
        assert torch.equal(graphs.input_ids[:n], ids) and torch.equal(graphs.positions[:n], positions)
        assert torch.equal(graphs.slot_mapping[:, :n], meta.slot_mapping)
        assert torch.equal(graphs.context_lens[:, :n], meta.context_lens)
        assert (graphs.slot_mapping[:, n:bs] == -1).all() and (graphs.context_lens[:, n:bs] == 0).all()
        assert torch.equal(graphs.page_tables[:, :n, :, :tables.shape[-1]], tables)
        if scores is not None:
            assert torch.equal(graphs.score_from[:n], meta.score_from)
            square = torch.zeros(n, dtype=torch.bool) if meta.square_scores is None else meta.square_scores
            skip = torch.zeros(n, dtype=torch.int32) if meta.score_skip is None else meta.score_skip
            assert torch.equal(graphs.square_scores[:n], square) and torch.equal(graphs.score_skip[:n], skip)
