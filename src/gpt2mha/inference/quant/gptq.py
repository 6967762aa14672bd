"""GPTQ: rounding weights so that their products with calibration inputs stay close.

Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", Algorithm 1, in this package's int8 / int4 storage (:mod:`.schemes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


#: GPTQ's dampening: ``damp · mean(diag H)`` is added to H's diagonal (Frantar et al., §4 "Step 3").
GPTQ_DAMP = 0.01
#: Columns quantized between two lazy batch updates of the rest (Frantar et al., "Step 2").
GPTQ_BLOCK = 128


@dataclass
class Grid:
    """The values a scheme rounds a weight column to, for :func:`gptq` (each scheme's
    ``gptq_grid(w, group_size)`` makes one): integers ``q`` in ``[qmin, qmax]`` standing for
    ``(q − offset)·scale + zero``, with ``(scale, zero)`` (each ``[N]``) either ``fixed`` for
    every column or computed by ``group_params(columns [N, group_size])`` when a group's first
    column is reached; ``finish(Q, groups)`` turns the rounded ``Q [N, K]`` (float) and the
    groups' ``(scale, zero)`` into what the scheme's rounding to nearest returns."""

    qmin: int
    qmax: int
    offset: int
    finish: Callable
    fixed: tuple | None = None
    group_size: int | None = None
    group_params: Callable | None = None


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
    from .linear import layer_class
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
    grid = layer_class(scheme).gptq_grid(w, group_size)
    params, groups, g = grid.fixed, [], grid.group_size          # groups: (scale, zero) per group, [N] each
    qmin, qmax, offset = grid.qmin, grid.qmax, grid.offset
    block = max(GPTQ_BLOCK, g or 0)
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1, E1, Hi = W[:, i1:i2].clone(), torch.empty(N, i2 - i1, device=W.device), Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            if g and (i1 + i) % g == 0:
                params = grid.group_params(W1[:, i:i + g])
                groups.append(params)
            scale, zero = params
            col = W1[:, i]
            q = torch.round((col - zero) / scale).add_(offset).clamp_(qmin, qmax)
            Q[:, i1 + i] = q
            err = (col - ((q - offset) * scale + zero)) / Hi[i, i]
            W1[:, i:] -= err[:, None] * Hi[i, i:][None]
            E1[:, i] = err
        W[:, i2:] -= E1 @ Hinv[i1:i2, i2:]
    return grid.finish(Q, groups)


