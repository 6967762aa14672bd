"""Look inside multi-head attention: a stage-by-stage shape trace, per-head attention maps, head roles.

Three tools, each a few flat functions:

* :func:`trace` walks one forward pass in seed 001's order (input, projections, view,
  transpose, scores, head contexts, merged, out_proj) for the three layouts of this project —
  ``fused`` (GPT-2's ``c_attn``/``c_proj`` Conv1D, seeds 000/002), ``split`` (the book's
  ``MultiHeadAttention``) and ``wrapper`` (the book's ``MultiHeadAttentionWrapper``) — and
  returns each stage's shape, the meaning of its axes and the operation that produced it.
  Shapes are computed by running the operations on ``meta`` tensors, so they are PyTorch's,
  not transcribed.
* :func:`attention_maps` / :func:`analyse_heads` run a :class:`~gpt2mha.GPT2` with the
  explicit attention path and return the weights ``[n_layer, B, h, T, T]``;
  :func:`role_scores` turns them into per-head role scores (seed 000: "one might follow the
  previous token").
* :func:`write_grid_png`, :func:`write_head_png`, :func:`write_html` draw them (matplotlib,
  Agg backend; the HTML page is self-contained: data inline, no network).

The checker for attention modules people write themselves lives in :mod:`gpt2mha.check`.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import math
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

LAYOUTS = ("fused", "split", "wrapper")

#: Meaning of each axis name used in the trace.
AXES = {
    "b": "batch (sequences)",
    "T": "token (new tokens; the queries)",
    "S": "key token (past + new)",
    "h": "head",
    "head_dim": "feature within one head",
    "d_in": "input feature",
    "d_out": "feature, heads side by side (head h at h*head_dim ...)",
    "3*d_out": "q | k | v: three contiguous d_out blocks (not per-head chunks)",
    "h*d_out": "feature, the heads' outputs concatenated",
    "2": "k or v",
}


@dataclass
class Stage:
    """One tensor of the forward pass.

    Attributes:
        name: stage name (seed 001's words: input, projections, view, transpose, scores,
            weights, contexts, merged, out_proj; plus qkv, past, unmerge where a layout has them).
        shape: the tensor's shape.
        axes: one axis name per dimension (keys of :data:`AXES`).
        op: the operation that turns the previous stage into this one ("" for the input).
        count: how many tensors of this shape the stage holds (3 for q, k, v).
        note: a remark (e.g. the column layout of a fused projection).
    """

    name: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    op: str
    count: int = 1
    note: str = ""


@dataclass
class Trace:
    """A traced forward pass: the configuration, head_dim, the mask's shape and the stages."""

    layout: str
    config: dict
    head_dim: int
    mask_shape: tuple[int, int]
    stages: list[Stage] = field(default_factory=list)

    def to_dict(self) -> dict:
        """Plain data for ``--json`` (shapes as lists)."""
        d = dataclasses.asdict(self)
        d["axes"] = AXES
        return d

    def shapes(self) -> list[tuple[int, ...]]:
        """The stages' shapes, in order."""
        return [s.shape for s in self.stages]


