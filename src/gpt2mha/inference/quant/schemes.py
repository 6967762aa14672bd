"""What int8 and int4 weights mean: the schemes, their rounding to nearest, and int4 packing.

Weight-only quantization as gpt-fast's ``int8``/``int4`` modes and llama.cpp's ``q8_0``/``q4_0``:
int8 with one scale per output channel (symmetric), int4 with a scale and a zero per group of
``group_size`` inputs (asymmetric), activations kept in floating point. Weights are ``[N, K]``
(``N = out`` rows of ``K = in`` inputs), the layout the kernels read.
"""

from __future__ import annotations

import math

import torch

#: How the weights are rounded: "gptq" (:func:`gptq`, on calibration text) or "rtn" (to nearest).
METHODS = ("gptq", "rtn")
#: The calibration text GPTQ uses when none is given: the first 16 KiB of Tiny Shakespeare,
#: inside the built-in model's training split (package data ``gpt2mha/data/calibration.txt``).
DEFAULT_CALIBRATION = "calibration.txt"
#: Group sizes the int4 CPU kernel takes.
INT4_GROUP_SIZES = (32, 64, 128, 256)
#: Dtype of the stored scales, and of the activations handed to the int4 kernel, which runs
#: much faster on bf16 than on float32 activations. The product is converted back
#: to the model's dtype; the bias and the residual stream stay in it.
KERNEL_DTYPE = torch.bfloat16
#: The LM head's scheme when none is asked: int8 in both schemes. A tied embedding then carries
#: int8's ~1% error. With int4 blocks the head may be int4 in their groups
#: (``quantize(..., head="int4")``): a 24 MB head on 124M instead of 38.6 (of a decode step's 92
#: MB), for about 2 points of top-1 agreement with float32 on the built-in model
#: (benchmarks/results/quality.json).
HEAD_SCHEME = "int8"


class QuantizationError(ValueError):
    """A quantized checkpoint or tensor that cannot be used as it is; the message names it."""


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
    scale, zero = int4_params(g.amin(-1), g.amax(-1))                     # [N, K/g]
    q = torch.round((g - zero[..., None]) / scale[..., None]) + 8
    q = q.clamp_(0, 15).to(torch.int32).view(N, K)
    scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)
    return q, scale_zero


def int4_params(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
