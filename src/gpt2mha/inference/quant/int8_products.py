"""int8 products that keep float32 activations exact to ~14 bits or more: each activation row
written as integer pieces (:func:`split_activations`) multiplied by the int8 weight with exact
int32 sums (:func:`int8_matmul`), and per_row's faster W7A8 product (:func:`int8_matmul_per_row`).

Which integer kernel runs them depends on the CPU (:func:`int8_kernel`): ``torch._int_mm`` where
it has AVX-512 VNNI or AMX, FBGEMM's int8 GEMM (``quantized::`` ops, the kernels of ``torch.ao``
dynamic quantization) on other x86 CPUs, where ``_int_mm`` has no fast path: on an AVX2-only
CPU it runs several times slower than the float32 matmul, and FBGEMM faster than the float32
matmul at decode sizes. :class:`~.linear.QuantizedLinear` calls them.
"""

from __future__ import annotations

import os
import warnings

import torch


#: A row whose largest |activation| exceeds this many times the mean |activation| of its other
#: features (an outlier feature) is split into more than two 8-bit pieces (:func:`pieces_for`):
#: two pieces keep every activation within ``mean / 1613`` of its value up to this ratio, and
#: each row gets as many pieces as keep that bound (at most :data:`MAX_PIECES`), for 8-bit or
#: 7-bit pieces alike.
WIDE_ROW = 40.0
MAX_PIECES = 4
#: The int8 kernels :func:`int8_kernel` chooses from, and the environment variable that forces one.
INT8_KERNELS = ("int_mm", "fbgemm")
INT8_KERNEL_ENV = "GPT2MHA_INT8_KERNEL"
#: Largest piece value per kernel: ``_int_mm`` takes int8 pieces in [-127, 127]; FBGEMM's AVX2
#: kernels add pairs of uint8 × int8 products in saturating int16 (``vpmaddubsw``), exact only
#: for 7-bit activations, so its pieces stay in [-63, 63] (stored as uint8 with zero point 64).
PIECE_LEVELS = {"int_mm": 127, "fbgemm": 63}
_FBGEMM_ZERO = 64


def fbgemm_available() -> bool:
    """Whether this torch build has FBGEMM's quantized linear ops (x86 builds do)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and \
        hasattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32")


def int8_kernel() -> str:
    """The int8 product kernel for this CPU: one of :data:`INT8_KERNELS`.

    ``"int_mm"`` (``torch._int_mm``, oneDNN) where the CPU has AVX-512 VNNI or AMX
    (``torch.cpu._is_vnni_supported`` / ``_is_amx_tile_supported``) or FBGEMM is missing (ARM
    builds); ``"fbgemm"`` on other x86 CPUs, where ``_int_mm`` runs several times slower than
    the float32 matmul and FBGEMM faster than it at one and eight rows (``python
    benchmarks/quant_kernels.py`` measures them on this CPU). The environment variable
    ``GPT2MHA_INT8_KERNEL`` (``int_mm`` or ``fbgemm``) overrides the choice.

    Raises:
        ValueError: the environment variable names no kernel, or ``fbgemm`` where it is missing.
    """
    forced = os.environ.get(INT8_KERNEL_ENV)
    if forced:
        if forced not in INT8_KERNELS:
            raise ValueError(f"{INT8_KERNEL_ENV}={forced!r}: expected one of {INT8_KERNELS}")
        if forced == "fbgemm" and not fbgemm_available():
            raise ValueError(f"{INT8_KERNEL_ENV}=fbgemm: this torch build has no FBGEMM (engines: "
                             f"{torch.backends.quantized.supported_engines})")
        return forced
    vnni = getattr(torch.cpu, "_is_vnni_supported", lambda: False)() or \
        getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return "int_mm" if vnni or not fbgemm_available() else "fbgemm"


def split_activations(x: torch.Tensor, pieces: int = 2, levels: int = 127, dtype: torch.dtype = torch.int8,
                      top: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Write float ``x [M, K]`` as ``a · (p₀ + p₁/(2L) + p₂/(2L)² + …)`` with ``pieces`` integer
    ``pᵢ`` in ``[-L, L]`` (``L = levels``) and one float ``a [M, 1]`` per row (``max |x| / L``),
    so that integer products see ~log₂(2L)·pieces significant bits of the row's largest value.

    ``p₀ = round(x / a)``, then each next piece rounds 2L × what the previous left over; the
    error is at most ``a / (2·(2L)^(pieces−1))``: for L = 127, ``max|x| / 64516`` with two pieces,
    ``max|x| / 16.4e6`` with three (float32's own precision); for L = 63 (FBGEMM's 7 bits),
    ``max|x| / 15876`` and ``max|x| / 2.0e6``. Non-finite rows give NaN. ``top [M, 1]``: each
    row's ``max |x|`` when the caller has it already.

    Returns:
        ``(pieces [pieces·M, K] in dtype (int8, or float32 holding the integers): all p₀ rows,
        then all p₁ rows, …, a float32 [M, 1])``.
    """
    x = x.float()
    M, K = x.shape
    if top is None:
        top = x.abs().amax(-1, keepdim=True)
    a = top.clamp(min=1e-30).div_(levels)
    u = x / a
    out = torch.empty(pieces * M, K, dtype=torch.float32, device=x.device)
    for i in range(pieces):
        p = torch.round(u, out=out[i * M:(i + 1) * M])
        if i < pieces - 1:
            u.sub_(p).mul_(2 * levels)
    return (out if dtype == torch.float32 else out.to(dtype)), a


