"""Batch invariance: a prompt's greedy output does not depend on its company."""
from nanokv import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n",
    "In 1905, Albert Einstein published four papers that changed physics. The first",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Once upon a time " * 12,
    "import numpy as np\n\n# compute the mean of an array\n",
    "<|im_start|>user\nList three prime numbers.<|im_end|>\n<|im_start|>assistant\n",
]


def test_greedy_output_is_the_same_alone_and_in_a_chunked_batch(bundled_dir):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)   # past the chunked prefill, in a batch
    alone = LLM(str(bundled_dir), dtype="float32", num_kv_blocks=256, max_model_len=512)
    expected = [alone.generate(p, params)[0].token_ids for p in PROMPTS]
    batched = LLM(str(bundled_dir), dtype="float32", num_kv_blocks=256, max_model_len=512,
                  max_num_batched_tokens=32)
    outs = batched.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == expected
    assert any(len(batched.tokenizer.encode(p)) > 32 for p in PROMPTS)   # some prompt was chunked
