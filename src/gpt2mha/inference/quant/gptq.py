"""GPTQ: rounding weights so that their products with calibration inputs stay close.

Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", Algorithm 1, in this package's int8 / int4 storage (:mod:`.schemes`).
"""

from __future__ import annotations

import torch

from .schemes import KERNEL_DTYPE, int4_params, quantize_int8


#: GPTQ's dampening: ``damp · mean(diag H)`` is added to H's diagonal (Frantar et al., §4 "Step 3").
GPTQ_DAMP = 0.01
#: Columns quantized between two lazy batch updates of the rest (Frantar et al., "Step 2").
GPTQ_BLOCK = 128


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
    if scheme == "int8":
        _, scales = quantize_int8(w)
        s = scales.float()
        params = (s, torch.zeros_like(s))                      # w ≈ q·s, q in -127..127
        qmin, qmax, offset = -127, 127, 0
    else:
        groups = []                                             # (scale, zero) per group, [N] each
        qmin, qmax, offset = 0, 15, 8                          # w ≈ (q − 8)·scale + zero
    block = max(GPTQ_BLOCK, group_size or 0)
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1, E1, Hi = W[:, i1:i2].clone(), torch.empty(N, i2 - i1, device=W.device), Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            if scheme == "int4" and (i1 + i) % group_size == 0:
                g = W1[:, i:i + group_size]
                params = int4_params(g.amin(-1), g.amax(-1))
                groups.append(params)
            scale, zero = params
            col = W1[:, i]
            q = torch.round((col - zero) / scale).add_(offset).clamp_(qmin, qmax)
            Q[:, i1 + i] = q
            err = (col - ((q - offset) * scale + zero)) / Hi[i, i]
            W1[:, i:] -= err[:, None] * Hi[i, i:][None]
            E1[:, i] = err
        W[:, i2:] -= E1 @ Hinv[i1:i2, i2:]
    if scheme == "int8":
        return Q.to(torch.int8), scales
    scale_zero = torch.stack([torch.stack(p, -1) for p in groups])            # [K/g, N, 2]
    return Q.to(torch.int32), scale_zero.to(KERNEL_DTYPE)