def pieces_for(ratio: float, levels: int) -> int:
    """How many pieces of ``levels`` (:func:`split_activations`) keep rows whose largest
    |activation| is ``ratio`` times the mean |activation| of their other features within
    ``mean / 1613`` of every value (the bound two 8-bit pieces give at :data:`WIDE_ROW`): the smallest ``n ≥ 2`` with
    ``L·(2L)^(n−1) ≥ 127·254·ratio / WIDE_ROW``, at most :data:`MAX_PIECES`. For 8-bit pieces:
    2 up to ratio 40, 3 up to 10160; for 7-bit: 2 up to 9.8, 3 up to 1240, 4 beyond."""
    need = 127 * 254 * ratio / WIDE_ROW
    n, span = 2, levels * 2 * levels
    while span < need and n < MAX_PIECES:
        n, span = n + 1, span * 2 * levels
    return n


def fbgemm_pack(q: torch.Tensor, scales: torch.Tensor):
    """FBGEMM's packed form of int8 ``q [N, K]`` with per-output-channel ``scales [N]`` (the
    same numbers: a per-channel quantized tensor made from them, zero points 0), for
    :func:`int8_matmul`'s ``"fbgemm"`` kernel."""
    with warnings.catch_warnings():                             # torch warns on making quantized tensors
        warnings.simplefilter("ignore")
        qt = torch._make_per_channel_quantized_tensor(q.contiguous(), scales.double(),
                                                      torch.zeros(q.shape[0], dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(qt, None)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, kernel: str | None = None,
                packed=None, pieces: int | None = None) -> torch.Tensor:
    """``x [M, K] @ (q · scales)ᵀ`` → float32 ``[M, N]`` for int8 ``q [N, K]``, scales ``[N]``.

    The activations are split into integer pieces per row (:func:`split_activations`: two, or
    more when a row holds an outlier beyond :data:`WIDE_ROW` times its mean magnitude, which
    would otherwise set a coarse step for the rest of the row: :func:`pieces_for`; each row's count
    is its own, so a row gets the same bits whatever else is in the batch) and multiplied by ``q`` with an
    integer kernel whose int32 sums are exact; one float32 rescale per row and per output
    channel follows. ``kernel`` (default :func:`int8_kernel`): ``"int_mm"`` runs
    ``torch._int_mm`` on 8-bit pieces (relative error ~3e-5 on ordinary rows); ``"fbgemm"``
    runs ``quantized::linear_with_input_q_dq_qweight_dq_output_fp32`` on 7-bit pieces
    (:data:`PIECE_LEVELS`; ~1e-4), over ``packed`` (:func:`fbgemm_pack` of q and scales; made
    here when not given, slowly). Both are far closer to float32 than bf16 activations on
    ``aten._weight_int8pack_mm`` (~2e-3, output rounded to bf16).

    ``pieces=1`` rounds each activation row to one piece instead (per-row absmax scale, 8 bits
    on ``_int_mm``, 7 on FBGEMM: W8A8 / W8A7 as CTranslate2's int8 with per-row scales): faster
    for many rows, not exact (relative error ~1e-2).

    Raises:
        ValueError: an unknown ``kernel``, or ``pieces`` not None or 1..MAX_PIECES.
    """
    kernel = kernel or int8_kernel()
    if kernel not in INT8_KERNELS:
        raise ValueError(f"kernel={kernel!r}: expected one of {INT8_KERNELS}")
    M, K = x.shape
    xf = x.float()
    xa = xf.abs()
    levels = PIECE_LEVELS[kernel]
    top = xa.amax(-1, keepdim=True)
    row_pieces = None
    if pieces is None:
        rest = xa.sum(-1, keepdim=True).sub_(top).div_(max(K - 1, 1)).clamp_(min=1e-30)   # mean |x| of the others
        row_pieces = [pieces_for(r, levels) for r in (top / rest).flatten().tolist()]   # decided per row
        n = max(row_pieces, default=2)
    elif isinstance(pieces, int) and 1 <= pieces <= MAX_PIECES:
        n = pieces
    else:
        raise ValueError(f"pieces={pieces!r}: expected None (as many as exactness needs) or 1..{MAX_PIECES}")
    p, a = split_activations(xf, n, levels, torch.float32 if kernel == "fbgemm" else torch.int8, top)
    if row_pieces is not None and min(row_pieces, default=n) < n:   # rows needing fewer: zero pieces past
        need = torch.tensor(row_pieces, device=x.device)            # theirs, which adds exactly nothing
        for i in range(2, n):
            p[i * M:(i + 1) * M].masked_fill_((need <= i)[:, None], 0)
    if kernel == "fbgemm":
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            p, 1.0, _FBGEMM_ZERO, packed if packed is not None else fbgemm_pack(q, scales))
        parts = y.split(M)                                      # the weight scales are already applied
        scale = a
    else:
        if M == 1:                                              # single rows take the GEMV path
            parts = [torch._int_mm(p[i:i + 1], q.t()) for i in range(n)]
        else:
            parts = torch._int_mm(p, q.t()).split(M)
        scale = None
    y = parts[-1].float()
    for part in reversed(parts[:-1]):                           # Horner: p₀ + (p₁ + p₂/2L)/2L
        y = y.mul_(1 / (2 * levels)).add_(part)
    y = y.mul_(a)
    return y if scale is not None else y.mul_(scales.float())


