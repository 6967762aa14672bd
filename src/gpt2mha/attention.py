"""GPT-2's masked multi-head self-attention, exactly as OpenAI's ``src/model.py`` computes it.

Read top to bottom: the mask, the head split/merge, the two attention cores (explicit math
that can return the weights, and PyTorch's fused ``scaled_dot_product_attention``), then the
``CausalSelfAttention`` sublayer in GPT-2's fused Conv1D layout.

Shapes use B = batch, T = new tokens, P = past (cached) tokens, S = P + T keys,
h = n_head, head_dim = n_embd // n_head.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

#: The official code writes masked scores as ``w * m - 1e10 * (1 - m)``.
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
    """Combine the causal mask with a key-padding mask, keeping every query row non-empty.

    Args:
        causal: BoolTensor ``[T, S]`` from :func:`attention_mask`.
        key_padding: optional Bool/int tensor ``[B, S]``, 1/True for real tokens, 0 for pads.

    Returns:
        BoolTensor ``[T, S]`` (no padding) or ``[B, 1, T, S]``. A padding mask never switches
        causal masking off. Each query may always read its own key (the bottom-right
        diagonal), so a pad query whose keys are all pads still has one key: its output stays
        finite (no softmax over an empty row, no NaN) and, being a pad, never reaches a real
        token, because real queries do not read pad keys.
    """
    if key_padding is None:
        return causal
    T, S = causal.shape
    mask = causal & key_padding.to(torch.bool)[:, None, None, :]
    own_key = torch.arange(T, device=causal.device)[:, None] + (S - T) == torch.arange(S, device=causal.device)
    return mask | own_key


def as_bool_mask(mask: torch.Tensor | None, name: str = "attn_mask") -> torch.Tensor | None:
    """A mask given as bool, or as an integer/float tensor of 0/1 values, as a BoolTensor.

    Every core reads the result the same way (True = may attend / real token), so a float 0/1
    mask can never reach SDPA as an additive bias.

    Raises:
        ValueError: not a tensor, or a non-bool mask holding a value other than 0 and 1
            (naming ``name`` and the offending value).
    """
    if mask is None or (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool):
        return mask
    if not isinstance(mask, torch.Tensor) or mask.is_complex():
        raise ValueError(f"{name} must be a bool tensor or a tensor of 0/1 values; got {type(mask).__name__}"
                         + (f" of dtype {mask.dtype}" if isinstance(mask, torch.Tensor) else ""))
    bad = mask[(mask != 0) & (mask != 1)]
    if bad.numel():
        raise ValueError(f"{name} must be bool or hold only 0 (masked/pad) and 1 (attend/real) values; "
                         f"got the value {bad.flatten()[0].item()!r} (dtype {mask.dtype})")
    return mask != 0


def split_heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """``[B, T, n_embd]`` → ``[B, n_head, T, head_dim]`` (OpenAI's ``split_states`` + transpose)."""
    B, T, C = x.shape
    return x.view(B, T, n_head, C // n_head).transpose(1, 2)  # [B, h, T, head_dim]


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``[B, n_head, T, head_dim]`` → ``[B, T, n_embd]``, head h at columns h·head_dim… (``merge_states``)."""
    B, h, T, hd = x.shape
    return x.transpose(1, 2).contiguous().view(B, T, h * hd)  # [B, T, n_embd]


def attend_explicit(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
    dropout_p: float = 0.0, training: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention written out, as OpenAI's ``multihead_attn``.

    Args:
        q: ``[B, h, T, head_dim]``; k, v: ``[B, h, S, head_dim]``.
        mask: BoolTensor broadcastable to ``[B, h, T, S]`` (True = may attend).
        dropout_p: dropout on the attention weights, applied only when ``training``.

    Returns:
        ``(a, w)``: context ``[B, h, T, head_dim]`` in q's dtype and weights ``[B, h, T, S]``
        (float32, or float64 for float64 inputs). Scores are computed and softmaxed in float32
        even for fp16/bf16 inputs.

    Masked scores are set to the dtype's lowest value rather than OpenAI's ``-1e10``
    (:data:`MASK_VALUE`): the weights are the same numbers whenever a query's real scores are
    above about -1e10, and masked keys still get exactly 0 when every real score is lower
    (e.g. -1e12), where -1e10 would be the row's maximum and take all the weight.
    """
    acc = torch.promote_types(q.dtype, torch.float32)          # fp16/bf16 -> fp32; fp64 stays
    w = q.to(acc) @ k.to(acc).transpose(-1, -2)                # [B, h, T, S]
    w = w * (1.0 / math.sqrt(v.shape[-1]))                     # scale the scores, not q or k
    w = torch.where(mask, w, torch.finfo(acc).min)             # masked scores -> lowest value (OpenAI: -1e10)
    w = w - w.amax(dim=-1, keepdim=True)                       # max-subtracted softmax
    w = w.exp()
    w = w / w.sum(dim=-1, keepdim=True)                        # masked keys get exactly 0
    w = w * mask.any(dim=-1, keepdim=True)                     # a query with no key reads nothing (as SDPA)
    w_drop = F.dropout(w, dropout_p, training)
    a = (w_drop @ v.to(acc)).to(v.dtype)                       # [B, h, T, head_dim]
    return a, w


def attend_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    dropout_p: float = 0.0, training: bool = False,
) -> torch.Tensor:
    """The same attention through ``torch.nn.functional.scaled_dot_product_attention``.

    Args:
        q: ``[B, h, T, head_dim]``; k, v: ``[B, h, S, head_dim]``.
        mask: BoolTensor broadcastable to ``[B, h, T, S]``, or None for "causal, T == S" or
            "one query, no padding" (bottom-right causal with one query sees every key).
            ``is_causal=True`` is only used when T == S: PyTorch aligns it top-left, which is
            wrong once a cache makes S > T.

    Returns:
        Context ``[B, h, T, head_dim]``.
    """
    T, S = q.shape[-2], k.shape[-2]
    p = dropout_p if training else 0.0
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=T == S and T > 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)


