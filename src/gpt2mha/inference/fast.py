"""Decode speed applied from outside the model: swap modules for faster-laid-out copies.

Decoding one token at a time streams every weight once per step, so the layout a kernel reads
fastest matters. :func:`for_decoding` returns a view of a model (a new module tree sharing
every parameter and capture point) in which:

* the LM head multiplies by a float32 ``[n_embd, n_vocab]`` copy of its weight
  (:class:`TransposedHead`): on CPU ``x @ W`` over a contiguous copy streams faster for a few
  rows than ``F.linear`` over ``wte``, and a bf16/fp16 model skips upcasting ``wte`` per step;
* on CPU, every bf16/fp16 :class:`~gpt2mha.core.attention.Conv1D` multiplies by an
  ``[n_out, n_in]`` copy (:class:`TransposedConv1D`): torch's reduced-precision kernels read
  that layout faster. A float32 model keeps GPT-2's ``[in, out]``, its fastest;
* every attention sublayer is a :class:`PrefillAttention`: a causal prefill on CPU attends by
  gpt2mha's kernel, which computes only the scores each query keeps;
* the MLPs of per_row int8 models are :class:`GeluFusedMLP`: GELU inside ``c_fc``'s operator.

With ``batch_invariant`` (by default for every model but one with float32 weights,
:func:`invariant_by_default`), every product in the view gives each row the same bits whatever
the other rows of the call (benchmarks/batch_invariance.py measures each kernel): MKL's float32 GEMM rounds
a row one way in calls of 1–3 rows and another in calls of 4 or more (and with several threads
splits a call into blocks of 4 rows plus a remainder), so every float32 product of the view
(:class:`RowPaddedConv1D`, the head) runs on a multiple of :data:`ROW_MULTIPLE` rows, zero rows
added. bf16/fp16 products and the quantized kernels need no padding.

The copies are taken when the view is made and belong to it: ``generate`` makes one per call
and the serving scheduler one per server, so they are never stale and the user's model is never
changed. The same products in another layout: results agree with the model's own to float
rounding (tests hold them to it). Quantized layers (:mod:`gpt2mha.inference.quant`) already hold their kernels' layouts and are
left as they are. In the spirit of gpt-fast's ``convert_for_runtime``.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..core.attention import CausalSelfAttention, Conv1D, attention_mask
from ..core.model import MLP, LMHead, TiedLMHead, logits_dtype
from .quant import gemv


def transposed_copy(w: torch.Tensor, dtype: torch.dtype | None = None, block: int = 256) -> torch.Tensor:
    """A new contiguous ``[C, R]`` copy of a 2-D ``w [R, C]`` (no grad), in ``dtype`` if given.

    Copied ``block`` rows at a time: a blocked transpose keeps both sides in cache, faster than
    ``w.t().contiguous()`` for GPT-2's wte and block matrices, which it reads with long strides.
    """
    w = w.detach()
    out = torch.empty(w.shape[1], w.shape[0], dtype=dtype or w.dtype, device=w.device)
    for i in range(0, w.shape[0], block):
        out[:, i:i + block].copy_(w[i:i + block].t())
    return out


#: Float32 products in a decode view run on a multiple of this many rows (see the module's docstring).
ROW_MULTIPLE = 4


def pad_rows(x: torch.Tensor, multiple: int = ROW_MULTIPLE) -> torch.Tensor:
    """``x [M, K]`` with zero rows appended up to a multiple of ``multiple`` (``x`` itself if none
    are needed); the caller keeps the first M rows of the product."""
    extra = -x.shape[0] % multiple
    return torch.cat([x, x.new_zeros(extra, x.shape[1])]) if extra else x


class RowPaddedConv1D(nn.Module):
    """A float32 :class:`~gpt2mha.core.attention.Conv1D` (the same ``weight [n_in, n_out]`` and
    ``bias``, shared) whose product runs on a multiple of :data:`ROW_MULTIPLE` rows, so each
    row rounds alike in a batch of any size. ``[..., n_in]`` → ``[..., n_out]``. Inference only."""

    def __init__(self, conv: Conv1D):
        super().__init__()
        self.n_in, self.n_out = conv.n_in, conv.n_out
        self.weight, self.bias = conv.weight, conv.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.n_in)                           # [M, n_in]
        y = torch.addmm(self.bias, pad_rows(x2), self.weight)[:x2.shape[0]]
        return y.view(*x.shape[:-1], self.n_out)


class TransposedConv1D(nn.Module):
    """A :class:`~gpt2mha.core.attention.Conv1D` computed as ``F.linear(x, Wᵀ, b)`` over an
    ``[n_out, n_in]`` copy of its weight (the same product in another summation order);
    ``bias`` is the original's. ``[..., n_in]`` → ``[..., n_out]``. Inference only."""

    def __init__(self, conv: Conv1D):
        super().__init__()
        self.n_in, self.n_out = conv.n_in, conv.n_out
        self.register_buffer("weight_t", transposed_copy(conv.weight), persistent=False)   # [n_out, n_in]
        self.bias = conv.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_t, self.bias)


