"""The pure core: attention, model, KV cache and capture points; imports only torch."""

from .attention import CausalSelfAttention, Conv1D, attention_mask, merge_heads, split_heads
from .hooks import HookPoint
from .kv_cache import CacheStep, KVCache
from .model import GPT2, PRESETS, GPT2Config, GPT2Output

__all__ = ["CausalSelfAttention", "Conv1D", "attention_mask", "merge_heads", "split_heads", "HookPoint",
           "CacheStep", "KVCache", "GPT2", "PRESETS", "GPT2Config", "GPT2Output"]
