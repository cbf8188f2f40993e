"""nanokv: a minimal LLM inference engine with KV-cache eviction (Batch-Max)."""
from nanokv.llm import LLM, EngineStats, RequestOutput, TokenLogprob
from nanokv.sampling_params import SamplingParams

__all__ = ["LLM", "EngineStats", "RequestOutput", "SamplingParams", "TokenLogprob"]
