"""Test data for gpt2mha.check: the book's MultiHeadAttention with one mistake.

Mistake: the head count is hard-coded (4) instead of taken from ``num_heads``: correct only
when the caller happens to ask for 4 heads.
"""

import torch
from torch import nn


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // 4                                   # WRONG: d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, T, _ = x.shape
        split = lambda t: t.view(b, T, 4, self.head_dim).transpose(1, 2)  # noqa: E731  WRONG: 4, not num_heads
        q, k, v = split(self.W_query(x)), split(self.W_key(x)), split(self.W_value(x))
        w = (q @ k.transpose(2, 3)).masked_fill(self.mask.bool()[:T, :T], -torch.inf)
        w = self.dropout(torch.softmax(w / self.head_dim ** 0.5, dim=-1))
        return self.out_proj((w @ v).transpose(1, 2).contiguous().view(b, T, self.d_out))
