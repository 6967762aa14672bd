"""Exact weight conversions between the attention layouts: the book's classes and GPT-2's fused one.

Layouts (C = n_embd = d_out, h = heads, hd = head_dim = C // h):

* per-head wrapper: :class:`~gpt2mha.learn.book.MultiHeadAttentionWrapper`, head i owns
  ``W_query/W_key/W_value.weight [hd, d_in]`` (nn.Linear ``[out, in]``), no output projection;
* weight split: :class:`~gpt2mha.learn.book.MultiHeadAttention`, ``W_query/W_key/W_value.weight
  [C, d_in]`` whose rows ``i*hd … (i+1)*hd - 1`` are head i, ``out_proj.weight [C, C]``;
* fused: :class:`~gpt2mha.core.attention.CausalSelfAttention` (GPT-2), Conv1D
  ``[in, out]`` used as ``x @ W + b``: ``c_attn.weight [C, 3C]`` = all q | all k | all v
  (contiguous blocks, not per-head chunks), ``c_proj.weight [C, C]``;
* per-head view of the fused layout: head h's q, k, v columns at ``h*hd``, ``C + h*hd``,
  ``2C + h*hd``.

Every function copies (never aliases) and checks every size first, raising ValueError that
names the tensor and both shapes. The KV caches of ``MultiHeadAttention`` and
``CausalSelfAttention`` share one layout ``[B, 2, h, P, hd]``, so a past needs no conversion.
The module conversions leave the global RNG untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.attention import CausalSelfAttention
from .book import MultiHeadAttention, MultiHeadAttentionWrapper



def _expect(name: str, t: torch.Tensor | None, shape: tuple) -> None:
    """Raise ValueError unless tensor ``t`` has ``shape`` (None = must be absent)."""
    if shape is None or t is None:
        if (shape is None) != (t is None):
            raise ValueError(f"{name}: expected {'no tensor' if shape is None else list(shape)}, "
                             f"got {'none' if t is None else list(t.shape)}")
        return
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {list(t.shape)}, expected {list(shape)}")


def _new(cls, *args, **kwargs):
    """Build a module without consuming the global CPU RNG (its init is overwritten anyway)."""
    with torch.random.fork_rng(devices=[]):
        return cls(*args, **kwargs)


def _place(module: nn.Module, like: torch.Tensor) -> nn.Module:
    return module.to(device=like.device, dtype=like.dtype)


def _bias_or_zero(linear: nn.Linear) -> torch.Tensor:
    b = linear.bias
    return b.detach() if b is not None else linear.weight.new_zeros(linear.weight.shape[0])


# ----------------------------------------------------------------- wrapper <-> weight split
def wrapper_to_mha(wrapper: MultiHeadAttentionWrapper) -> MultiHeadAttention:
    """Per-head wrapper → :class:`MultiHeadAttention` with the same outputs.

    Head i's ``W_query.weight [hd, d_in]`` becomes rows ``i*hd … (i+1)*hd - 1`` of the result's
    ``W_query.weight [num_heads*hd, d_in]`` (same for keys, values, biases). The wrapper has no
    output projection, so ``out_proj`` is the identity ``[C, C]`` with zero bias.

    Returns:
        ``MultiHeadAttention(d_in, num_heads*hd, context_length, dropout, num_heads, qkv_bias)``
        on the wrapper's device/dtype, same ``attn_impl`` and train/eval mode.

    Raises:
        ValueError: heads that differ in sizes or bias, or a parameter of the wrong shape.
    """
    heads = list(wrapper.heads)
    h0 = heads[0]
    hd, d_in, ctx, bias = h0.d_out, h0.d_in, h0.context_length, h0.W_query.bias is not None
    for i, head in enumerate(heads):
        for role in ("W_query", "W_key", "W_value"):
            lin = getattr(head, role)
            _expect(f"heads[{i}].{role}.weight", lin.weight, (hd, d_in))
            _expect(f"heads[{i}].{role}.bias", lin.bias, (hd,) if bias else None)
        if head.context_length != ctx:
            raise ValueError(f"heads[{i}] has context_length={head.context_length}, heads[0] has {ctx}")
    C = hd * len(heads)
    mha = _new(MultiHeadAttention, d_in, C, ctx, h0.dropout.p, len(heads), qkv_bias=bias)
    with torch.no_grad():
        for role in ("W_query", "W_key", "W_value"):
            dst = getattr(mha, role)
            dst.weight.copy_(torch.cat([getattr(head, role).weight for head in heads], dim=0))  # [C, d_in]
            if bias:
                dst.bias.copy_(torch.cat([getattr(head, role).bias for head in heads], dim=0))  # [C]
        mha.out_proj.weight.copy_(torch.eye(C))
        mha.out_proj.bias.zero_()
    mha.attn_impl = wrapper.attn_impl
    return _place(mha, h0.W_query.weight).train(wrapper.training)


def mha_to_wrapper(mha: MultiHeadAttention, atol: float = 0.0) -> MultiHeadAttentionWrapper:
    """:class:`MultiHeadAttention` whose ``out_proj`` is the identity with zero bias → wrapper.

    The inverse of :func:`wrapper_to_mha`: rows ``i*hd …`` of ``W_query/W_key/W_value.weight
    [C, d_in]`` become head i's ``[hd, d_in]``. ``out_proj`` cannot be expressed by the wrapper,
    so it must be the identity (within ``atol``).

    Raises:
        ValueError: ``out_proj`` is not the identity with zero bias, or a parameter has the
            wrong shape.
    """
    C, d_in, h, hd = mha.d_out, mha.d_in, mha.num_heads, mha.head_dim
    bias = mha.W_query.bias is not None
    _check_mha(mha)
    eye = torch.eye(C, device=mha.out_proj.weight.device, dtype=mha.out_proj.weight.dtype)
    if not (torch.allclose(mha.out_proj.weight, eye, rtol=0, atol=atol)
            and torch.allclose(mha.out_proj.bias, torch.zeros_like(mha.out_proj.bias), rtol=0, atol=atol)):
        raise ValueError("out_proj is not the identity with zero bias; the wrapper has no output "
                         "projection (use mha_to_fused / fused_to_heads to keep it)")
    wrapper = _new(MultiHeadAttentionWrapper, d_in, hd, mha.context_length, mha.dropout.p, h, qkv_bias=bias)
    with torch.no_grad():
        for i, head in enumerate(wrapper.heads):
            rows = slice(i * hd, (i + 1) * hd)
            for role in ("W_query", "W_key", "W_value"):
                getattr(head, role).weight.copy_(getattr(mha, role).weight[rows])     # [hd, d_in]
                if bias:
                    getattr(head, role).bias.copy_(getattr(mha, role).bias[rows])
    wrapper.attn_impl = mha.attn_impl
    return _place(wrapper, mha.W_query.weight).train(mha.training)


def _check_mha(mha: MultiHeadAttention) -> None:
    C, d_in = mha.d_out, mha.d_in
    bias = mha.W_query.bias is not None
    for role in ("W_query", "W_key", "W_value"):
        _expect(f"{role}.weight", getattr(mha, role).weight, (C, d_in))
        _expect(f"{role}.bias", getattr(mha, role).bias, (C,) if bias else None)
    _expect("out_proj.weight", mha.out_proj.weight, (C, C))
    _expect("out_proj.bias", mha.out_proj.bias, (C,))


# -------------------------------------------------------------- weight split <-> fused GPT-2
def mha_to_fused(mha: MultiHeadAttention) -> CausalSelfAttention:
    """:class:`MultiHeadAttention` (d_in == d_out) → GPT-2's fused :class:`CausalSelfAttention`.

    ``c_attn.weight [C, 3C] = cat([W_query.weight, W_key.weight, W_value.weight], 0).T``
    (nn.Linear ``[out, in]`` → Conv1D ``[in, out]``; q | k | v contiguous blocks), ``c_attn.bias
    [3C]`` = the three biases or zeros when ``qkv_bias=False``; ``c_proj.weight [C, C] =
    out_proj.weight.T``, ``c_proj.bias = out_proj.bias``. ``attn_pdrop`` = the book's dropout.

    Raises:
        ValueError: ``d_in != d_out`` (GPT-2's sublayer maps n_embd → n_embd), or a parameter
            of the wrong shape.
    """
    if mha.d_in != mha.d_out:
        raise ValueError(f"d_in={mha.d_in} != d_out={mha.d_out}: the fused CausalSelfAttention needs "
                         f"d_in == d_out == n_embd")
    _check_mha(mha)
    C = mha.d_out
    attn = _new(CausalSelfAttention, C, mha.num_heads, attn_pdrop=mha.dropout.p, attn_impl=mha.attn_impl)
    with torch.no_grad():
        roles = (mha.W_query, mha.W_key, mha.W_value)
        attn.c_attn.weight.copy_(torch.cat([lin.weight for lin in roles], dim=0).t())   # [C, 3C]
        attn.c_attn.bias.copy_(torch.cat([_bias_or_zero(lin) for lin in roles], dim=0))  # [3C]
        attn.c_proj.weight.copy_(mha.out_proj.weight.t())                               # [C, C]
        attn.c_proj.bias.copy_(mha.out_proj.bias)
    return _place(attn, mha.W_query.weight).train(mha.training)


def fused_to_mha(attn: CausalSelfAttention, context_length: int, qkv_bias: bool | None = None) -> MultiHeadAttention:
    """GPT-2's fused :class:`CausalSelfAttention` → :class:`MultiHeadAttention` (inverse of :func:`mha_to_fused`).

    ``W_query/W_key/W_value.weight [C, C]`` are the transposed column blocks ``0:C``, ``C:2C``,
    ``2C:3C`` of ``c_attn.weight [C, 3C]``; ``out_proj.weight = c_proj.weight.T``.

    Args:
        context_length: the result's context length (the fused module has none).
        qkv_bias: None = True iff ``c_attn.bias`` has a nonzero entry; False requires the bias
            to be all zeros (the book's default layout has no q/k/v bias).

    Raises:
        ValueError: ``qkv_bias=False`` with a nonzero ``c_attn.bias``, or a wrong shape.
    """
    C, h = attn.n_embd, attn.n_head
    _expect("c_attn.weight", attn.c_attn.weight, (C, 3 * C))
    _expect("c_attn.bias", attn.c_attn.bias, (3 * C,))
    _expect("c_proj.weight", attn.c_proj.weight, (C, C))
    _expect("c_proj.bias", attn.c_proj.bias, (C,))
    nonzero = bool(attn.c_attn.bias.detach().ne(0).any())
    if qkv_bias is None:
        qkv_bias = nonzero
    elif not qkv_bias and nonzero:
        raise ValueError("c_attn.bias has nonzero entries; convert with qkv_bias=True (or None) to keep them")
    mha = _new(MultiHeadAttention, C, C, context_length, attn.attn_pdrop, h, qkv_bias=qkv_bias)
    with torch.no_grad():
        w = attn.c_attn.weight.t()                                   # [3C, C] in nn.Linear layout
        for i, lin in enumerate((mha.W_query, mha.W_key, mha.W_value)):
            lin.weight.copy_(w[i * C:(i + 1) * C])                   # [C, C]
            if qkv_bias:
                lin.bias.copy_(attn.c_attn.bias[i * C:(i + 1) * C])
        mha.out_proj.weight.copy_(attn.c_proj.weight.t())
        mha.out_proj.bias.copy_(attn.c_proj.bias)
    mha.attn_impl = attn.attn_impl
    return _place(mha, attn.c_attn.weight).train(attn.training)


# ----------------------------------------------------------------- fused <-> per-head view
def fused_to_heads(attn: CausalSelfAttention) -> list[dict[str, torch.Tensor]]:
    """Per-head view of GPT-2's fused attention (its q | k | v column offsets).

    For head h (hd = head_dim, C = n_embd), in Conv1D layout (``x @ W + b``):
    ``q_weight = c_attn.weight[:, h*hd : h*hd+hd]``, ``k_weight`` at ``C + h*hd``, ``v_weight``
    at ``2C + h*hd`` (each ``[C, hd]``), the matching ``q_bias/k_bias/v_bias [hd]``, and
    ``proj_weight = c_proj.weight[h*hd : h*hd+hd] [hd, C]``, the rows of c_proj that read head
    h, so ``y = sum_h a_h @ proj_weight_h + c_proj.bias``.

    Returns:
        ``n_head`` dicts of detached copies.
    """
    C, hd = attn.n_embd, attn.head_dim
    _expect("c_attn.weight", attn.c_attn.weight, (C, 3 * C))
    _expect("c_attn.bias", attn.c_attn.bias, (3 * C,))
    _expect("c_proj.weight", attn.c_proj.weight, (C, C))
    W, b = attn.c_attn.weight.detach(), attn.c_attn.bias.detach()
    heads = []
    for h in range(attn.n_head):
        q, k, v = (slice(base + h * hd, base + (h + 1) * hd) for base in (0, C, 2 * C))
        heads.append({
            "q_weight": W[:, q].clone(), "k_weight": W[:, k].clone(), "v_weight": W[:, v].clone(),  # [C, hd]
            "q_bias": b[q].clone(), "k_bias": b[k].clone(), "v_bias": b[v].clone(),                 # [hd]
            "proj_weight": attn.c_proj.weight.detach()[h * hd:(h + 1) * hd].clone(),                # [hd, C]
        })
    return heads


def heads_to_fused(heads: list[dict[str, torch.Tensor]], c_proj_bias: torch.Tensor) -> CausalSelfAttention:
    """Inverse of :func:`fused_to_heads`: per-head dicts + ``c_proj_bias [C]`` → :class:`CausalSelfAttention`.

    Raises:
        ValueError: no heads, a missing key, or a tensor whose shape does not match head 0's
            ``[C, hd]`` / ``[hd]`` / ``[hd, C]`` layout or ``c_proj_bias [C]``.
    """
    if not heads:
        raise ValueError("heads is empty; need at least one head")
    keys = ("q_weight", "k_weight", "v_weight", "q_bias", "k_bias", "v_bias", "proj_weight")
    for i, head in enumerate(heads):
        missing = [k for k in keys if k not in head]
        if missing:
            raise ValueError(f"heads[{i}] is missing {', '.join(missing)}")
    C, hd = heads[0]["q_weight"].shape if heads[0]["q_weight"].dim() == 2 else (None, None)
    if C is None or hd * len(heads) != C:
        raise ValueError(f"heads[0]['q_weight'] has shape {list(heads[0]['q_weight'].shape)}; expected "
                         f"[n_embd, head_dim] with n_embd = {len(heads)} heads x head_dim")
    shapes = {"q_weight": (C, hd), "k_weight": (C, hd), "v_weight": (C, hd), "q_bias": (hd,), "k_bias": (hd,),
              "v_bias": (hd,), "proj_weight": (hd, C)}
    for i, head in enumerate(heads):
        for k in keys:
            _expect(f"heads[{i}]['{k}']", head[k], shapes[k])
    _expect("c_proj_bias", c_proj_bias, (C,))
    attn = _new(CausalSelfAttention, C, len(heads))
    with torch.no_grad():
        for j, role in enumerate("qkv"):
            attn.c_attn.weight[:, j * C:(j + 1) * C].copy_(torch.cat([hh[f"{role}_weight"] for hh in heads], dim=1))
            attn.c_attn.bias[j * C:(j + 1) * C].copy_(torch.cat([hh[f"{role}_bias"] for hh in heads]))
        attn.c_proj.weight.copy_(torch.cat([hh["proj_weight"] for hh in heads], dim=0))
        attn.c_proj.bias.copy_(c_proj_bias)
    return _place(attn, heads[0]["q_weight"])
