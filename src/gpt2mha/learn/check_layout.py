"""Recognising how a learner's attention module holds its projections and heads.

:func:`recognise_layout` reads a module's parameter names and shapes: one projection per role
(``W_query/W_key/W_value``, ``q_proj/k_proj/v_proj`` ...), a fused q|k|v projection
(``c_attn``, ``qkv`` ...), a ``heads`` ModuleList of single-head modules, or a
``torch.nn.MultiheadAttention`` inside; the head count comes from the constructor argument,
an attribute or the signature's default (:func:`num_heads_source`).
"""

from __future__ import annotations

import inspect as pyinspect
from dataclasses import dataclass, field

import torch
from torch import nn

from .check_load import HEAD_ALIASES, CheckError, is_count

SPLIT_NAMES = (("W_query", "W_key", "W_value"), ("q_proj", "k_proj", "v_proj"), ("query", "key", "value"),
               ("W_q", "W_k", "W_v"), ("wq", "wk", "wv"))
FUSED_NAMES = ("c_attn", "qkv", "W_qkv", "Wqkv", "qkv_proj", "in_proj", "to_qkv")
OUT_NAMES = ("out_proj", "o_proj", "c_proj", "W_o", "wo", "proj", "out")


@dataclass
class Proj:
    """One projection: its name, weight and bias, and whether the weight is stored ``[in, out]``
    (Conv1D or a bare parameter used as ``x @ W``) rather than ``nn.Linear``'s ``[out, in]``."""

    name: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    in_out: bool
    bias_rows: slice | None = None     #: this projection's rows of a packed bias (nn.MultiheadAttention)
    bare: bool = False                 #: a bare nn.Parameter (its orientation is a guess the check tries both ways)

    @property
    def d_in(self) -> int:
        return self.weight.shape[0] if self.in_out else self.weight.shape[1]

    @property
    def d_out(self) -> int:
        return self.weight.shape[1] if self.in_out else self.weight.shape[0]

    def set(self, W: torch.Tensor, b: torch.Tensor) -> None:
        """Copy ``W [out, in]`` (nn.Linear orientation) and ``b [out]`` in."""
        self.weight.copy_(W.T if self.in_out else W)
        if self.bias is not None:
            (self.bias if self.bias_rows is None else self.bias[self.bias_rows]).copy_(b)


@dataclass
class Layout:
    """A recognised parameter layout.

    ``kind`` is ``"split"`` (one projection per role), ``"fused"`` (one q|k|v projection) or
    ``"wrapper"`` (per-head modules); ``q``/``k``/``v`` hold one :class:`Proj` per head for
    the wrapper, one otherwise; ``qkv`` the fused projection; ``out`` the output projection
    (None if the module has none); ``other`` the parameters the check leaves as they are.
    """

    kind: str
    d_in: int
    d_out: int
    num_heads: int
    q: list = field(default_factory=list)
    k: list = field(default_factory=list)
    v: list = field(default_factory=list)
    qkv: Proj | None = None
    out: Proj | None = None
    other: list = field(default_factory=list)
    heads_from: str = ""       #: where num_heads came from (constructor argument, attribute, default ...)
    single_head: bool = False  #: no head count anywhere: checked as one head of width d_out
    source: str = ""           #: e.g. "torch.nn.MultiheadAttention at attn (batch_first=True)"

    @property
    def head_dim(self) -> int:
        return self.d_out // self.num_heads

    def describe(self) -> str:
        if self.kind == "fused":
            names = [self.qkv.name]
        elif self.kind == "wrapper":                               # e.g. heads[i].W_query for i < 4
            container = self.q[0].name.split(".")[0]
            names = [f"{container}[i].{p.name.rsplit('.', 1)[-1]}" for p in (self.q[0], self.k[0], self.v[0])]
            names[-1] += f" for i < {self.num_heads}"
        else:
            names = [p[0].name for p in (self.q, self.k, self.v)]
        names.append(self.out.name if self.out else "no output projection")
        text = (f"{self.kind} ({', '.join(names)}) d_in={self.d_in} d_out={self.d_out} num_heads={self.num_heads} "
                f"head_dim={self.head_dim}")
        if self.single_head:
            text += " (single head: no head count found, checked as one head of width d_out)"
        elif self.heads_from:
            text += f" (num_heads from {self.heads_from})"
        return text + (f"; {self.source}" if self.source else "")


