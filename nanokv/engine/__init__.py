"""One step: the scheduler picks sequences and chunks, counting blocks (block_manager.py,
prefix_cache.py); the runner evicts (evict.py), runs the model, eagerly or from a CUDA graph
(cuda_graphs.py), and samples (sampler.py); memory.py sizes the KV pool."""