class TransposedHead(nn.Module):
    """An :class:`~gpt2mha.core.model.LMHead` computed as ``x @ W`` over a contiguous
    ``[n_embd, n_vocab]`` copy of its weight in the logits' dtype (float32): ``[B, T, n_embd]``
    → ``[B, T, n_vocab]`` float32 logits; on CPU on a multiple of :data:`ROW_MULTIPLE` rows
    unless ``pad`` is False. Inference only."""

    def __init__(self, head: LMHead, pad: bool = True):
        super().__init__()
        self.pad = pad
        self.register_buffer("weight_t", transposed_copy(head.weight, logits_dtype(head.weight.dtype)),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(self.weight_t.dtype)   # [M, n_embd]
        if self.pad and x2.device.type == "cpu":                 # float32 GEMM: a multiple of 4 rows
            y = (pad_rows(x2) @ self.weight_t)[:x2.shape[0]]
        else:
            y = x2 @ self.weight_t
        return y.view(*x.shape[:-1], -1)


#: A prefill of at least this many tokens (on CPU) attends in blocks of :data:`QUERY_BLOCK`
#: queries (:func:`causal_blocks`).
BLOCKED_FROM = 256
#: Queries per block of :func:`causal_blocks`.
QUERY_BLOCK = 64


def causal_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int = QUERY_BLOCK) -> torch.Tensor:
    """Causal attention over ``q, k, v [B, h, T, head_dim]`` (a prefill from position 0: every
    query sees the keys up to its own) by ``scaled_dot_product_attention`` on blocks of
    ``block`` queries, each over the keys it can see: ``[B, h, T, head_dim]``, the same
    softmax-weighted sums as ``is_causal=True`` (float32 rounding apart).

    Why: PyTorch's CPU flash kernel skips masked keys only in blocks of 512, so a 512-token
    prefill computes every score and drops half; in blocks of 64 queries each block computes
    only the scores up to its last query (56% of them at 512 tokens).
    """
    T = q.shape[-2]
    # block s:e sees mask[s:e, :e]; as 0 / -inf added to the scores (SDPA would turn each bool block into that)
    mask = torch.zeros(T, T, dtype=q.dtype, device=q.device).masked_fill_(~attention_mask(T, T, device=q.device),
                                                                           float("-inf"))
    out = [F.scaled_dot_product_attention(q[:, :, :block], k[:, :, :block], v[:, :, :block], is_causal=True)]
    for s in range(block, T, block):
        e = min(T, s + block)
        out.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e], attn_mask=mask[s:e, :e]))
    return torch.cat(out, dim=2)


def retyped(module: nn.Module, cls: type) -> nn.Module:
    """A shallow copy of ``module`` (parameters, buffers, capture points and submodules shared;
    its own dict of submodules) whose class is ``cls``, a subclass of ``module``'s that only
    overrides methods."""
    new = copy.copy(module)
    new.__class__, new._modules = cls, dict(module._modules)
    return new


