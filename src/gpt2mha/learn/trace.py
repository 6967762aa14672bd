"""A multi-head attention forward pass, stage by stage: each tensor's shape, axes and the
operation that produced it.

:func:`trace` walks the forward pass in the order the book's ``MultiHeadAttention`` computes
it (input, projections, view, transpose, scores, weights, contexts, merged, out_proj) for the
three layouts of this project: ``fused`` (GPT-2's ``c_attn``/``c_proj`` Conv1D), ``split``
(the book's ``MultiHeadAttention``) and ``wrapper`` (the book's
``MultiHeadAttentionWrapper``). Shapes come from running the operations on ``meta`` tensors,
so they are PyTorch's, not transcribed. :func:`format_trace` prints it for the terminal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

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
        name: stage name (the book's words: input, projections, view, transpose, scores,
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
        layout: ``"fused"`` (GPT-2: ``qkv = x @ c_attn.weight + c_attn.bias``),
            ``"split"`` (the book's ``MultiHeadAttention``: ``W_query``/``W_key``/``W_value``
            then ``out_proj``) or ``"wrapper"`` (``MultiHeadAttentionWrapper``:
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