def _proj(module: nn.Module, name: str, prefix: str = "", bare_in_out: bool = True) -> Proj | None:
    """The projection ``module.<name>``: an nn.Linear, a Conv1D, or a bare 2-D parameter (taken
    as ``[in, out]``, used as ``x @ W``, when ``bare_in_out``; else ``[out, in]``, ``x @ W.T``)."""
    obj = module._modules.get(name) or module._parameters.get(name)
    full = prefix + name
    if isinstance(obj, nn.Parameter):
        return Proj(full, obj, None, bare_in_out, bare=True) if obj.dim() == 2 else None
    if not isinstance(obj, nn.Module):
        return None
    w, b = getattr(obj, "weight", None), getattr(obj, "bias", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    b = b if isinstance(b, torch.Tensor) else None
    if isinstance(obj, nn.Linear):
        return Proj(full, w, b, False)
    if type(obj).__name__ == "Conv1D":
        return Proj(full, w, b, True)
    return None


def _split_projs(module: nn.Module, prefix: str = "", bare_in_out: bool = True) -> tuple | None:
    for names in SPLIT_NAMES:
        ps = [_proj(module, n, prefix, bare_in_out) for n in names]
        if all(ps):
            return tuple(ps)
    return None


def _out_proj(module: nn.Module, bare_in_out: bool = True) -> Proj | None:
    return next((p for p in (_proj(module, n, "", bare_in_out) for n in OUT_NAMES) if p), None)


def _torch_mha_layout(module: nn.Module) -> Layout | None:
    """The layout of the first ``torch.nn.MultiheadAttention`` inside ``module`` (None if none).

    Packed form: ``in_proj_weight [3E, E]`` (q | k | v rows, nn.Linear orientation) and
    ``in_proj_bias [3E]``; separate form (when kdim/vdim differ from embed_dim):
    ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` with rows of the packed bias.
    ``out_proj`` is an nn.Linear. Source: ``torch.nn.MultiheadAttention`` and
    ``torch.nn.functional.multi_head_attention_forward``.
    """
    name, mha = next(((n, m) for n, m in module.named_modules() if isinstance(m, nn.MultiheadAttention)),
                     (None, None))
    if mha is None:
        return None
    pre = f"{name}." if name else ""
    E, bias = mha.embed_dim, mha.in_proj_bias
    out = Proj(f"{pre}out_proj", mha.out_proj.weight, mha.out_proj.bias, False)
    source = f"torch.nn.MultiheadAttention at {name or 'the module itself'} (batch_first={mha.batch_first})"
    if mha._qkv_same_embed_dim:
        qkv = Proj(f"{pre}in_proj_weight", mha.in_proj_weight, bias, False)
        layout = Layout("fused", E, E, mha.num_heads, qkv=qkv, out=out)
    else:
        ps = [Proj(f"{pre}{r}_proj_weight", getattr(mha, f"{r}_proj_weight"), bias, False,
                   slice(i * E, (i + 1) * E) if bias is not None else None) for i, r in enumerate("qkv")]
        layout = Layout("split", ps[0].d_in, E, mha.num_heads, [ps[0]], [ps[1]], [ps[2]], out=out)
    layout.heads_from, layout.source = f"{pre}num_heads = {mha.num_heads}", source
    return layout


def num_heads_source(module: nn.Module, kwargs: dict) -> tuple[int | None, str]:
    """The module's head count and where it came from, or ``(None, "")``.

    Sources, in order: a constructor argument the checker passed (``num_heads``, ``n_head``,
    ``h`` ... see :data:`HEAD_ALIASES`), an int attribute of the module under one of those
    names, the default of such a parameter in the constructor's signature (``num_heads=4``).
    """
    for name in HEAD_ALIASES:
        if is_count(kwargs.get(name)):
            return kwargs[name], f"constructor argument {name}={kwargs[name]}"
    for name in HEAD_ALIASES:
        value = getattr(module, name, None)
        if is_count(value):
            return value, f"self.{name} = {value}"
    try:
        params = pyinspect.signature(type(module).__init__).parameters
    except (TypeError, ValueError):
        params = {}
    for name in HEAD_ALIASES:
        if name in params and is_count(params[name].default):
            return params[name].default, f"signature default {name}={params[name].default}"
    return None, ""


def recognise_layout(module: nn.Module, kwargs: dict | None = None, bare_in_out: bool = True) -> Layout:
    """Recognise the module's parameter layout from its names and shapes.

    Known layouts: ``W_query/W_key/W_value`` (+ optional ``out_proj``), ``q_proj/k_proj/v_proj``
    (+ ``o_proj``) and the other :data:`SPLIT_NAMES`; a fused q|k|v projection (:data:`FUSED_NAMES`);
    GPT-2's ``c_attn/c_proj`` Conv1D; a ``heads`` ModuleList of single-head modules; a
    ``torch.nn.MultiheadAttention`` inside the module. Bare ``nn.Parameter`` weights are read as
    ``[in, out]`` (``x @ W``) when ``bare_in_out``, else as ``[out, in]`` (``x @ W.T``).

    The head count comes from :func:`num_heads_source`; with none anywhere, a split or fused
    layout is checked as a single head of width d_out (the book's ``CausalAttention``,
    ``SelfAttention_v1/v2``).

    Raises:
        CheckError: no known layout (the message lists every parameter found with its
            shape), or projections of inconsistent shapes.
    """
    kwargs = kwargs or {}
    layout = None
    split, fused = _split_projs(module, "", bare_in_out), None
    if split is None:
        fused = next((p for p in (_proj(module, n, "", bare_in_out) for n in FUSED_NAMES) if p and p.d_out % 3 == 0),
                     None)
    heads = None
    if split is None and fused is None:
        for name, child in module.named_children():
            if isinstance(child, nn.ModuleList) and len(child):
                per_head = [_split_projs(m, f"{name}.{i}.", bare_in_out) for i, m in enumerate(child)]
                if all(per_head):
                    heads = per_head
                    break
    if split is None and fused is None and heads is None:
        layout = _torch_mha_layout(module)
    if split is None and fused is None and heads is None and layout is None:
        found = ", ".join(f"{n} {list(p.shape)}" for n, p in module.named_parameters()) or "none"
        raise CheckError(
            f"cannot recognise the parameter layout of {type(module).__name__}; parameters found: {found}. "
            f"Known layouts: W_query/W_key/W_value (+ out_proj); q_proj/k_proj/v_proj (+ o_proj); a fused qkv "
            f"nn.Linear named {'/'.join(FUSED_NAMES[1:])} (+ out_proj/c_proj); c_attn/c_proj Conv1D; "
            f"heads = ModuleList of single-head modules with W_query/W_key/W_value; a torch.nn.MultiheadAttention")
    if layout is None:
        out = _out_proj(module, bare_in_out)
        if heads is not None:
            q, k, v = (list(p) for p in zip(*heads))
            layout = Layout("wrapper", q[0].d_in, sum(p.d_out for p in q), len(heads), q, k, v, out=out)
            layout.heads_from = f"{len(heads)} modules in {q[0].name.split('.')[0]}"
        elif fused is not None:
            layout = Layout("fused", fused.d_in, fused.d_out // 3, 0, qkv=fused, out=out)
        else:
            layout = Layout("split", split[0].d_in, split[0].d_out, 0, [split[0]], [split[1]], [split[2]], out=out)
        if layout.kind != "wrapper":
            layout.num_heads, layout.heads_from = num_heads_source(module, kwargs)
            if not layout.num_heads:
                layout.num_heads, layout.single_head = 1, True
    _check_layout_shapes(layout)
    projs = [p for p in layout.q + layout.k + layout.v + [layout.qkv, layout.out] if p]
    used = {id(p.weight) for p in projs} | {id(p.bias) for p in projs if p.bias is not None}
    layout.other = [n for n, p in module.named_parameters() if id(p) not in used]
    return layout


def has_bare_weights(layout: Layout) -> bool:
    """Whether any projection is a bare nn.Parameter (so its orientation is a guess)."""
    return any(p.bare for p in layout.q + layout.k + layout.v + [layout.qkv, layout.out] if p)


def _check_layout_shapes(layout: Layout) -> None:
    """Raise CheckError if the projections do not fit one multi-head attention."""
    projs = layout.q + layout.k + layout.v + ([layout.qkv] if layout.qkv else [])
    shapes = ", ".join(f"{p.name} {list(p.weight.shape)}" for p in projs)
    if len({p.d_in for p in projs}) != 1:
        raise CheckError(f"the q/k/v projections read different input widths: {shapes}")
    if layout.kind == "split" and len({p.d_out for p in projs}) != 1:
        raise CheckError(f"the q/k/v projections have different output widths: {shapes}")
    if layout.kind == "wrapper" and len({p.d_out for p in projs}) != 1:
        raise CheckError(f"the heads' projections have different widths: {shapes}")
    if layout.d_out % layout.num_heads:
        raise CheckError(f"d_out={layout.d_out} is not divisible by num_heads={layout.num_heads}")
    if layout.out is not None and (layout.out.d_in, layout.out.d_out) != (layout.d_out, layout.d_out):
        raise CheckError(f"{layout.out.name} maps {layout.out.d_in} -> {layout.out.d_out}; expected "
                         f"d_out -> d_out = {layout.d_out} -> {layout.d_out}")