class Conv1D(nn.Module):
    """GPT-2's "conv1d": a dense layer stored ``[in, out]`` and applied as ``x @ W + b`` (no transpose).

    Args:
        n_in: input width; n_out: output width.

    Shapes: ``weight [n_in, n_out]``, ``bias [n_out]``; forward ``[..., n_in]`` → ``[..., n_out]``.

    Inside ``GPT2.decoding`` a bf16/fp16 Conv1D on CPU keeps an ``[n_out, n_in]`` copy of its
    weight (:meth:`keep_transposed`), whose layout those kernels read up to 1.4× faster for a
    few rows. While that copy is current (:attr:`weight_t`), the forward computes
    ``F.linear(x, weight_t, bias)``: the same product, in another summation order. It never does
    so when autograd wants the weight's gradient.

    Source: ``conv1d`` in openai/gpt-2 ``src/model.py`` (and transformers' ``Conv1D``).
    """

    _kept: Snapshot | None = None

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.n_in, self.n_out = n_in, n_out
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.n_in)                           # [N, n_in]
        w_t = None if self._kept is None else self.weight_t
        if w_t is not None and not (torch.is_grad_enabled() and self.weight.requires_grad):
            y = F.linear(x2, w_t, self.bias)                    # the kept [n_out, n_in] copy
        else:
            y = torch.addmm(self.bias, x2, self.weight)         # x @ W + b
        return y.view(*x.shape[:-1], self.n_out)

    @property
    def weight_t(self) -> torch.Tensor | None:
        """The kept ``[n_out, n_in]`` copy, or None: none kept, or ``weight`` is no longer the
        tensor it was taken from or has changed since (see :class:`Snapshot`)."""
        return current_copy(self._kept, self.weight)

    def keep_transposed(self) -> None:
        """Keep an ``[n_out, n_in]`` copy of the weight (:func:`transposed_copy`) until :meth:`drop_transposed`."""
        self._kept = snapshot(self.weight)

    def drop_transposed(self) -> None:
        """Free the kept copy."""
        self._kept = None

    def __getstate__(self):
        state = dict(super().__getstate__())
        state.pop("_kept", None)                                # decoding()'s copy stays with that block
        return state

    def extra_repr(self) -> str:
        return f"n_in={self.n_in}, n_out={self.n_out}"


def transposed_copy(w: torch.Tensor, dtype: torch.dtype | None = None, block: int = 256) -> torch.Tensor:
    """A new contiguous ``[C, R]`` copy of a 2-D ``w [R, C]`` (no grad), in ``dtype`` if given.

    Copied ``block`` rows of ``w`` at a time, a blocked transpose that keeps both sides in
    cache: ~110 ms for GPT-2's wte (50257×768) against 142 ms in float32 and 225 ms from bf16
    for ``w.t().contiguous()``, ~145 ms against ~210 ms for 124M's 48 bf16 block matrices.
    """
    w = w.detach()
    out = torch.empty(w.shape[1], w.shape[0], dtype=dtype or w.dtype, device=w.device)
    for i in range(0, w.shape[0], block):
        out[:, i:i + block].copy_(w[i:i + block].t())
    return out


