"""How a weight is stored for speed: dense copies in the layout a kernel reads fastest, and
weight-only int8 / int4 quantization (issue 13).

Decoding one token at a time streams every weight once per step, so its speed is the bytes of
weights divided by the memory bandwidth. Two ways to read fewer or faster bytes live here:

* **Decode-time copies** of a dense weight (:func:`transposed_copy`, :class:`Snapshot`): the
  ``[out, in]`` copy a bf16/fp16 Conv1D multiplies by inside ``GPT2.decoding()``, and the
  float32 ``[n_embd, n_vocab]`` copy of the LM head. A copy is used only while the weight it was
  taken from is unchanged (:func:`current_copy`).
* **Weight-only quantization** (gpt-fast's ``int8``/``int4`` modes, llama.cpp's ``q8_0``/``q4_0``):
  weights stored as int8 with one scale per output channel (symmetric), or as int4 with a scale
  and a zero per group of ``group_size`` inputs (asymmetric), activations kept in floating
  point. The rounding and packing are ours: round to nearest (:func:`quantize_int8`,
  :func:`quantize_int4`) or GPTQ on calibration text (:func:`gptq`, the default of
  :func:`quantize_model`). The matrix products are PyTorch's: int8 as exact integer products
  (``torch._int_mm``) of 16-bit activations split into two int8 pieces (:func:`int8_matmul`),
  int4 on ``aten._weight_int4pack_mm_for_cpu`` with bf16 activations (chosen by measurement
  over ``aten._weight_int8pack_mm`` and torchao, benchmarks/quant_kernels.py and RESULTS.md).
  :class:`QuantizedLinear` holds one quantized matrix; :func:`quantize_model` swaps every
  Conv1D of the blocks and the LM head for one.

Shapes: a Conv1D weight is ``[n_in, n_out]`` (``x @ W``); quantized weights are stored
``[out, in]`` (``N = out`` rows of ``K = in`` inputs), as the kernels read them.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

#: Schemes accepted by :meth:`gpt2mha.GPT2.quantize`.
SCHEMES = ("int8", "int4")
#: How the weights are rounded: "gptq" (:func:`gptq`, on calibration text) or "rtn" (to nearest).
METHODS = ("gptq", "rtn")
#: Group size used when none is given (int8 has one scale per output channel, no groups).
#: int4's 32 is the size that reached issue 13's 97% top-1 agreement on the built-in model with
#: GPTQ (64: 96.7%), and decodes as fast as 64 on this CPU (RESULTS.md, "Quantized decode").
DEFAULT_GROUP_SIZE = {"int8": None, "int4": 32}
#: The calibration text GPTQ uses when none is given: the first 16 KiB of Tiny Shakespeare,
#: inside the built-in model's training split (package data ``gpt2mha/data/calibration.txt``).
DEFAULT_CALIBRATION = "calibration.txt"
#: Group sizes the int4 CPU kernel takes.
INT4_GROUP_SIZES = (32, 64, 128, 256)
#: Dtype of the stored scales, and of the activations handed to the int4 kernel, which runs
#: 30x faster on bf16 than on float32 activations (RESULTS.md). The product is converted back
#: to the model's dtype; the bias and the residual stream stay in it.
KERNEL_DTYPE = torch.bfloat16
#: The LM head is int8 in both schemes: on the built-in model an int4 head (group 64) lowered
#: int4's top-1 agreement with float32 from 93.8% to 91.0% and raised its bits/byte by 0.0024,
#: for 0.45 ms/step less on 124M (RESULTS.md). A tied embedding then carries int8's ~1% error.
HEAD_SCHEME = "int8"
#: Robust relative error (:func:`error_row`) above which a tensor is reported as abnormal. A
#: Gaussian weight gives ~0.01 in int8 (per channel) and ~0.09 in int4 (group 64, asymmetric);
#: an outlier stretching a channel's or a group's range pushes it well past these limits.
ABNORMAL_ERROR = {"int8": 0.03, "int4": 0.20}


class QuantizationError(ValueError):
    """A quantized checkpoint or tensor that cannot be used as it is; the message names it."""


# ------------------------------------------------------------------ decode-time dense copies
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


# ------------------------------------------------------------------ quantization math
def _round_scales_up(s: torch.Tensor) -> torch.Tensor:
    """``s`` (float32, > 0) in :data:`KERNEL_DTYPE`, rounded up so that ``w / scale`` stays in range."""
    low = s.to(KERNEL_DTYPE)
    return torch.where(low.float() < s, torch.nextafter(low, torch.full_like(low, math.inf)), low)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization of ``w [N, K]`` (rows = output channels).

    ``scale[n] = max_k |w[n, k]| / 127`` (rounded up to :data:`KERNEL_DTYPE`; an all-zero row
    gets scale 1), ``q = round(w / scale)`` in ``[-127, 127]``, so ``|w − q·scale| ≤ scale / 2``.

    Returns:
        ``(q int8 [N, K], scales [N])`` in :data:`KERNEL_DTYPE`.

    Source: gpt-fast ``quantize.py`` (``dynamically_quantize_per_channel``), LLM.int8's
    absmax quantization.
    """
    w = w.detach().float().contiguous()
    amax = w.abs().amax(dim=1)
    scales = _round_scales_up(torch.where(amax > 0, amax / 127, torch.ones_like(amax)))
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``q [N, K] int8`` × ``scales [N]`` → float32 ``[N, K]``."""
    return q.float() * scales.float()[:, None]


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 quantization of ``w [N, K]`` along K (the inputs).

    Each row's K inputs are cut into groups of ``group_size``; a group spanning ``[lo, hi]`` gets
    ``scale = (hi − lo) / 15`` and ``zero = lo + 8·scale`` (both rounded to
    :data:`KERNEL_DTYPE`), and ``q = round((w − zero) / scale) + 8`` in ``[0, 15]``: the
    dequantized value is ``(q − 8)·scale + zero``, PyTorch's int4pack convention.

    Returns:
        ``(q int32 [N, K] in 0..15, scale_zero [K / group_size, N, 2])``; scale_zero in
        :data:`KERNEL_DTYPE`, ``[..., 0]`` scales and ``[..., 1]`` zeros, the layout
        ``aten._weight_int4pack_mm_for_cpu`` reads.

    Source: gpt-fast ``quantize.py`` (``get_group_qparams``), torchao's float-zero affine scheme.
    """
    w = w.detach().float().contiguous()
    N, K = w.shape
    g = w.view(N, K // group_size, group_size)
    scale, zero = _int4_params(g.amin(-1), g.amax(-1))                     # [N, K/g]
    q = torch.round((g - zero[..., None]) / scale[..., None]) + 8
    q = q.clamp_(0, 15).to(torch.int32).view(N, K)
    scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)
    return q, scale_zero


