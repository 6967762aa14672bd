"""Test data for gpt2mha.check: transformers' legacy cache convention (``past_key_values`` a
(keys, values) tuple, ``use_cache=True`` returns the present) with a causal mask not offset.

Mistake: with P cached tokens the mask is the top-left [:T, :P+T] slice of a square mask
instead of rows P..P+T-1, so every new query loses its own and the most recent keys. Without
a cache it is correct; the cache argument's name is not the OpenAI ``past``.
"""

import torch
from torch import nn


class MultiHeadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.o_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, hidden_states, past_key_values=None, use_cache=False):
        b, T, _ = hidden_states.shape
        split = lambda t: t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q_proj(hidden_states)), split(self.k_proj(hidden_states)), split(self.v_proj(hidden_states))
        if past_key_values is not None:
            k, v = torch.cat([past_key_values[0], k], -2), torch.cat([past_key_values[1], v], -2)
        S = k.shape[-2]
        w = (q @ k.transpose(-1, -2)) / self.head_dim ** 0.5
        hidden = torch.ones(S, S, dtype=torch.bool).triu(1)[:T, :S]     # WRONG: should be rows S - T .. S - 1
        w = w.masked_fill(hidden, float("-inf")).softmax(-1)
        out = self.o_proj((w @ v).transpose(1, 2).reshape(b, T, -1))
        return (out, (k, v)) if use_cache else (out, None)
