"""nanokv: a minimal LLM inference engine with KV-cache eviction (Batch-Max)."""
from nanokv.llm import LLM, RequestOutput
from nanokv.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