def _int4_params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 ``(scale, zero)`` (float32 holding :data:`KERNEL_DTYPE` values) of groups spanning
    ``[lo, hi]``: ``scale = (hi − lo) / 15`` rounded up, ``zero = lo + 8·scale`` rounded."""
    scale = _round_scales_up(((hi - lo) / 15).clamp(min=1e-6)).float()
    return scale, (lo + 8 * scale).to(KERNEL_DTYPE).float()


def dequantize_int4(q: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """``q [N, K]`` (0..15) with ``scale_zero [K / group_size, N, 2]`` → float32 ``[N, K]``."""
    N, K = q.shape
    sz = scale_zero.float().transpose(0, 1)                                 # [N, K/g, 2]
    g = q.view(N, K // group_size, group_size).float()
    return ((g - 8) * sz[..., :1] + sz[..., 1:]).view(N, K)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` values 0..15 → uint8 ``[N, K / 2]``: input ``2i`` in the low nibble, ``2i + 1``
    in the high one (the storage layout on disk; the kernel's own packing is CPU-specific)."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 ``[N, K / 2]`` → int32 ``[N, K]``."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1).to(torch.int32)


# ------------------------------------------------------------------ GPTQ
#: GPTQ's dampening: ``damp · mean(diag H)`` is added to H's diagonal (Frantar et al., §4 "Step 3").
GPTQ_DAMP = 0.01
#: Columns quantized between two lazy batch updates of the rest (Frantar et al., "Step 2").
GPTQ_BLOCK = 128


@torch.no_grad()
def gptq(w: torch.Tensor, hessian: torch.Tensor, scheme: str, group_size: int | None = None,
         damp: float = GPTQ_DAMP) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [N, K]`` (rows = output channels) so that its *products* with the calibration
    inputs stay close, not its entries: GPTQ (Frantar et al., 2022, "GPTQ: Accurate
    Post-Training Quantization for Generative Pre-trained Transformers", Algorithm 1).

    The K input columns are rounded one at a time, left to right; each rounding error is spread
    over the columns not yet rounded, weighted by the inverse of ``hessian = Σ xᵀx`` over the
    calibration inputs ``x [*, K]``, which minimises ``‖x·Wᵀ − x·deq(Q)ᵀ‖²`` greedily. Storage
    and kernels are those of :func:`quantize_int8` (its per-channel scales, from ``w``) and
    :func:`quantize_int4` (group scale and zero computed when the group's first column is
    reached, from the error-corrected weights). Inputs never seen (a zero diagonal) are rounded
    to nearest.

    Args:
        w: ``[N, K]`` float weight; hessian: ``[K, K]`` ``Σ xᵀx`` (float32 or float64).
        scheme, group_size: as :func:`check_scheme`; damp: see :data:`GPTQ_DAMP`.

    Returns:
        What :func:`quantize_int8` / :func:`quantize_int4` return for ``w``.

    Raises:
        ValueError: a hessian that is not ``[K, K]`` or holds NaN/inf.
    """
    W = w.detach().float().clone()
    N, K = W.shape
    if hessian.shape != (K, K):
        raise ValueError(f"hessian: expected a [{K}, {K}] matrix for a weight [{N}, {K}], got {list(hessian.shape)}")
    if not torch.isfinite(hessian).all():
        raise ValueError("hessian: holds NaN or inf (calibration activations that are not finite)")
    Hinv = None
    for dtype in (torch.float32, torch.float64):               # float64 when float32 is not positive definite
        H = hessian.detach().to(W.device, dtype).clone()
        diag = torch.diagonal(H)
        diag[diag == 0] = 1                                     # inputs never seen: no correlations
        diag += damp * diag.mean()
        try:
            Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
            break
        except RuntimeError:
            continue
    if Hinv is None:
        raise ValueError(f"hessian: not positive definite even in float64 with damp={damp} (calibration "
                         f"activations or weights of extreme magnitude); quantize with method='rtn'")
    if not torch.isfinite(Hinv).all():
        raise ValueError("hessian: its inverse is not finite (activations of extreme magnitude); "
                         "quantize with method='rtn'")
    Q = torch.empty(N, K, device=W.device)
    if scheme == "int8":
        _, scales = quantize_int8(w)
        s = scales.float()
        params = (s, torch.zeros_like(s))                      # w ≈ q·s, q in -127..127
        qmin, qmax, offset = -127, 127, 0
    else:
        groups = []                                             # (scale, zero) per group, [N] each
        qmin, qmax, offset = 0, 15, 8                          # w ≈ (q − 8)·scale + zero
    block = max(GPTQ_BLOCK, group_size or 0)
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1, E1, Hi = W[:, i1:i2].clone(), torch.empty(N, i2 - i1, device=W.device), Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            if scheme == "int4" and (i1 + i) % group_size == 0:
                g = W1[:, i:i + group_size]
                params = _int4_params(g.amin(-1), g.amax(-1))
                groups.append(params)
            scale, zero = params
            col = W1[:, i]
            q = torch.round((col - zero) / scale).add_(offset).clamp_(qmin, qmax)
            Q[:, i1 + i] = q
            err = (col - ((q - offset) * scale + zero)) / Hi[i, i]
            W1[:, i:] -= err[:, None] * Hi[i, i:][None]
            E1[:, i] = err
        W[:, i2:] -= E1 @ Hinv[i1:i2, i2:]
    if scheme == "int8":
        return Q.to(torch.int8), scales
    scale_zero = torch.stack([torch.stack(p, -1) for p in groups])            # [K/g, N, 2]
    return Q.to(torch.int32), scale_zero.to(KERNEL_DTYPE)


