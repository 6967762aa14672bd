"""Test data for gpt2mha.check: the book's KV-cache MultiHeadAttention (LLMs-from-scratch,
ch04/03_kv-cache): ``use_cache=True`` keeps keys/values in the module, forward returns the
output only.

Mistake: the position pointer is never advanced, so the cached call takes mask rows 0..T-1
(the top-left slice) instead of rows P..P+T-1. Without a cache it is correct.
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
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1),
                             persistent=False)
        self.register_buffer("cache_k", None, persistent=False)
        self.register_buffer("cache_v", None, persistent=False)
        self.ptr_current_pos = 0

    def forward(self, x, use_cache=False):
        b, T, _ = x.shape
        split = lambda t: t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.W_query(x)), split(self.W_key(x)), split(self.W_value(x))
        if use_cache:
            if self.cache_k is not None:
                k, v = torch.cat([self.cache_k, k], dim=2), torch.cat([self.cache_v, v], dim=2)
            self.cache_k, self.cache_v = k, v
        S = k.shape[2]
        mask_bool = self.mask.bool()[self.ptr_current_pos:self.ptr_current_pos + T, :S]
        # WRONG: self.ptr_current_pos += T is missing
        w = (q @ k.transpose(2, 3)).masked_fill(mask_bool, -torch.inf)
        w = self.dropout(torch.softmax(w / self.head_dim ** 0.5, dim=-1))
        return self.out_proj((w @ v).transpose(1, 2).contiguous().view(b, T, self.d_out))
