"""Test data for gpt2mha.check: a ``cache`` object of the file's own class, filled in place.

Mistake: ``KVCache.store`` replaces the cached keys/values with the new ones instead of
appending them, so the new tokens never see the earlier ones. Without a cache it is correct.
"""

import torch
from torch import nn


class KVCache:
    def __init__(self):
        self.k = self.v = None

    def store(self, k, v):
        self.k, self.v = k, v          # WRONG: should be torch.cat([self.k, k], dim=2) once a past exists
        return self.k, self.v


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

    def forward(self, x, cache=None):
        b, T, _ = x.shape
        split = lambda t: t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.W_query(x)), split(self.W_key(x)), split(self.W_value(x))
        if cache is not None:
            k, v = cache.store(k, v)
        S = k.shape[2]
        w = (q @ k.transpose(2, 3)) / self.head_dim ** 0.5
        w = w.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(S - T + 1), -torch.inf).softmax(-1)
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, T, self.d_out))
