"""The quantized dense layer (:class:`QuantizedLinear`, one class for int8 and int4 weights) and
its quantized LM head. int8 layers multiply through :mod:`.int8_products` (integer pieces that
keep float32 activations exact to ~14 bits, or per_row's W7A8), int4 layers on PyTorch's CPU int4
kernel. One-token steps (decode) of int8 layers run gpt2mha's own GEMV kernel where it builds
(:mod:`.gemv`: float32 activations times the dequantized weight, no rounding of the activations at
all; 2.9x faster than the pieces at batch 1 on the AVX2 Zen 3, RESULTS.md, "A kernel of our own");
int4 layers' one-token steps too (float32 activations where torch's int4 kernel takes bf16).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from . import gemv
from .gptq import gptq
# The int8 products, imported by name: QuantizedLinear looks them up here (benchmarks swap
# ``linear.int8_matmul`` for a variant: what QuantizedLinear calls, not what int8_matmul calls
# inside), and imports of the public names from this module keep working.
from .int8_products import (INT8_KERNEL_ENV, INT8_KERNELS, MAX_PIECES, PIECE_LEVELS, WIDE_ROW,  # noqa: F401
                            fbgemm_available, fbgemm_pack, int8_kernel, int8_matmul, int8_matmul_per_row,
                            pieces_for, split_activations, weight_7bit)
from .schemes import (KERNEL_DTYPE, check_scheme, dequantize_int4, pack_int4, quantize_int4,
                      quantize_int8, unpack_int4)


#: Input rows from which a CPU without VNNI/AMX multiplies by the dequantized weight
#: (:meth:`QuantizedLinear.dequantize_for`) instead of the quantized kernel. Measured on an
#: AVX2 Zen 3 (``python benchmarks/quant_prefill.py kernels``: the 48 block matrices of 124M,
#: 1 thread; RESULTS.md, "Prefill on an AVX2-only host"): int8's two 7-bit pieces on FBGEMM
#: 1.24x float32 at 16 rows, 0.91x at 32, 0.86x at 64, 0.75x at 512; the dequantized weight
#: 0.85x, 0.70x, 0.93x, 0.89x (three runs put the crossing at 64 rows, two of them for the
#: dequantized weight there); int4's bf16 kernel 0.79x / 0.58x / 0.55x / 0.39x, its dequantized
#: weight 0.43x / 0.51x / 0.68x / 0.78x (a tie at 32 in another run).
DEQUANTIZE_FROM_ROWS = {"int8": 64, "int4": 32}
#: Largest number of float32 weights dequantized at once (16 MiB: a whole block matrix of GPT-2
#: 124M or medium): a larger weight (the LM head, the MLP of GPT-2 large and XL) is dequantized
#: and multiplied in slices of output channels, so each thread's scratch (:func:`_scratch`)
#: stays this small.
DEQUANTIZE_CHUNK = 1 << 22
#: How int8 products treat the activations (:attr:`QuantizedLinear.activations`): ``"exact"``
#: never rounds them (decode steps: float32 times the dequantized weight on the GEMV kernel,
#: :mod:`.gemv`; else integer pieces, :func:`int8_matmul`); ``"per_row"`` rounds each row to 8
#: bits with its own scale and zero point, over the weights re-rounded to 7 bits
#: (:func:`int8_matmul_per_row`, W7A8): faster, not exact; ``"auto"`` picks per shape: the exact
#: pieces where ``"exact"`` runs them (decode), W7A8 where ``"exact"`` would fall back to the
#: dequantized float32 GEMM (:meth:`QuantizedLinear.dequantize_for`: prefill of many tokens on
#: CPUs without VNNI).
ACTIVATIONS = ("exact", "per_row", "auto", "per_block")
#: The values each scheme's layers take: ``"per_block"`` is int4's W4A8 (:func:`~.gemv.int4_gemv`), every product.
SCHEME_ACTIVATIONS = {"int8": ("exact", "per_row", "auto"), "int4": ("exact", "per_block")}



def _scratch(numel: int, device: torch.device) -> torch.Tensor:
    """A float32 buffer of at least ``numel`` elements on ``device``, kept per thread and
    reused by every layer (the dequantized weights of :meth:`QuantizedLinear.dequantize_for`
    products): no fresh allocation, and so no page faults, per product. Made outside
    inference mode so that it can be written in place in and out of it."""
    store = _SCRATCH.__dict__
    buf = store.get(device)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=torch.float32, device=device)
        store[device] = buf
    return buf[:numel]


_SCRATCH = threading.local()


# ------------------------------------------------------------------ the quantized layer
def _version(t: torch.Tensor) -> int:
    """``t``'s in-place write counter (-1 for inference tensors, which have none)."""
    try:
        return t._version
    except RuntimeError:
        return -1


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
    :func:`int8_matmul` (float32 result; :func:`int8_matmul_per_row` with
    ``activations="per_row"``, and with ``"auto"`` where the dequantized product would run);
    one token per sequence (a decode step: ``[B, 1, n_in]``, or a 2-D input of one row) with
    ``"exact"`` or ``"auto"`` runs the GEMV kernel instead where it builds
    (:func:`~.gemv.int8_gemv`: the float32 product of the dequantized weight, closer to float32
    than the pieces; decided per sequence, never by the batch size, so batch invariance holds);
    int4 decode steps likewise run :func:`~.gemv.int4_gemv` (float32 activations), other int4
    products hand torch's int4 kernel :data:`KERNEL_DTYPE` activations; int4 with
    ``activations="per_block"`` runs every product (steps and prompts) on the W4A8 kernel over
    its packed copy (:meth:`a8_packed`) where it builds; on CPUs
    without VNNI/AMX, inputs of :data:`DEQUANTIZE_FROM_ROWS` rows or more run
    :meth:`dequantized_product` instead. The product comes back to x's dtype before the bias is
    added (float32 bias and residual stream for a float32 model). Elsewhere the weight is
    dequantized for each call (correct, not fast).

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
        self._activations = "exact"

    @property
    def activations(self) -> str:
        """How this layer's products treat the activations, one of :data:`ACTIVATIONS`. int8:
        ``"exact"`` (default; the GEMV kernel for one token per sequence where it builds,
        :mod:`.gemv`, else integer pieces, :func:`int8_matmul`, or the dequantized weight for
        many rows, :meth:`dequantize_for`), ``"per_row"`` (8 bits per row with a zero point over
        7-bit weights, :func:`int8_matmul_per_row`, at every size) or ``"auto"`` (per shape:
        ``"exact"``'s integer pieces where it runs them, ``"per_row"`` where it would run the
        dequantized weight). int4 layers take ``"exact"`` (float32 activations on the GEMV kernel
        for decode steps) or ``"per_block"`` (every product, decode steps and prompts, on the
        kernel's W4A8 product, each activation row rounded to 8 bits per group of
        ``group_size``, as llama.cpp's q8_0 activations; on the CPU where gpt2mha's kernels
        load, else as ``"exact"``): :data:`SCHEME_ACTIVATIONS`.

        Raises:
            ValueError: (on setting) a value this layer's scheme does not take (:data:`SCHEME_ACTIVATIONS`).
        """
        return self._activations

    @activations.setter
    def activations(self, value: str) -> None:
        if value not in SCHEME_ACTIVATIONS[self.scheme]:
            raise ValueError(f"activations={value!r}: an {self.scheme} layer takes one of {SCHEME_ACTIVATIONS[self.scheme]}")
        self._activations = value

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
            return self.weight.float().mul_(self.scales.float()[:, None])     # dequantize_int8, one allocation
        return dequantize_int4(unpack_int4(self.weight), self.scale_zero, self.group_size)

    def repack(self) -> None:
        """Rebuild the int4 kernel's packed weight from ``weight`` and ``scale_zero`` (CPU only)."""
        if self.scheme != "int4" or self.weight.device.type != "cpu" or self.weight.is_meta:
            self.packed = None
            return
        q = unpack_int4(self.weight)
        pad = _pad_rows(self.n_out) - self.n_out                         # the kernel needs N % 16 == 0
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(F.pad(q, (0, 0, 0, pad)), 1)

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """``x [..., n_in]`` → ``[..., n_out]`` (see the class); ``gelu``: GPT-2's GELU applied
        to the result (an MLP's ``c_fc`` with its activation,
        :class:`~gpt2mha.inference.fast.GeluFusedMLP`): inside per_row's operator where the
        layer runs it (float32 out), else ``F.gelu(approximate="tanh")`` after."""
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(f"this layer's weight is quantized ({self.scheme}): autograd cannot flow through "
                               f"it; quantized models are for inference (train the float model, then quantize)")
        x2 = x.reshape(-1, self.n_in)                                  # [M, K]
        tokens = x.shape[-2] if x.dim() > 2 else x2.shape[0]            # tokens per sequence
        # gpt2mha's operators add a float32 bias to a float32 output themselves (one pass less)
        bias = self.bias if self.bias is not None and self.bias.dtype == torch.float32 \
            and self.out_dtype(x.dtype) == torch.float32 else None
        fused = in_op = False
        many = (x.device.type == "cpu" and self.activations != "per_row"      # (per_row never asks)
                and self.dequantize_for(tokens))
        if x.device.type != "cpu":
            y = F.linear(x2.to(KERNEL_DTYPE), self.dequantized().to(KERNEL_DTYPE))
        elif self.scheme == "int8" and (self.activations == "per_row" or self.activations == "auto" and many):
            if gemv.vnni():
                # the same W7A8 product in one call (rounding, exact integer sums on the packed
                # copy, rescale): faster than _int_mm and the ops around it at every size
                # measured, 1 to 512 rows (RESULTS.md, "Packed weights for per_row decode")
                in_op = gelu and x.dtype == torch.float32 and (self.bias is None or bias is not None)
                y = torch.ops.gpt2mha.int8_per_row(x2.float().contiguous(), *self.per_row_packed(), bias, in_op)
                fused = True
            else:
                q7, scales7, packed, wsum = self.per_row_weights()
                y = int8_matmul_per_row(x2, q7, scales7, int8_kernel(), packed, wsum)
        elif self.activations == "per_block" and gemv.available() and x2.shape[0] > 0:
            # W4A8 on the packed copy, every row count (prompts as decode steps; RESULTS.md,
            # "W4A8 on packed tiles")
            y = torch.ops.gpt2mha.int4_a8_packed(x2.float().contiguous(), *self.a8_packed(), self.group_size,
                                                 self.n_out, bias)
            fused = True
        elif many:
            y = self.dequantized_product(x2.float())
        elif tokens == 1 and self.weight.is_contiguous() and gemv.available():
            # decode: float32 x @ deq(W)ᵀ on the GEMV kernel
            if self.scheme == "int8":
                y = torch.ops.gpt2mha.int8_gemv(x2.float(), self.weight, self.gemv_scales(), bias)
            else:
                y = torch.ops.gpt2mha.int4_gemv(x2.float(), self.weight, self.gemv_scales(), self.group_size, bias)
            fused = True
        elif self.scheme == "int8":
            kernel = int8_kernel()
            y = int8_matmul(x2, self.weight, self.scales, kernel,
                            self.fbgemm_packed() if kernel == "fbgemm" else None)
        else:
            x2 = x2.to(KERNEL_DTYPE).contiguous()
            pad = self.packed.shape[0] - self.n_out                    # rows padded to a multiple of 16
            scale_zero = F.pad(self.scale_zero, (0, 0, 0, pad)) if pad else self.scale_zero
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, scale_zero)
            y = y[:, :self.n_out]
        y = y.to(self.out_dtype(x.dtype))
        if self.bias is not None and not (fused and bias is not None):
            y = y + self.bias
        if gelu and not in_op:
            y = F.gelu(y, approximate="tanh")
        return y.view(*x.shape[:-1], self.n_out)

    @property
    def fuses_gelu(self) -> bool:
        """Whether :meth:`forward` with ``gelu=True`` may fuse the activation into the product
        (per_row's operator: an int8 layer with per_row or auto activations on a CPU with
        AVX-512 VNNI where gpt2mha's kernel builds)."""
        return (self.scheme == "int8" and self.activations in ("per_row", "auto")
                and self.weight.device.type == "cpu" and gemv.vnni())

    def out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the output for inputs in ``dtype``: the same."""
        return dtype

    def dequantize_for(self, rows: int) -> bool:
        """Whether a product over ``rows`` input rows runs as a float32 GEMM over the
        dequantized weight (:meth:`dequantized_product`) rather than the quantized kernel: on
        CPUs whose int8 kernel is FBGEMM (no VNNI/AMX, :func:`int8_kernel`) from
        :data:`DEQUANTIZE_FROM_ROWS` rows on, where the float32 GEMM outruns the two integer
        pieces (int8) and the bf16 int4 kernel (int4) in prefill (RESULTS.md, "Prefill on an
        AVX2-only host"). Products with ``activations="per_row"`` never do (faster still), and
        with ``"auto"`` run W7A8 there instead.

        The forward counts the tokens of one sequence (``x.shape[-2]`` of ``[B, T, n_in]``;
        all rows of a 2-D input), never the batch: a decode step over 100 sequences
        (``[100, 1, n_in]``) takes the quantized kernel as each sequence alone does, so a row's
        result does not depend on how many rows share the call (batch invariance)."""
        return rows >= DEQUANTIZE_FROM_ROWS[self.scheme] and int8_kernel() == "fbgemm"

    def dequantized_product(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, n_in] @ deq(W)ᵀ`` → float32 ``[M, n_out]`` (no bias) by float32 GEMMs over
        the weight dequantized into a reused per-thread scratch (:func:`_scratch`), at most
        :data:`DEQUANTIZE_CHUNK` weights at a time (slices of output channels).

        int8: the integer weight is converted to float32 and the per-channel scales multiply
        the outputs (the same product as ``x @ dequantized()ᵀ`` up to float32 rounding, ~1e-7
        relative); the conversion is a plain int8 → float32 copy. int4: the low nibbles (even
        inputs) and the high nibbles (odd inputs) are converted into two contiguous ``[N, K/2]``
        halves (no strided writes), scaled per group in place and multiplied by the even and
        odd inputs; the zeros enter as ``Σ_group x · offset`` (``offset = z − 8·s``), one small
        ``[M, K/g] @ [K/g, N]`` product instead of a pass over the weight.
        """
        N, K = self.n_out, self.n_in
        step = max(1, min(N, DEQUANTIZE_CHUNK // K))
        if self.scheme == "int4":
            g = self.group_size
            even, odd = x[:, 0::2], x[:, 1::2]                                   # the low and the high nibbles' inputs
            sz = self.scale_zero.float()                                          # [K/g, N, 2]
            scale = sz[..., 0].t().contiguous()                                   # [N, K/g]
            offset = (sz[..., 1] - 8 * sz[..., 0]).t()                            # (q − 8)·s + z = q·s + offset
            group_sums = x.view(x.shape[0], K // g, g).sum(-1)                    # Σ x over each group [M, K/g]
            nibbles = torch.empty(min(N, step), K // 2, dtype=torch.uint8, device=x.device)
        outs = []
        for n0 in range(0, N, step):
            n1 = min(N, n0 + step)
            w = _scratch((n1 - n0) * K, x.device).view(n1 - n0, K)
            if self.scheme == "int8":
                outs.append(F.linear(x, w.copy_(self.weight[n0:n1])).mul_(self.scales[n0:n1].float()))
                continue
            packed, bits = self.weight[n0:n1], nibbles[:n1 - n0]
            lo, hi = w.view(2, n1 - n0, K // 2)                                   # contiguous halves
            lo.copy_(torch.bitwise_and(packed, 15, out=bits))
            hi.copy_(torch.bitwise_right_shift(packed, 4, out=bits))
            w.view(2, n1 - n0, K // g, g // 2).mul_(scale[n0:n1, :, None])
            y = group_sums @ offset[n0:n1].t()
            outs.append(y.addmm_(even, lo.t()).addmm_(odd, hi.t()))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def per_row_weights(self):
        """``(q7, scales7, packed, wsum)`` for :func:`int8_matmul_per_row`: the weight re-rounded
        to 7 bits (:func:`weight_7bit`; None on FBGEMM, which reads only its packed copy),
        FBGEMM's packed copy (None where the kernel is ``_int_mm``) and the row sums; made on
        first use and again whenever ``weight`` or ``scales`` change (as :meth:`fbgemm_packed`).
        Not part of the state dict."""
        key = (self.weight, self.scales, _version(self.weight), _version(self.scales), self.weight.data_ptr(),
               self.scales.data_ptr(), int8_kernel())                  # the kernel last: read below
        cached = self.__dict__.get("_per_row")
        if cached is None or any(a is not b for a, b in zip(cached[0][:2], key[:2])) or cached[0][2:] != key[2:]:
            with torch.inference_mode(False), torch.no_grad():
                q7, scales7 = weight_7bit(self.weight, self.scales)
                packed = fbgemm_pack(q7, scales7) if key[-1] == "fbgemm" else None
                wsum = q7.float().mul_(scales7[:, None]).sum(1)
                cached = (key, (None if packed is not None else q7, scales7, packed, wsum))
            self.__dict__["_per_row"] = cached
        return cached[1]

    def per_row_packed(self):
        """``(packed, qsum, scales7, wsum)`` for ``torch.ops.gpt2mha.int8_per_row``
        (:func:`~.gemv.int8_per_row`): the 7-bit weight (:func:`weight_7bit`) packed for the
        kernel (:func:`~.gemv.pack_rows`, int8 ``[ceil(n_out/32), ceil(n_in/4), 32, 4]``), its row
        sums as int32, the 7-bit scales as float32 and the float row sums of ``q7 · scales7``;
        made on first use and again whenever ``weight`` or ``scales`` change (as
        :meth:`per_row_weights`). Not part of the state dict."""
        key = (self.weight, self.scales, _version(self.weight), _version(self.scales), self.weight.data_ptr(),
               self.scales.data_ptr())
        cached = self.__dict__.get("_per_row_packed")
        if cached is None or any(a is not b for a, b in zip(cached[0][:2], key[:2])) or cached[0][2:] != key[2:]:
            with torch.inference_mode(False), torch.no_grad():
                q7, scales7 = weight_7bit(self.weight, self.scales)
                scales7 = scales7.float().contiguous()
                cached = (key, (gemv.pack_rows(q7), q7.sum(1, dtype=torch.int32), scales7,
                                q7.float().mul_(scales7[:, None]).sum(1)))
            self.__dict__["_per_row_packed"] = cached
        return cached[1]

    def a8_packed(self):
        """``(packed, params)`` for ``torch.ops.gpt2mha.int4_a8_packed`` (an int4 layer's W4A8
        product, ``activations="per_block"``): the nibbles in tiles of 32 output channels by 4
        inputs, uint8 ``[ceil(n_out/32), n_in/4, 64]``, and per tile and group the channels'
        scales and offsets ``z − 8·s``, float32 ``[ceil(n_out/32), n_in/group_size, 2, 32]``
        (``kernels/w4a8_products.cpp`` describes the layout). Made on first use and again whenever
        ``weight`` or ``scale_zero`` change: another tensor, a write in place, new data
        (``p.data = t``); every call for inference-mode tensors, which count no writes. Not part
        of the state dict."""
        key = (self.weight, self.scale_zero, _version(self.weight), _version(self.scale_zero), self.weight.data_ptr(),
               self.scale_zero.data_ptr())
        cached = self.__dict__.get("_a8_packed")
        if cached is None or any(a is not b for a, b in zip(cached[0][:2], key[:2])) or cached[0][2:] != key[2:] \
                or self.weight.is_inference() or self.scale_zero.is_inference():
            with torch.inference_mode(False), torch.no_grad():
                cached = (key, torch.ops.gpt2mha.int4_pack_a8(self.weight.contiguous(),
                                                              self.scale_zero.transpose(0, 1).contiguous(),
                                                              self.group_size))
            self.__dict__["_a8_packed"] = cached
        return cached[1]

    def fbgemm_packed(self):
        """FBGEMM's packed copy of the int8 weight (:func:`fbgemm_pack`), made on first use and
        made again whenever ``weight`` or ``scales`` is another tensor or was written in place
        (a packed copy is never stale). Not part of the state dict; copies of the layer
        (``copy.deepcopy``, pickling) make their own."""
        key = (self.weight, self.scales, _version(self.weight), _version(self.scales), self.weight.data_ptr(),
               self.scales.data_ptr())
        cached = self.__dict__.get("_fbgemm")
        if cached is None or any(a is not b for a, b in zip(cached[0][:2], key[:2])) or cached[0][2:] != key[2:]:
            with torch.inference_mode(False), torch.no_grad():
                cached = (key, fbgemm_pack(self.weight, self.scales))
            self.__dict__["_fbgemm"] = cached
        return cached[1]

    def gemv_scales(self) -> torch.Tensor:
        """The scales in the GEMV kernel's layout (:mod:`.gemv`): int8's as float32 ``[n_out]``;
        int4's ``scale_zero`` as bfloat16 ``[n_out, n_in / group_size, 2]`` (each output
        channel's groups together, the order the kernel streams them). Made on first use and
        again whenever the buffer is another tensor or was written in place (made at every call
        for an inference-mode tensor, which counts no writes)."""
        scales = self.scales if self.scheme == "int8" else self.scale_zero
        convert = (lambda t: t.float().contiguous()) if self.scheme == "int8" else \
            (lambda t: t.transpose(0, 1).contiguous())
        if scales.is_inference():                # no version counter: a write in place would go unseen
            return convert(scales)
        key = (scales, _version(scales), scales.data_ptr())
        cached = self.__dict__.get("_gemv")
        if cached is None or cached[0][0] is not key[0] or cached[0][1:] != key[1:]:
            cached = (key, convert(scales))
            self.__dict__["_gemv"] = cached
        return cached[1]

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state.pop("_fbgemm", None)
        state.pop("_per_row", None)
        state.pop("_per_row_packed", None)
        state.pop("_a8_packed", None)
        state.pop("_gemv", None)
        return state

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
        a = f", activations={self.activations}" if self.activations != "exact" else ""
        return f"n_in={self.n_in}, n_out={self.n_out}, scheme={self.scheme}{g}, bias={self.bias is not None}{a}"




class QuantizedHead(QuantizedLinear):
    """A quantized LM head: a :class:`QuantizedLinear` without bias whose logits come out in
    float32 (float64 for float64 inputs), as the float model's
    :class:`~gpt2mha.core.model.LMHead` gives them."""

    def __init__(self, n_in: int, n_out: int, scheme: str, group_size: int | None = None, bias: bool = False):
        super().__init__(n_in, n_out, scheme, group_size, bias=False)

    def out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.promote_types(dtype, torch.float32)

    def dequantize_for(self, rows: int) -> bool:
        """As :meth:`QuantizedLinear.dequantize_for`; an int4 head also from 2 rows on, and at 1
        where gpt2mha's kernels are not loaded, wherever the layer would take torch's
        bf16-activation kernel, whose bf16 *output* rounding left ~78 distinct logits of 256 per
        row and ties for the top token (a break-it review): the float32 product of the
        dequantized weight keeps logits float32 as the float head's."""
        return (self.scheme == "int4" and (rows >= 2 or not gemv.available())) or super().dequantize_for(rows)
