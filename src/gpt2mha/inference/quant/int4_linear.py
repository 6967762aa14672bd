"""int4 weights (a scale and a zero per group of ``group_size`` inputs,
:func:`~.schemes.quantize_int4`) and the layers that multiply by them: :class:`Int4Linear`
(float32 activations in decode steps, torch's bf16 int4 kernel elsewhere) and
:class:`W4A8Linear` (``per_block``: every product on gpt2mha's W4A8 kernel), with their LM heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import gemv
from .gptq import gptq
from .linear import QuantizedHead, QuantizedLinear, pad_rows, register, register_head
from .schemes import (INT4_GROUP_SIZES, KERNEL_DTYPE, int4_params, dequantize_int4, pack_int4, quantize_int4,
                      unpack_int4)


@register
class Int4Linear(QuantizedLinear):
    """An int4 layer (``scheme="int4"``, ``activations="exact"``).

    Buffers: ``weight`` uint8 ``[n_out, n_in / 2]`` (:func:`~.schemes.pack_int4`) and
    ``scale_zero [n_in / group_size, n_out, 2]`` in :data:`~.schemes.KERNEL_DTYPE`; for torch's
    int4 kernel the weight is also kept in its CPU-specific packed layout (``packed``, rows padded
    to a multiple of 16), rebuilt whenever the buffers are loaded or moved.

    Forward on the CPU: one token per sequence (a decode step) runs :func:`~.gemv.int4_gemv`
    where gpt2mha's kernels build (float32 activations, the nibbles converted in registers);
    other products hand torch's int4 kernel :data:`~.schemes.KERNEL_DTYPE` activations; on CPUs
    without VNNI/AMX, inputs of :attr:`dequantize_from_rows` tokens or more run
    :meth:`~.linear.QuantizedLinear.dequantized_product` instead.
    """

    scheme = "int4"
    scale_buffer = "scale_zero"
    grouped = True
    #: 32: with GPTQ, top-1 agreement with float32 on the built-in model 97.3% against group
    #: 64's 96.6% (benchmarks/results/quality.json), decoding as fast as 64.
    default_group_size = 32
    #: A Gaussian weight gives ~0.09 (group 64, asymmetric); an outlier stretching a group's
    #: range pushes it well past this.
    abnormal_error = 0.20
    #: Measured as int8's (:attr:`.int8_linear.Int8Linear.dequantize_from_rows`): from about 32
    #: rows the float32 GEMM over the dequantized weight is level with int4's bf16 kernel, and
    #: ahead of it beyond.
    dequantize_from_rows = 32

    def _make_buffers(self) -> None:
        n_in, n_out = self.n_in, self.n_out
        self.register_buffer("weight", torch.zeros(n_out, n_in // 2, dtype=torch.uint8))
        self.register_buffer("scale_zero", torch.ones(n_in // self.group_size, n_out, 2, dtype=KERNEL_DTYPE))
        self.register_buffer("packed", None, persistent=False)

    @classmethod
    def check_group_size(cls, group_size, n_in: int | None) -> None:
        if isinstance(group_size, bool) or group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size={group_size!r}: int4 needs one of {INT4_GROUP_SIZES} (the CPU kernel's sizes)")
        if n_in is not None and n_in % group_size:
            fits = [g for g in INT4_GROUP_SIZES if n_in % g == 0]
            raise ValueError(f"group_size={group_size} does not divide the layer's input width {n_in} (n_embd or "
                             f"4·n_embd); " + (f"choose one of {fits}" if fits else
                                               f"no int4 group size {INT4_GROUP_SIZES} does: use int8"))

    def set_weight(self, w: torch.Tensor, hessian: torch.Tensor | None = None) -> None:
        q, self.scale_zero = (gptq(w, hessian, self.scheme, self.group_size) if hessian is not None
                              else quantize_int4(w, self.group_size))
        self.weight = pack_int4(q)
        self.repack()

    @staticmethod
    def gptq_grid(w: torch.Tensor, group_size: int):
        """The integers :func:`~.gptq.gptq` rounds ``w``'s columns to: ``w ≈ (q − 8)·scale + zero``,
        ``q`` in 0..15, each group's scale and zero computed when its first column is reached,
        from the error-corrected weights."""
        from .gptq import Grid

        def finish(Q, groups):
            scale_zero = torch.stack([torch.stack(p, -1) for p in groups])            # [K/g, N, 2]
            return Q.to(torch.int32), scale_zero.to(KERNEL_DTYPE)
        return Grid(0, 15, 8, group_size=group_size, group_params=lambda g: int4_params(g.amin(-1), g.amax(-1)),
                    finish=finish)

    def dequantized(self) -> torch.Tensor:
        return dequantize_int4(unpack_int4(self.weight), self.scale_zero, self.group_size)

    @classmethod
    def row_norms(cls, sd: dict, path: str, group_size: int | None, rows: int = 4096) -> torch.Tensor:
        w, sz = sd[path + ".weight"], sd[path + ".scale_zero"]
        return torch.cat([torch.linalg.vector_norm(dequantize_int4(unpack_int4(w[i:i + rows]), sz[:, i:i + rows],
                                                                   group_size), dim=1)
                          for i in range(0, w.shape[0], rows)]).double()

    def repack(self) -> None:
        """Rebuild torch's int4 kernel's packed weight from ``weight`` and ``scale_zero`` (CPU only)."""
        if self.weight.device.type != "cpu" or self.weight.is_meta:
            self.packed = None
            return
        q = unpack_int4(self.weight)
        pad = pad_rows(self.n_out) - self.n_out                         # the kernel needs N % 16 == 0
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(F.pad(q, (0, 0, 0, pad)), 1)

    def _moved(self) -> None:
        if self.packed is None or self.packed.device != self.weight.device:
            self.repack()

    def bf16_output_for(self, rows: int) -> bool:
        """From 2 rows on, and at 1 where gpt2mha's kernels are not loaded: torch's bf16-activation kernel."""
        return rows >= 2 or not gemv.available()

    def _product(self, x2, tokens, bias, gelu):
        if self.dequantize_for(tokens):
            return self.dequantized_product(x2.float()), False, False
        if tokens == 1 and self.weight.is_contiguous() and gemv.available():
            # decode: float32 x @ deq(W)ᵀ on the GEMV kernel
            y = torch.ops.gpt2mha.int4_gemv(x2.float(), self.weight, self.gemv_scales(), self.group_size, bias)
            return y, bias is not None, False
        x2 = x2.to(KERNEL_DTYPE).contiguous()
        pad = self.packed.shape[0] - self.n_out                    # rows padded to a multiple of 16
        scale_zero = F.pad(self.scale_zero, (0, 0, 0, pad)) if pad else self.scale_zero
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, scale_zero)
        return y[:, :self.n_out], False, False

    def _dequantize_prep(self, x, rows):
        # the low nibbles (even inputs) and the high nibbles (odd inputs) are converted into two
        # contiguous [N, K/2] halves (no strided writes), scaled per group in place and multiplied
        # by the even and odd inputs; the zeros enter as Σ_group x · offset (offset = z − 8·s),
        # one small [M, K/g] @ [K/g, N] product instead of a pass over the weight
        g, K = self.group_size, self.n_in
        sz = self.scale_zero.float()                                          # [K/g, N, 2]
        return dict(even=x[:, 0::2], odd=x[:, 1::2],                          # the low and the high nibbles' inputs
                    scale=sz[..., 0].t().contiguous(),                        # [N, K/g]
                    offset=(sz[..., 1] - 8 * sz[..., 0]).t(),                 # (q − 8)·s + z = q·s + offset
                    group_sums=x.view(x.shape[0], K // g, g).sum(-1),         # Σ x over each group [M, K/g]
                    nibbles=torch.empty(rows, K // 2, dtype=torch.uint8, device=x.device))

    def _dequantized_chunk(self, x, prep, n0, n1, w):
        g, K = self.group_size, self.n_in
        packed, bits = self.weight[n0:n1], prep["nibbles"][:n1 - n0]
        lo, hi = w.view(2, n1 - n0, K // 2)                                   # contiguous halves
        lo.copy_(torch.bitwise_and(packed, 15, out=bits))
        hi.copy_(torch.bitwise_right_shift(packed, 4, out=bits))
        w.view(2, n1 - n0, K // g, g // 2).mul_(prep["scale"][n0:n1, :, None])
        y = prep["group_sums"] @ prep["offset"][n0:n1].t()
        return y.addmm_(prep["even"], lo.t()).addmm_(prep["odd"], hi.t())

    def _gemv_layout(self, scales):
        return scales.transpose(0, 1).contiguous()   # bfloat16 [n_out, n_in / group_size, 2]: each channel's groups

    def a8_packed(self):
        """``(packed, params)`` for ``torch.ops.gpt2mha.int4_a8_packed`` (the W4A8 product of
        :class:`W4A8Linear`): the nibbles in tiles of 32 output channels by 4 inputs, uint8
        ``[ceil(n_out/32), n_in/4, 64]``, and per tile and group the channels' scales and offsets
        ``z − 8·s``, float32 ``[ceil(n_out/32), n_in/group_size, 2, 32]``
        (``kernels/w4a8_products.cpp`` describes the layout). Made on first use and again whenever
        ``weight`` or ``scale_zero`` change: another tensor, a write in place, new data
        (``p.data = t``); every call for inference-mode tensors, which count no writes. Not part
        of the state dict."""
        return self._cached("a8_packed", (self.weight, self.scale_zero),
                            lambda: torch.ops.gpt2mha.int4_pack_a8(self.weight.contiguous(),
                                                                   self.scale_zero.transpose(0, 1).contiguous(),
                                                                   self.group_size),
                            always=self.weight.is_inference() or self.scale_zero.is_inference())

    def native_tensors(self) -> list[torch.Tensor]:
        """The W4A8 tiles of :meth:`a8_packed`."""
        return list(self.a8_packed())

    def compiled_layer(self):
        """:class:`~gpt2mha.inference.compiled.GemvInt4Linear` where gpt2mha's kernels build
        (float32 activations); else None: the eager layer's bf16 kernel."""
        from ..compiled import GemvInt4Linear
        return GemvInt4Linear(self) if gemv.available() else None


