"""Test data for gpt2mha.check: transformers' Cache convention (``past_key_values.update(k, v,
layer_idx)`` stores the new keys/values in place and returns all of them).

Mistake: the keys/values ``update`` returns are dropped, so the new tokens attend to each other
only, never to the cached ones. Without a cache it is correct.
"""

import torch
from torch import nn


class MultiHeadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, layer_idx=0):
        super().__init__()
        self.num_heads, self.head_dim, self.layer_idx = num_heads, embed_dim // num_heads, layer_idx
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.o_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, hidden_states, past_key_values=None, cache_position=None):
        b, T, _ = hidden_states.shape
        split = lambda t: t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q_proj(hidden_states)), split(self.k_proj(hidden_states)), split(self.v_proj(hidden_states))
        if past_key_values is not None:
            past_key_values.update(k, v, self.layer_idx, {"cache_position": cache_position})   # WRONG: result dropped
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, T, -1)), None
