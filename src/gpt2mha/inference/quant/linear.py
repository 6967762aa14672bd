"""The quantized dense layer and its products: exact int8 products of 16-bit activations
(``torch._int_mm``), int4 on PyTorch's CPU int4 kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .gptq import gptq
from .schemes import (KERNEL_DTYPE, check_scheme, dequantize_int4, dequantize_int8, pack_int4, quantize_int4,
                      quantize_int8, unpack_int4)


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
    would otherwise set a coarse step for the rest of the row; each row's count is its own, so
    a row gets the same bits whatever else is in the batch) and multiplied by ``q`` with
    ``torch._int_mm``, whose int32 sums are exact; one float32 rescale per row and per output
    channel follows. The product is about as exact as float32 activations give (relative error
    ~3e-5 on ordinary rows, against ~2e-3 for bf16 activations on ``aten._weight_int8pack_mm``,
    whose output is also rounded to bf16), for somewhat more time than that kernel (RESULTS.md,
    "Second pass: exact int8 products, GPTQ, int4 group 32").
    """
    M = x.shape[0]
    xf = x.float()
    xa = xf.abs()
    wide = xa.amax(-1) > WIDE_ROW * xa.mean(-1)                 # [M]: decided per row, not per batch
    n = 3 if bool(wide.any()) else 2
    pieces, a = split_activations(xf, n)
    if n == 3 and not bool(wide.all()):                         # the others keep two pieces: a zero third
        pieces[2 * M:].masked_fill_(~wide[:, None], 0)
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
        y = y.to(self.out_dtype(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.n_out)

    def out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the output for inputs in ``dtype``: the same."""
        return dtype

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




class QuantizedHead(QuantizedLinear):
    """A quantized LM head: a :class:`QuantizedLinear` without bias whose logits come out in
    float32 (float64 for float64 inputs), as the float model's
    :class:`~gpt2mha.core.model.LMHead` gives them."""

    def __init__(self, n_in: int, n_out: int, scheme: str, group_size: int | None = None, bias: bool = False):
        super().__init__(n_in, n_out, scheme, group_size, bias=False)

    def out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.promote_types(dtype, torch.float32)
