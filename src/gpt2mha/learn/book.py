"""The book's attention family: ``CausalAttention``, ``MultiHeadAttentionWrapper``, ``MultiHeadAttention``.

Source: Sebastian Raschka, "Build a Large Language Model (From Scratch)", chapter 3
(3.5 causal attention, 3.6.1 the wrapper, 3.6.2 weight splits). Signatures,
attribute names (``W_query``, ``W_key``, ``W_value``, ``out_proj``, ``heads``, ``dropout``, the
``mask`` buffer ``triu(ones, diagonal=1)``) and the order parameters are created in are the
book's, so ``torch.manual_seed(123)`` gives the book's printed numbers and the book's state
dicts load unchanged.

What gpt2mha adds: clear ValueErrors instead of asserts and failed ``masked_fill_``; an
optional KV cache on :class:`MultiHeadAttention` (``past``/``present`` in the fused module's
layout, bottom-right causal mask as :func:`gpt2mha.attention_mask`); and one switch,
``attn_impl = "explicit" | "sdpa"``, choosing the written-out core (can return the weights;
the default, so training-mode dropout draws the book's random numbers) or PyTorch's fused
``scaled_dot_product_attention``.

Shapes: b = batch, T = num_tokens (new tokens), P = past tokens, S = P + T keys.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core import checks
from ..core.attention import ATTN_IMPLS, attend_explicit, attend_sdpa


check_sizes = checks.positive_ints          # the book's classes check what the core checks, the same way


def check_dropout(dropout: float) -> None:
    """Raise ValueError unless ``0 <= dropout < 1``."""
    checks.dropout_p(dropout=dropout)


def check_input(x: torch.Tensor, d_in: int, context_length: int, past_len: int = 0) -> None:
    """Raise ValueError unless ``x`` is ``[b, num_tokens, d_in]`` with ``1 <= past_len + num_tokens <= context_length``."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x has shape {shape}; expected rank 3 [b, num_tokens, d_in={d_in}]")
    if x.shape[-1] != d_in:
        raise ValueError(f"x has shape {tuple(x.shape)}: last dimension {x.shape[-1]} != d_in={d_in}")
    if x.shape[1] == 0:
        raise ValueError(f"x has shape {tuple(x.shape)}: num_tokens must be at least 1")
    if past_len + x.shape[1] > context_length:
        raise ValueError(f"num_tokens={x.shape[1]} (after {past_len} past tokens) exceeds "
                         f"context_length={context_length}")


def causal_attend(q, k, v, mask, dropout: nn.Dropout, training: bool, attn_impl: str = "explicit",
                  need_weights: bool = False):
    """The causal attention core shared by the book's classes.

    Args:
        q: ``[..., T, head_dim]`` queries of the last T positions; k, v: ``[..., S, head_dim]``.
        mask: the book's buffer ``triu(ones(context_length, context_length), diagonal=1)``
            (1 = future = hidden). Rows ``S-T … S-1`` of it are the bottom-right causal mask
            ``gpt2mha.attention_mask(T, S)``; with no past (S = T) that is the book's
            ``mask[:T, :T]``.
        dropout: the module's ``nn.Dropout`` on the attention weights (active when training).
        attn_impl: ``"explicit"`` (:func:`gpt2mha.core.attention.attend_explicit`: scores
            ``q @ kᵀ / √head_dim``, masked to the dtype's lowest value rather than -inf so no
            row can ever give NaN, max-subtracted softmax) or ``"sdpa"``
            (:func:`gpt2mha.core.attention.attend_sdpa`).
        need_weights: also return the weights ``[..., T, S]`` (forces the explicit path).

    Returns:
        ``(context [..., T, head_dim], weights or None)``.
    """
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl={attn_impl!r}; expected one of {ATTN_IMPLS}")
    T, S = q.shape[-2], k.shape[-2]
    allowed = ~mask.bool()[S - T:S, :S]                             # [T, S], True = may attend
    if need_weights or attn_impl == "explicit":
        seen = []                                                   # the softmaxed weights, before dropout
        a = attend_explicit(q, k, v, allowed, dropout.p, training, hook_pattern=lambda w: seen.append(w) or w)
        return a, seen[0] if need_weights else None
    # mask=None: T == S is plain causal (is_causal); one query after a past sees every key
    return attend_sdpa(q, k, v, None if S == T or T == 1 else allowed, dropout.p, training), None


