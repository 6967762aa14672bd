"""The Python side of gpt2mha's C++ products (``src/gpt2mha/kernels/products.cpp``): the
operators ``torch.ops.gpt2mha.int8_gemv`` and ``int4_gemv`` (float32 activations),
``int4_gemv_a8`` (W4A8) and ``int8_per_row`` (W7A8) behind checked wrappers, per_row's weight
packing. The library is built at install and loaded by
:mod:`gpt2mha.kernels`; :func:`available` says whether it is, :func:`unavailable_reason` why not
(then callers keep torch's kernels, and gpt2mha has said so once).

At one to eight input rows a product is a read of the int8 weights. On an AVX2-only CPU none of
the kernels torch ships streams them near the memory's speed (inductor's weight-only int8
template comes closest, FBGEMM and oneDNN less); ``products.cpp`` reads each weight row start to
end and converts it to float32 in registers, faster than the template and with float32
activations where the template rounds them to bf16. int4 weights (two per byte, a bf16 scale and zero per group) are unpacked the same way,
where torch's int4 kernel takes bf16 activations, emulated and slow on CPUs without AVX-512
BF16.

A C++ operator, not a Python one: inside a compiled step each call costs ~5 us through torch's
dispatcher, against ~35 us for a ``torch.library`` operator implemented in Python (measured:
~1.5 ms a step over 124M's 49 products). The kernels' OpenMP threads are torch's
(``torch.set_num_threads`` sets their number).
"""

from __future__ import annotations

import torch

from ... import kernels


def available() -> bool:
    """Whether gpt2mha's kernels are loaded (:func:`gpt2mha.kernels.available`)."""
    return kernels.available()