class PrefillAttention(CausalSelfAttention):
    """A :class:`~gpt2mha.core.attention.CausalSelfAttention` (the same parameters, capture
    points and ``forward``) whose causal prefills on CPU (2 or more queries over at most twice as
    many keys, OpenAI's causal mask, nothing hooked, no grad) attend by gpt2mha's kernel
    ``torch.ops.gpt2mha.causal_attention`` (float32, head_dim a multiple of 8, each head's rows
    contiguous, where :func:`~.quant.gemv.available`): each query
    computes only the scores it keeps, where SDPA's CPU kernel computes a block of 512 keys
    whole and drops the masked ones; else, from
    :data:`BLOCKED_FROM` tokens, in blocks of
    queries (:func:`causal_blocks`). Every other call attends as the original does. Made by
    :func:`for_decoding` (:meth:`view_of`). Inference only."""

    @classmethod
    def view_of(cls, attn: CausalSelfAttention) -> "PrefillAttention":
        """A shallow copy of ``attn`` (its parameters and submodules shared) of this class."""
        return retyped(attn, cls)

    def attend(self, q, k, v, mask, hooked: bool) -> torch.Tensor:
        T, S = q.shape[-2], k.shape[-2]
        if (mask is None and not hooked and self.attn_impl == "sdpa" and not self.training and q.device.type == "cpu"
                and not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and q.requires_grad)):
            if (1 < T and S <= 2 * T and q.dtype == k.dtype == v.dtype == torch.float32 and q.shape[-1] % 8 == 0
                    and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and gemv.available()):
                return torch.ops.gpt2mha.causal_attention(q, k, v)
            if T >= BLOCKED_FROM and S == T:
                return causal_blocks(q, k, v)
        return super().attend(q, k, v, mask, hooked)


class GeluFusedMLP(MLP):
    """An :class:`~gpt2mha.core.model.MLP` (the same parameters and capture points) whose
    ``c_fc`` applies the GELU itself (``c_fc(x, gelu=True)``: per_row's operator computes it as
    it writes each output, one pass over ``[B, T, 4·n_embd]`` less). While ``hook_pre`` or
    ``c_fc`` has hooks (which must see the activation's input) it runs as the original.
    Made by :func:`for_decoding` for layers whose :attr:`fuses_gelu` is true. Inference only."""

    @classmethod
    def view_of(cls, mlp: MLP) -> "GeluFusedMLP":
        """A shallow copy of ``mlp`` (its parameters and submodules shared) of this class."""
        return retyped(mlp, cls)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hooked(self.c_fc) or hooked(self.hook_pre):
            return super().forward(x)
        h = self.hook_post(self.c_fc(x, gelu=True))                # [B, T, 4·n_embd], after GELU
        return F.dropout(self.c_proj(h), self.dropout, self.training)


def swap_modules(model: nn.Module, replace: Callable[[str, nn.Module], nn.Module | None],
                 after: Callable[[nn.Module], nn.Module | None] | None = None) -> nn.Module:
    """A new module tree over ``model``: every module for which ``replace(path, module)`` returns
    a module is swapped for it, every other one is shared or (on the path to a swap) shallow-
    copied, so parameters, buffers and capture points stay the very same tensors and modules.
    ``after(module)``, once a kept module's children are done, may return a module to put in
    its place (a view of it: :meth:`PrefillAttention.view_of`). ``model`` itself is not changed."""
    def visit(path: str, module: nn.Module) -> nn.Module:
        new = replace(path, module)
        if new is not None:
            return new
        if not module._modules:                                 # a leaf (half of them: capture points)
            return (after and after(module)) or module
        children = {name: visit(f"{path}.{name}" if path else name, child)
                    for name, child in module._modules.items() if child is not None}
        out = module
        if any(children[n] is not module._modules[n] for n in children):
            out = copy.copy(module)                             # shallow: parameters shared
            out._modules = {**module._modules, **children}
        return (after and after(out)) or out
    return visit("", model)