class Snapshot(NamedTuple):
    """A copy derived from a weight, with what identifies the weight's contents at that time.

    ``source`` is the weight tensor itself and ``stamp`` its :func:`stamp`. In-place writes
    (optimizer steps, ``load_state_dict``, ``.copy_``) bump the version counter, and ``.half()``
    or ``.to()`` change the dtype or the data pointer, so a changed weight is noticed.
    Substituted weights are noticed as well: ``torch.func.functional_call`` and pruning or
    weight-norm hooks put another tensor in its place. Writes through ``.data`` bump nothing,
    and fused optimizers do not bump the counter either; neither can be seen.
    """
    copy: torch.Tensor
    source: torch.Tensor
    stamp: tuple


def stamp(w: torch.Tensor) -> tuple:
    """``(version, dtype, device, data_ptr)`` of ``w``; version is None for inference tensors."""
    return (None if w.is_inference() else w._version, w.dtype, w.device, w.data_ptr())


def snapshot(w: torch.Tensor, dtype: torch.dtype | None = None, block: int = 256) -> Snapshot:
    """A :class:`Snapshot` of ``w``'s :func:`transposed_copy`."""
    return Snapshot(transposed_copy(w, dtype, block), w, stamp(w))


def current_copy(kept: Snapshot | None, w) -> torch.Tensor | None:
    """``kept.copy`` if it was taken from ``w`` itself and ``w`` has not changed since, else None."""
    if kept is None or kept.source is not w or kept.stamp != stamp(w):
        return None
    return kept.copy