def unavailable_reason() -> str:
    """Why :func:`available` is False ("" when it is True)."""
    return kernels.unavailable_reason()


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` int8 laid out for ``torch.ops.gpt2mha.int8_per_row``: ``[ceil(N/32),
    ceil(K/4), 32, 4]``, four consecutive inputs of 32 output channels per 128 bytes
    (``P[t, j, c, i] = q[32t + c, 4j + i]``, zero past N and K), the order VNNI's ``vpdpbusd``
    multiplies them in (oneDNN and FBGEMM pack their int8 weights alike). A copy (same bytes,
    rounded up).

    Raises:
        ValueError: ``q`` is not a 2-D int8 CPU tensor, or holds values outside [-63, 63].
    """
    if q.dtype != torch.int8 or q.dim() != 2 or q.device.type != "cpu":
        raise ValueError(f"q must be a 2-D int8 CPU tensor [N, K]; got {q.dtype} {tuple(q.shape)} on {q.device}")
    if q.numel() and (int(q.min()) < -63 or int(q.max()) > 63):   # 8-bit weights would saturate the AVX2 path
        raise ValueError(f"q: weights from {int(q.min())} to {int(q.max())}; expected 7-bit weights in [-63, 63] "
                         f"(int8_products.weight_7bit)")
    N, K = q.shape
    Np, Kp = -(-N // 32) * 32, -(-K // 4) * 4
    padded = torch.zeros(Np, Kp, dtype=torch.int8)
    padded[:N, :K] = q
    return padded.view(Np // 32, 32, Kp // 4, 4).transpose(1, 2).contiguous()


def vnni() -> bool:
    """Whether :func:`int8_per_row` takes its AVX-512 VNNI path (``vpdpbusd``) now: the CPU has
    AVX-512 and AVX-512 VNNI, both allowed (:mod:`gpt2mha.kernels.dispatch`). False where the
    kernels are not loaded."""
    return kernels.dispatch.paths().get("per_row") == "avx512_vnni"


def int8_per_row(x: torch.Tensor, packed: torch.Tensor, qsum: torch.Tensor, scales7: torch.Tensor,
                 wsum: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
    """per_row's W7A8 layer (:func:`~.int8_products.int8_matmul_per_row`, plus the bias) at decode
    sizes by ``products.cpp``: each row of x rounded to 8 bits with its own step ``a = (max − min) /
    255`` and minimum ``lo``, ``u = round((x − lo) / a)``; the exact integer sums of u with the
    7-bit weights on their packed copy (``vpdpbusd`` on AVX-512 VNNI CPUs, ``vpmaddubsw``
    elsewhere: the same bits); then ``(Σ u·q − 128·qsum)·scales7·a + (128·a + lo)·wsum + bias``.

    Args:
        x: float32 ``[M, K]`` (made for 1–16 rows).
        packed: :func:`pack_rows` of the 7-bit weights ``q7 [N, K]`` (values in [-63, 63],
            :func:`~.int8_products.weight_7bit`: 8-bit weights would saturate the AVX2 path).
        qsum: int32 ``[N]``, ``q7.sum(1)``.
        scales7: float32 ``[N]``; wsum: float32 ``[N]``, ``(q7 · scales7).sum(1)``.
        bias: float32 ``[N]`` or None.
        gelu: apply GPT-2's GELU to the result (the MLP's ``c_fc`` fused with its activation):
            ``x / (1 + exp(-2u))``, ``u = √(2/π)(x + 0.044715x³)``, which is
            ``0.5x(1 + tanh(u))`` (openai/gpt-2's ``gelu``) within a few float32 ulps of
            ``F.gelu(approximate="tanh")`` (its own exp: Cephes' ``expf``).

    Returns:
        float32 ``[M, N]``; a row of x holding NaN or ±inf gives a NaN row. Each row's result is
        the same whatever the other rows and the threads are.

    Raises:
        RuntimeError: the kernel is not available, or (from the operator, before it reads
            anything) a tensor of the wrong dtype, shape or layout, named.
        ValueError: ``x`` requires grad, is not a float32 CPU matrix or is empty, no output
            channels (N = 0), or NaN or ±inf in ``scales7`` or ``wsum``.
    """
    _check_x(x, "per_row")
    if qsum.dim() == 1 and qsum.shape[0] == 0:
        raise ValueError("qsum is empty: N=0 output channels; expected at least one")
    _check_finite(scales7=scales7, wsum=wsum)
    return torch.ops.gpt2mha.int8_per_row(x, packed, qsum, scales7, wsum, bias, gelu)


def _check_x(x: torch.Tensor, scheme: str) -> None:
    # the operators check too (TORCH_CHECK, a RuntimeError); here the same checks raise ValueError
    if not available():
        raise RuntimeError(f"the {scheme} GEMV kernel is not available: {unavailable_reason()}")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"x requires grad: the {scheme} GEMV kernel is for inference (no backward); "
                         f"call it under torch.no_grad() or torch.inference_mode()")
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a float32 CPU tensor [M, K]; got {x.dtype} {tuple(x.shape)} on {x.device}")
    if x.numel() == 0:
        raise ValueError(f"x is empty: [M, K] = {list(x.shape)}; expected at least one row and one input")


def _check_finite(**tensors: torch.Tensor) -> None:
    # NaN or inf scales would turn every output they touch into NaN or inf: refused by name
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} holds NaN or ±inf ({int((~torch.isfinite(t)).sum())} of {t.numel()} values); "
                             f"expected finite values")


def int8_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight · scales)ᵀ + bias`` in float32 by ``products.cpp``: the float32 product with the
    dequantized weight (float32 accumulation; the activations are not rounded).

    Args:
        x: float32 ``[M, K]`` (any M; made for 1–8).
        weight: int8 ``[N, K]``, contiguous (a :class:`~.linear.QuantizedLinear`'s ``weight``).
        scales: float32 ``[N]``, one per output channel.
        bias: float32 ``[N]`` or None.

    Returns:
        float32 ``[M, N]``. Each row's result is the same whatever the other rows are.

    Raises:
        RuntimeError: the kernel is not available (:func:`unavailable_reason` says why).
        ValueError: a tensor of the wrong dtype, shape or device, a weight that is not
            contiguous, an empty x or weight, NaN or ±inf scales, or ``x`` requiring grad (no
            backward).
    """
    _check_x(x, "int8")
    if weight.dtype != torch.int8 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or not weight.is_contiguous() \
            or weight.device.type != "cpu" or weight.shape[0] == 0:
        raise ValueError(f"weight must be a contiguous int8 CPU tensor [N, K={x.shape[1]}]; got {weight.dtype} "
                         f"{tuple(weight.shape)} (contiguous={weight.is_contiguous()}) on {weight.device}")
    for name, t in (("scales", scales), ("bias", bias)):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (weight.shape[0],)
                              or not t.is_contiguous() or t.device.type != "cpu"):
            raise ValueError(f"{name} must be a contiguous float32 CPU tensor [N={weight.shape[0]}]; "
                             f"got {t.dtype} {tuple(t.shape)}")
    _check_finite(scales=scales)
    return torch.ops.gpt2mha.int8_gemv(x, weight, scales, bias)


#: :func:`int4_gemv`'s operator and the multiple its group size must be of, by ``activations``.
INT4_GEMV = {"exact": ("int4_gemv", 16), "per_block": ("int4_gemv_a8", 32)}


def int4_gemv(x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int,
              bias: torch.Tensor | None = None, activations: str = "exact") -> torch.Tensor:
    """``x @ deq(W)ᵀ + bias`` in float32 by ``int4_products.cpp`` for an int4 weight, ``deq(W) = (q − 8)·s + z``.

    ``activations="exact"`` (``torch.ops.gpt2mha.int4_gemv``): the float32 product with the
    dequantized weight (float32 activations and accumulation). ``"per_block"``
    (``torch.ops.gpt2mha.int4_gemv_a8``, W4A8 as llama.cpp's q4_0 · q8_0): each row of x rounded
    to 8 bits per group of ``group_size`` inputs, ``a = round(x / d)`` with ``d = max|x| / 127``
    over the group, the nibbles times ``a`` in exact int32 sums (``vpdpbusd`` on AVX-512 VNNI
    CPUs, ``vpmaddubsw`` elsewhere: the same bits), scaled by ``s·d`` per group:
    ``x̂ @ deq(W)ᵀ`` for the rounded ``x̂ = a·d``, fewer instructions per weight.

    Args:
        x: float32 ``[M, K]`` (any M; made for 1–8).
        weight: uint8 ``[N, K/2]``, contiguous, input ``2i`` in the low nibble of byte ``i``
            and ``2i + 1`` in the high one (:func:`~.schemes.pack_int4`, a
            :class:`~.linear.QuantizedLinear`'s int4 ``weight``).
        scale_zero: bfloat16 ``[N, K / group_size, 2]``, contiguous: each row's groups'
            (scale, zero) (the layer's ``scale_zero [K/g, N, 2]`` transposed, see
            :meth:`~.linear.QuantizedLinear.gemv_params`).
        group_size: inputs per group, a multiple of 16 dividing K (for ``"per_block"``: of 32).
        bias: float32 ``[N]`` or None.
        activations: ``"exact"`` or ``"per_block"``.

    Returns:
        float32 ``[M, N]``. Each row's result is the same whatever the other rows are.

    Raises:
        RuntimeError: the kernel is not available (:func:`unavailable_reason` says why).
        ValueError: a tensor of the wrong dtype, shape or device, a tensor that is not
            contiguous, an empty x or weight, NaN or ±inf in ``scale_zero``, a group size the
            weight cannot have, an unknown ``activations``, or ``x`` requiring grad.
    """
    if activations not in tuple(INT4_GEMV):
        raise ValueError(f"activations={activations!r}: expected 'exact' or 'per_block'")
    name, unit = INT4_GEMV[activations]
    _check_x(x, "int4")
    K = x.shape[1]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < unit or group_size % unit \
            or K % group_size:
        raise ValueError(f"group_size={group_size!r}: expected a multiple of {unit} dividing K={K}")
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] * 2 != K or not weight.is_contiguous() \
            or weight.device.type != "cpu" or weight.shape[0] == 0:
        raise ValueError(f"weight must be a contiguous uint8 CPU tensor [N, K/2={K // 2}]; got {weight.dtype} "
                         f"{tuple(weight.shape)} (contiguous={weight.is_contiguous()}) on {weight.device}")
    N = weight.shape[0]
    if scale_zero.dtype != torch.bfloat16 or tuple(scale_zero.shape) != (N, K // group_size, 2) \
            or not scale_zero.is_contiguous() or scale_zero.device.type != "cpu":
        raise ValueError(f"scale_zero must be a contiguous bfloat16 CPU tensor [N={N}, K/group_size="
                         f"{K // group_size}, 2]; got {scale_zero.dtype} {tuple(scale_zero.shape)} "
                         f"(contiguous={scale_zero.is_contiguous()})")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (N,)
                             or not bias.is_contiguous() or bias.device.type != "cpu"):
        raise ValueError(f"bias must be a contiguous float32 CPU tensor [N={N}]; got {bias.dtype} {tuple(bias.shape)}")
    _check_finite(scale_zero=scale_zero)
    return getattr(torch.ops.gpt2mha, name)(x, weight, scale_zero, group_size, bias)
