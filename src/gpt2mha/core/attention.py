"""GPT-2's masked multi-head self-attention, exactly as OpenAI's ``src/model.py`` computes it.

Read top to bottom: the mask, the head split/merge, the two attention cores (the math written
out, and PyTorch's fused ``scaled_dot_product_attention``), GPT-2's ``Conv1D``, then the
``CausalSelfAttention`` sublayer in GPT-2's fused layout.

Shapes use B = batch, T = new tokens, P = past (cached) tokens, S = P + T keys,
h = n_head, head_dim = n_embd // n_head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import checks
from .hooks import HookPoint
from .kv_cache import CacheStep, KVCache

#: The official code writes masked scores as ``w * m - 1e10 * (1 - m)``; the explicit core uses
#: the dtype's lowest value instead (see :func:`attend_explicit`).
MASK_VALUE = -1e10

#: Names accepted by :attr:`CausalSelfAttention.attn_impl`.
ATTN_IMPLS = ("sdpa", "explicit")


def attention_mask(nd: int, ns: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Causal mask of OpenAI's ``attention_mask(nd, ns)``: ``m[i, j] = i >= j - ns + nd``.

    Args:
        nd: number of queries (new tokens), ``>= 1``.
        ns: number of keys (past + new tokens), ``>= nd``.

    Returns:
        BoolTensor ``[nd, ns]``; True where query ``i`` may read key ``j``. It is aligned to
        the bottom-right corner, so with a cache (``ns > nd``) every new query sees the whole
        past plus its own prefix.

    Raises:
        ValueError: if ``nd < 1`` or ``ns < nd``.

    Source: ``attention_mask`` in openai/gpt-2 ``src/model.py``.
    """
    if any(isinstance(n, bool) or not isinstance(n, int) for n in (nd, ns)) or nd < 1 or ns < nd:
        raise ValueError(f"attention_mask needs integers 1 <= nd <= ns, got nd={nd!r}, ns={ns!r}")
    i = torch.arange(nd, device=device)[:, None]
    j = torch.arange(ns, device=device)
    return i >= j - ns + nd


def combine_masks(causal: torch.Tensor, key_padding: torch.Tensor | None) -> torch.Tensor:
    """The causal mask with a key-padding mask, keeping every query row non-empty.

    Args:
        causal: BoolTensor ``[T, S]`` (:func:`attention_mask`) or ``[B, 1, T, S]``.
        key_padding: optional ``[B, S]``, True/1 for real tokens, False/0 for pads.

    Returns:
        BoolTensor ``[T, S]`` (no padding) or ``[B, 1, T, S]``. A padding mask never switches
        causal masking off. Each query may always read its own key (the bottom-right
        diagonal), so a pad query whose keys are all pads still has one key: its output stays
        finite (no softmax over an empty row, no NaN) and, being a pad, never reaches a real
        token, because real queries do not read pad keys.
    """
    if key_padding is None:
        return causal
    T, S = causal.shape[-2:]
    mask = causal & key_padding.to(torch.bool)[:, None, None, :]
    own_key = torch.arange(T, device=causal.device)[:, None] + (S - T) == torch.arange(S, device=causal.device)
    return mask | own_key


