# GPT-2's layout: one fused c_attn (Conv1D, [in, out], x @ W + b) whose 3*n_embd columns are
# all q | all k | all v, n_head heads of head_dim, the causal mask, softmax, c_proj.
import math

import torch
from torch import nn


class Conv1D(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class Attention(nn.Module):
    def __init__(self, n_embd, n_head, n_ctx):
        super().__init__()
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.c_attn = Conv1D(n_embd, 3 * n_embd)
        self.c_proj = Conv1D(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)                  # [B, T, C] each: the three column blocks
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        w = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)    # [B, h, T, T]
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        w = w.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        a = (w @ v).transpose(1, 2).reshape(B, T, C)              # heads side by side
        return self.c_proj(a)
