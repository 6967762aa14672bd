"""int8 weights (one scale per output channel, :func:`~.schemes.quantize_int8`) and the layers
that multiply by them: :class:`Int8Linear` (activations never rounded), :class:`W7A8Linear`
(``per_row``: each activation row rounded to 8 bits, W7A8) and :class:`AutoInt8Linear` (``auto``:
per shape, one or the other), with their LM heads.

Products: integer pieces that keep float32 activations exact to ~14 bits
(:func:`~.int8_products.int8_matmul`), per_row's W7A8 (:func:`~.int8_products.int8_matmul_per_row`,
or gpt2mha's ``int8_per_row`` kernel in one call where it builds with AVX-512 VNNI); one-token
steps (decode) of exact layers run gpt2mha's own GEMV kernel where it builds (:mod:`.gemv`:
float32 activations times the dequantized weight, no rounding of the activations at all; faster
than the pieces at batch 1 on an AVX2 CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import gemv
from .gptq import gptq
from .int8_products import fbgemm_pack, int8_kernel, int8_matmul, int8_matmul_per_row, weight_7bit
from .linear import QuantizedHead, QuantizedLinear, register, register_head
from .schemes import KERNEL_DTYPE, quantize_int8


@register
class Int8Linear(QuantizedLinear):
    """An int8 layer (``scheme="int8"``, ``activations="exact"``): the activations are never
    rounded.

    Buffers: ``weight`` int8 ``[n_out, n_in]`` and ``scales`` ``[n_out]`` in
    :data:`~.schemes.KERNEL_DTYPE` (symmetric, per output channel).

    Forward on the CPU: one token per sequence (a decode step: ``[B, 1, n_in]``, or a 2-D input
    of one row) runs the GEMV kernel where it builds (:func:`~.gemv.int8_gemv`: the float32
    product of the dequantized weight, closer to float32 than the pieces; decided per sequence,
    never by the batch size, so batch invariance holds); other products :func:`~.int8_products.int8_matmul`
    (float32 result); on CPUs without VNNI/AMX, inputs of :attr:`dequantize_from_rows` tokens or
    more :meth:`~.linear.QuantizedLinear.dequantized_product` instead.
    """

    scheme = "int8"
    #: int8 has one scale per output channel, no groups.
    default_group_size = None
    #: A Gaussian weight gives ~0.01 (per channel); an outlier stretching a channel's range
    #: pushes it well past this.
    abnormal_error = 0.03
    #: The row count from which the float32 GEMM over the dequantized weight outruns int8's two
    #: 7-bit pieces on FBGEMM (both by then slower than float32 itself), measured on an AVX2 CPU
    #: by ``python benchmarks/quant_prefill.py kernels`` (the 48 block matrices of 124M, 1 thread).
    dequantize_from_rows = 64

    def _make_buffers(self) -> None:
        self.register_buffer("weight", torch.zeros(self.n_out, self.n_in, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(self.n_out, dtype=KERNEL_DTYPE))

    @classmethod
    def check_group_size(cls, group_size, n_in: int | None) -> None:
        if group_size is not None:
            raise ValueError(f"group_size={group_size!r}: int8 has one scale per output channel, no groups; "
                             f"leave group_size as None")

    def set_weight(self, w: torch.Tensor, hessian: torch.Tensor | None = None) -> None:
        self.weight, self.scales = gptq(w, hessian, self.scheme) if hessian is not None else quantize_int8(w)

    @staticmethod
    def gptq_grid(w: torch.Tensor, group_size: int | None):
        """The integers :func:`~.gptq.gptq` rounds ``w``'s columns to: ``w ≈ q·s``, ``q`` in
        -127..127 with the per-channel scales of :func:`~.schemes.quantize_int8` (from ``w``)."""
        from .gptq import Grid
        _, scales = quantize_int8(w)
        s = scales.float()
        return Grid(-127, 127, 0, fixed=(s, torch.zeros_like(s)),
                    finish=lambda Q, groups: (Q.to(torch.int8), scales))

    def dequantized(self) -> torch.Tensor:
        return self.weight.float().mul_(self.scales.float()[:, None])     # dequantize_int8, one allocation

    @classmethod
    def row_norms(cls, sd: dict, path: str, group_size: int | None, rows: int = 4096) -> torch.Tensor:
        w = sd[path + ".weight"]                 # ‖q[n]‖ · scale[n]
        q = torch.cat([torch.linalg.vector_norm(w[i:i + rows].float(), dim=1) for i in range(0, w.shape[0], rows)])
        return q.double() * sd[path + ".scales"].double()

    def _product(self, x2, tokens, bias, gelu):
        if self.dequantize_for(tokens):
            return self.dequantized_product(x2.float()), False, False
        if tokens == 1 and self.weight.is_contiguous() and gemv.available():
            # decode: float32 x @ deq(W)ᵀ on the GEMV kernel
            return torch.ops.gpt2mha.int8_gemv(x2.float(), self.weight, self.gemv_scales(), bias), bias is not None, False
        kernel = int8_kernel()
        return int8_matmul(x2, self.weight, self.scales, kernel,
                           self.fbgemm_packed() if kernel == "fbgemm" else None), False, False

    def _per_row_product(self, x2, bias, gelu):
        # W7A8: each row rounded to 8 bits with its own scale and zero point, over 7-bit weights
        if gemv.vnni():
            # the same W7A8 product in one call (rounding, exact integer sums on the packed
            # copy, rescale): faster than _int_mm and the ops around it at every size from
            # 1 to 512 rows
            y = torch.ops.gpt2mha.int8_per_row(x2.float().contiguous(), *self.per_row_packed(), bias, gelu)
            return y, bias is not None, gelu
        q7, scales7, packed, wsum = self.per_row_weights()
        return int8_matmul_per_row(x2, q7, scales7, int8_kernel(), packed, wsum), False, False

    def _dequantized_chunk(self, x, prep, n0, n1, w):
        # a plain int8 → float32 copy; the per-channel scales multiply the outputs (the same
        # product as x @ dequantized()ᵀ up to float32 rounding, ~1e-7 relative)
        return F.linear(x, w.copy_(self.weight[n0:n1])).mul_(self.scales[n0:n1].float())

    def _gemv_layout(self, scales):
        return scales.float().contiguous()       # float32 [n_out]

    def per_row_weights(self):
        """``(q7, scales7, packed, wsum)`` for :func:`~.int8_products.int8_matmul_per_row`: the
        weight re-rounded to 7 bits (:func:`~.int8_products.weight_7bit`; None on FBGEMM, which
        reads only its packed copy), FBGEMM's packed copy (None where the kernel is ``_int_mm``)
        and the row sums; made on first use and again whenever ``weight`` or ``scales`` change
        (as :meth:`fbgemm_packed`). Not part of the state dict."""
        kernel = int8_kernel()

        def make():
            q7, scales7 = weight_7bit(self.weight, self.scales)
            packed = fbgemm_pack(q7, scales7) if kernel == "fbgemm" else None
            return (None if packed is not None else q7, scales7, packed, q7.float().mul_(scales7[:, None]).sum(1))
        return self._cached("per_row", (self.weight, self.scales), make, (kernel,))

    def per_row_packed(self):
        """``(packed, qsum, scales7, wsum)`` for ``torch.ops.gpt2mha.int8_per_row``
        (:func:`~.gemv.int8_per_row`): the 7-bit weight (:func:`~.int8_products.weight_7bit`)
        packed for the kernel (:func:`~.gemv.pack_rows`, int8 ``[ceil(n_out/32), ceil(n_in/4),
        32, 4]``), its row sums as int32, the 7-bit scales as float32 and the float row sums of
        ``q7 · scales7``; made on first use and again whenever ``weight`` or ``scales`` change
        (as :meth:`per_row_weights`). Not part of the state dict."""
        def make():
            q7, scales7 = weight_7bit(self.weight, self.scales)
            scales7 = scales7.float().contiguous()
            return (gemv.pack_rows(q7), q7.sum(1, dtype=torch.int32), scales7, q7.float().mul_(scales7[:, None]).sum(1))
        return self._cached("per_row_packed", (self.weight, self.scales), make)

    def fbgemm_packed(self):
        """FBGEMM's packed copy of the int8 weight (:func:`~.int8_products.fbgemm_pack`), made
        on first use and made again whenever ``weight`` or ``scales`` is another tensor or was
        written in place (a packed copy is never stale). Not part of the state dict; copies of
        the layer (``copy.deepcopy``, pickling) make their own."""
        return self._cached("fbgemm", (self.weight, self.scales), lambda: fbgemm_pack(self.weight, self.scales))

    def native_tensors(self) -> list[torch.Tensor]:
        """(weight, float32 scales): the exact int8 head of an int4 model, as ``int8_gemv`` takes them."""
        return [self.weight.detach().contiguous(), self.gemv_scales()]

    def compiled_layer(self):
        """:class:`~gpt2mha.inference.compiled.GemvInt8Linear` (gpt2mha's GEMV kernel, float32
        activations), or where it does not build
        :class:`~gpt2mha.inference.compiled.WoqInt8Linear` (inductor's int8 template, bf16
        activations)."""
        from ..compiled import GemvInt8Linear, WoqInt8Linear
        return GemvInt8Linear(self) if gemv.available() else WoqInt8Linear(self)

    @classmethod
    def model_compile_options(cls) -> dict:
        """Without gpt2mha's GEMV kernel, max-autotune over inductor's C++ GEMM templates only
        (max-autotune times its candidates on weights hot in cache, where ATen's eager kernel
        looks faster than it is when the weights stream from memory)."""
        return {} if gemv.available() else {"max_autotune": True, "max_autotune_gemm_backends": "CPP"}


@register
class W7A8Linear(Int8Linear):
    """An int8 layer with ``activations="per_row"``: each activation row rounded to 8 bits with
    its own scale and zero point, over the weights re-rounded to 7 bits
    (:func:`~.int8_products.int8_matmul_per_row`, W7A8), at every size: faster than
    :class:`Int8Linear`, not exact. On a CPU with AVX-512 VNNI where gpt2mha's kernel builds,
    the whole product in one call (``torch.ops.gpt2mha.int8_per_row`` on the packed copy,
    :meth:`~Int8Linear.per_row_packed`), GELU fused when asked. Runs on the native forward."""

    activations_mode = "per_row"
    native_kind = "w7a8"
    native_heads = (("int8", "per_row"),)

    def _product(self, x2, tokens, bias, gelu):
        return self._per_row_product(x2, bias, gelu)

    @property
    def fuses_gelu(self) -> bool:
        """Whether :meth:`forward` with ``gelu=True`` may fuse the activation into the product
        (per_row's operator: on a CPU with AVX-512 VNNI where gpt2mha's kernel builds)."""
        return self.weight.device.type == "cpu" and gemv.vnni()

    def native_tensors(self) -> list[torch.Tensor]:
        """The packed four of :meth:`~Int8Linear.per_row_packed`."""
        return list(self.per_row_packed())

    def compiled_layer(self):
        """:class:`~gpt2mha.inference.compiled.PerRowInt8Linear`: the same W7A8 product."""
        from ..compiled import PerRowInt8Linear
        return PerRowInt8Linear(self)

    @classmethod
    def model_compile_options(cls) -> dict:
        return {}

    def compile_options(self) -> dict:
        """No freezing where the integer kernel is ``torch._int_mm`` (VNNI CPUs): with the weight
        frozen into a constant, inductor's lowering of ``torch._int_mm`` followed by per_row's
        rescale gave NaN/inf (garbage) for two rows or more (torch 2.13, Zen 4 with VNNI;
        tests/test_compiled.py); not frozen, the same step is right."""
        return {"freezing": False} if int8_kernel() == "int_mm" else {}


@register
class AutoInt8Linear(Int8Linear):
    """An int8 layer with ``activations="auto"``: per shape, :class:`W7A8Linear`'s product where
    :class:`Int8Linear` would multiply by the dequantized float32 weight
    (:meth:`~.linear.QuantizedLinear.dequantize_for`: prefill of many tokens on CPUs without
    VNNI), :class:`Int8Linear`'s everywhere else (decode steps, short prompts). Compiled as
    :class:`Int8Linear`."""

    activations_mode = "auto"

    def _product(self, x2, tokens, bias, gelu):
        if self.dequantize_for(tokens):
            return self._per_row_product(x2, bias, gelu)
        return super()._product(x2, tokens, bias, gelu)

    fuses_gelu = W7A8Linear.fuses_gelu


@register_head
class Int8Head(QuantizedHead, Int8Linear):
    """:class:`Int8Linear` as the LM head (:class:`~.linear.QuantizedHead`)."""


@register_head
class W7A8Head(QuantizedHead, W7A8Linear):
    """:class:`W7A8Linear` as the LM head (:class:`~.linear.QuantizedHead`)."""


@register_head
class AutoInt8Head(QuantizedHead, AutoInt8Linear):
    """:class:`AutoInt8Linear` as the LM head (:class:`~.linear.QuantizedHead`)."""
