"""Test data for gpt2mha.check: a ``kv_cache`` dict filled in place ({"k": ..., "v": ...}),
forward returning the output only.

Mistake: the new keys/values are concatenated before the cached ones instead of after them,
so the bottom-right causal mask hides the wrong keys. Without a cache it is correct.
"""

import torch
from torch import nn


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

    def forward(self, x, kv_cache=None):
        b, T, _ = x.shape
        split = lambda t: t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.W_query(x)), split(self.W_key(x)), split(self.W_value(x))
        if kv_cache is not None:
            if "k" in kv_cache:
                k = torch.cat([k, kv_cache["k"]], dim=2)       # WRONG: the past must come first
                v = torch.cat([v, kv_cache["v"]], dim=2)
            kv_cache["k"], kv_cache["v"] = k, v
        S = k.shape[2]
        w = (q @ k.transpose(2, 3)) / self.head_dim ** 0.5
        w = w.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(S - T + 1), -torch.inf).softmax(-1)
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, T, self.d_out))