class CausalAttention(nn.Module):
    """One causal self-attention head (book section 3.5, the unit the wrapper stacks).

    Args:
        d_in: input width; d_out: width of the queries, keys, values and the output.
        context_length: the most tokens a forward may see (size of the ``mask`` buffer).
        dropout: dropout probability on the attention weights, in [0, 1).
        qkv_bias: give ``W_query``/``W_key``/``W_value`` a bias (the book's default: none).

    Parameters (creation order): ``W_query``, ``W_key``, ``W_value``, each
    ``nn.Linear(d_in, d_out)`` (weight ``[d_out, d_in]``); buffer ``mask [context_length,
    context_length]``.

    Forward: ``x [b, T, d_in]`` → context ``[b, T, d_out]`` (and weights ``[b, T, T]`` if
    ``need_weights``).

    Raises:
        ValueError: non-positive sizes, dropout outside [0, 1); in forward, x not rank 3, its
            last dimension != d_in, or T > context_length.
    """

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        check_sizes(d_in=d_in, d_out=d_out, context_length=context_length)
        check_dropout(dropout)
        self.d_in, self.d_out, self.context_length = d_in, d_out, context_length
        self.attn_impl = "explicit"
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x, need_weights=False):
        """``x [b, T, d_in]`` → context ``[b, T, d_out]``, or ``(context, weights [b, T, T])``."""
        check_input(x, self.d_in, self.context_length)
        keys = self.W_key(x)                                        # (b, T, d_out)
        queries = self.W_query(x)
        values = self.W_value(x)
        context_vec, w = causal_attend(queries, keys, values, self.mask, self.dropout, self.training,
                                       self.attn_impl, need_weights)  # (b, T, d_out)
        return (context_vec, w) if need_weights else context_vec


