"""gpt2mha: GPT-2's multi-head causal self-attention, exact and fast, with the model around it."""

from .attention import CausalSelfAttention, Conv1D, attention_mask, merge_heads, split_heads
from .book import CausalAttention, MultiHeadAttention, MultiHeadAttentionWrapper
from .kv_cache import KVCache
from .model import GPT2, PRESETS, GPT2Config, GPT2Output

#: The model every command uses when no ``--model`` is given (shipped in the package).
DEFAULT_MODEL = "shakespeare-byte"

__version__ = "0.1.0"

__all__ = [
    "CausalSelfAttention", "Conv1D", "attention_mask", "split_heads", "merge_heads",
    "CausalAttention", "MultiHeadAttentionWrapper", "MultiHeadAttention",
    "KVCache", "GPT2", "GPT2Config", "GPT2Output", "PRESETS", "DEFAULT_MODEL",
]
