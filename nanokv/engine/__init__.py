"""One step of the engine. The scheduler (scheduler.py) picks which sequences
(sequence.py) run and how many tokens each, counting blocks (block_manager.py, with
the prefix cache, prefix_cache.py); the runner (runner.py) carries out the step's
evictions (evict.py), builds its inputs, runs the model, eagerly or from a CUDA graph
(cuda_graphs.py), and samples (sampler.py); memory.py sizes the KV pool."""
