"""The model and all its forward pass reads: its shape (config.py), the decoder
(decoder.py), the KV cache's tensors (kv_cache.py), one step's attention metadata
(attention_metadata.py) and its traffic with the host tier (host_stream.py); and where
weights come from (loader.py: checkpoints and the hub; gguf_convert.py: the bundled model;
shapes.py: random weights of named shapes).
Imports kernels only."""
from models.attention_metadata import AttentionMetadata, KeptInputs
from models.config import ModelConfig
from models.decoder import Decoder
from models.host_stream import HostStream
from models.kv_cache import HostKVCache, KVCache

__all__ = ["AttentionMetadata", "Decoder", "HostKVCache", "HostStream", "KVCache", "KeptInputs", "ModelConfig"]
