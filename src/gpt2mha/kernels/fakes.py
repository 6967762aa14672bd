"""The operators' fake (meta) implementations: each output's shape, dtype and strides without
computing it, so that ``torch.compile`` traces a call as one opaque node (the library defines
the operators and their CPU kernels; :func:`register` runs once it is loaded).
tests/test_kernel_ops.py checks every operator with ``torch.library.opcheck``."""

from __future__ import annotations

import torch


def product(x: torch.Tensor, weight: torch.Tensor, *rest) -> torch.Tensor:
    """int8_gemv, int4_gemv, int4_gemv_a8, linear_f32 and linear_bf16: float32 ``[M, N]`` for x ``[M, K]``,
    weight ``[N, ...]``."""
    return x.new_empty(x.shape[0], weight.shape[0])


def conv1d(x: torch.Tensor, weight: torch.Tensor, *rest) -> torch.Tensor:
    """conv1d_f32 and conv1d_bf16 (GPT-2's Conv1D layout): float32 ``[M, N]`` for x ``[M, K]``, weight ``[K, N]``."""
    return x.new_empty(x.shape[0], weight.shape[1])


def per_row(x: torch.Tensor, packed: torch.Tensor, qsum: torch.Tensor, *rest) -> torch.Tensor:
    """int8_per_row: float32 ``[M, N]``, N from qsum ``[N]`` (packed rows are rounded up to 32)."""
    return x.new_empty(x.shape[0], qsum.shape[0])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[B, h, T, D]`` laid out ``[B, T, h, D]`` (the heads merge with a free reshape)."""
    B, h, T, D = q.shape
    return q.new_empty(B, T, h, D).permute(0, 2, 1, 3)


def cached_forward(tokens, wte, wpe, layers, ln_f_weight, ln_f_bias, head, k, v, lengths, group_size, eps):
    """Each row's last logits ``[B, V]`` (k and v are written in place: the schema says so)."""
    vocab = head[1].shape[0] if head[0].dim() == 4 else head[0].shape[0]     # per_row's packed head: qsum [V]
    return wte.new_empty(k.shape[1], vocab, dtype=torch.float32)          # float32 for a bf16 model too


#: Every operator of the library that takes tensors (tests/test_kernel_ops.py holds new ones to it).
FAKES = {"int8_gemv": product, "int4_gemv": product, "int4_gemv_a8": product, "int8_per_row": per_row,
         "causal_attention": causal_attention, "cached_forward": cached_forward, "conv1d_f32": conv1d,
         "linear_f32": product, "conv1d_bf16": conv1d, "linear_bf16": product}


def register() -> None:
    """Registers :data:`FAKES` for the loaded library's operators (``gpt2mha::NAME``)."""
    for name, fn in FAKES.items():
        torch.library.register_fake(f"gpt2mha::{name}")(fn)