def hooked(m: nn.Module) -> bool:
    """Whether forward hooks or pre-hooks are attached to ``m`` itself (e.g. a user's
    activation steering, or ``torch.nn.utils.prune`` recomputing its weight before each call)."""
    return bool(m._forward_hooks or m._forward_pre_hooks)


def global_hooks() -> bool:
    """Whether forward hooks or pre-hooks are registered for every module
    (``torch.nn.modules.module.register_module_forward_hook`` and its pre-hook twin)."""
    from torch.nn.modules import module
    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)


def invariant_by_default(model: nn.Module) -> bool:
    """Whether ``generate`` and the server pad float32 products (``batch_invariant=None``): for
    every model whose block weights are not float32. A float32 model's decode step at batch 1
    runs every product as a GEMV; padded to 4 rows MKL's GEMM takes several times as long on 124M
    (docs/explanation/batch-invariance.md, "The cost"), so float32 asks for it with
    ``batch_invariant=True``."""
    w = getattr(model.h[0].attn.c_attn, "weight", None)
    return not (isinstance(w, torch.Tensor) and w.dtype == torch.float32)


def for_decoding(model: nn.Module, head: bool = True, conv1d: bool = True,
                 batch_invariant: bool | None = None) -> nn.Module:
    """``model`` with the decode-speed swaps of this module (a view: nothing of ``model`` is
    changed or copied but the swapped weights; the caller sets the mode).

    Args:
        model: a :class:`~gpt2mha.core.model.GPT2` (float or quantized, any device).
        head: swap the LM head for a :class:`TransposedHead` (on CPU, or whenever the logits'
            dtype differs from the weight's). Costs one float32 copy of the head (154 MB for
            124M) while the view lives.
        conv1d: on CPU, swap bf16/fp16 Conv1Ds for :class:`TransposedConv1D` (one more copy of
            the block weights while the view lives) and float32 ones for :class:`RowPaddedConv1D`
            (no copy). False keeps the model's Conv1Ds, and float32 rows then round with the
            batch's size.
        batch_invariant: run float32 products on a multiple of :data:`ROW_MULTIPLE` rows (the
            head's always, float32 Conv1Ds' with ``conv1d``), so that each row's logits are the
            same bits in a batch of any size. False: the batch's own row count (faster at batch
            1–3). None: :func:`invariant_by_default` (all but float32 weights).

    A module with forward hooks or pre-hooks of its own (:func:`hooked`; for the tied head,
    also on ``wte``) is kept as it is: a copy would skip the hooks, and a weight a pre-hook
    recomputes (pruning) may be stale until the module runs.
    """
    if batch_invariant is None:
        batch_invariant = invariant_by_default(model)

    def replace(path: str, m: nn.Module) -> nn.Module | None:
        if hooked(m) or (type(m) is TiedLMHead and hooked(m.wte)):
            return None                                         # the user's hooks (pruning, steering) run as they are
        if head and type(m) in (LMHead, TiedLMHead):
            w = m.weight
            if w.device.type == "cpu" or logits_dtype(w.dtype) != w.dtype:
                return TransposedHead(m, pad=batch_invariant)
        if conv1d and type(m) is Conv1D and m.weight.device.type == "cpu":
            if m.weight.dtype in (torch.bfloat16, torch.float16):
                return TransposedConv1D(m)
            if m.weight.dtype == torch.float32 and batch_invariant:
                return RowPaddedConv1D(m)
        return None

    def prefill(m: nn.Module) -> nn.Module | None:
        if type(m) is CausalSelfAttention and not hooked(m):
            return PrefillAttention.view_of(m)
        if type(m) is MLP and not hooked(m) and getattr(m.c_fc, "fuses_gelu", False):
            return GeluFusedMLP.view_of(m)
        return None
    with torch.no_grad():
        return swap_modules(model, replace, prefill)
