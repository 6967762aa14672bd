"""Test data for gpt2mha.check: a MultiHeadAttention with a KV cache whose causal mask is not offset.

Mistake: with P cached tokens the mask is sliced top-left, [:T, :P+T], instead of rows
P..P+T-1 (bottom-right), so every new query loses its own and the most recent keys. Without a
cache (P = 0) it is correct.
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
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x, past=None):
        """x (b, T, d_in), past (b, 2, h, P, head_dim) or None -> (out (b, T, d_out), present)."""
        b, T, _ = x.shape
        split = lambda t: t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
        queries, keys, values = split(self.W_query(x)), split(self.W_key(x)), split(self.W_value(x))
        present = torch.stack([keys, values], dim=1)
        if past is not None:
            keys = torch.cat([past[:, 0], keys], dim=2)
            values = torch.cat([past[:, 1], values], dim=2)
        S = keys.shape[2]
        attn_scores = queries @ keys.transpose(2, 3)
        attn_scores.masked_fill_(self.mask.bool()[:T, :S], -torch.inf)  # WRONG: should be [S - T:S, :S]
        attn_weights = self.dropout(torch.softmax(attn_scores / self.head_dim ** 0.5, dim=-1))
        context_vec = (attn_weights @ values).transpose(1, 2).contiguous().view(b, T, self.d_out)
        return self.out_proj(context_vec), present
