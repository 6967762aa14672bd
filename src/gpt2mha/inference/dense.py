"""The Python side of gpt2mha's float32, bf16 and fp16 products (``src/gpt2mha/kernels/float_products.cpp``,
``bf16_products.cpp``): the operators ``torch.ops.gpt2mha.conv1d_f32``, ``conv1d_bf16`` and
``conv1d_f16`` (GPT-2's Conv1D layout, ``x @ W + b``) and ``linear_f32``, ``linear_bf16`` and
``linear_f16`` (``F.linear``'s, ``x @ Wᵀ + b``: the LM head over ``wte``) behind checked wrappers
that pick by the weight's dtype. The native forward (:mod:`.native`) calls the same kernels from
C++ for float32, bf16 and fp16 models.

bf16 weights: the activations are rounded to bf16 (a bf16 model's already are), every product
of two bf16 values is exact in float32, the sums are float32 fused multiply-adds in AVX-512
BF16's ``vdpbf16ps`` order (the same on 8 float32 lanes on CPUs without it: the same bits, but
where the instruction flushes a subnormal to zero), and ``conv1d`` rounds its output to bf16 (as a bf16
model's GEMMs do), then GELU and bf16 again if asked; ``linear`` returns float32 (the head's
logits).

fp16 weights: the activations are rounded to fp16 (a fp16 model's already are), each weight
converted to float32 (exact; F16C's ``vcvtph2ps``) and summed exactly as the float32 products
sum (float32 fused multiply-adds in their order: the same bits as ``conv1d_f32`` over
``weight.float()``), ``conv1d`` rounds its output to fp16 once (as torch's fp16 GEMM on the CPU
does: float32 sums, bias included, rounded once), then GELU and fp16 again if asked; ``linear``
returns float32.

Each output is summed in one fixed order (see the C++ file), so a row's result is the same bits
whatever the other rows, the number of threads or the instruction set (AVX2 or AVX-512); against
torch's products (MKL's order) the results differ by float32 rounding only. Made for decode
sizes (1–16 rows), where a product is a read of the weights: at one row they read 124M's
weights near the memory's speed, where torch's GEMV called from Python reads them at about half
of it (docs/performance.md, a step's products against torch's GEMMs).
"""

from __future__ import annotations

import torch

from .. import kernels
from .quant import gemv


def conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           gelu: bool = False) -> torch.Tensor:
    """``x @ weight + bias`` (GPT-2's Conv1D), then GPT-2's GELU if ``gelu``, by ``conv1d_f32``
    (float32 weights), ``conv1d_bf16`` or ``conv1d_f16`` (bf16, fp16 weights: see the module's
    docstring).

    Args:
        x: float32 ``[M, K]`` on the CPU (any strides: made contiguous).
        weight: float32, bfloat16 or float16 ``[K, N]``, contiguous (a :class:`~gpt2mha.core.attention.Conv1D`'s).
        bias: float32 ``[N]`` or None.
        gelu: apply ``0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))`` to each output (simd.h's gelu:
            within a few float32 ulps of ``F.gelu(approximate="tanh")``).

    Returns:
        float32 ``[M, N]``: output ``(m, n)`` is ``bias[n]`` then ``+ x[m, k]·weight[k, n]`` fused
        for k = 0, 1, … in order (bf16: in pairs, rounded to bf16 values; fp16: rounded to fp16 values).

    Raises:
        RuntimeError: the kernels are not loaded.
        ValueError: naming the argument: x requires grad or is not a non-empty float32 CPU
            matrix; weight or bias of the wrong dtype, shape, device or layout.
    """
    _check(x, weight, bias, conv=True)
    return getattr(torch.ops.gpt2mha, f"conv1d_{_OPS[weight.dtype]}")(x, weight, bias, bool(gelu))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (``F.linear``) by ``linear_f32``, ``linear_bf16`` or ``linear_f16``
    (bf16, fp16 weights).

    Args:
        x: float32 ``[M, K]`` on the CPU.
        weight: float32, bfloat16 or float16 ``[N, K]``, contiguous (an LM head's, or ``wte``).
        bias: float32 ``[N]`` or None.

    Returns:
        float32 ``[M, N]``: output ``(m, n)`` sums ``x[m, k]·weight[n, k]`` in 16 lanes (float32
        and fp16 weights: lane l takes k ≡ l mod 16, in order; bf16: lane l takes the pairs k = 32j + 2l,
        2l + 1, in ``vdpbf16ps``'s order), then the lanes in a fixed tree, then ``+ bias[n]``.

    Raises:
        RuntimeError: the kernels are not loaded.
        ValueError: as :func:`conv1d`.
    """
    _check(x, weight, bias, conv=False)
    return getattr(torch.ops.gpt2mha, f"linear_{_OPS[weight.dtype]}")(x, weight, bias)


#: the operators' suffix by the weight's dtype: ``conv1d_f32``, ``linear_bf16``, …
_OPS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def has_bf16_dot() -> bool:
    """Whether the bf16 products take AVX-512 BF16's ``vdpbf16ps`` now: the CPU has AVX-512 and
    AVX-512 BF16, both allowed (:mod:`gpt2mha.kernels.dispatch`). False where the kernels are
    not loaded."""
    return kernels.dispatch.paths().get("bf16") == "avx512_bf16"


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv: bool) -> None:
    # the operators check too (TORCH_CHECK, a RuntimeError); here the same checks raise ValueError
    if not gemv.available():
        raise RuntimeError(f"the float product kernels are not available: {gemv.unavailable_reason()}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor; got {type(t).__name__}")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError("x requires grad: the float product kernels are for inference (no backward); call them "
                         "under torch.no_grad() or torch.inference_mode()")
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.numel() == 0:
        raise ValueError(f"x must be a non-empty float32 CPU tensor [M, K]; got {x.dtype} {tuple(x.shape)} on "
                         f"{x.device}")
    K = x.shape[1]
    layout = "[K, N]" if conv else "[N, K]"
    k_dim = 0 if conv else 1
    if (weight.dim() != 2 or weight.dtype not in _OPS or weight.device.type != "cpu"
            or not weight.is_contiguous() or weight.shape[k_dim] != K or weight.shape[1 - k_dim] == 0):
        raise ValueError(f"weight must be a contiguous float32, bfloat16 or float16 CPU tensor {layout} with K={K} (x's "
                         f"columns) and N >= 1; got {weight.dtype} {tuple(weight.shape)} on {weight.device}"
                         + ("" if weight.is_contiguous() else " (not contiguous)"))
    N = weight.shape[1 - k_dim]
    if bias is not None and (bias.dtype != torch.float32 or bias.dim() != 1 or bias.shape[0] != N
                             or bias.device.type != "cpu" or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous float32 CPU tensor [N={N}] or None; got {bias.dtype} "
                         f"{tuple(bias.shape)} on {bias.device}")