class MultiHeadAttentionWrapper(nn.Module):
    """Multi-head attention as ``num_heads`` stacked :class:`CausalAttention` heads (book listing 3.4).

    Args:
        d_in: input width; d_out: width of EACH head (the output is ``num_heads * d_out`` wide).
        context_length, dropout, qkv_bias: as :class:`CausalAttention`; num_heads: heads.

    Parameters: ``heads[i].W_query/W_key/W_value`` (``[d_out, d_in]`` each), created head by
    head; no output projection (heads are concatenated, never mixed).

    Forward: ``x [b, T, d_in]`` → ``[b, T, num_heads * d_out]``, head i in columns
    ``i*d_out … (i+1)*d_out - 1`` (and weights ``[b, num_heads, T, T]`` if ``need_weights``).
    ``attn_impl`` sets the core of every head.
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        check_sizes(num_heads=num_heads)
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)]
        )

    @property
    def attn_impl(self) -> str:
        """``"explicit"`` or ``"sdpa"``, for every head (settable)."""
        return self.heads[0].attn_impl

    @attn_impl.setter
    def attn_impl(self, value: str) -> None:
        if value not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={value!r}; expected one of {ATTN_IMPLS}")
        for head in self.heads:
            head.attn_impl = value

    def forward(self, x, need_weights=False):
        """``x [b, T, d_in]`` → ``[b, T, num_heads * d_out]``, or ``(context, weights [b, num_heads, T, T])``."""
        if not need_weights:
            return torch.cat([head(x) for head in self.heads], dim=-1)  # (b, T, num_heads * d_out)
        outs, ws = zip(*(head(x, need_weights=True) for head in self.heads))
        return torch.cat(outs, dim=-1), torch.stack(ws, dim=1)     # ..., (b, num_heads, T, T)


class MultiHeadAttention(nn.Module):
    """Multi-head causal attention with weight splits (book section 3.6.2; chapter 4's GPT uses it).

    Args:
        d_in: input width; d_out: TOTAL width of queries/keys/values and of the output, split
            into ``num_heads`` heads of ``head_dim = d_out // num_heads`` (so d_out must be
            divisible by num_heads; GPT-2 small: 768 / 12 = 64).
        context_length: the most tokens (past + new) a forward may see.
        dropout: dropout probability on the attention weights, in [0, 1).
        num_heads: number of heads; qkv_bias: bias on the three input projections.

    Parameters (creation order): ``W_query``, ``W_key``, ``W_value`` (``nn.Linear(d_in, d_out)``,
    weight ``[d_out, d_in]``), ``out_proj`` (``nn.Linear(d_out, d_out)``, always with bias);
    buffer ``mask [context_length, context_length]``.

    Raises:
        ValueError: ``d_out % num_heads != 0`` (naming both), non-positive sizes, dropout
            outside [0, 1); in forward, a bad x (rank, last dim != d_in, too many tokens) or past.
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        check_sizes(d_in=d_in, d_out=d_out, context_length=context_length, num_heads=num_heads)
        if d_out % num_heads:
            raise ValueError(f"d_out={d_out} is not divisible by num_heads={num_heads}")
        check_dropout(dropout)
        self.d_in, self.context_length = d_in, context_length
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.attn_impl = "explicit"
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def check_past(self, x, past) -> int:
        """Validate ``past [b, 2, num_heads, P, head_dim]`` against x; return P (0 if None)."""
        if past is None:
            return 0
        expected = (x.shape[0] if x.dim() == 3 else None, 2, self.num_heads, None, self.head_dim)
        if not isinstance(past, torch.Tensor) or past.dim() != 5 or any(
                e is not None and e != s for e, s in zip(expected, past.shape)):
            shape = tuple(past.shape) if isinstance(past, torch.Tensor) else type(past).__name__
            raise ValueError(f"past has shape {shape}; expected [b={expected[0]}, 2, num_heads={self.num_heads}, "
                             f"P, head_dim={self.head_dim}]")
        return past.shape[3]

    def forward(self, x, past=None, return_present=False, need_weights=False):
        """Attention over ``x`` after an optional cached ``past``.

        Args:
            x: ``[b, T, d_in]``, tokens at positions ``P … P+T-1``.
            past: optional ``[b, 2, num_heads, P, head_dim]`` keys/values of earlier tokens
                (the ``present`` of earlier calls concatenated on dim 3; the same layout as
                :class:`gpt2mha.CausalSelfAttention`'s past).
            return_present: also return ``present = stack([keys, values], 1)``
                ``[b, 2, num_heads, T, head_dim]`` of the new tokens.
            need_weights: also return the attention weights ``[b, num_heads, T, P+T]``.

        Returns:
            context ``[b, T, d_out]`` alone (the book's interface), else
            ``(context, present?, weights?)`` in that order.
        """
        P = self.check_past(x, past)
        check_input(x, self.d_in, self.context_length, P)
        b, num_tokens, d_in = x.shape

        keys = self.W_key(x)                                        # (b, T, d_out)
        queries = self.W_query(x)
        values = self.W_value(x)

        # (b, T, d_out) -> (b, T, num_heads, head_dim) -> (b, num_heads, T, head_dim)
        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

        present = torch.stack([keys, values], dim=1)                # (b, 2, num_heads, T, head_dim)
        if past is not None:
            keys = torch.cat([past[:, 0].to(keys.dtype), keys], dim=2)    # (b, num_heads, P+T, head_dim)
            values = torch.cat([past[:, 1].to(values.dtype), values], dim=2)

        context_vec, attn_weights = causal_attend(queries, keys, values, self.mask, self.dropout,
                                                  self.training, self.attn_impl, need_weights)
        # (b, num_heads, T, head_dim) -> (b, T, num_heads, head_dim) -> (b, T, d_out)
        context_vec = context_vec.transpose(1, 2).contiguous().view(b, num_tokens, self.d_out)
        context_vec = self.out_proj(context_vec)                    # (b, T, d_out)

        extras = (present,) * bool(return_present) + (attn_weights,) * bool(need_weights)
        return (context_vec, *extras) if extras else context_vec
