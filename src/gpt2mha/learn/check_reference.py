"""The reference a learner's module is compared with, and the classic mistakes it can reproduce.

:func:`reference` is multi-head causal attention written out stage by stage on random weights
(:func:`make_params`, copied into the module by :func:`copy_params`); given mistake keys of
:data:`MISTAKES` it computes what a module with those mistakes would, so
:func:`diagnose_by_reproduction` can name the mistakes that reproduce a module's output.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ..core.attention import attention_mask
from .check_layout import Layout

#: Output max abs error under which a module matches.
TOL = 1e-4

#: Classic mistakes the reference can reproduce: key → diagnosis.
MISTAKES = {
    "interleaved_qkv": "q|k|v read as interleaved per-head chunks [q_h | k_h | v_h] of 3*head_dim columns; the fused "
                       "projection holds three contiguous d_out blocks, all q | all k | all v (GPT-2's c_attn layout): split it "
                       "with qkv.split(d_out, dim=-1) before view(b, T, num_heads, head_dim)",
    "split_no_transpose": "missing transpose when splitting heads: q, k and v must be (b, num_heads, T, head_dim) "
                          "= view(b, T, num_heads, head_dim).transpose(1, 2); left as (b, T, num_heads, head_dim), "
                          "or viewed straight as (b, num_heads, T, head_dim), tokens and heads get mixed",
    "merge_no_transpose": "missing transpose when merging heads: contexts (b, num_heads, T, head_dim) were viewed "
                          "straight as (b, T, d_out); use transpose(1, 2).contiguous().view(b, T, d_out)",
    "scale_d_out": "scores scaled by 1/sqrt(d_out) instead of 1/sqrt(head_dim) (keys.shape[-1] read before the "
                   "head split?)",
    "scale_d_in": "scores scaled by 1/sqrt(d_in) instead of 1/sqrt(head_dim)",
    "scale_head_dim_no_sqrt": "scores scaled by 1/head_dim instead of 1/sqrt(head_dim)",
    "scale_none": "scores not scaled: divide them by sqrt(head_dim)",
    "no_mask": "no causal mask: each token also attends to later tokens; fill scores where key j > query i "
               "with -inf before the softmax",
    "mask_not_offset": "causal mask not offset for a cache: with P cached tokens the T new queries need rows "
                       "P..P+T-1 of the mask (attention_mask(T, P+T), aligned bottom-right), not the top-left "
                       "[:T, :P+T] slice that hides each query's own and most recent keys",
    "past_ignored": "the cache is stored but never read: with P cached tokens the T new queries attend only to "
                    "each other; attend to the cached keys and values followed by the new ones (torch.cat([past_k, "
                    "k], dim=token axis), the same for v), or append to the cache instead of replacing it",
    "past_after_new": "cache concatenated in the wrong order: the new keys/values come before the cached ones; "
                      "the cached tokens are earlier positions: torch.cat([past_k, k]) along the token axis",
    "mask_after_softmax": "mask applied after the softmax without renormalising: masking the weights to 0 after "
                          "softmax leaves rows that no longer sum to 1 (and the future still shaped them); fill the "
                          "scores with -inf before the softmax",
    "anti_causal_mask": "anti-causal (transposed) mask: each token attends to itself and the LATER tokens; the "
                        "hidden positions are key j > query i, triu(ones, diagonal=1), not tril(ones, diagonal=-1) "
                        "or mask.T",
    "split_keys_no_transpose": "head split done wrong on the keys only: keys were viewed straight as (b, num_heads, "
                               "T, head_dim) while queries and values used view(b, T, num_heads, head_dim)"
                               ".transpose(1, 2); split the keys the same way",
    "softmax_queries": "softmax over the wrong axis: over queries (dim=-2); it must run over keys (dim=-1)",
    "softmax_heads": "softmax over the wrong axis: over heads (dim=1); it must run over keys (dim=-1)",
    "merge_wrong_order": "heads merged in the wrong order: (b, T, head_dim, num_heads) was flattened, so the "
                         "heads' features interleave; flatten (b, T, num_heads, head_dim) so head h occupies "
                         "columns h*head_dim ... (h+1)*head_dim",
    "heads_reversed": "heads concatenated in reverse order (head h must occupy columns h*head_dim ...)",
    "no_out_proj": "out_proj not applied: the output is the merged heads; apply the output projection, which "
                   "mixes the heads",
    "dropout_in_eval": "dropout active in eval mode: with dropout > 0 and module.eval() the output changes from "
                       "run to run (or differs from dropout = 0); F.dropout(x, p) defaults to training=True, so "
                       "write F.dropout(x, p, training=self.training) (or dropout_p=p if self.training else 0.0 "
                       "for scaled_dot_product_attention), or use an nn.Dropout module",
    "hard_coded_heads": "head count hard-coded: built with another head count, the module still splits into the "
                        "first configuration's number of heads (a literal in view(b, T, 4, head_dim), d_out // 4, "
                        "or self.num_heads set to a constant?); use the constructor's num_heads everywhere",
    "view_non_contiguous": "view on a non-contiguous tensor: after transpose(1, 2) the tensor must be made "
                           "contiguous before view (transpose(1, 2).contiguous().view(b, T, d_out)) or use reshape",
}


@dataclass
class RefParams:
    """Reference weights in nn.Linear orientation: ``Wq, Wk, Wv [d_out, d_in]``, biases
    ``[d_out]`` (zeros where the module has none), ``Wo [d_out, d_out]`` and ``bo`` or None."""

    Wq: torch.Tensor
    Wk: torch.Tensor
    Wv: torch.Tensor
    bq: torch.Tensor
    bk: torch.Tensor
    bv: torch.Tensor
    Wo: torch.Tensor | None
    bo: torch.Tensor | None


def make_params(layout: Layout, gen: torch.Generator) -> RefParams:
    """Random reference weights with the layout's shapes (std 1/sqrt(fan_in), so q·k is O(head_dim)
    and the scale matters); biases only where the module has them."""
    d, d_in = layout.d_out, layout.d_in

    def w(rows, cols):
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    def b(projs):
        has = any(p.bias is not None for p in projs)
        return torch.randn(d, generator=gen) * 0.5 if has else torch.zeros(d)

    qkv = [layout.qkv] if layout.qkv else []
    Wo = bo = None
    if layout.out is not None:
        Wo = w(d, d)
        bo = torch.randn(d, generator=gen) * 0.5 if layout.out.bias is not None else torch.zeros(d)
    return RefParams(w(d, d_in), w(d, d_in), w(d, d_in), b(layout.q + qkv), b(layout.k + qkv), b(layout.v + qkv),
                     Wo, bo)


def copy_params(layout: Layout, p: RefParams) -> None:
    """Copy the reference weights into the module's parameters (in place, no grad)."""
    with torch.no_grad():
        if layout.kind == "fused":
            layout.qkv.set(torch.cat([p.Wq, p.Wk, p.Wv]), torch.cat([p.bq, p.bk, p.bv]))
        else:
            hd = layout.d_out // len(layout.q)                  # one projection, or one per head
            for i, (q, k, v) in enumerate(zip(layout.q, layout.k, layout.v)):
                rows = slice(i * hd, (i + 1) * hd)
                q.set(p.Wq[rows], p.bq[rows])
                k.set(p.Wk[rows], p.bk[rows])
                v.set(p.Wv[rows], p.bv[rows])
        if layout.out is not None:
            layout.out.set(p.Wo, p.bo)


