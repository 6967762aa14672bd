"""Attention modules as learners write them (test data for gpt2mha.check, issue 16).

The book's non-causal single heads (SelfAttention_v1/v2, sections 3.3-3.4, which check must
report as "no causal mask"), and correct causal modules that keep the head count somewhere
the checker has to look for, use bare nn.Parameter weights, or wrap torch.nn.MultiheadAttention.
"""

import torch
from torch import nn


class SelfAttention_v1(nn.Module):
    """The book's section 3.3.1: bare [d_in, d_out] parameters, no mask."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x):
        keys, queries, values = x @ self.W_key, x @ self.W_query, x @ self.W_value
        attn_scores = queries @ keys.transpose(-2, -1)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values


class SelfAttention_v2(nn.Module):
    """The book's section 3.3.2: nn.Linear projections, no mask."""

    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        keys, queries, values = self.W_key(x), self.W_query(x), self.W_value(x)
        attn_scores = queries @ keys.transpose(-2, -1)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values


class CausalBareHead(nn.Module):
    """One causal head with bare [d_in, d_out] parameters used as x @ W (SelfAttention_v1 made causal)."""

    def __init__(self, d_in, d_out, context_length):
        super().__init__()
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        T = x.shape[1]
        keys, queries, values = x @ self.W_key, x @ self.W_query, x @ self.W_value
        attn_scores = (queries @ keys.transpose(1, 2)).masked_fill(self.mask.bool()[:T, :T], -torch.inf)
        return torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1) @ values


class LinearConventionParams(nn.Module):
    """Bare parameters stored [out, in] and used as x @ W.T; the head count only in the
    signature's default and kept as ``self.h``."""

    def __init__(self, d_in, d_out, heads=4):
        super().__init__()
        self.h = heads
        self.W_q = nn.Parameter(torch.randn(d_out, d_in))
        self.W_k = nn.Parameter(torch.randn(d_out, d_in))
        self.W_v = nn.Parameter(torch.randn(d_out, d_in))
        self.W_o = nn.Parameter(torch.randn(d_out, d_out))

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = ((x @ W.T).view(b, T, self.h, -1).transpose(1, 2) for W in (self.W_q, self.W_k, self.W_v))
        w = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        w = w.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return (w @ v).transpose(1, 2).reshape(b, T, -1) @ self.W_o.T


class HeadsFromDefault(nn.Module):
    """The head count is a signature default and is never stored: only a local in __init__."""

    def __init__(self, d_in, d_out, num_heads=3):
        super().__init__()
        self.split = lambda t: t.view(t.shape[0], t.shape[1], num_heads, -1).transpose(1, 2)
        self.W_query = nn.Linear(d_in, d_out)
        self.W_key = nn.Linear(d_in, d_out)
        self.W_value = nn.Linear(d_in, d_out)
        self.out_proj = nn.Linear(d_out, d_out)

    def forward(self, x):
        b, T, _ = x.shape
        q, k, v = self.split(self.W_query(x)), self.split(self.W_key(x)), self.split(self.W_value(x))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, T, -1))


class TorchMHABatchFirst(nn.Module):
    """torch.nn.MultiheadAttention, packed in_proj_weight, batch_first=True, a bool causal attn_mask."""

    def __init__(self, d_model, nhead, dropout=0.0):
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=True)

    def forward(self, x):
        T = x.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)                     # True = not allowed
        y, _ = self.attn(x, x, x, attn_mask=mask, need_weights=False)
        return y


class TorchMHASeqFirst(nn.Module):
    """torch.nn.MultiheadAttention with batch_first=False (inputs transposed to [T, b, E]),
    a float -inf causal mask and the is_causal hint."""

    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.mha = nn.MultiheadAttention(embed_dim, num_heads)

    def forward(self, x):
        T = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(T)
        xt = x.transpose(0, 1)                                                  # [T, b, E]
        y, _ = self.mha(xt, xt, xt, attn_mask=mask, is_causal=True, need_weights=False)
        return y.transpose(0, 1)


class TorchMHASeparateWeights(nn.Module):
    """torch.nn.MultiheadAttention in its q_proj_weight/k_proj_weight/v_proj_weight form (the
    form it takes when kdim/vdim differ from embed_dim; forced here at equal widths)."""

    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.mha = nn.MultiheadAttention(embed_dim, num_heads, kdim=embed_dim + 1, vdim=embed_dim + 1,
                                         batch_first=True)
        self.mha.kdim = self.mha.vdim = embed_dim
        self.mha.k_proj_weight = nn.Parameter(torch.randn(embed_dim, embed_dim))
        self.mha.v_proj_weight = nn.Parameter(torch.randn(embed_dim, embed_dim))

    def forward(self, x):
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        return self.mha(x, x, x, attn_mask=mask)[0]
