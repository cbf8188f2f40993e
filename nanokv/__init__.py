"""nanokv: a minimal LLM inference engine with KV-cache eviction (Batch-Max)."""
from nanokv.engine.sequence import TokenLogprob
from nanokv.llm import LLM
from nanokv.outputs import EngineStats, RequestOutput
from nanokv.sampling_params import SamplingParams, StructuredOutput

__all__ = ["LLM", "EngineStats", "RequestOutput", "SamplingParams", "StructuredOutput", "TokenLogprob"]
