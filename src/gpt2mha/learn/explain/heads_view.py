"""The heads view's data: every head's pattern as a small multiple, and each head's role.

The small multiples are the patterns (``hook_pattern``) reduced to at most :data:`THUMB` x
:data:`THUMB` pixels, each the largest weight of its block of cells (a mean would fade a head
that puts all its weight on one key per query to 1/16 of the scale at 1024 tokens), on the
fixed 0-1 scale, rounded to 8 bits; a click on one fetches that head's
full-precision unit (:func:`~gpt2mha.learn.explain.tensors.head_unit`). Roles and their scores
are :mod:`gpt2mha.learn.heads`' (relative to uniform attention; induction measured on a random
sequence repeated twice).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core.hooks import attached
from ..heads import NO_ROLE, ROLE_THRESHOLD, ROLES, assign_roles, induction_scores, relative_scores
from .tensors import encode_u8

#: Side of a small multiple, in cells (a prompt of T tokens is pooled to min(T, THUMB)).
THUMB = 64


#: How a thumbnail pixel sums up its block of cells (the page's legend says it).
POOL = "max"


def thumbnails(patterns: torch.Tensor) -> torch.Tensor:
    """``[n_layer, n_head, T, T]`` → ``[n_layer, n_head, B, B]`` with ``B = min(T, THUMB)``:
    the largest weight of each block of cells (``adaptive_max_pool2d``: block i spans rows
    ``floor(i·T/B)`` to ``ceil((i+1)·T/B)``; T ≤ THUMB: the patterns themselves)."""
    L, H, T, _ = patterns.shape
    if T <= THUMB:
        return patterns.float()
    return F.adaptive_max_pool2d(patterns.float().reshape(L * H, 1, T, T), THUMB).reshape(L, H, THUMB, THUMB)


def collect(model, idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
    """Every head's small multiple and relative role scores from one forward over ``idx [1, T]``,
    each layer's ``hook_pattern`` reduced as the forward passes it (never all layers' ``[n_head,
    T, T]`` maps at once: 600 MB for 124M at 1024 tokens).

    Returns:
        ``(thumbs [n_layer, n_head, B, B], relative)``: :func:`thumbnails`, and
        :func:`~gpt2mha.learn.heads.relative_scores` ``{"previous", "first", "self"}`` →
        ``[n_layer, n_head]`` (None when T < 2).
    """
    L, T = model.config.n_layer, idx.shape[1]
    thumbs, rel = [None] * L, [None] * L

    def keep(l):
        def fn(pattern, hook):
            w = pattern[:1].float()                                 # [1, h, T, T]
            thumbs[l] = thumbnails(w)[0]
            rel[l] = relative_scores(w[None]) if T >= 2 else None
        return fn
    with torch.no_grad(), attached(model, [(f"h.{l}.attn.hook_pattern", keep(l)) for l in range(L)]):
        model(idx.to(model.wte.weight.device), last_only=True)
    relative = None if T < 2 else {k: torch.cat([r[k] for r in rel]) for k in rel[0]}
    return torch.stack(thumbs), relative


def heads_unit(thumbs: torch.Tensor, relative: dict | None, induction: tuple[torch.Tensor, torch.Tensor] | None) -> dict:
    """Small multiples and roles.

    Args:
        thumbs: ``[n_layer, n_head, B, B]``; relative: from :func:`collect` (None: T < 2).
        induction: ``(raw, relative)`` ``[n_layer, n_head]`` from
            :func:`~gpt2mha.learn.heads.induction_scores`, or None.

    Returns:
        ``{"thumbs": uint8 [L, H, B, B] (:func:`~gpt2mha.learn.explain.tensors.encode_u8`),
        "pool": :data:`POOL`,
        "roles": one row per head {"layer", "head", "role", "score", "scores"} (empty when T < 2,
        with "note" saying why), "threshold", "role_keys"}``.
    """
    unit = {"thumbs": encode_u8(thumbs), "pool": POOL, "threshold": ROLE_THRESHOLD, "no_role": NO_ROLE,
            "role_keys": [[label, key] for label, key in ROLES], "roles": [], "note": ""}
    if relative is None:
        unit["note"] = "head roles need a prompt of at least 2 tokens"
        return unit
    relative = dict(relative)
    if induction is not None:
        relative["induction"] = induction[1]
    unit["roles"] = assign_roles(relative)
    return unit


def model_induction(model) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~gpt2mha.learn.heads.induction_scores` of ``model`` (``(raw, relative)``, ``[n_layer, n_head]``)."""
    with torch.no_grad():
        return induction_scores(model)