@register
class W4A8Linear(Int4Linear):
    """An int4 layer with ``activations="per_block"``: every product, decode steps and prompts,
    on the W4A8 kernel over its packed copy (:meth:`~Int4Linear.a8_packed`; its speed against
    the other products: benchmarks/results/w4a8_products.json), each activation row rounded to 8 bits per group of ``group_size`` inputs,
    as llama.cpp's q8_0 activations against its q4_0 weights; where gpt2mha's kernels do not
    load, as :class:`Int4Linear`. Runs on the native forward, with an int4 head of its own
    class or an exact int8 head."""

    activations_mode = "per_block"
    native_kind = "w4a8"
    native_heads = (("int4", "per_block"), ("int8", "exact"))

    def _product(self, x2, tokens, bias, gelu):
        if gemv.available() and x2.shape[0] > 0:
            y = torch.ops.gpt2mha.int4_a8_packed(x2.float().contiguous(), *self.a8_packed(), self.group_size,
                                                 self.n_out, bias)
            return y, bias is not None, False
        return super()._product(x2, tokens, bias, gelu)

    def native_group_size(self) -> int:
        return self.group_size

    def compiled_layer(self):
        """:class:`~gpt2mha.inference.compiled.GemvInt4Linear` on the W4A8 product, where
        gpt2mha's kernels build."""
        from ..compiled import GemvInt4Linear
        return GemvInt4Linear(self, a8=True) if gemv.available() else None


@register_head
class Int4Head(QuantizedHead, Int4Linear):
    """:class:`Int4Linear` as the LM head (:class:`~.linear.QuantizedHead`)."""


@register_head
class W4A8Head(QuantizedHead, W4A8Linear):
    """:class:`W4A8Linear` as the LM head (:class:`~.linear.QuantizedHead`)."""
