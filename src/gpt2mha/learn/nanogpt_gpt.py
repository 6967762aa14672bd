"""nanoGPT's whole model, ``GPT`` (Karpathy's nanoGPT ``model.py``): the reference
``gpt2mha check-model`` runs a nanoGPT checkpoint through when the learner gives no class of
their own, so nanoGPT need not be installed.

Source: github.com/karpathy/nanoGPT ``model.py``. Names (``transformer.wte/wpe/drop/h/ln_f``,
``attn.c_attn``/``c_proj``, ``mlp.c_fc``/``c_proj``, ``lm_head``), the ``GPTConfig`` fields
(``block_size, vocab_size, n_layer, n_head, n_embd, dropout, bias``) and the computation are
nanoGPT's: nn.Linear layers (``[out, in]`` weights), a LayerNorm whose bias may be absent
(``bias=False``) with eps 1e-5, causal attention by ``scaled_dot_product_attention(is_causal=True)``
(nanoGPT's "flash" path; its fallback, the explicit ``tril`` mask, computes the same), the exact
erf GELU (``nn.GELU()``, where GPT-2 uses the tanh approximation), ``lm_head`` tied to ``wte``,
and at inference (no targets) the logits of the last position only. Shapes: B = batch, T =
tokens, C = n_embd. (nanoGPT's weight initialisation and optimizer set-up are left out: the
reference is always loaded from a checkpoint.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    """nanoGPT's ``GPTConfig`` (its checkpoints' ``model_args``); ``bias=False`` drops every
    Linear and LayerNorm bias."""

    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    """``F.layer_norm`` over the last axis with eps 1e-5 and an optional bias."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    """``c_attn`` (C → 3C, split q | k | v), heads of C / n_head, causal softmax attention
    scaled by 1/sqrt(head_dim), ``c_proj``: ``(B, T, C)`` → same."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}")
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)      # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """``c_fc`` (C → 4C), exact GELU, ``c_proj`` (4C → C), dropout."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's GPT. ``forward(idx (B, T), targets=None)`` → ``(logits, loss)``: with targets
    the logits of every position ``(B, T, vocab_size)`` and the cross-entropy loss (targets -1
    ignored); without, the last position's ``(B, 1, vocab_size)`` and None.

    Raises:
        ValueError: (in forward) T longer than ``block_size``.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight                    # weight tying

    def forward(self, idx, targets=None):
        b, t = idx.size()
        if t > self.config.block_size:
            raise ValueError(f"cannot forward a sequence of length {t}, block size is only {self.config.block_size}")
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
            return logits, loss
        return self.lm_head(x[:, [-1], :]), None
