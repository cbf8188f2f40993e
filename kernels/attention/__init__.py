"""Attention over the paged cache: reference.py (the torch oracle), cpu.py (the CPU
backend's formulation), the Triton kernels prefill.py and decode.py (flash-decoding)
with their building blocks in tiles.py, and key_scores.py (the eviction scores of a
prefill chunk: reference and kernel). kernels.paged_attention picks among them."""
