"""The operators' fake (meta) implementations: each output's shape, dtype and strides without
computing it, so that ``torch.compile`` traces a call as one opaque node (the library defines
the operators and their CPU kernels; :func:`register` runs once it is loaded).
tests/test_kernel_ops.py checks every operator with ``torch.library.opcheck``."""

from __future__ import annotations

import torch


def product(x: torch.Tensor, weight: torch.Tensor, *rest) -> torch.Tensor:
    """int8_gemv, int4_gemv, int4_gemv_a8, linear_f32, linear_bf16 and linear_f16: float32 ``[M, N]`` for x ``[M, K]``,
    weight ``[N, ...]``."""
    return x.new_empty(x.shape[0], weight.shape[0])


def conv1d(x: torch.Tensor, weight: torch.Tensor, *rest) -> torch.Tensor:
    """conv1d_f32, conv1d_bf16 and conv1d_f16 (GPT-2's Conv1D layout): float32 ``[M, N]`` for x ``[M, K]``, weight ``[K, N]``."""
    return x.new_empty(x.shape[0], weight.shape[1])


def per_row(x: torch.Tensor, packed: torch.Tensor, qsum: torch.Tensor, *rest) -> torch.Tensor:
    """int8_per_row: float32 ``[M, N]``, N from qsum ``[N]`` (packed rows are rounded up to 32)."""
    return x.new_empty(x.shape[0], qsum.shape[0])


def a8_packed(x: torch.Tensor, packed: torch.Tensor, params: torch.Tensor, group_size: int, n_out: int,
              bias=None) -> torch.Tensor:
    """int4_a8_packed: float32 ``[M, n_out]`` (packed tiles are rounded up to 32 channels)."""
    return x.new_empty(x.shape[0], n_out)


def pack_a8(weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int):
    """int4_pack_a8: uint8 ``[ceil(N/32), K/4, 64]`` and float32 ``[ceil(N/32), K/group_size, 2, 32]``."""
    N, K = weight.shape[0], 2 * weight.shape[1]
    T = (N + 31) // 32
    return weight.new_empty(T, K // 4, 64), weight.new_empty(T, K // group_size, 2, 32, dtype=torch.float32)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[B, h, T, D]`` laid out ``[B, T, h, D]`` (the heads merge with a free reshape)."""
    B, h, T, D = q.shape
    return q.new_empty(B, T, h, D).permute(0, 2, 1, 3)


def cached_forward(tokens, wte, wpe, layers, ln_f_weight, ln_f_bias, head, k, v, lengths, group_size, eps, kind=""):
    """Each row's last logits ``[B, V]`` (k and v are written in place: the schema says so)."""
    # per_row's packed head: qsum [V]; W4A8's packed tiles: wte's rows
    vocab = head[1].shape[0] if head[0].dim() == 4 else wte.shape[0] if head[0].dim() == 3 else head[0].shape[0]
    return wte.new_empty(k.shape[1], vocab, dtype=torch.float32)          # float32 for a bf16 or fp16 model too


#: Every operator of the library that takes tensors (tests/test_kernel_ops.py holds new ones to it).
FAKES = {"int8_gemv": product, "int4_gemv": product, "int4_gemv_a8": product, "int8_per_row": per_row,
         "int4_a8_packed": a8_packed, "int4_pack_a8": pack_a8,
         "causal_attention": causal_attention, "causal_attention_bf16": causal_attention, "cached_forward": cached_forward, "conv1d_f32": conv1d,
         "linear_f32": product, "conv1d_bf16": conv1d, "linear_bf16": product,
         "conv1d_f16": conv1d, "linear_f16": product}


def _one_device(name: str, fn):
    """fn, refusing tensors on different devices: a real CPU tensor beside one on the meta device
    dispatches here, not to the CPU kernel, and would get an uninitialized output, not an error
    (under ``torch.compile``'s fake tensors every argument reports the same device)."""
    def fake(*args):
        flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
        devices = {t.device for t in flat if isinstance(t, torch.Tensor)}
        if len(devices) > 1:
            raise RuntimeError(f"{name}: every tensor must be on one device (the CPU); got "
                               f"{', '.join(sorted(str(d) for d in devices))}")
        return fn(*args)
    return fake


def register() -> None:
    """Registers :data:`FAKES` for the loaded library's operators (``gpt2mha::NAME``)."""
    for name, fn in FAKES.items():
        torch.library.register_fake(f"gpt2mha::{name}")(_one_device(name, fn))