# ------------------------------------------------------------------ int8 products
#: A row whose largest |activation| exceeds this many times its mean |activation| (an outlier
#: feature) is split into three int8 pieces instead of two (:func:`int8_matmul`).
WIDE_ROW = 40.0


def split_activations(x: torch.Tensor, pieces: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Write float ``x [M, K]`` as ``a · (p₀ + p₁/254 + p₂/254² + …)`` with ``pieces`` int8
    ``pᵢ`` and one float ``a [M, 1]`` per row (``max |x| / 127``), so that integer products see
    ~8 + 8·(pieces − 1) significant bits of the row's largest value.

    ``p₀ = round(x / a)``, then each next piece rounds 254 × what the previous left over; the
    error is at most ``a / (2·254^(pieces−1))``: ``max|x| / 64516`` for two pieces,
    ``max|x| / 16.4e6`` for three (float32's own precision). Non-finite rows give NaN.

    Returns:
        ``(pieces int8 [pieces·M, K]: all p₀ rows, then all p₁ rows, …, a float32 [M, 1])``.
    """
    x = x.float()
    a = x.abs().amax(-1, keepdim=True).clamp_(min=1e-30) / 127
    u = x / a
    out = []
    for i in range(pieces):
        p = u.round()
        out.append(p)
        if i < pieces - 1:
            u = (u - p).mul_(254)
    return torch.cat(out).to(torch.int8), a


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ (q · scales)ᵀ`` → float32 ``[M, N]`` for int8 ``q [N, K]``, scales ``[N]``.

    The activations are split into int8 pieces per row (:func:`split_activations`: two, or
    three when a row holds an outlier beyond :data:`WIDE_ROW` times its mean magnitude, which
    would otherwise set a coarse step for the rest of the row) and multiplied by ``q`` with
    ``torch._int_mm``, whose int32 sums are exact; one float32 rescale per row and per output
    channel follows. The product is about as exact as float32 activations give (relative error
    ~3e-5 on ordinary rows, against ~2e-3 for bf16 activations on ``aten._weight_int8pack_mm``,
    whose output is also rounded to bf16), at 1.3-1.6x that kernel's time (RESULTS.md, "Second
    pass: exact int8 products, GPTQ, int4 group 32").
    """
    M = x.shape[0]
    xf = x.float()
    xa = xf.abs()
    wide = bool((xa.amax(-1) > WIDE_ROW * xa.mean(-1)).any())
    n = 3 if wide else 2
    pieces, a = split_activations(xf, n)
    if M == 1:                                                  # single rows take the GEMV path
        parts = [torch._int_mm(pieces[i:i + 1], q.t()) for i in range(n)]
    else:
        parts = torch._int_mm(pieces, q.t()).split(M)
    y = parts[-1].float()
    for part in reversed(parts[:-1]):                           # Horner: p₀ + (p₁ + p₂/254)/254
        y = y.mul_(1 / 254).add_(part)
    return y.mul_(a).mul_(scales.float())


# ------------------------------------------------------------------ the quantized layer
def _pad_rows(n: int, multiple: int = 16) -> int:
    return -(-n // multiple) * multiple


class QuantizedLinear(nn.Module):
    """A dense layer with a weight-only quantized weight: ``y = x @ deq(W)ᵀ + b``.

    Args:
        n_in, n_out: input and output widths (K and N).
        scheme: ``"int8"`` (per-output-channel scales) or ``"int4"`` (per-group scale and zero).
        group_size: int4's group of inputs sharing a scale (must divide ``n_in``); None for int8.
        bias: whether the layer adds a float bias ``[n_out]``.

    Buffers (what the checkpoint stores): int8 ``weight`` int8 ``[n_out, n_in]`` and ``scales``
    ``[n_out]``; int4 ``weight`` uint8 ``[n_out, n_in / 2]`` (:func:`pack_int4`) and
    ``scale_zero [n_in / group_size, n_out, 2]``; scales in :data:`KERNEL_DTYPE` whatever the
    model's dtype. ``bias`` is a parameter without grad, in the model's dtype. For the int4
    kernel the weight is also kept in its CPU-specific packed layout (rows padded to a multiple
    of 16), rebuilt whenever the buffers are loaded.

    Forward: ``[..., n_in]`` → ``[..., n_out]`` in x's dtype. On CPU int8 runs
    :func:`int8_matmul` (float32 result), int4 hands the kernel :data:`KERNEL_DTYPE`
    activations; the product comes back to x's dtype before the bias is added (float32 bias
    and residual stream for a float32 model). Elsewhere the weight is dequantized for each call
    (correct, not fast).

    Raises:
        RuntimeError: in forward, if autograd would need a gradient through the layer
            (quantized weights are for inference; train the float model).
    """

    def __init__(self, n_in: int, n_out: int, scheme: str, group_size: int | None = None, bias: bool = True):
        super().__init__()
        check_scheme(scheme, group_size, n_in)
        self.n_in, self.n_out, self.scheme, self.group_size = n_in, n_out, scheme, group_size
        if scheme == "int8":
            self.register_buffer("weight", torch.zeros(n_out, n_in, dtype=torch.int8))
            self.register_buffer("scales", torch.ones(n_out, dtype=KERNEL_DTYPE))
        else:
            self.register_buffer("weight", torch.zeros(n_out, n_in // 2, dtype=torch.uint8))
            self.register_buffer("scale_zero", torch.ones(n_in // group_size, n_out, 2, dtype=KERNEL_DTYPE))
            self.register_buffer("packed", None, persistent=False)
        self.bias = nn.Parameter(torch.zeros(n_out), requires_grad=False) if bias else None

    @classmethod
    def from_float(cls, w: torch.Tensor, b: torch.Tensor | None, scheme: str,
                   group_size: int | None = None, hessian: torch.Tensor | None = None) -> "QuantizedLinear":
        """Quantize ``w [n_out, n_in]`` (and keep ``b [n_out]`` as it is) into a new layer:
        rounded to nearest, or by :func:`gptq` when the inputs' ``hessian [n_in, n_in]`` is given."""
        n_out, n_in = w.shape
        layer = cls(n_in, n_out, scheme, group_size, bias=b is not None).to(w.device)
        with torch.no_grad():
            if hessian is not None:
                q, params = gptq(w, hessian, scheme, group_size)
            else:
                q, params = quantize_int8(w) if scheme == "int8" else quantize_int4(w, group_size)
            if scheme == "int8":
                layer.weight, layer.scales = q, params
            else:
                layer.scale_zero = params
                layer.weight = pack_int4(q)
                layer.repack()
            if b is not None:
                layer.bias = nn.Parameter(b.detach().clone(), requires_grad=False)
        return layer

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``[n_out, n_in]`` this layer multiplies by."""
        if self.scheme == "int8":
            return dequantize_int8(self.weight, self.scales)
        return dequantize_int4(unpack_int4(self.weight), self.scale_zero, self.group_size)

    def repack(self) -> None:
        """Rebuild the int4 kernel's packed weight from ``weight`` and ``scale_zero`` (CPU only)."""
        if self.scheme != "int4" or self.weight.device.type != "cpu" or self.weight.is_meta:
            self.packed = None
            return
        q = unpack_int4(self.weight)
        pad = _pad_rows(self.n_out) - self.n_out                         # the kernel needs N % 16 == 0
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(F.pad(q, (0, 0, 0, pad)), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(f"this layer's weight is quantized ({self.scheme}): autograd cannot flow through "
                               f"it; quantized models are for inference (train the float model, then quantize)")
        x2 = x.reshape(-1, self.n_in)                                  # [M, K]
        if x.device.type != "cpu":
            y = F.linear(x2.to(KERNEL_DTYPE), self.dequantized().to(KERNEL_DTYPE))
        elif self.scheme == "int8":
            y = int8_matmul(x2, self.weight, self.scales)
        else:
            x2 = x2.to(KERNEL_DTYPE).contiguous()
            pad = self.packed.shape[0] - self.n_out                    # rows padded to a multiple of 16
            scale_zero = F.pad(self.scale_zero, (0, 0, 0, pad)) if pad else self.scale_zero
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, scale_zero)
            y = y[:, :self.n_out]
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.n_out)

    def _apply(self, fn, recurse=True):
        """As any module (device moves, ``.to(dtype)``), except that the scales keep
        :data:`KERNEL_DTYPE`: ``.half()`` or ``.float()`` convert only the bias."""
        name = "scales" if self.scheme == "int8" else "scale_zero"
        scales = self._buffers.pop(name)
        super()._apply(fn, recurse)
        self._buffers[name] = fn(scales.view(torch.int16)).view(KERNEL_DTYPE)   # an int view: dtype kept
        if self.scheme == "int4" and (self.packed is None or self.packed.device != self.weight.device):
            self.repack()
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.repack()

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        return f"n_in={self.n_in}, n_out={self.n_out}, scheme={self.scheme}{g}, bias={self.bias is not None}"


def check_scheme(scheme, group_size, n_in: int | None = None) -> None:
    """Raises ValueError naming the argument for an unknown scheme or a group size the scheme
    or the kernel cannot use (int4: one of :data:`INT4_GROUP_SIZES` dividing ``n_in``)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} is unknown; expected one of {SCHEMES}")
    if scheme == "int8":
        if group_size is not None:
            raise ValueError(f"group_size={group_size!r}: int8 has one scale per output channel, no groups; "
                             f"leave group_size as None")
        return
    if isinstance(group_size, bool) or group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size={group_size!r}: int4 needs one of {INT4_GROUP_SIZES} (the CPU kernel's sizes)")
    if n_in is not None and n_in % group_size:
        fits = [g for g in INT4_GROUP_SIZES if n_in % g == 0]
        raise ValueError(f"group_size={group_size} does not divide the layer's input width {n_in} (n_embd or "
                         f"4·n_embd); " + (f"choose one of {fits}" if fits else
                                           f"no int4 group size {INT4_GROUP_SIZES} does: use int8"))


# ------------------------------------------------------------------ the whole model
#: The four Conv1Ds of a block, by their path inside it.
BLOCK_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class QuantizationWarning(UserWarning):
    """A tensor whose quantization error is abnormal (:data:`ABNORMAL_ERROR`)."""


def head_weight(model) -> torch.Tensor:
    """The LM head's float weight ``[n_vocab, n_embd]``: ``GPT2.output_weight()`` (``wte.weight``
    when tied)."""
    return model.output_weight()


def error_row(name: str, w: torch.Tensor, layer: QuantizedLinear, hessian: torch.Tensor | None = None) -> dict:
    """Quantization error of one tensor.

    ``rel_error = rms(W − deq(W)) / rms(W)``, and ``robust_rel_error``, the same error over a
    robust spread of W, ``1.4826 · median |W|`` (σ for a Gaussian): an outlier channel inflates
    rms(W) as much as the error, so only the robust figure shows that it stretched the scales
    for every other weight of its rows or groups. ``abnormal`` when the robust figure exceeds
    :data:`ABNORMAL_ERROR`, or an error is not finite. Also ``max_abs_error``, and with the
    calibration inputs' ``hessian = Σ xᵀx`` the error of the products,
    ``output_rel_error = ‖x·(W − deq(W))ᵀ‖ / ‖x·Wᵀ‖`` over those inputs (None without).
    """
    w = w.detach().float()
    err = layer.dequantized() - w
    rms_err = err.pow(2).mean().sqrt()
    rel = float(rms_err / w.pow(2).mean().sqrt().clamp(min=1e-30))
    robust = float(rms_err / (1.4826 * w.abs().median()).clamp(min=1e-30))
    out = None
    if hessian is not None:
        h = hessian.float()
        out = float(((err @ h) * err).sum().clamp(min=0).sqrt() / ((w @ h) * w).sum().clamp(min=1e-30).sqrt())
    return dict(name=name, shape=list(w.shape), scheme=layer.scheme, rel_error=rel, robust_rel_error=robust,
                max_abs_error=float(err.abs().max()), output_rel_error=out,
                abnormal=not robust <= ABNORMAL_ERROR[layer.scheme])


def quantized_layers(model, scheme: str, group_size: int | None) -> dict[str, QuantizedLinear]:
    """Empty :class:`QuantizedLinear` layers for every block Conv1D and the head of ``model``
    (shapes only, to be filled by ``load_state_dict``), by module path."""
    c = model.config
    layers = {}
    for i in range(c.n_layer):
        for path, (n_in, n_out) in zip(BLOCK_LINEARS, ((c.n_embd, 3 * c.n_embd), (c.n_embd, c.n_embd),
                                                      (c.n_embd, 4 * c.n_embd), (4 * c.n_embd, c.n_embd))):
            layers[f"h.{i}.{path}"] = QuantizedLinear(n_in, n_out, scheme, group_size)
    layers["quantized_head"] = QuantizedLinear(c.n_embd, c.n_vocab, HEAD_SCHEME, bias=False)
    return layers


def install(model, layers: dict[str, nn.Module], scheme: str, group_size: int | None, tied: bool) -> None:
    """Put ``layers`` into ``model`` at their paths, record the scheme, freeze the rest."""
    for path, layer in layers.items():
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, layer)
    if not tied and isinstance(getattr(model, "lm_head", None), nn.Module):
        model.lm_head = None                                      # the untied float head: quantized_head replaces it
    model.quantization = {"scheme": scheme, "group_size": group_size, "head": HEAD_SCHEME, "tied": tied}
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)


#: Rows of calibration tokens run through the model at a time.
CALIBRATION_BATCH = 8


def default_calibration() -> str:
    """The packaged calibration text (:data:`DEFAULT_CALIBRATION`)."""
    from importlib.resources import files
    return files("gpt2mha").joinpath("data", DEFAULT_CALIBRATION).read_text(encoding="utf-8")


def calibration_ids(model, calibration) -> torch.Tensor:
    """Calibration tokens ``[B, T]`` (int64) for :func:`quantize_model` from text (encoded with
    the model's tokenizer) or token ids (1-D, cut into rows of ``T = min(n_ctx, 256)``, or
    ``[B, T]``).

    Raises:
        ValueError: naming ``calibration``: not text or integer ids, ids outside the
            vocabulary, rows longer than n_ctx, or fewer tokens than one row.
    """
    c = model.config
    path_hint = ""
    if isinstance(calibration, (bytes, bytearray, os.PathLike)):
        raise ValueError(f"calibration: expected text (str) or integer token ids, got {type(calibration).__name__}; "
                         f"to calibrate on a file pass its text, open(path, encoding='utf-8').read() (the CLI's "
                         f"--calibration FILE reads the file)")
    if isinstance(calibration, str):
        if not calibration:
            raise ValueError("calibration: the text is empty")
        if len(calibration) < 4096 and os.path.isfile(calibration):
            path_hint = (f" (calibration= takes the text itself, and {calibration!r} is a file name: pass "
                         f"open({calibration!r}, encoding='utf-8').read())")
        from .tokenizer import get_tokenizer
        calibration = get_tokenizer(c.tokenizer).encode(calibration)
    try:
        ids = torch.as_tensor(calibration)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"calibration: expected text or integer token ids [N] or [B, T] (equal rows), got "
                         f"{type(calibration).__name__} ({e})") from None
    if ids.numel() == 0 and ids.dim() == 1:
        raise ValueError("calibration: no tokens")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() not in (1, 2):
        raise ValueError(f"calibration: expected text or integer token ids [N] or [B, T], got a {ids.dim()}-D "
                         f"{ids.dtype} tensor")
    ids = ids.long()
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < c.n_vocab):
        raise ValueError(f"calibration: token ids must be in [0, {c.n_vocab}), got {int(ids.min())}..{int(ids.max())}")
    if ids.dim() == 1:
        T = min(c.n_ctx, 256)
        if len(ids) < T:
            raise ValueError(f"calibration: {len(ids)} tokens, fewer than one row of {T}; give more text{path_hint}")
        ids = ids[:len(ids) // T * T].view(-1, T)
    if ids.shape[1] > c.n_ctx or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"calibration: rows [{ids.shape[0]}, {ids.shape[1]}]: need at least one row of at most "
                         f"n_ctx={c.n_ctx} tokens")
    return ids


def _hessians(modules: dict[str, nn.Module], run, of_output: bool = False) -> dict[str, torch.Tensor]:
    """``Σ xᵀx`` (float64 ``[K, K]``) of each module's inputs (or outputs) while ``run()`` runs."""
    hessians, hooks = {}, []
    for name, m in modules.items():
        def hook(mod, args, out, name=name):
            x = (out if of_output else args[0]).detach()
            x = x.reshape(-1, x.shape[-1]).float()
            h = x.t() @ x
            if not torch.isfinite(h).all():                     # float32 overflow: redo in float64
                h = x.double().t() @ x.double()
            hessians[name] = hessians.get(name, 0) + h.double()
        hooks.append(m.register_forward_hook(hook))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return hessians


@torch.no_grad()
def _gptq_layers(model, scheme: str, group_size: int | None, ids: torch.Tensor, weights: dict) -> tuple[dict, dict]:
    """GPTQ every layer of ``weights`` on the calibration ``ids``, block after block (GPTQ's
    sequential order: each block is calibrated on the outputs of the blocks already quantized).
    The quantized layers replace the Conv1Ds as they are made.

    The head comes first, from the float model's final LayerNorm outputs: a tied ``wte`` is then
    the dequantized head before the blocks are calibrated, so they see the embeddings they will
    get (on the built-in model this order agreed with float32 on more held-out bytes than the
    head last). Returns ``(layers by path, hessians by path)``.
    """
    rows = max(1, 2048 // ids.shape[1])                         # ~2048 tokens per forward
    chunks = ids.to(model.wte.weight.device).split(rows)

    def layer(path, w, b, scheme, group_size, hessian):
        try:
            return QuantizedLinear.from_float(w, b, scheme, group_size, hessian=hessian)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def final_states():
        for idx in chunks:
            x = model.embed(idx, 0)
            for block in model.h:
                x = block(x)[0]
            model.ln_f(x)

    hessians = _hessians({"quantized_head": model.ln_f}, final_states, of_output=True)
    w, _ = weights["quantized_head"]
    layers = {"quantized_head": layer("quantized_head", w, None, HEAD_SCHEME, None, hessians["quantized_head"])}
    if w is model.wte.weight:                                   # a new tensor: the float one stays intact
        model.wte.weight = nn.Parameter(layers["quantized_head"].dequantized().to(w.dtype), requires_grad=False)
    xs = [model.embed(idx, 0) for idx in chunks]
    for i, block in enumerate(model.h):
        paths = {f"h.{i}.{p}": block.get_submodule(p) for p in BLOCK_LINEARS}
        hessians.update(_hessians(paths, lambda: [block(x) for x in xs]))
        for path in paths:
            w, b = weights[path]
            layers[path] = layer(path, w, b, scheme, group_size, hessians[path])
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, layers[path])
        xs = [block(x)[0] for x in xs]
    return layers, hessians


def _state_before(model, sources: dict) -> dict:
    """What :func:`quantize_model` changes, to put back if it stops half-way."""
    return dict(sources=dict(sources), wte=model.wte.weight, lm_head=model._modules.get("lm_head", False),
                training=model.training, grads=[(p, p.requires_grad) for p in model.parameters()])


def _restore(model, before: dict) -> None:
    """Undo a :func:`quantize_model` that stopped half-way: the original modules and tensors
    (never written in place) go back, nothing quantized stays."""
    for path, module in before["sources"].items():
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, module)
    model.wte.weight = before["wte"]
    if before["lm_head"] is not False:
        model.lm_head = before["lm_head"]
    model._modules.pop("quantized_head", None)
    model.quantization = None
    for p, flag in before["grads"]:
        with contextlib.suppress(RuntimeError):
            p.requires_grad_(flag)
    model.train(before["training"])


@torch.no_grad()
def quantize_model(model, scheme: str, group_size: int | None = None, method: str = "gptq", calibration=None):
    """Weight-only quantize ``model`` in place: every block Conv1D (``c_attn``, ``attn.c_proj``,
    ``c_fc``, ``mlp.c_proj``) and the LM head become :class:`QuantizedLinear` layers.

    The LM head is quantized to int8 (:data:`HEAD_SCHEME`) from :func:`head_weight` into
    ``model.quantized_head``. When it is
    tied to ``wte``, ``wte`` is overwritten with the dequantized head, so the float embedding
    lookup and the head read the same numbers, and a checkpoint stores them once (quantized):
    the model reloads with identical logits. LayerNorms, biases and ``wpe`` stay float.

    ``method="gptq"`` (the default) rounds the weights by :func:`gptq`, block after block, so
    that the layers' outputs on the calibration text stay close to the float model's;
    ``"rtn"`` rounds each weight to nearest (gpt-fast's and llama.cpp's default: instant, no
    data). GPTQ takes seconds to minutes (README, "Quantized decode", for measured times and
    their conditions; int8's calibration pass through the integer products is the longest part)
    and is what reaches issue 13's top-1 agreement targets.

    Each tensor's error is measured (:func:`error_row`) into ``model.quantization_report``;
    tensors with an abnormal error (e.g. an outlier channel stretching a scale) are listed in a
    :class:`QuantizationWarning`.

    Args:
        model: a float :class:`~gpt2mha.model.GPT2` on the CPU (eval mode afterwards; no
            parameter requires grad).
        scheme: ``"int8"`` or ``"int4"``; group_size: int4's group (default
            :data:`DEFAULT_GROUP_SIZE`), None for int8.
        method: ``"gptq"`` or ``"rtn"`` (:data:`METHODS`).
        calibration: GPTQ's text, or token ids ``[N]`` / ``[B, T]`` (:func:`calibration_ids`);
            None: the packaged :func:`default_calibration` text. Only with ``"gptq"``.

    Returns:
        ``model``.

    Raises:
        ValueError: unknown scheme or method, a group size the scheme or n_embd does not
            allow, calibration given with ``"rtn"`` or unusable (:func:`calibration_ids`), a
            model already quantized, or weights holding NaN/inf (named).
    """
    if getattr(model, "quantization", None):
        raise ValueError(f"this model is already quantized ({model.quantization['scheme']}); quantizing twice would "
                         f"round the rounded weights again: quantize the float model instead")
    defaulted = group_size is None
    if scheme in SCHEMES and group_size is None:
        group_size = DEFAULT_GROUP_SIZE[scheme]
    try:
        check_scheme(scheme, group_size, model.config.n_embd)
    except ValueError as e:
        if defaulted and group_size is not None:
            raise ValueError(f"{e} (group_size was not given: {group_size} is {scheme}'s default)") from None
        raise
    sources = {f"h.{i}.{path}": model.get_submodule(f"h.{i}.{path}") for i in range(model.config.n_layer)
               for path in BLOCK_LINEARS}
    weights = {path: (m.weight.t(), m.bias) for path, m in sources.items()}      # [out, in]
    weights["quantized_head"] = (head_weight(model), None)
    bad = [path for path, (w, b) in weights.items()
           if not torch.isfinite(w).all() or (b is not None and not torch.isfinite(b).all())]
    if bad:
        raise ValueError(f"cannot quantize: {', '.join(bad)} hold NaN or inf values")
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown; expected one of {METHODS}")
    if method == "rtn" and calibration is not None:
        raise ValueError("calibration: round-to-nearest (method='rtn') uses no calibration text; "
                         "pass method='gptq' to use it")
    ids = None
    if method == "gptq":
        try:
            ids = calibration_ids(model, default_calibration() if calibration is None else calibration)
        except ValueError as e:
            if calibration is not None:
                raise
            raise ValueError(f"{e} (the packaged calibration text, encoded with this model's {model.config.tokenizer!r} "
                             f"tokenizer); pass calibration= token ids the model takes, or method='rtn'") from None
    tied = head_weight(model) is model.wte.weight
    before = _state_before(model, sources)
    model.eval()
    try:
        if ids is not None:
            layers, hessians = _gptq_layers(model, scheme, group_size, ids, weights)
        else:
            layers, hessians = {}, {}
            for path, (w, b) in weights.items():
                head = path == "quantized_head"
                layers[path] = QuantizedLinear.from_float(w, b, HEAD_SCHEME if head else scheme,
                                                          None if head else group_size)
        report = [error_row(path, w, layers[path], hessians.get(path)) for path, (w, b) in weights.items()]
        install(model, layers, scheme, group_size, tied)
        if tied:                                                # a new tensor: never written in place
            model.wte.weight = nn.Parameter(layers["quantized_head"].dequantized().to(before["wte"].dtype),
                                            requires_grad=False)
        model.quantization["method"] = method
    except BaseException:                                       # errors and Ctrl-C: the float model, as it was
        _restore(model, before)
        raise
    model.quantization_report = report
    abnormal = [r for r in report if r["abnormal"]]
    for r in abnormal:
        warnings.warn(f"{r['name']} {r['shape']}: abnormal {r['scheme']} quantization error ({r['robust_rel_error']:.3f} "
                      f"of the weights' robust spread, limit {ABNORMAL_ERROR[r['scheme']]}; an outlier channel or group "
                      f"stretching the scales?)", QuantizationWarning, stacklevel=3)
    return model


# ------------------------------------------------------------------ checkpoints
#: The format of a quantized checkpoint, recorded in config.json's "gpt2mha.quantization".
FORMAT_VERSION = 1


def state_to_save(model, dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], dict]:
    """A quantized model's tensors for ``model.safetensors`` and its ``config.json`` entry.

    The quantized buffers are stored as they are (int8 / uint8 nibbles / bf16 scales), the
    float tensors (LayerNorms, biases, wpe, an untied wte) in ``dtype``. A tied ``wte`` is not
    stored: it is the dequantized head, rebuilt on load.

    Returns:
        ``(tensors by state-dict name, {"scheme", "group_size", "head", "tied", "format"})``.
    """
    q = model.quantization
    tensors = {}
    quantized = {f"{path}.{name}" for path, m in model.named_modules() if isinstance(m, QuantizedLinear)
                 for name in ("weight", "scales", "scale_zero")}
    for k, v in model.state_dict().items():
        if k == "wte.weight" and q["tied"]:
            continue
        tensors[k] = v.detach().contiguous() if k in quantized else v.detach().to(dtype).contiguous()
    return tensors, {**q, "format": FORMAT_VERSION}


def read_scheme(entry, source: str) -> tuple[str, int | None, bool]:
    """``(scheme, group_size, tied)`` from config.json's quantization entry.

    Raises:
        QuantizationError: an entry this version cannot read (names the field).
    """
    if not isinstance(entry, dict):
        raise QuantizationError(f"{source}: gpt2mha.quantization must be an object, got {entry!r}")
    if entry.get("format") != FORMAT_VERSION or entry.get("head") != HEAD_SCHEME:
        raise QuantizationError(f"{source}: quantization format {entry.get('format')!r} with a {entry.get('head')!r} "
                                f"head; this gpt2mha reads format {FORMAT_VERSION} with an {HEAD_SCHEME} head")
    try:
        check_scheme(entry.get("scheme"), entry.get("group_size"))
    except ValueError as e:
        raise QuantizationError(f"{source}: {e}") from None
    if entry.get("method", "rtn") not in METHODS:
        raise QuantizationError(f"{source}: quantization method {entry.get('method')!r} is unknown; expected one of "
                                f"{METHODS}")
    return entry["scheme"], entry["group_size"], bool(entry.get("tied", True))


def check_state(model, sd: dict[str, torch.Tensor], source: str, tied: bool) -> None:
    """Compare a quantized checkpoint's tensors with the (quantized, empty) ``model`` before
    anything is copied: names, shapes, exact dtypes of the quantized buffers, finite float
    tensors, and scales that are finite and > 0.

    Raises:
        QuantizationError: listing every problem, e.g. ``h.0.mlp.c_fc.scales: corrupted scale
            tensor: 3 values are NaN, inf or <= 0`` or ``h.0.attn.c_attn.scale_zero has shape
            [24, 576, 2]: group size 32, but config.json says group_size=64``.
    """
    expected = {k: v for k, v in model.state_dict().items() if not (tied and k == "wte.weight")}
    problems = [f"missing tensor {k} {list(v.shape)}" for k, v in expected.items() if k not in sd]
    problems += [f"unexpected tensor {k} {list(v.shape)}" for k, v in sd.items() if k not in expected]
    group_size = model.quantization["group_size"]
    for k, t in sd.items():
        if k not in expected:
            continue
        e = expected[k]
        if k.endswith(".scale_zero") and t.dim() == 3 and t.shape[1:] == e.shape[1:] and t.shape != e.shape:
            n_in = e.shape[0] * group_size
            problems.append(f"{k} has shape {list(t.shape)}: group size {n_in / t.shape[0]:g}, but config.json says "
                            f"group_size={group_size} (mismatched group size)")
        elif t.shape != e.shape:
            problems.append(f"{k}: checkpoint shape {list(t.shape)} != model shape {list(e.shape)}")
        elif k.endswith((".scales", ".scale_zero")) or not e.is_floating_point():
            if t.dtype != e.dtype:
                problems.append(f"{k}: dtype {t.dtype}, expected {e.dtype}")
            elif k.endswith(".scales") and not ((t > 0) & torch.isfinite(t)).all():
                bad = int((~((t > 0) & torch.isfinite(t))).sum())
                problems.append(f"{k}: corrupted scale tensor: {bad} value(s) are NaN, inf or <= 0")
            elif k.endswith(".scale_zero") and not (torch.isfinite(t).all() and (t[..., 0] > 0).all()):
                bad = int((~torch.isfinite(t)).any(-1).sum() + (t[..., 0] <= 0).sum())
                problems.append(f"{k}: corrupted scale tensor: {bad} scale/zero pair(s) are NaN, inf or have scale <= 0")
        elif not t.is_floating_point():
            problems.append(f"{k}: dtype {t.dtype} is not a floating-point type")
        elif not torch.isfinite(t).all():
            problems.append(f"{k}: contains NaN or inf values")
    if problems:
        raise QuantizationError(f"{source}: cannot load the quantized checkpoint:\n  " + "\n  ".join(problems))


def load_state(model, entry, sd: dict[str, torch.Tensor], source: str, dtype: torch.dtype):
    """Build a quantized model from a checkpoint: ``model`` is the float model on the meta
    device; every tensor is checked (:func:`check_state`) before any is copied, so a bad file
    never yields a half-loaded model.

    Returns:
        The quantized model on the CPU, float tensors in ``dtype``, in eval mode.

    Raises:
        QuantizationError: see :func:`read_scheme`, :func:`check_state`.
    """
    scheme, group_size, tied = read_scheme(entry, source)
    try:
        check_scheme(scheme, group_size, model.config.n_embd)
    except ValueError as e:
        raise QuantizationError(f"{source}: {e}") from None
    with torch.device("meta"):
        install(model, quantized_layers(model, scheme, group_size), scheme, group_size, tied)
    check_state(model, sd, source, tied)
    model = model.to_empty(device="cpu")
    quantized = {k for k, v in model.state_dict().items() if not v.is_floating_point() or
                 k.endswith((".scales", ".scale_zero"))}
    with torch.no_grad():
        model.load_state_dict({k: v if k in quantized else v.to(torch.float32) for k, v in sd.items()}, strict=False)
        if tied:
            model.wte.weight.copy_(model.quantized_head.dequantized())
    model.quantization["method"] = entry.get("method", "rtn")
    return model.to(dtype).eval()