def weight_7bit(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights ``q [N, K]`` with ``scales [N]`` re-rounded to 7 bits per output channel:
    ``(q7 int8 [N, K] in [-63, 63], scales7 float32 [N])`` with ``q7 = round(q · 63 / max|q|)``
    and ``scales7 = scales · max|q| / 63`` (an all-zero row keeps its scale), so that
    ``q7 · scales7 ≈ q · scales`` within half a 7-bit step. The weights of
    :func:`int8_matmul_per_row`. Takes the whole int8 range: −128 (which other int8 tools
    write) has magnitude 128 and becomes −63."""
    top = q.float().abs().amax(1).clamp(min=1)                                # [N] (int8's abs(-128) is -128)
    q7 = torch.round(q.float() * (63 / top)[:, None]).to(torch.int8)
    return q7, scales.float() * top / 63


def int8_matmul_per_row(x: torch.Tensor, q7: torch.Tensor | None, scales7: torch.Tensor, kernel: str | None = None,
                        packed=None, wsum: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ (q7 · scales7)ᵀ`` → float32 ``[M, N]`` with each activation row rounded to
    8 bits with its own scale and zero point, over 7-bit weights ``q7 [N, K]`` in ``[-63, 63]``
    (:func:`weight_7bit`) with ``scales7 [N]``: one integer product instead of
    :func:`int8_matmul`'s two or more, so faster for many rows; not exact (W7A8). On FBGEMM
    with ``packed`` (:func:`fbgemm_pack` of q7 and scales7) and ``wsum`` given, ``q7`` may be
    None (the layer keeps only the packed copy).

    Each row is written ``x ≈ a·u + lo`` with ``lo = min x``, ``a = (max x − min x) / 255`` and
    integers ``u = round((x − lo) / a)`` in ``[0, 255]`` (error ≤ a/2 per value: half a step of
    the row's *range*, up to twice finer than a symmetric 8-bit scale for one-sided rows such as
    GELU outputs). The product is ``a·(u·q7ᵀ)·scales7 + lo·wsum`` with the weights' row sums
    ``wsum [N]`` (``(q7 · scales7).sum(1)``, computed here when not given). The integer sums
    are exact on both kernels: ``_int_mm`` takes ``u − 128`` as int8; FBGEMM's AVX2 kernels add
    pairs of uint8 × int8 products in saturating int16, and ``2 · 255 · 63 < 2¹⁵`` (8-bit
    weights with 8-bit activations could saturate, hence the 7-bit weights; ``torch.ao``'s x86
    dynamic quantization makes the other trade, 7-bit activations). A row's result does not
    depend on the other rows. Rows holding NaN or ±inf give NaN rows.

    Top-1 agreement with float32 on the built-in model (benchmarks/results/quality.json): 97.4%
    against the exact pieces' 99.4%; llama.cpp q8_0 (8 bits per block of 32) 98.30%, ONNX Runtime
    int8 96.25%, CTranslate2 int8 (symmetric 8 bits per row) 95.84% on the same bytes. Rounding
    the activation rows to 7 bits over the 8-bit weights instead agrees less (``python
    benchmarks/quant_prefill.py quality`` simulates the other roundings).

    Raises:
        ValueError: an unknown ``kernel``; ``q7`` outside [-63, 63] (checked when neither ``packed``
            nor ``wsum`` is given: callers that pass them made q7 with :func:`weight_7bit`), or
            None where it is needed.
    """
    kernel = kernel or int8_kernel()
    if kernel not in INT8_KERNELS:
        raise ValueError(f"kernel={kernel!r}: expected one of {INT8_KERNELS}")
    if q7 is None and (kernel != "fbgemm" or packed is None or wsum is None):
        raise ValueError(f"q7=None: the 7-bit weights are needed on kernel={kernel!r} unless FBGEMM's packed copy "
                         f"and wsum are given")
    if packed is None and wsum is None and int(q7.abs().max()) > 63:    # a pass over the weights: the layer,
        # which made q7 with weight_7bit and passes its wsum, skips it (it cost 2x the product on _int_mm)
        raise ValueError(f"q7: weights up to {int(q7.abs().max())} in magnitude; expected 7-bit weights in "
                         f"[-63, 63] (weight_7bit)")
    xf = x.float()
    lo = xf.amin(-1, keepdim=True)
    a = xf.amax(-1, keepdim=True).sub_(lo).div_(255)
    bad = None if bool(torch.isfinite(a).all()) else ~torch.isfinite(a)
    if bad is not None:                                                  # such rows become NaN below
        a.masked_fill_(bad, 1.0)
        lo = lo.masked_fill(bad, 0.0)
    u = (xf - lo).div_(a.clamp_(min=1e-30)).round_().sub_(128)          # integers in [-128, 127]
    if wsum is None:
        wsum = q7.float().mul_(scales7.float()[:, None]).sum(1)
    if kernel == "fbgemm":
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            u, 1.0, 128, packed if packed is not None else fbgemm_pack(q7, scales7))
    else:
        y = torch._int_mm(u.to(torch.int8), q7.t()).float().mul_(scales7.float())
    y = y.mul_(a).addr_(a.mul(128).add_(lo).flatten(), wsum)          # x = a·(u + 128) + lo
    return y if bad is None else y.masked_fill_(bad, float("nan"))
