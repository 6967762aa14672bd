"""The book's whole model, ``GPTModel`` (chapter 4, 4.1–4.6), around
:class:`gpt2mha.learn.book.MultiHeadAttention`: the reference ``gpt2mha check-model`` runs a book
checkpoint through when the learner gives no class of their own.

Source: Sebastian Raschka, "Build a Large Language Model (From Scratch)", chapter 4. Names,
config keys (``vocab_size, context_length, emb_dim, n_heads, n_layers, drop_rate, qkv_bias``)
and parameter order are the book's, so the book's state dicts load unchanged. Shapes: b =
batch, T = tokens, C = emb_dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .book import MultiHeadAttention


class LayerNorm(nn.Module):
    """``scale * (x - mean) / sqrt(var + 1e-5) + shift`` over the last axis (biased variance)."""

    def __init__(self, emb_dim: int):
        super().__init__()
        self.eps = 1e-5
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        return self.scale * (x - mean) / torch.sqrt(var + self.eps) + self.shift


class GELU(nn.Module):
    """The tanh approximation of GELU (GPT-2's)."""

    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


class FeedForward(nn.Module):
    """``layers = Sequential(Linear(C, 4C), GELU(), Linear(4C, C))``: ``(b, T, C)`` → same."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(cfg["emb_dim"], 4 * cfg["emb_dim"]), GELU(),
                                    nn.Linear(4 * cfg["emb_dim"], cfg["emb_dim"]))

    def forward(self, x):
        return self.layers(x)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + drop(att(norm1(x)))`` then ``x + drop(ff(norm2(x)))``."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.att = MultiHeadAttention(d_in=cfg["emb_dim"], d_out=cfg["emb_dim"], context_length=cfg["context_length"],
                                      num_heads=cfg["n_heads"], dropout=cfg["drop_rate"], qkv_bias=cfg["qkv_bias"])
        self.ff = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg["emb_dim"])
        self.norm2 = LayerNorm(cfg["emb_dim"])
        self.drop_shortcut = nn.Dropout(cfg["drop_rate"])

    def forward(self, x):
        x = x + self.drop_shortcut(self.att(self.norm1(x)))        # (b, T, C)
        return x + self.drop_shortcut(self.ff(self.norm2(x)))


class GPTModel(nn.Module):
    """The book's GPT: ``tok_emb``, ``pos_emb``, ``drop_emb``, ``trf_blocks`` (Sequential),
    ``final_norm``, ``out_head`` (``Linear(C, vocab_size, bias=False)``, not tied).
    ``forward(in_idx (b, T)) -> logits (b, T, vocab_size)``."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
        self.drop_emb = nn.Dropout(cfg["drop_rate"])
        self.trf_blocks = nn.Sequential(*[TransformerBlock(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = LayerNorm(cfg["emb_dim"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)

    def forward(self, in_idx):
        T = in_idx.shape[1]
        x = self.tok_emb(in_idx) + self.pos_emb(torch.arange(T, device=in_idx.device))   # (b, T, C)
        x = self.trf_blocks(self.drop_emb(x))
        return self.out_head(self.final_norm(x))                    # (b, T, vocab_size)


class LoRALayer(nn.Module):
    """Appendix E's LoRA: ``alpha · (x @ A @ B)``, ``A [in_dim, rank]`` (Kaiming-uniform),
    ``B [rank, out_dim]`` (zeros), ``alpha`` a plain attribute (in no state dict)."""

    def __init__(self, in_dim: int, out_dim: int, rank: int, alpha: float):
        super().__init__()
        self.A = nn.Parameter(torch.empty(in_dim, rank))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.B = nn.Parameter(torch.zeros(rank, out_dim))
        self.alpha = alpha

    def forward(self, x):
        return self.alpha * (x @ self.A @ self.B)


class LinearWithLoRA(nn.Module):
    """Appendix E: ``linear(x) + lora(x)`` around an ``nn.Linear``."""

    def __init__(self, linear: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.linear = linear
        self.lora = LoRALayer(linear.in_features, linear.out_features, rank, alpha)

    def forward(self, x):
        return self.linear(x) + self.lora(x)


def replace_linear_with_lora(model: nn.Module, rank: int, alpha: float) -> None:
    """Appendix E: every ``nn.Linear`` of ``model`` (recursively) becomes a :class:`LinearWithLoRA`."""
    for name, module in model.named_children():
        if isinstance(module, nn.Linear):
            setattr(model, name, LinearWithLoRA(module, rank, alpha))
        else:
            replace_linear_with_lora(module, rank, alpha)