def reference(x: torch.Tensor, p: RefParams, h: int, past: int = 0, mistakes=frozenset()) -> dict:
    """Multi-head causal attention written out, optionally with classic mistakes (:data:`MISTAKES` keys).

    Args:
        x: ``[b, S, d_in]``; the first ``past`` tokens play the cache, the last ``T = S - past``
            are the new tokens (queries).
        p: :class:`RefParams`; h: number of heads.

    Returns:
        Stage name → tensor for the new tokens: ``input [b,T,d_in]``, ``q``/``k``/``v``
        ``[b,T,d_out]``, ``qkv [b,T,3·d_out]``, ``view`` (q, k, v ``[b,T,h,hd]``),
        ``transpose`` (q, k, v ``[b,h,T,hd]``), ``scores [b,h,T,S]`` (q @ kᵀ, unscaled),
        ``weights [b,h,T,S]``, ``contexts [b,h,T,hd]``, ``merged [b,T,d_out]``, ``output``.
    """
    b, S, d_in = x.shape
    d = p.Wq.shape[0]
    hd, T = d // h, S - past
    q, k, v = x @ p.Wq.T + p.bq, x @ p.Wk.T + p.bk, x @ p.Wv.T + p.bv                # [b, S, d]
    if "interleaved_qkv" in mistakes:                                                 # [q_h | k_h | v_h] chunks
        q4, k4, v4 = torch.cat([q, k, v], -1).view(b, S, h, 3 * hd).split(hd, dim=-1)
    else:
        q4, k4, v4 = (t.view(b, S, h, hd) for t in (q, k, v))                         # [b, S, h, hd]
    if "split_no_transpose" in mistakes:
        qh, kh, vh = (t.reshape(b, h, S, hd) for t in (q4, k4, v4))                   # memory reinterpreted
    else:
        qh, kh, vh = (t.transpose(1, 2) for t in (q4, k4, v4))                        # [b, h, S, hd]
    if "split_keys_no_transpose" in mistakes:
        kh = k4.reshape(b, h, S, hd)                                                  # keys only
    ka, va, S_att = kh, vh, S                                                         # the keys attended to
    if past and "past_ignored" in mistakes:                                           # new keys only
        ka, va, S_att = kh[:, :, past:], vh[:, :, past:], T
    elif past and "past_after_new" in mistakes:                                       # [new | past]
        ka, va = (torch.cat([t[:, :, past:], t[:, :, :past]], dim=2) for t in (kh, vh))
    scores = qh[:, :, past:] @ ka.transpose(-1, -2)                                   # [b, h, T, S]
    denominator = {"scale_d_out": math.sqrt(d), "scale_d_in": math.sqrt(d_in), "scale_head_dim_no_sqrt": hd,
                   "scale_none": 1.0}
    scale = next((denominator[m] for m in denominator if m in mistakes), math.sqrt(hd))
    mask = attention_mask(T, S_att)
    if "mask_not_offset" in mistakes:
        mask = torch.ones(S_att, S_att, dtype=torch.bool).tril()[:T, :S_att]
    if "anti_causal_mask" in mistakes:                                                # key j >= query i + past
        mask = torch.arange(S_att)[None, :] >= torch.arange(T)[:, None] + (S_att - T)
    if "no_mask" in mistakes:
        mask = torch.ones(T, S_att, dtype=torch.bool)
    dim = -2 if "softmax_queries" in mistakes else 1 if "softmax_heads" in mistakes else -1
    if "mask_after_softmax" in mistakes:
        weights = torch.softmax(scores / scale, dim=dim).masked_fill(~mask, 0.0)
    else:
        weights = torch.softmax((scores / scale).masked_fill(~mask, float("-inf")), dim=dim)
    a = weights @ va                                                                  # [b, h, T, hd]
    if "merge_no_transpose" in mistakes:
        merged = a.contiguous().view(b, T, d)
    elif "merge_wrong_order" in mistakes:
        merged = a.permute(0, 2, 3, 1).reshape(b, T, d)                               # (hd, h) order
    elif "heads_reversed" in mistakes:
        merged = a.flip(1).transpose(1, 2).reshape(b, T, d)
    else:
        merged = a.transpose(1, 2).reshape(b, T, d)                                   # [b, T, d]
    out = merged if p.Wo is None or "no_out_proj" in mistakes else merged @ p.Wo.T + p.bo
    new = slice(past, S)
    return {"input": x[:, new], "q": q[:, new], "k": k[:, new], "v": v[:, new],
            "qkv": torch.cat([q, k, v], -1)[:, new],
            "view": [t[:, new] for t in (q4, k4, v4)], "transpose": [t[:, :, new] for t in (qh, kh, vh)],
            "scores": scores, "scale": scale, "mask": mask, "weights": weights, "contexts": a,
            "merged": merged, "output": out}