def _check_trace_config(layout, b, T, d_in, d_out, num_heads, context_length, past):
    """Raise ValueError on a configuration the layout cannot run."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; expected one of {', '.join(LAYOUTS)}")
    sizes = dict(batch=b, tokens=T, d_in=d_in, d_out=d_out, num_heads=num_heads, context_length=context_length)
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if not isinstance(past, int) or past < 0:
        raise ValueError(f"past={past!r} must be an integer >= 0")
    if layout != "wrapper" and d_out % num_heads:
        raise ValueError(f"d_out={d_out} is not divisible by num_heads={num_heads}: the heads would not "
                         f"have equal widths (head_dim = d_out / num_heads)")
    if past + T > context_length:
        raise ValueError(f"past + tokens = {past} + {T} = {past + T} > context_length={context_length}: "
                         f"the causal mask buffer has no row for these positions")


def trace(layout: str = "split", b: int = 2, T: int = 6, d_in: int = 768, d_out: int | None = None,
          num_heads: int = 12, context_length: int = 1024, past: int = 0) -> Trace:
    """Trace one forward pass of a multi-head attention layout, stage by stage.

    Args:
        layout: ``"fused"`` (GPT-2: ``qkv = x @ c_attn.weight + c_attn.bias``, seed 000),
            ``"split"`` (the book's ``MultiHeadAttention``: ``W_query``/``W_key``/``W_value``
            then ``out_proj``, seed 001) or ``"wrapper"`` (``MultiHeadAttentionWrapper``:
            ``num_heads`` complete single-head layers, outputs concatenated, no ``out_proj``).
        b, T: batch size and new tokens (queries).
        d_in: input width. d_out: output width; for ``wrapper`` it is each head's width, as in
            the book's constructor (default 768, or 768 // num_heads for ``wrapper``).
        num_heads: heads; context_length: the mask buffer's size (past + T must fit).
        past: cached tokens before the T new ones; keys then number S = past + T and the mask
            is ``attention_mask(T, S)``, aligned bottom-right (query i reads keys j <= i + past).

    Returns:
        :class:`Trace` with shapes from running the operations on ``meta`` tensors.

    Raises:
        ValueError: unknown layout, non-positive sizes, d_out not divisible by num_heads,
            or past + T > context_length.
    """
    if d_out is None:            # GPT-2 small's width; the wrapper's heads share it (768 / 12 = 64 each)
        wrapper = layout == "wrapper" and isinstance(num_heads, int) and num_heads > 0
        d_out = max(1, 768 // num_heads) if wrapper else 768
    _check_trace_config(layout, b, T, d_in, d_out, num_heads, context_length, past)
    head_dim = d_out if layout == "wrapper" else d_out // num_heads
    config = dict(b=b, T=T, d_in=d_in, d_out=d_out, num_heads=num_heads, head_dim=head_dim,
                  context_length=context_length, past=past, S=past + T)
    stages = (_trace_wrapper if layout == "wrapper" else _trace_heads)(layout, b, T, d_in, d_out, num_heads, past)
    return Trace(layout, config, head_dim, (T, past + T), stages)


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta")


def _trace_heads(layout, b, T, d_in, d_out, h, P) -> list[Stage]:
    """Stages of the fused and split layouts (one wide projection per role, heads by reshaping)."""
    hd, S = d_out // h, P + T
    x = _meta(b, T, d_in)
    st = [Stage("input", tuple(x.shape), ("b", "T", "d_in"), "")]
    if layout == "fused":
        qkv = x @ _meta(d_in, 3 * d_out)                                       # [b, T, 3·d_out]
        st.append(Stage("qkv", tuple(qkv.shape), ("b", "T", "3*d_out"), "x @ c_attn.weight + c_attn.bias",
                        note=f"c_attn.weight [{d_in}, {3 * d_out}] (Conv1D: [in, out], no transpose); head h "
                             f"reads q at h*{hd}, k at {d_out} + h*{hd}, v at {2 * d_out} + h*{hd}"))
        q = qkv.split(d_out, dim=2)[0]
        st.append(Stage("projections", tuple(q.shape), ("b", "T", "d_out"), "qkv.split(d_out, dim=2) -> q, k, v", 3))
    else:
        q = x @ _meta(d_in, d_out)                                             # [b, T, d_out]
        st.append(Stage("projections", tuple(q.shape), ("b", "T", "d_out"), "W_query(x), W_key(x), W_value(x)", 3,
                        note=f"nn.Linear weight [{d_out}, {d_in}] each: one full-width projection per role"))
    q4 = q.view(b, T, h, hd)                                                   # [b, T, h, hd]
    st.append(Stage("view", tuple(q4.shape), ("b", "T", "h", "head_dim"), "view(b, T, num_heads, head_dim)", 3,
                    note="reinterprets d_out as num_heads x head_dim; no copy"))
    qh = q4.transpose(1, 2)                                                    # [b, h, T, hd]
    st.append(Stage("transpose", tuple(qh.shape), ("b", "h", "T", "head_dim"), "transpose(1, 2)", 3,
                    note="heads next to batch: one batched matmul runs every head"))
    k = qh
    if P:
        k = torch.cat([_meta(b, h, P, hd), qh], dim=-2)                        # [b, h, S, hd]
        st.append(Stage("past", tuple(k.shape), ("b", "h", "S", "head_dim"), "cat([past_k, k], dim=-2), same for v", 2,
                        note=f"past [b, 2, h, {P}, head_dim] prepended on the sequence axis"))
    w = qh @ k.transpose(-1, -2)                                               # [b, h, T, S]
    st.append(Stage("scores", tuple(w.shape), ("b", "h", "T", "S"), "queries @ keys.transpose(2, 3)",
                    note="one T x S score matrix per head per sequence"))
    scale = f"1/sqrt(head_dim) = 1/sqrt({hd})"
    st.append(Stage("weights", tuple(w.shape), ("b", "h", "T", "S"),
                    f"* {scale}; mask attention_mask({T}, {S}); softmax(dim=-1)",
                    note=f"mask [{T}, {S}] offset by past={P}: query i reads keys j <= i + {P}"))
    a = w @ k                                                                  # [b, h, T, hd]
    st.append(Stage("contexts", tuple(a.shape), ("b", "h", "T", "head_dim"), "weights @ values"))
    a = a.transpose(1, 2)                                                      # [b, T, h, hd]
    st.append(Stage("unmerge", tuple(a.shape), ("b", "T", "h", "head_dim"), "transpose(1, 2)",
                    note="tokens back in front; now non-contiguous"))
    m = a.contiguous().view(b, T, d_out)                                       # [b, T, d_out]
    st.append(Stage("merged", tuple(m.shape), ("b", "T", "d_out"), "contiguous().view(b, T, d_out)",
                    note="head h at columns h*head_dim ... (h+1)*head_dim"))
    y = m @ _meta(d_out, d_out)
    op = "merged @ c_proj.weight + c_proj.bias" if layout == "fused" else "out_proj(merged)"
    st.append(Stage("out_proj", tuple(y.shape), ("b", "T", "d_out"), op, note="mixes the heads"))
    return st


def _trace_wrapper(layout, b, T, d_in, d_out, h, P) -> list[Stage]:
    """Stages of the wrapper: ``num_heads`` complete single-head layers, concatenated."""
    S = P + T
    x = _meta(b, T, d_in)
    st = [Stage("input", tuple(x.shape), ("b", "T", "d_in"), "")]
    q = x @ _meta(d_in, d_out)                                                 # [b, T, d_out] per head
    st.append(Stage("projections", tuple(q.shape), ("b", "T", "head_dim"), "heads[i].W_query(x), W_key(x), W_value(x)",
                    3 * h, note=f"each head owns its nn.Linear [{d_out}, {d_in}] x 3; head_dim = d_out = {d_out}"))
    k = q
    if P:
        k = torch.cat([_meta(b, P, d_out), q], dim=-2)                         # [b, S, d_out]
        st.append(Stage("past", tuple(k.shape), ("b", "S", "head_dim"), "cat([past_k, k], dim=1), same for v", 2 * h))
    w = q @ k.transpose(1, 2)                                                  # [b, T, S]
    st.append(Stage("scores", tuple(w.shape), ("b", "T", "S"), "queries @ keys.transpose(1, 2)", h))
    st.append(Stage("weights", tuple(w.shape), ("b", "T", "S"),
                    f"* 1/sqrt(head_dim) = 1/sqrt({d_out}); mask attention_mask({T}, {S}); softmax(dim=-1)", h,
                    note=f"mask [{T}, {S}] offset by past={P}: query i reads keys j <= i + {P}"))
    a = w @ k                                                                  # [b, T, d_out]
    st.append(Stage("contexts", tuple(a.shape), ("b", "T", "head_dim"), "weights @ values", h))
    m = torch.cat([a] * h, dim=-1)                                             # [b, T, h·d_out]
    st.append(Stage("merged", tuple(m.shape), ("b", "T", "h*d_out"), "torch.cat([head(x) for head in heads], dim=-1)",
                    note="the output: no out_proj, the heads are never mixed"))
    return st


def format_trace(tr: Trace) -> str:
    """The trace as terminal text: a header, then each stage with its shape and axes and the
    operation leading to it on the line above."""
    c = tr.config
    lines = [f"layout {tr.layout}: b={c['b']} T={c['T']} d_in={c['d_in']} d_out={c['d_out']} "
             f"num_heads={c['num_heads']} head_dim={tr.head_dim} context_length={c['context_length']} "
             f"past={c['past']}",
             f"mask {tr.mask_shape}: attention_mask(T={c['T']}, S={c['S']}), True where query i may read key j "
             f"(j <= i + {c['past']})", ""]
    for i, s in enumerate(tr.stages, 1):
        if s.op:
            lines.append(f"        | {s.op}")
        times = f" x{s.count}" if s.count > 1 else ""
        axes = ", ".join(s.axes)
        lines.append(f"{i:>3}  {s.name:<12} {str(s.shape) + times:<24} [{axes}]")
        if s.note:
            lines.append(f"{'':17}{s.note}")
    lines.append("")
    lines.append("axes: " + "; ".join(f"{k} = {AXES[k]}" for k in sorted({a for s in tr.stages for a in s.axes},
                                                                         key=list(AXES).index)))
    return "\n".join(lines)


# ------------------------------------------------------------------------ attention maps
class HeadsResult(NamedTuple):
    """What :func:`analyse_heads` returns.

    Attributes:
        weights: ``[n_layer, B, h, T, T]`` attention weights (float32, rows sum to 1).
        scores: raw score name → ``[n_layer, h]`` tensor (see :func:`role_scores`; plus
            ``induction`` from :func:`induction_scores` when a model was given).
        tokens: the prompt's token ids; labels: one printable label per token.
        relative: role → ``[n_layer, h]`` score over the uniform-attention baseline (see
            :func:`relative_scores`); roles: one row per head from :func:`assign_roles`.
    """

    weights: torch.Tensor
    scores: dict
    tokens: list
    labels: list
    relative: dict = {}
    roles: list = []


def attention_maps(model, idx: torch.Tensor) -> torch.Tensor:
    """Every head's attention weights for ``idx``, through the explicit attention path.

    Args:
        model: a :class:`~gpt2mha.GPT2`.
        idx: token ids ``[B, T]``, ``1 <= T <= n_ctx``.

    Returns:
        ``[n_layer, B, n_head, T, T]`` float32; row i of a map is query token i's weights over
        keys 0..i (the causal mask makes the rest exactly 0).

    Raises:
        ValueError: idx is not ``[B, T]``, T is 0 or longer than the model's context, or ids
            are outside the vocabulary.
    """
    if idx.dim() != 2 or idx.shape[1] == 0:
        raise ValueError(f"idx has shape {tuple(idx.shape)}; expected [B, T] with T >= 1")
    n_ctx = model.config.n_ctx
    if idx.shape[1] > n_ctx:
        raise ValueError(f"the prompt is {idx.shape[1]} tokens but the model's context is n_ctx={n_ctx} tokens; "
                         f"shorten it to at most {n_ctx}")
    if int(idx.min()) < 0 or int(idx.max()) >= model.config.n_vocab:
        raise ValueError(f"idx holds ids outside the vocabulary [0, {model.config.n_vocab})")
    was_training = model.training
    model.eval()
    maps = []
    with torch.no_grad():
        x = model.embed(idx, 0)                                   # [B, T, n_embd]
        for block in model.h:
            x, _, w = block(x, None, None, True)                  # w [B, h, T, T]
            maps.append(w.float())
    model.train(was_training)
    return torch.stack(maps)                                      # [n_layer, B, h, T, T]


def role_scores(weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-head role scores from attention weights.

    Args:
        weights: ``[n_layer, B, h, T, T]`` with ``T >= 2`` (as from :func:`attention_maps`).

    Returns:
        Dict of ``[n_layer, h]`` tensors, each a mean over the batch and over query tokens
        1..T-1 (query 0 can only read itself, so it says nothing about a head):

        * ``previous``: weight on the previous token (key i-1);
        * ``first``: weight on the first token (key 0);
        * ``self``: weight on the query's own token (key i);
        * ``entropy``: row entropy in nats;
        * ``entropy_norm``: entropy / log(i+1), 0 = one key, 1 = uniform over the visible keys.

    Raises:
        ValueError: weights is not 5-D with square maps, or T < 2.
    """
    if weights.dim() != 5 or weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"weights has shape {tuple(weights.shape)}; expected [n_layer, B, h, T, T]")
    T = weights.shape[-1]
    if T < 2:
        raise ValueError("role scores need a prompt of at least 2 tokens")
    w = weights.float()
    i = torch.arange(1, T)
    entropy = -(w * w.clamp_min(1e-30).log()).sum(-1)[..., 1:]   # [L, B, h, T-1]
    return {
        "previous": w[..., i, i - 1].mean(dim=(1, 3)),
        "first": w[..., 1:, 0].mean(dim=(1, 3)),
        "self": w[..., i, i].mean(dim=(1, 3)),
        "entropy": entropy.mean(dim=(1, 3)),
        "entropy_norm": (entropy / torch.log(i + 1.0)).mean(dim=(1, 3)),
    }