class CausalSelfAttention(nn.Module):
    """GPT-2's attention sublayer in the fused Conv1D layout (seeds 000 and 002).

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
        attn_impl: ``"sdpa"`` (fused, default) or ``"explicit"`` (returns weights). The two
            agree to float32 rounding; change it any time via the attribute.

    Parameters: ``c_attn.weight [n_embd, 3·n_embd]``, ``c_attn.bias [3·n_embd]``,
    ``c_proj.weight [n_embd, n_embd]``, ``c_proj.bias [n_embd]``.

    Raises:
        ValueError: n_embd or n_head not positive, or n_embd not divisible by n_head.

    Source: ``attn`` in openai/gpt-2 ``src/model.py``.
    """

    def __init__(self, n_embd: int, n_head: int, attn_pdrop: float = 0.0, resid_pdrop: float = 0.0,
                 attn_impl: str = "sdpa"):
        super().__init__()
        for name, value in (("n_embd", n_embd), ("n_head", n_head)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        for name, value in (("attn_pdrop", attn_pdrop), ("resid_pdrop", resid_pdrop)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value} must be in [0, 1)")
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={attn_impl!r}; expected one of {ATTN_IMPLS}")
        self.n_embd, self.n_head, self.head_dim = n_embd, n_head, n_embd // n_head
        self.attn_pdrop, self.resid_pdrop = attn_pdrop, resid_pdrop
        self.attn_impl = attn_impl
        self.c_attn = Conv1D(n_embd, 3 * n_embd)
        self.c_proj = Conv1D(n_embd, n_embd)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, T, n_embd]`` → q, k, v each ``[B, h, T, head_dim]`` (contiguous q|k|v blocks)."""
        return self.split_qkv(self.c_attn(x))

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """c_attn's output ``[B, T, 3·n_embd]`` → q, k, v each ``[B, h, T, head_dim]`` (views)."""
        q, k, v = qkv.split(self.n_embd, dim=2)                # 3 × [B, T, n_embd]
        return split_heads(q, self.n_head), split_heads(k, self.n_head), split_heads(v, self.n_head)

    def present(self, qkv: torch.Tensor) -> torch.Tensor:
        """``stack([k, v], 1)`` ``[B, 2, h, T, head_dim]`` as a view of c_attn's output (no copy):
        k and v are the 2nd and 3rd n_embd blocks of every row, so one permute lines them up."""
        B, T, _ = qkv.shape
        return qkv.view(B, T, 3, self.n_head, self.head_dim).permute(0, 2, 3, 1, 4)[:, 1:]

    def attend(self, q, k, v, mask, need_weights: bool = False):
        """Run the selected core and the output projection.

        Args: q ``[B, h, T, hd]``; k, v ``[B, h, S, hd]``; mask as for :func:`attend_sdpa`
        (None means plain causal). Returns ``y [B, T, n_embd]`` and, if ``need_weights``,
        the weights ``[B, h, T, S]`` (this forces the explicit path).
        """
        w = None
        if need_weights or self.attn_impl == "explicit":
            if mask is None:
                mask = attention_mask(q.shape[-2], k.shape[-2], device=q.device)
            a, w = attend_explicit(q, k, v, mask, self.attn_pdrop, self.training)
        else:
            a = attend_sdpa(q, k, v, mask, self.attn_pdrop, self.training)
        y = F.dropout(self.c_proj(merge_heads(a)), self.resid_pdrop, self.training)
        return y, w

    def forward(self, x: torch.Tensor, past: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None, need_weights: bool = False):
        """Attention over ``x`` and an optional cached ``past``.

        Args:
            x: ``[B, T, n_embd]`` (already layer-normalised by ln_1).
            past: optional floating ``[B, 2, h, P, head_dim]`` keys/values of earlier tokens
                (OpenAI's per-layer ``past``), concatenated before the new ones.
            attn_mask: optional mask broadcastable to ``[B, h, T, P + T]`` that replaces the
                plain causal mask (see :func:`combine_masks` for padding): bool, or 0/1 values
                (1 = may attend), read the same way by both cores (:func:`as_bool_mask`).
            need_weights: also return the attention weights ``[B, h, T, P + T]``.

        Returns:
            ``(y, present)`` with ``y [B, T, n_embd]`` and ``present = stack([k, v], 1)``
            ``[B, 2, h, T, head_dim]`` of the new tokens only, or ``(y, present, weights)``.

        Raises:
            ValueError: x is not ``[B, T, n_embd]``, past does not match x and this module or
                is not floating point, or attn_mask holds values other than 0/1.
        """
        if x.dim() != 3 or x.shape[-1] != self.n_embd or x.shape[1] == 0:
            raise ValueError(f"x has shape {tuple(x.shape)}; expected [B, T, n_embd={self.n_embd}] with T >= 1")
        qkv = self.c_attn(x)                                    # [B, T, 3·n_embd]
        q, k, v = self.split_qkv(qkv)                           # 3 × [B, h, T, head_dim]
        present = self.present(qkv)                             # [B, 2, h, T, head_dim], a view
        if past is not None:
            expected = (x.shape[0], 2, self.n_head, None, self.head_dim)
            if not isinstance(past, torch.Tensor) or not past.is_floating_point():
                raise ValueError(f"past must be a floating-point tensor of cached keys/values; got "
                                 f"{past.dtype if isinstance(past, torch.Tensor) else type(past).__name__}")
            if past.dim() != 5 or any(e is not None and e != s for e, s in zip(expected, past.shape)):
                raise ValueError(f"past has shape {tuple(past.shape)}; expected "
                                 f"[B={x.shape[0]}, 2, n_head={self.n_head}, P, head_dim={self.head_dim}]")
            k = torch.cat([past[:, 0].to(k.dtype), k], dim=-2)  # [B, h, P + T, head_dim]
            v = torch.cat([past[:, 1].to(v.dtype), v], dim=-2)
        mask = as_bool_mask(attn_mask)
        if mask is None and past is not None and x.shape[1] > 1:
            mask = attention_mask(x.shape[1], k.shape[-2], device=x.device)
        y, w = self.attend(q, k, v, mask, need_weights)
        return (y, present, w) if need_weights else (y, present)

    def forward_cached(self, x: torch.Tensor, cache, layer: int,
                       attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention that reads and writes a preallocated :class:`~gpt2mha.kv_cache.KVCache`.

        Args:
            x: ``[B, T, n_embd]`` new tokens, at positions ``cache.length … +T-1``.
            cache: the model's KVCache; this layer's slot ``layer`` is written in place.
            attn_mask: as in :meth:`forward`, over ``cache.length + T`` keys.

        Returns:
            ``y [B, T, n_embd]``; equal to :meth:`forward` with the same keys as ``past``.
        """
        q, k, v = self.qkv(x)
        k, v = cache.update(layer, k, v)                        # [B, h, P + T, head_dim]
        T, S = q.shape[-2], k.shape[-2]
        mask = as_bool_mask(attn_mask)
        if mask is None and 1 < T < S:
            mask = attention_mask(T, S, device=x.device)
        return self.attend(q, k, v, mask)[0]
