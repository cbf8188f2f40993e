"""A real evaluation client: lm-evaluation-harness's local-completions model scores a small
multiple-choice task (its items ship in data/) through the server, by echo and logprobs; its
per-item log-likelihoods must be those the same harness gets from LLM directly."""
from pathlib import Path

import pytest

from nanokv import LLM, SamplingParams
from serving import running_server

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

ITEMS = Path(__file__).parent / "data" / "choices.jsonl"
TASK = """task: nanokv_choices
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


class DirectLM(TemplateLM):
    """The harness's model on LLM itself: a continuation's log-likelihood is the sum of its
    tokens' prompt logprobs; greedy if each is the most likely token."""
    backend = "causal"

    def __init__(self, llm: LLM):
        super().__init__()
        self.llm = llm

    @property
    def eot_token_id(self) -> int:
        return self.llm.tokenizer.eos_token_id

    def tok_encode(self, string: str, add_special_tokens: bool = False, **kwargs) -> list[int]:
        return self.llm.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
        outs = self.llm.generate([context + continuation for _, context, continuation in requests],
                                 SamplingParams(max_tokens=1, prompt_logprobs=True))
        scored = [out.prompt_logprobs[len(context):] for out, (_, context, _) in zip(outs, requests)]
        return [(sum(e.logprob for e in entries), all(e.token == e.top_token for e in entries)) for entries in scored]

    def loglikelihood_rolling(self, requests, **kwargs):
        raise NotImplementedError

    def generate_until(self, requests, **kwargs):
        raise NotImplementedError


def scores(tasks: TaskManager, model, model_args: dict | None = None) -> list[float]:
    """The log-likelihood of every (item, choice), in order."""
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["nanokv_choices"],
                                      task_manager=tasks, log_samples=True, num_fewshot=0)
    samples = sorted(results["samples"]["nanokv_choices"], key=lambda s: s["doc_id"])
    return [resp[0][0] for sample in samples for resp in sample["resps"]]


def test_lm_eval_through_the_server_scores_as_on_llm_directly(bundled_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "choices.yaml").write_text(TASK.format(items=ITEMS))
    tasks = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)   # indexing its own: ~30 s
    engine = dict(dtype="float32", num_kv_blocks=64, max_model_len=256)
    direct = scores(tasks, DirectLM(LLM(str(bundled_dir), **engine)))
    with running_server(LLM(str(bundled_dir), **engine)) as (base, _):
        served = scores(tasks, "local-completions", dict(
            model="tiny", base_url=f"{base}/v1/completions", tokenizer_backend="huggingface",
            tokenizer=str(bundled_dir), num_concurrent=1, max_retries=1))
    assert len(served) == 17 and all(s < 0 for s in served)
    assert served == pytest.approx(direct, abs=1e-3)