def split_heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """``[B, T, n_embd]`` → ``[B, n_head, T, head_dim]`` (OpenAI's ``split_states`` + transpose)."""
    B, T, C = x.shape
    return x.view(B, T, n_head, C // n_head).transpose(1, 2)  # [B, h, T, head_dim]


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``[B, n_head, T, head_dim]`` → ``[B, T, n_embd]``, head h at columns h·head_dim… (``merge_states``)."""
    B, h, T, hd = x.shape
    return x.transpose(1, 2).reshape(B, T, h * hd)            # [B, T, n_embd]


def attend_explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    dropout_p: float = 0.0, training: bool = False,
                    hook_scores=None, hook_pattern=None) -> torch.Tensor:
    """Scaled dot-product attention written out, as OpenAI's ``multihead_attn``.

    Args:
        q: ``[B, h, T, head_dim]``; k, v: ``[B, h, S, head_dim]``.
        mask: BoolTensor broadcastable to ``[B, h, T, S]`` (True = may attend), or None for
            OpenAI's bottom-right causal ``attention_mask(T, S)``.
        dropout_p: dropout on the attention weights, applied only when ``training``.
        hook_scores, hook_pattern: optional callables (:class:`HookPoint`) applied to the masked
            scores and to the softmaxed pattern ``[B, h, T, S]``; what they return is used.

    Returns:
        Context ``[B, h, T, head_dim]`` in q's dtype. Scores are computed and softmaxed in
        float32 even for fp16/bf16 inputs (float64 stays float64).

    Masked scores are set to the dtype's lowest value rather than OpenAI's ``-1e10``
    (:data:`MASK_VALUE`): the weights are the same numbers whenever a query's real scores are
    above about -1e10, and masked keys still get exactly 0 when every real score is lower
    (e.g. -1e12), where -1e10 would be the row's maximum and take all the weight.
    """
    if mask is None:
        mask = attention_mask(q.shape[-2], k.shape[-2], device=q.device)
    acc = torch.promote_types(q.dtype, torch.float32)          # fp16/bf16 -> fp32; fp64 stays
    w = q.to(acc) @ k.to(acc).transpose(-1, -2)                # [B, h, T, S]
    w = w * (1.0 / math.sqrt(v.shape[-1]))                     # scale the scores, not q or k
    w = torch.where(mask, w, torch.finfo(acc).min)             # masked scores -> lowest value
    if hook_scores is not None:
        w = hook_scores(w)
    w = w - w.amax(dim=-1, keepdim=True)                       # max-subtracted softmax
    w = w.exp()
    w = w / w.sum(dim=-1, keepdim=True)                        # masked keys get exactly 0
    w = w * mask.any(dim=-1, keepdim=True)                     # a query with no key reads nothing (as SDPA)
    if hook_pattern is not None:
        w = hook_pattern(w)
    w = F.dropout(w, dropout_p, training)
    return (w @ v.to(acc)).to(v.dtype)                         # [B, h, T, head_dim]


def attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """The same attention through ``torch.nn.functional.scaled_dot_product_attention``.

    Args:
        q: ``[B, h, T, head_dim]``; k, v: ``[B, h, S, head_dim]``.
        mask: BoolTensor broadcastable to ``[B, h, T, S]``, or None for OpenAI's bottom-right
            causal mask: no mask when T == 1 (one query sees every key), ``is_causal`` when
            T == S (PyTorch aligns it top-left, which is only right then), else built.

    Returns:
        Context ``[B, h, T, head_dim]``.

    PyTorch's CPU kernel returns zeros for a query whose scores are all NaN (e.g. ``q · k``
    overflowing float32) over fewer than 16 keys, where OpenAI's formula gives NaN; a call with
    such a row is recomputed by :func:`attend_explicit` (:func:`formula_where_zeroed`), so both
    cores agree on which outputs are NaN.
    """
    T, S = q.shape[-2], k.shape[-2]
    p = dropout_p if training else 0.0
    if mask is None and 1 < T < S:
        mask = attention_mask(T, S, device=q.device)
    if mask is None:
        causal = True if T == S and T > 1 else False            # a bool also for symbolic T, S (dynamic compile)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
    else:
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
    return formula_where_zeroed(a, q, k, v, mask, dropout_p, training)


#: ``scaled_dot_product_attention`` on the CPU writes zeros for a query whose scores are all NaN
#: only when it reads fewer keys than this (:func:`formula_where_zeroed`).
ZERO_ROWS_BELOW = 16


def formula_where_zeroed(a: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor | None, dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """``a``, the context ``[B, h, T, head_dim]`` ``scaled_dot_product_attention`` computed on the
    CPU for ``q, k, v`` and ``mask`` (None: OpenAI's causal mask), or, when a row of it is all
    zeros and ``k`` holds fewer than :data:`ZERO_ROWS_BELOW` keys, :func:`attend_explicit`'s
    context for the whole call.

    Why: for a query whose scores are all NaN (``q · k`` overflowing float32, a NaN query) the
    CPU kernel writes 0 over fewer keys than a SIMD vector holds and NaN over more (torch 2.13,
    measured on AVX2: zeros up to 7 keys, float32, bf16 and fp16 alike; 16 covers AVX-512's
    float32 vectors): the model gave finite, meaningless logits on prompts of up to 7 tokens and
    NaN beyond, where the explicit core and the C++ kernels give NaN. A row of exact zeros is otherwise rare (a query with no key, values of zero):
    recomputed, it gives the same numbers. The check (one reduction over ``a``) runs on the
    CPU, not while compiling, and only on calls over so few keys; tests/test_attention.py
    checks that the kernel gives NaN from :data:`ZERO_ROWS_BELOW` keys on.
    """
    if (k.shape[-2] >= ZERO_ROWS_BELOW or a.device.type != "cpu" or torch.compiler.is_compiling()
            or bool(a.any(dim=-1).all())):
        return a
    return attend_explicit(q, k, v, mask, dropout_p, training).to(a.dtype)


class Conv1D(nn.Module):
    """GPT-2's "conv1d": a dense layer stored ``[in, out]`` and applied as ``x @ W + b`` (no transpose).

    Args:
        n_in: input width; n_out: output width.

    Shapes: ``weight [n_in, n_out]``, ``bias [n_out]``; forward ``[..., n_in]`` → ``[..., n_out]``.

    Source: ``conv1d`` in openai/gpt-2 ``src/model.py`` (and transformers' ``Conv1D``).
    """

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.n_in, self.n_out = n_in, n_out
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.addmm(self.bias, x.reshape(-1, self.n_in), self.weight)   # [N, n_out] = x @ W + b
        return y.view(*x.shape[:-1], self.n_out)

    def extra_repr(self) -> str:
        return f"n_in={self.n_in}, n_out={self.n_out}"


class CausalSelfAttention(nn.Module):
    """GPT-2's attention sublayer in the fused Conv1D layout.

    ``qkv = x @ c_attn.weight + c_attn.bias`` is ``[B, T, 3·n_embd]`` whose columns are three
    contiguous n_embd blocks, all queries | all keys | all values (not per-head chunks):
    head h reads q at ``h·head_dim``, k at ``n_embd + h·head_dim``, v at
    ``2·n_embd + h·head_dim``. Heads are split to ``[B, h, T, head_dim]``, scores are
    ``q @ kᵀ / √head_dim``, masked with :func:`attention_mask`, softmaxed, applied to v, merged
    back to ``[B, T, n_embd]`` and projected by ``c_proj``.

    Args:
        n_embd: model width (``d``); n_head: number of heads, must divide n_embd.
        attn_pdrop: dropout on the attention weights; resid_pdrop: dropout after c_proj.
            Both act only in training mode.
        attn_impl: ``"sdpa"`` (fused, default) or ``"explicit"`` (the math written out). The
            two agree to float32 rounding; change it any time via the attribute. A hook on
            ``hook_attn_scores`` or ``hook_pattern`` runs the explicit core (SDPA has no scores).
        layer_idx: which layer of a :class:`~gpt2mha.core.kv_cache.KVCache` this sublayer uses.

    Parameters: ``c_attn.weight [n_embd, 3·n_embd]``, ``c_attn.bias [3·n_embd]``,
    ``c_proj.weight [n_embd, n_embd]``, ``c_proj.bias [n_embd]``.

    Capture points (:class:`~gpt2mha.core.hooks.HookPoint`, TransformerLens' names):
    ``hook_q``, ``hook_k``, ``hook_v`` ``[B, T, h, head_dim]``; ``hook_attn_scores``,
    ``hook_pattern`` ``[B, h, T, S]``; ``hook_z`` ``[B, T, h, head_dim]`` (the heads' outputs
    before c_proj); ``hook_result`` ``[B, T, h, n_embd]`` (each head's share of c_proj's output,
    computed only while a hook is attached).

    Raises:
        ValueError: n_embd or n_head not positive, n_embd not divisible by n_head, dropout
            outside [0, 1), or an unknown attn_impl.

    Source: ``attn`` in openai/gpt-2 ``src/model.py``.
    """

    def __init__(self, n_embd: int, n_head: int, attn_pdrop: float = 0.0, resid_pdrop: float = 0.0,
                 attn_impl: str = "sdpa", layer_idx: int = 0):
        super().__init__()
        checks.positive_ints(n_embd=n_embd, n_head=n_head)
        checks.dropout_p(attn_pdrop=attn_pdrop, resid_pdrop=resid_pdrop)
        checks.divisible(n_embd, n_head)
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={attn_impl!r}; expected one of {ATTN_IMPLS}")
        self.n_embd, self.n_head, self.head_dim = n_embd, n_head, n_embd // n_head
        self.attn_pdrop, self.resid_pdrop = attn_pdrop, resid_pdrop
        self.attn_impl, self.layer_idx = attn_impl, layer_idx
        self.c_attn = Conv1D(n_embd, 3 * n_embd)
        self.c_proj = Conv1D(n_embd, n_embd)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_attn_scores, self.hook_pattern = HookPoint(), HookPoint()
        self.hook_z, self.hook_result = HookPoint(), HookPoint()

    def forward(self, x: torch.Tensor, past: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                *, cache: KVCache | None = None, step: CacheStep | None = None):
        """Attention over ``x`` and the keys before it (an OpenAI ``past``, or a cache).

        Args:
            x: ``[B, T, n_embd]`` (already layer-normalised by ln_1).
            past: optional floating ``[B, 2, h, P, head_dim]`` keys/values of earlier tokens
                (OpenAI's per-layer ``past``): they become a one-call cache, as if concatenated
                before the new ones.
            attn_mask: optional bool mask broadcastable to ``[B, h, T, S]`` that replaces the
                causal mask (see :func:`combine_masks` for padding); 0/1 values are read the
                same way by both cores (:func:`~gpt2mha.core.checks.bool_mask`).
            cache, step: a :class:`~gpt2mha.core.kv_cache.KVCache` and the step planned on it
                (:meth:`~gpt2mha.core.kv_cache.KVCache.plan`): the new keys/values are written at
                layer :attr:`layer_idx` and every cached key the step reads is attended.

        Returns:
            ``(y, present)``: ``y [B, T, n_embd]``, and ``present = stack([k, v], 1)``
            ``[B, 2, h, T, head_dim]`` of the new tokens only (None when a ``cache`` is given:
            the cache holds them).

        Raises:
            ValueError: x is not ``[B, T, n_embd]``, past does not match x and this module or
                is not floating point, or attn_mask holds values other than 0/1.
        """
        if not torch.compiler.is_compiling():
            checks.hidden(x, self.n_embd)
            if past is not None:
                checks.layer_past(past, x, self.n_head, self.head_dim)
            attn_mask = checks.bool_mask(attn_mask)
        B, T, _ = x.shape
        h, hd = self.n_head, self.head_dim
        q, k, v = self.c_attn(x).split(h * hd, dim=2)          # 3 × [B, T, h·head_dim]
        q = self.hook_q(q.view(B, T, h, hd)).transpose(1, 2)   # [B, h, T, head_dim]
        k = self.hook_k(k.view(B, T, h, hd)).transpose(1, 2)
        v = self.hook_v(v.view(B, T, h, hd)).transpose(1, 2)
        present = None if cache is not None else torch.stack([k, v], dim=1)   # [B, 2, h, T, head_dim]
        layer = self.layer_idx
        if past is not None:                                    # OpenAI's past: a cache for this call
            cache, layer = KVCache.from_past(past[:, None], past.shape[3] + T, dtype=k.dtype), 0
            step = cache.plan(T)
        groups = None
        if cache is not None:
            k, v = cache.update(layer, k, v, step)              # [B, h, S, head_dim]: cached + new
            groups = step.groups if attn_mask is None else None
            attn_mask = step.mask if attn_mask is None else attn_mask
        hooked = self.hook_attn_scores.has_hooks() or self.hook_pattern.has_hooks()
        if groups is not None and not hooked:                   # each run of rows over exactly its own keys
            a = torch.cat([self.attend(q[rows], k[rows, :, :S], v[rows, :, :S], None, hooked) for rows, S in groups])
        else:
            a = self.attend(q, k, v, attn_mask, hooked)
        z = self.hook_z(a.transpose(1, 2))                      # [B, T, h, head_dim]
        if self.hook_result.has_hooks():
            y = self.head_results(z).sum(dim=2) + self.c_proj.bias
        else:
            y = self.c_proj(z.reshape(B, T, h * hd))            # merge heads, project: [B, T, n_embd]
        return F.dropout(y, self.resid_pdrop, self.training), present

    def attend(self, q, k, v, mask, hooked: bool) -> torch.Tensor:
        """The attention core this sublayer uses (``attn_impl``; the explicit one while scores
        or pattern are hooked) over ``q [B, h, T, hd]``, ``k, v [B, h, S, hd]`` and ``mask``."""
        if self.attn_impl == "explicit" or hooked:
            return attend_explicit(q, k, v, mask, self.attn_pdrop, self.training,
                                   self.hook_attn_scores, self.hook_pattern)
        return attend_sdpa(q, k, v, mask, self.attn_pdrop, self.training)

    def head_results(self, z: torch.Tensor) -> torch.Tensor:
        """Each head's share of c_proj's output, ``[B, T, h, n_embd]`` (summed over heads, plus
        ``c_proj.bias``, it is the sublayer's output), through ``hook_result``.

        Raises:
            ValueError: c_proj is not a float :class:`Conv1D` (e.g. quantized).
        """
        if not isinstance(self.c_proj, Conv1D):
            raise ValueError(f"hook_result needs a float Conv1D c_proj; this one is {type(self.c_proj).__name__}")
        w = self.c_proj.weight.view(self.n_head, self.head_dim, -1)          # [h, head_dim, n_embd]
        return self.hook_result(torch.einsum("bthd,hdn->bthn", z, w))