#: Roles a head can be given: (label, score key). A head that attends broadly (high entropy) has
#: no role: near-uniform attention is what random weights give.
ROLES = (("previous-token", "previous"), ("first-token", "first"), ("self", "self"), ("induction", "induction"))

#: A head gets a role only when its relative score (:func:`relative_scores`) is at least this:
#: 30% of the way from what uniform (or random) attention gives to all weight on the role's key.
#: Random weights stay well below it (GPT-2's init: ~0.00; attention weights scaled 30x: < 0.25;
#: tests/test_inspect.py holds that).
ROLE_THRESHOLD = 0.3
NO_ROLE = "no clear role"


def _relative(w_target: torch.Tensor, n_visible: torch.Tensor) -> torch.Tensor:
    """``(w - 1/n) / (1 - 1/n)`` per query row: 0 for uniform attention over the ``n`` visible keys
    (also the expectation under random attention that ignores positions), 1 for all weight on the
    target key, negative when the key gets less than its uniform share."""
    base = 1.0 / n_visible
    return (w_target - base) / (1.0 - base)


def relative_scores(weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Role scores over the uniform-attention baseline, for previous, first and self.

    A head that spreads its weight uniformly over the i+1 keys query i can see puts 1/(i+1) on
    the previous token: a raw "previous" score of ~0.25 over 8 tokens means nothing. Each row's
    weight on the role's key is rescaled by :func:`_relative` (baseline 1/(i+1)), then averaged
    over query tokens 1..T-1 and the batch.

    Args:
        weights: ``[n_layer, B, h, T, T]``, T >= 2.

    Returns:
        ``{"previous", "first", "self"}`` → ``[n_layer, h]``; 0 = uniform/random, 1 = always that key.

    Raises:
        ValueError: as :func:`role_scores`.
    """
    if weights.dim() != 5 or weights.shape[-1] != weights.shape[-2] or weights.shape[-1] < 2:
        raise ValueError(f"weights has shape {tuple(weights.shape)}; expected [n_layer, B, h, T, T] with T >= 2")
    T = weights.shape[-1]
    w = weights.float()
    i = torch.arange(1, T)
    n = (i + 1).float()                                           # keys visible to query i
    return {
        "previous": _relative(w[..., i, i - 1], n).mean(dim=(1, 3)),
        "first": _relative(w[..., 1:, 0], n).mean(dim=(1, 3)),
        "self": _relative(w[..., i, i], n).mean(dim=(1, 3)),
    }


def repeated_random_tokens(config, n: int | None = None, batch: int = 4, seed: int = 0) -> torch.Tensor:
    """``[batch, 2n]`` ids: n random tokens, then the same n again (the induction-head test input).

    Tokens are drawn uniformly from printable ASCII (32..126) for byte-level models, from the
    whole vocabulary otherwise; ``n`` defaults to ``min(50, n_ctx // 2)``.
    """
    n = n or min(50, config.n_ctx // 2)
    gen = torch.Generator().manual_seed(seed)
    lo, hi = (32, 127) if config.n_vocab == 256 else (0, config.n_vocab)
    first = torch.randint(lo, hi, (batch, n), generator=gen)
    return torch.cat([first, first], dim=1)


def induction_scores(model, n: int | None = None, batch: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The induction-head score of every head (Olsson et al. 2022, "In-context learning and induction heads").

    On a random sequence repeated twice (:func:`repeated_random_tokens`), query token n + j of the
    second copy holds the same token as position j of the first; an induction head attends to
    position j + 1, the token that followed it. Score: the mean weight there over j = 0..n-1.

    Returns:
        ``(raw [n_layer, h], relative [n_layer, h])``; relative uses the uniform baseline
        1/(n+j+1) of :func:`_relative`.
    """
    return induction_from_maps(attention_maps(model, repeated_random_tokens(model.config, n, batch, seed)))


def induction_from_maps(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Induction scores from the maps ``[n_layer, B, h, 2n, 2n]`` of a sequence repeated twice.

    Returns:
        ``(raw, relative)``, each ``[n_layer, h]``: the mean over j = 0..n-1 of the weight from
        query n + j to key j + 1, and of that weight over the uniform baseline 1/(n+j+1).

    Raises:
        ValueError: weights not 5-D with square maps of even size >= 2.
    """
    if weights.dim() != 5 or weights.shape[-1] != weights.shape[-2] or weights.shape[-1] % 2:
        raise ValueError(f"weights has shape {tuple(weights.shape)}; expected [n_layer, B, h, 2n, 2n]")
    n = weights.shape[-1] // 2
    j = torch.arange(n)
    target = weights.float()[..., n + j, j + 1]                   # [L, B, h, n]
    return target.mean(dim=(1, 3)), _relative(target, (n + j + 1).float()).mean(dim=(1, 3))


def assign_roles(relative: dict[str, torch.Tensor], threshold: float = ROLE_THRESHOLD) -> list[dict]:
    """One role per head: the role of :data:`ROLES` with the highest relative score, or
    :data:`NO_ROLE` when that score is below ``threshold``.

    Returns:
        Rows ``{"layer", "head", "role", "score", "scores"}`` in layer/head order; ``score`` is
        the best relative score, ``scores`` every role's.
    """
    keys = [(label, key) for label, key in ROLES if key in relative]
    L, H = relative[keys[0][1]].shape
    rows = []
    for l in range(L):
        for h in range(H):
            scores = {key: float(relative[key][l, h]) for _, key in keys}
            label, key = max(keys, key=lambda lk: scores[lk[1]])
            rows.append({"layer": l, "head": h, "role": label if scores[key] >= threshold else NO_ROLE,
                         "score": scores[key], "scores": scores})
    return rows


def strongest_heads(relative: dict[str, torch.Tensor], top: int = 3, threshold: float = ROLE_THRESHOLD) -> list[dict]:
    """Per role of :data:`ROLES`, up to ``top`` heads whose role (:func:`assign_roles`) it is, best first.

    Each head is listed once, under its strongest role; heads with no clear role are not listed.

    Returns:
        Rows ``{"role", "layer", "head", "score"}`` (0-based layer and head, relative score).
    """
    assigned = assign_roles(relative, threshold)
    rows = []
    for label, _ in ROLES:
        mine = sorted((r for r in assigned if r["role"] == label), key=lambda r: -r["score"])[:top]
        rows += [{"role": label, "layer": r["layer"], "head": r["head"], "score": r["score"]} for r in mine]
    return rows


def top_heads(score: torch.Tensor, top: int = 3) -> list[dict]:
    """The ``top`` heads of one ``[n_layer, h]`` score, best first: rows ``{"layer", "head", "score"}``."""
    flat = score.flatten()
    return [{"layer": j // score.shape[1], "head": j % score.shape[1], "score": float(flat[j])}
            for j in flat.argsort(descending=True)[:top].tolist()]


def format_strongest(rows: list[dict], roles: list[dict] | None = None) -> str:
    """``layer 3 head 5: previous-token head, 0.91`` lines, one per row, then (given ``roles``
    from :func:`assign_roles`) how many heads have no clear role."""
    lines = [f"layer {r['layer']} head {r['head']}: {r['role']} head, {r['score']:.2f}" for r in rows]
    if roles is not None:
        none = sum(r["role"] == NO_ROLE for r in roles)
        lines.append(f"{none} of {len(roles)} heads have no clear role (relative score < {ROLE_THRESHOLD} for every "
                     f"role)")
    return "\n".join(lines)


def token_labels(tokenizer, ids) -> list[str]:
    """One short printable label per token: space → ␣, newline → ↵, tab → ⇥, undecodable
    bytes (a UTF-8 character split across byte tokens) as ``\\xNN``."""
    labels = []
    for i in ids:
        raw = tokenizer.decode_bytes([i])
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError:
            s = "".join(f"\\x{c:02x}" for c in raw)
        labels.append(s.replace(" ", "\u2423").replace("\n", "\u21b5").replace("\t", "\u21e5").replace("\r", "\\r")
                      or "\u2205")
    return labels


def analyse_heads(model, prompt: str) -> HeadsResult:
    """Tokenise ``prompt`` with the model's tokenizer, get every head's map and role scores
    (previous, first, self from the prompt; induction from :func:`induction_scores`).

    Returns:
        :class:`HeadsResult` with weights ``[n_layer, 1, h, T, T]``, raw and relative scores
        and one role per head.

    Raises:
        ValueError: empty prompt, fewer than 2 tokens, or more tokens than the context.
    """
    from ..io.tokenizer import tokenizer_for

    if not prompt:
        raise ValueError("PROMPT is empty; give at least two tokens of text")
    tok = tokenizer_for(model.config)
    ids = tok.encode(prompt)
    if len(ids) < 2:
        raise ValueError(f"PROMPT is {len(ids)} token; head roles need at least 2 tokens")
    weights = attention_maps(model, torch.tensor([ids], dtype=torch.long))
    scores, relative = role_scores(weights), relative_scores(weights)
    scores["induction"], relative["induction"] = induction_scores(model)
    return HeadsResult(weights, scores, ids, token_labels(tok, ids), relative, assign_roles(relative))


def check_selection(n_layer: int, n_head: int, layer: int | None, head: int | None) -> None:
    """Raise ValueError if a selected layer or head is outside the model."""
    if layer is not None and not 0 <= layer < n_layer:
        raise ValueError(f"--layer {layer} is out of range: the model has {n_layer} layers (0..{n_layer - 1})")
    if head is not None and not 0 <= head < n_head:
        raise ValueError(f"--head {head} is out of range: the model has {n_head} heads per layer (0..{n_head - 1})")


def selected_heads(n_layer: int, n_head: int, layer: int | None, head: int | None,
                   rows: list[dict]) -> list[tuple[int, int]]:
    """Heads to draw at full size: layer and head given → that head; only one given → that
    whole layer / that head in every layer; neither → the best head of each role in ``rows``.

    Raises:
        ValueError: layer or head out of range.
    """
    check_selection(n_layer, n_head, layer, head)
    if layer is None and head is None:
        seen_roles, best = set(), []
        for r in rows:                                     # rows are best-first within each role
            if r["role"] not in seen_roles:
                seen_roles.add(r["role"])
                if (r["layer"], r["head"]) not in best:
                    best.append((r["layer"], r["head"]))
        return best
    layers = range(n_layer) if layer is None else [layer]
    heads = range(n_head) if head is None else [head]
    return [(l, h) for l in layers for h in heads]


# ---------------------------------------------------------------------------------- images
#: Grid geometry in pixels at :data:`DPI` (a power of two, so inches * DPI is exact). RIGHT holds
#: the colour bar, BOTTOM the key labels and a line saying how labels were thinned.
DPI, CELL, GAP, LEFT, BOTTOM, TOP, RIGHT = 128, 128, 16, 88, 104, 48, 96
#: Cell side for prompts longer than 64 tokens (more room for labels).
CELL_LONG = 192
#: Token labels: font size in points (6 pt = 10.7 px at 128 dpi), at most one label per
#: LABEL_PX pixels of a map's side, each cut to LABEL_CHARS characters.
LABEL_PT, LABEL_PX, LABEL_CHARS = 6, 16, 8


def grid_geometry(n_layer: int, n_head: int, T: int | None = None) -> dict:
    """Pixel size of the grid PNG, each map's box, the colour bar's box and the label thinning.

    Args:
        n_layer, n_head: the grid's rows and columns; T: prompt tokens (maps get
            :data:`CELL_LONG` pixels instead of :data:`CELL` past 64 tokens).

    Returns:
        ``{"width", "height", "cell", "cells": {(layer, head): (x0, y0, x1, y1)}, "colorbar":
        (x0, y0, x1, y1), "label_step"}``, y from the top; layers are rows (layer 0 on top),
        heads are columns; every ``label_step``-th token is labelled: at most one label per
        :data:`LABEL_PX` pixels of a map's side, so every token up to 8 (128-pixel maps), then
        ``ceil(T / 8)``; past 64 tokens the maps are 192 pixels and the step ``ceil(T / 12)``.
    """
    cell = CELL_LONG if T is not None and T > 64 else CELL
    width = LEFT + n_head * cell + (n_head - 1) * GAP + RIGHT
    height = TOP + n_layer * cell + (n_layer - 1) * GAP + BOTTOM
    cells = {}
    for l in range(n_layer):
        for h in range(n_head):
            x0, y0 = LEFT + h * (cell + GAP), TOP + l * (cell + GAP)
            cells[(l, h)] = (x0, y0, x0 + cell, y0 + cell)
    bar_x = width - RIGHT + 12
    colorbar = (bar_x, TOP, bar_x + 12, height - BOTTOM)
    step = max(1, math.ceil((T or 1) / (cell // LABEL_PX)))
    return {"width": width, "height": height, "cell": cell, "cells": cells, "colorbar": colorbar, "label_step": step}


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _mpl_text(s: str) -> str:
    return s.replace("$", r"\$")


def _short(label: str, n: int = LABEL_CHARS) -> str:
    return label if len(label) <= n else label[:n - 1] + "\u2026"


def _tick_labels(ax, labels: list[str], x: bool, y: bool, fontsize: float, step: int) -> None:
    """Token labels on the axes: every ``step``-th token, each cut to :data:`LABEL_CHARS` characters."""
    ticks = list(range(0, len(labels), step))
    text = [_mpl_text(_short(labels[i]) if step == 1 else f"{i} {_short(labels[i])}") for i in ticks]
    ax.set_xticks(ticks if x else [])
    ax.set_yticks(ticks if y else [])
    if x:
        ax.set_xticklabels(text, rotation=90, fontsize=fontsize)
    if y:
        ax.set_yticklabels(text, fontsize=fontsize)


def ordinal(n: int) -> str:
    """``1`` → ``"1st"``, ``2`` → ``"2nd"``, ``3`` → ``"3rd"``, ``11`` → ``"11th"``, ``22`` → ``"22nd"``."""
    suffix = "th" if 11 <= n % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def grid_notes(labels: list[str], step: int) -> list[str]:
    """What the grid leaves out: thinned labels, shortened labels."""
    notes = []
    if step > 1:
        notes.append(f"grid.png labels every {ordinal(step)} of {len(labels)} tokens (0, {step}, {2 * step}, ...), "
                     f"each with its position")
    if any(len(t) > LABEL_CHARS for t in labels):
        notes.append(f"grid.png token labels longer than {LABEL_CHARS} characters are cut (…)")
    return notes


def write_grid_png(weights: torch.Tensor, labels: list[str], path: str, title: str = "") -> dict:
    """Every layer x head map of sequence 0 in one PNG (rows = layers, columns = heads), with a
    colour bar (viridis, 0 to 1) and token labels on the outer maps, thinned to one per
    :data:`LABEL_PX` pixels; the image says below the maps when labels were thinned or cut.

    Args:
        weights: ``[n_layer, B, h, T, T]``; labels: T token labels (outer axes only).
        path: the PNG to write.

    Returns:
        :func:`grid_geometry` of the written image, plus ``"notes"`` (:func:`grid_notes`) and
        ``"labels_drawn"``: the token labels matplotlib drew under the maps.
    """
    plt = _plt()
    L, _, H, T, _ = weights.shape
    geo = grid_geometry(L, H, T)
    W, Hpx, cell = geo["width"], geo["height"], geo["cell"]
    fig = plt.figure(figsize=(W / DPI, Hpx / DPI), dpi=DPI)
    im = None
    for (l, h), (x0, y0, x1, y1) in geo["cells"].items():
        ax = fig.add_axes((x0 / W, 1 - y1 / Hpx, cell / W, cell / Hpx))
        im = ax.imshow(weights[l, 0, h].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto",
                       interpolation="nearest")
        ax.set_title(f"layer {l} head {h}", fontsize=LABEL_PT, pad=1.5)
        _tick_labels(ax, labels, x=l == L - 1, y=h == 0, fontsize=LABEL_PT, step=geo["label_step"])
        ax.tick_params(length=1.5, pad=0.5)
    bx0, by0, bx1, by1 = geo["colorbar"]
    cax = fig.add_axes((bx0 / W, 1 - by1 / Hpx, (bx1 - bx0) / W, (by1 - by0) / Hpx))
    cb = fig.colorbar(im, cax=cax)
    cb.ax.tick_params(labelsize=LABEL_PT)
    cb.set_label("attention weight", fontsize=LABEL_PT)
    fig.suptitle(_mpl_text(title or "attention maps"), fontsize=8, y=1 - 8 / Hpx, va="top")
    fig.text(LEFT / W, 1 - 30 / Hpx, "rows: layers, columns: heads; in each map row = query token, column = key token",
             fontsize=LABEL_PT)
    corner = fig.axes[(L - 1) * H]                                   # bottom-left map: both axes labelled
    geo["labels_drawn"] = [t.get_text() for t in corner.get_xticklabels()]
    geo["notes"] = grid_notes(labels, geo["label_step"])
    if geo["notes"]:
        fig.text(4 / W, 6 / Hpx, _mpl_text("; ".join(geo["notes"])), fontsize=LABEL_PT)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return geo


def head_geometry(T: int) -> tuple[int, int]:
    """Pixel size (width, height) of a single-head PNG for T tokens: a square map of
    ``clamp(16·T, 512, 2048)`` pixels plus margins for labels and the colour bar."""
    side = max(512, min(2048, 16 * T))
    return side + 112 + 96, side + 112 + 48


def write_head_png(weights: torch.Tensor, labels: list[str], layer: int, head: int, path: str) -> None:
    """One head's map of sequence 0 at full size, every token labelled (thinned past 96).

    Args:
        weights: ``[n_layer, B, h, T, T]``; layer, head: 0-based.
    """
    plt = _plt()
    T = weights.shape[-1]
    W, H = head_geometry(T)
    side = W - 112 - 96
    fig = plt.figure(figsize=(W / DPI, H / DPI), dpi=DPI)
    ax = fig.add_axes((112 / W, 112 / H, side / W, side / H))
    im = ax.imshow(weights[layer, 0, head].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto",
                   interpolation="nearest")
    _tick_labels(ax, labels, x=True, y=True, fontsize=6, step=max(1, math.ceil(T / 96)))   # >= 16 px per label
    ax.set_xlabel("key token", fontsize=7)
    ax.set_ylabel("query token", fontsize=7)
    ax.set_title(f"layer {layer} head {head}", fontsize=8)
    cax = fig.add_axes(((112 + side + 16) / W, 112 / H, 16 / W, side / H))
    fig.colorbar(im, cax=cax).ax.tick_params(labelsize=5)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


#: heads.html embeds the maps as 8-bit lower triangles; past this many bytes of maps it embeds
#: only the layers of the selected heads.
HTML_MAX_MAP_BYTES = 4_000_000


def quantise_maps(w: torch.Tensor) -> bytes:
    """Maps ``[n, T, T]`` (causal, values in [0, 1]) → the lower triangles as uint8 ``round(255·w)``,
    map after map, row after row (row i holds keys 0..i): ``n · T(T+1)/2`` bytes."""
    T = w.shape[-1]
    rows, cols = torch.tril_indices(T, T)
    return (w[:, rows, cols].clamp(0, 1) * 255).round().to(torch.uint8).numpy().tobytes()


def html_layers(n_layer: int, n_head: int, T: int, selected: list[tuple[int, int]] | None,
                max_bytes: int = HTML_MAX_MAP_BYTES) -> list[int]:
    """Layers whose maps heads.html embeds: all of them when ``n_layer·n_head·T(T+1)/2`` bytes
    fit in ``max_bytes``, else the layers of the ``selected`` heads (layer 0 if none)."""
    if n_layer * n_head * T * (T + 1) // 2 <= max_bytes:
        return list(range(n_layer))
    return sorted({l for l, _ in selected or []}) or [0]


def write_html(result: HeadsResult, path: str, title: str = "attention heads", grid_png: str | None = None,
               selected: list[tuple[int, int]] | None = None, max_bytes: int = HTML_MAX_MAP_BYTES) -> dict:
    """One self-contained HTML page: every head as a small canvas (id ``L{layer}H{head}``),
    a large view of the clicked head (at first the first of ``selected``, e.g. ``--layer 2
    --head 5``'s) with token labels and hover values, the role and the
    raw and relative scores of every head, and the grid PNG inlined as a data URI. No
    external resources.

    The maps are embedded quantised to 8 bits (steps of 1/255), lower triangles only, base64:
    ``n_layer·n_head·T(T+1)/2`` bytes before base64, about 0.55 MB for 6 x 6 heads and 150
    tokens. Past ``max_bytes`` only the layers of the ``selected`` heads are embedded
    (:func:`html_layers`); the page says so and the other layers' canvases stay grey.

    Args:
        result: from :func:`analyse_heads` (sequence 0 is shown).
        path: the HTML file to write; grid_png: optional PNG path to embed.

    Returns:
        ``{"layers": embedded layers, "notes": [...]}``.
    """
    w = result.weights[:, 0]                                               # [L, h, T, T]
    L, H, T = w.shape[0], w.shape[1], w.shape[-1]
    layers = html_layers(L, H, T, selected, max_bytes)
    notes = ["heads.html holds the weights rounded to 8 bits (steps of 1/255)"]
    if len(layers) < L:
        notes.append(f"heads.html embeds only layer(s) {', '.join(map(str, layers))}: all {L} layers of a {T}-token "
                     f"prompt would take {L * H * T * (T + 1) // 2 / 1e6:.1f} MB (limit {max_bytes / 1e6:.1f} MB); "
                     f"pick others with --layer")
    q = quantise_maps(w[layers].reshape(len(layers) * H, T, T))
    first = list(selected[0]) if selected else [layers[0], 0]              # the page opens on it
    data = {"labels": result.labels, "n_layer": L, "n_head": H, "T": T, "layers": layers, "selected": first,
            "maps": base64.b64encode(q).decode()}
    payload = json.dumps(data).replace("</", "<\\/")
    rows = []
    for l in range(L):
        cells = "".join(f'<td><canvas id="L{l}H{h}" width="96" height="96" data-layer="{l}" data-head="{h}" '
                        f'title="layer {l} head {h}"></canvas><br>layer {l} head {h}</td>' for h in range(H))
        rows.append(f"<tr>{cells}</tr>")
    roles = {(r["layer"], r["head"]): r for r in result.roles}
    rel_keys = [k for _, k in ROLES if k in result.relative]
    score_rows = []
    for l in range(L):
        for h in range(H):
            raw = "".join(f"<td>{float(result.scores[k][l, h]):.3f}</td>"
                          for k in ("previous", "first", "self", "induction", "entropy_norm") if k in result.scores)
            rel = "".join(f"<td>{float(result.relative[k][l, h]):.2f}</td>" for k in rel_keys)
            role = html.escape(roles[(l, h)]["role"]) if (l, h) in roles else ""
            score_rows.append(f"<tr><td>{l}</td><td>{h}</td><td>{role}</td>{rel}{raw}</tr>")
    raw_head = "".join(f"<th>{k} (raw)</th>" for k in ("previous", "first", "self", "induction", "entropy_norm")
                       if k in result.scores)
    rel_head = "".join(f"<th>{k}</th>" for k in rel_keys)
    strongest = ""
    if result.relative:
        strongest = html.escape(format_strongest(strongest_heads(result.relative, 3), result.roles))
    img = ""
    if grid_png:
        with open(grid_png, "rb") as f:
            img = f'<img alt="grid" src="data:image/png;base64,{base64.b64encode(f.read()).decode()}">'
    page = _HTML.format(title=html.escape(title), prompt=html.escape("".join(result.labels)), L=L, H=H, T=T,
                        grid="\n".join(rows), scores="\n".join(score_rows), raw_head=raw_head, rel_head=rel_head,
                        strongest=strongest, img=img, payload=payload, threshold=ROLE_THRESHOLD,
                        notes="".join(f"<li>{html.escape(n)}</li>" for n in notes))
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return {"layers": layers, "notes": notes}


_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 1em; }} td {{ text-align: center; font-size: 11px; padding: 2px; }}
canvas.small {{ cursor: pointer; }} canvas.small.sel {{ outline: 3px solid #e33; }} #big {{ border: 1px solid #ccc; }}
table.s td {{ padding: 1px 8px; }} pre {{ background: #f4f4f4; padding: .5em; }}
</style></head><body>
<h1>{title}</h1>
<p>Prompt ({T} tokens; space shown as &#9251;, newline as &#8629;): <code>{prompt}</code></p>
<p>{L} layers x {H} heads. In every map row = query token, column = key token; brighter = more weight.
Click a small map to enlarge it.</p>
<ul id="notes">{notes}</ul>
<h2>Heads with a clear role</h2>
<p>Each head gets one role, its strongest, scored relative to uniform attention (0 = what uniform or random
attention gives, 1 = all weight on that key); below {threshold} a head has no clear role. Induction is measured on a
random sequence repeated twice.</p>
<pre>{strongest}</pre>
<h2>Selected head: <span id="sel"></span></h2>
<canvas id="big" width="640" height="640"></canvas><div id="hover">&nbsp;</div>
<h2>All heads</h2>
<table id="heads">{grid}</table>
<h2>Scores of every head</h2>
<table class="s"><tr><th>layer</th><th>head</th><th>role</th>{rel_head}{raw_head}</tr>
{scores}
</table>
<h2>Grid image</h2>{img}
<script>
const D = {payload};
const Q = Uint8Array.from(atob(D.maps), (c) => c.charCodeAt(0)), TRI = D.T * (D.T + 1) / 2;
function weight(l, h, i, j) {{ const k = D.layers.indexOf(l);
  if (k < 0 || j > i) return j > i ? 0 : null;
  return Q[(k * D.n_head + h) * TRI + i * (i + 1) / 2 + j] / 255; }}
function color(v) {{ const r = Math.round(68 + 185 * v), g = Math.round(1 + 230 * v), b = Math.round(84 + 20 * v);
  return `rgb(${{r}},${{g}},${{b}})`; }}
function draw(cv, l, h, margin) {{
  const ctx = cv.getContext("2d"), T = D.T, s = (cv.width - margin) / T;
  ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, cv.width, cv.height);
  if (!D.layers.includes(l)) {{ ctx.fillStyle = "#ccc";
    ctx.fillRect(margin, margin, cv.width - margin, cv.height - margin);
    ctx.fillStyle = "#000"; ctx.font = "10px sans-serif"; ctx.fillText("not embedded", margin + 4, margin + 14); return s; }}
  const edge = (k) => Math.round(margin + k * s);                 // whole pixels: no seams between cells
  for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) {{
    ctx.fillStyle = color(weight(l, h, i, j));
    ctx.fillRect(edge(j), edge(i), edge(j + 1) - edge(j), edge(i + 1) - edge(i)); }}
  if (margin > 0) {{ ctx.fillStyle = "#000"; ctx.font = Math.max(6, Math.min(12, s)) + "px sans-serif";
    const step = Math.max(1, Math.ceil(T / ((cv.width - margin) / 10)));
    for (let i = 0; i < T; i += step) {{ ctx.fillText(D.labels[i], 2, margin + (i + 0.8) * s);
      ctx.save(); ctx.translate(margin + (i + 0.8) * s, margin - 2); ctx.rotate(-Math.PI / 2);
      ctx.fillText(D.labels[i], 0, 0); ctx.restore(); }} }}
  return s;
}}
let cur = [0, 0];
function select(l, h) {{ cur = [l, h]; document.getElementById("sel").textContent = `layer ${{l}} head ${{h}}`;
  document.querySelectorAll("canvas.small").forEach((c) => c.classList.toggle("sel", c.id === `L${{l}}H${{h}}`));
  draw(document.getElementById("big"), l, h, 80); }}
for (let l = 0; l < D.n_layer; l++) for (let h = 0; h < D.n_head; h++) {{
  const cv = document.getElementById(`L${{l}}H${{h}}`); cv.className = "small";
  draw(cv, l, h, 0); cv.onclick = () => select(l, h); }}
const big = document.getElementById("big");
big.onmousemove = (e) => {{ const T = D.T, s = (big.width - 80) / T, r = big.getBoundingClientRect();
  const j = Math.floor((e.clientX - r.left - 80) / s), i = Math.floor((e.clientY - r.top - 80) / s);
  const v = weight(cur[0], cur[1], i, j);
  if (i >= 0 && j >= 0 && i < T && j < T && v !== null) document.getElementById("hover").textContent =
    `query ${{i}} "${{D.labels[i]}}" -> key ${{j}} "${{D.labels[j]}}": ${{v.toFixed(3)}}`; }};
select(D.selected[0], D.selected[1]);
</script>
</body></html>
"""


def write_heads(result: HeadsResult, out_dir: str, heads: list[tuple[int, int]], title: str = "") -> dict:
    """Write ``grid.png``, ``layer{L}_head{H}.png`` per selected head and ``heads.html``.

    Returns:
        ``{"grid": path, "heads": [paths], "html": path, "geometry": grid_geometry, "notes": what
        the files leave out (thinned labels, 8-bit weights, layers not embedded), "html_layers"}``.
    """
    os.makedirs(out_dir, exist_ok=True)
    grid = os.path.join(out_dir, "grid.png")
    geo = write_grid_png(result.weights, result.labels, grid, title)
    paths = []
    for l, h in heads:
        p = os.path.join(out_dir, f"layer{l}_head{h}.png")
        write_head_png(result.weights, result.labels, l, h, p)
        paths.append(p)
    page = os.path.join(out_dir, "heads.html")
    info = write_html(result, page, title or "attention heads", grid, heads)
    return {"grid": grid, "heads": paths, "html": page, "geometry": geo, "notes": geo["notes"] + info["notes"],
            "html_layers": info["layers"]}