def applicable_mistakes(layout: Layout, cache_tested: bool) -> list[str]:
    """The :data:`MISTAKES` the reference can reproduce for this layout."""
    skip = {"view_non_contiguous", "dropout_in_eval", "hard_coded_heads"}
    if layout.kind != "fused":
        skip.add("interleaved_qkv")
    if layout.kind == "wrapper":
        skip |= {"split_no_transpose", "split_keys_no_transpose", "merge_no_transpose", "merge_wrong_order"}
    if layout.num_heads == 1:                       # one head: these change nothing
        skip |= {"split_no_transpose", "split_keys_no_transpose", "merge_no_transpose", "merge_wrong_order",
                 "heads_reversed", "softmax_heads", "interleaved_qkv"}
    if layout.out is None:
        skip.add("no_out_proj")
    if not cache_tested:
        skip |= {"mask_not_offset", "past_ignored", "past_after_new"}
    return [m for m in MISTAKES if m not in skip]


def max_err(a: torch.Tensor | None, b: torch.Tensor) -> float:
    """``max |a - b|`` in float32 (NaN where both are NaN counts as equal, NaN on one side as inf);
    inf when ``a`` is None or the shapes differ, 0 for empty tensors."""
    if a is None or a.shape != b.shape:
        return float("inf")
    diff = (a.float() - b.float()).abs()
    both_nan = a.isnan() & b.isnan()
    diff = torch.where(both_nan, torch.zeros_like(diff), diff)
    return float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0


def diagnose_by_reproduction(x, p: RefParams, layout: Layout, outputs: dict[int, torch.Tensor], T: int,
                             candidates: list[str]) -> list[str]:
    """Mistakes (one, else two together) whose reference reproduces the module's outputs.

    Args:
        x: ``[b, P+T, d_in]``; outputs: past length → the module's output for the last T
            tokens (0: the full run on ``x[:, P:]``; P: the cached step), each compared.
    """
    P = x.shape[1] - T

    def reproduces(ms) -> bool:
        for past, y in outputs.items():
            xs = x if past else x[:, P:]
            if max_err(y, reference(xs, p, layout.num_heads, past, frozenset(ms))["output"]) > TOL:
                return False
        return True

    for size in (1, 2):
        found = [list(ms) for ms in itertools.combinations(candidates, size) if reproduces(ms)]
        if found:
            return sorted({m for ms in found for m in ms}, key=list(MISTAKES).index) if size == 1 else found[0]
    return []

