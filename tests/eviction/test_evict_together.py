"""evict_together: a decoding request joins the evictions of others of its method (the same rule
under the same schedule), so that their evictions share steps and pieces and stay in step."""
from __future__ import annotations

import pytest
import torch

from helpers import VOCAB
from nanokv import LLM, SamplingParams
from nanokv.config import EngineConfig
from nanokv.eviction.settings import method_for
from nanokv.tools.method_spec import parse_spec

BUDGET, EVERY = 64, 16


def evictions_by_step(llm, prompts, params):
    """Each step's evictions as {seq_id: (num_slots, num_evicted)}, while decoding, and the outputs."""
    steps, evict = [], llm.runner.evictor.evict

    def watched(evictions):
        steps.append({e.seq.seq_id: (e.num_slots, e.num_evicted) for e in evictions
                      if e.seq.num_computed_tokens >= e.seq.num_prompt_tokens})
        evict(evictions)
    llm.runner.evictor.evict = watched
    outputs = llm.generate(prompts, params)
    llm.runner.evictor.evict = evict
    return [s for s in steps if s], outputs


@pytest.mark.parametrize("method", ["batchmax", "kvcompress"])
def test_requests_that_evict_together_join_each_others_evictions_and_stay_in_step(tiny_dir, method):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (70, 77, 86, 93)]
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256, num_threads=1)

    def params(together):
        return SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, kv_method=method, kv_budget=BUDGET,
                              evict_every=EVERY, evict_together=together)
    alone, outputs = evictions_by_step(llm, prompts, [params(False)] * 4)
    assert all(len(o.token_ids) == 60 for o in outputs)
    together, outputs = evictions_by_step(llm, prompts, [params(True)] * 3 + [params(False)])
    assert all(len(o.token_ids) == 60 for o in outputs)
    *joiners, loner = sorted({i for step in together for i in step})   # the last request does not join
    # Alone, each evicts p pairs when it holds |kv|, in steps of its own.
    assert len({i for step in alone for i in step}) == 4 and all(len(step) == 1 for step in alone)
    assert all(counts == (BUDGET, EVERY) for step in alone for counts in step.values())
    # Together, a joiner evicts whenever another evicts, down to what an eviction leaves: never
    # past |kv|, and in step with the others from then on, in fewer steps.
    assert all(slots <= BUDGET and slots - evicted == BUDGET - EVERY for step in together
               for slots, evicted in step.values())
    assert any(evicted < EVERY for step in together for i, (_, evicted) in step.items() if i in joiners)
    # They join a decoding request that must evict, not a prompt's chunks (those evict at every
    # step while a prompt is read, and the joiners would with them).
    assert all((BUDGET, EVERY) in step.values() for step in together)
    assert all(set(joiners) <= set(step) and all(step[i] == (BUDGET, EVERY) for i in joiners) for step in together[-3:])
    assert len(together) < len(alone) / 2
    # The one that does not join evicts when it must, and only then.
    assert all(step[loner] == (BUDGET, EVERY) for step in together if loner in step)


def test_evict_together_is_a_request_setting_with_an_engine_default(tiny_dir):
    """A bool, or None for the engine's; full and ed join no one, so they ignore it; bench.py
    writes it as together=0 or 1."""
    with pytest.raises(TypeError, match="evict_together must be None or True or False, got 1"):
        SamplingParams(evict_together=1)
    assert parse_spec("kvcompress,together=1") == dict(kv_method="kvcompress", evict_together=True)
    with pytest.raises(ValueError, match="bad setting 'together=2'"):
        parse_spec("kvcompress,together=2")
    engine = EngineConfig(evict_together=True)

    def method(**settings):
        return method_for(SamplingParams(kv_budget=64, evict_every=16, **settings), engine, 16)
    assert method(kv_method="batchmax").together and method(kv_method="kvcompress").together
    assert method(kv_method="batchmax").cohort == method(kv_method="batchmax").cohort != method(kv_method="h2o").cohort
    assert not method(kv_method="batchmax", evict_together=False).together
    assert not method(kv_method="ed").together
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=128, num_threads=1, evict_together=True)
    assert len(llm.generate([1, 2, 3], SamplingParams(max_tokens=2))[0].token_ids) == 2   # full: joins no one
