"""Test data for gpt2mha.check: the book's MultiHeadAttention with one mistake.

Mistake: each query attends to the last 6 keys only (a window, as if the mask were built with
a band), where GPT-2 attends to every earlier token: correct for sequences of up to 6 tokens.
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
        ones = torch.ones(context_length, context_length)
        # WRONG: tril(ones, -6) also hides keys more than 5 tokens back
        self.register_buffer("mask", torch.triu(ones, diagonal=1) + torch.tril(ones, diagonal=-6))

    def forward(self, x):
        b, T, _ = x.shape
        split = lambda t: t.view(b, T, self.num_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.W_query(x)), split(self.W_key(x)), split(self.W_value(x))
        w = (q @ k.transpose(2, 3)).masked_fill(self.mask.bool()[:T, :T], -torch.inf)
        w = self.dropout(torch.softmax(w / self.head_dim ** 0.5, dim=-1))
        return self.out_proj((w @ v).transpose(1, 2).contiguous().view(b, T, self.d_out))
