"""Named capture points: the one way to read or change an activation inside the model.

A :class:`HookPoint` is an identity module placed on a tensor in the forward pass (queries,
scores, pattern, per-head outputs, the residual stream, …), in the spirit of TransformerLens'
``HookPoint``. With nothing attached it returns its input untouched and costs one Python call;
a forward hook attached to it (``register_forward_hook`` or :meth:`HookPoint.add_hook`) sees
the tensor and may return a replacement, which the forward then uses. Everything that looks
inside the model (attention maps, calibration, activation caches, ablation, patching) goes
through these points, never through a copy of the forward loop.
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable, Iterable, Iterator, Union

import torch
from torch import nn

#: A hook function, TransformerLens' signature: ``fn(activation, hook) -> replacement | None``.
HookFn = Callable[[torch.Tensor, "HookPoint"], Union[torch.Tensor, None]]
#: Which points a hook goes on: one name (either spelling, :func:`canonical_name`) or a
#: predicate called with both spellings of every point's name (true for either selects it).
NameFilter = Union[str, Callable[[str], bool]]


class HookPoint(nn.Module):
    """Identity ``x → x`` at a named place in the forward pass.

    ``name`` is the module's path in the model (``h.0.attn.hook_q``), set by
    :func:`name_hook_points`. A hook is a function ``fn(tensor, hook) -> tensor | None``
    (TransformerLens' signature): returning a tensor replaces the activation.

    Shapes: whatever the forward passes (each point documents its own, e.g.
    ``hook_q [B, T, n_head, head_dim]``).
    """

    def __init__(self):
        super().__init__()
        self.name = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._forward_hooks or self._forward_pre_hooks:
            return super().__call__(x)
        return x                  # nothing attached here: no module machinery (global module hooks skip points)

    def add_hook(self, fn: Callable[[torch.Tensor, "HookPoint"], torch.Tensor | None]):
        """Attach ``fn(tensor, hook)``; returns a handle whose ``remove()`` detaches it."""
        return self.register_forward_hook(lambda module, args, out: fn(out, module))

    def remove_hooks(self) -> None:
        """Detach every hook attached to this point."""
        self._forward_hooks.clear()
        self._forward_pre_hooks.clear()

    def has_hooks(self) -> bool:
        """Whether anything is attached here (the forward then computes what it would skip,
        e.g. the explicit attention scores and pattern)."""
        return bool(self._forward_hooks or self._forward_pre_hooks)

    def layer(self) -> int:
        """The block this point is in (``h.3.attn.hook_q`` → 3), as TransformerLens' ``hook.layer()``.

        Raises:
            ValueError: the point is outside the blocks (``hook_embed``, ``ln_f.hook_normalized``).
        """
        m = re.match(r"h\.(\d+)\.", self.name)
        if m is None:
            raise ValueError(f"{self.name!r} is not inside a block: it has no layer")
        return int(m.group(1))

    @property
    def tl_name(self) -> str:
        """The point's TransformerLens name (``blocks.3.attn.hook_q``, :func:`tl_name`)."""
        return tl_name(self.name)

    def extra_repr(self) -> str:
        return self.name


def name_hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Give every :class:`HookPoint` in ``model`` its path as ``name``; returns them by path.

    Each point is also bound as a plain attribute of its parent, so the forward reaches it
    without ``nn.Module.__getattr__``'s lookup (a point is called ~15 times per layer per
    step). Replacing the attribute with another module (``nn.Module.__setattr__``) drops the
    binding, so the two never disagree.
    """
    points = {}
    for path, m in model.named_modules():
        for attr, child in m._modules.items():
            if isinstance(child, HookPoint):
                child.name = f"{path}.{attr}" if path else attr
                points[child.name] = child
                m.__dict__[attr] = child
    return points


# TransformerLens' module names → ours (the modules keep GPT-2's names, so state dicts and
# checkpoints are GPT-2's; only the capture points answer to both spellings). A LayerNorm's
# output (after weight and bias) is our ``hook_normalized`` and TransformerLens 4's ``hook_out``;
# its ``hook_normalized`` (before weight and bias) is our ``hook_standardized``.
_TL_TO_CORE = ((re.compile(r"(^|\.)(ln1|ln2|ln_final)\.hook_normalized$"), r"\1\2.hook_standardized"),
               (re.compile(r"(^|\.)(ln1|ln2|ln_final)\.hook_out$"), r"\1\2.hook_normalized"),
               (re.compile(r"^blocks\.(\d+)\."), r"h.\1."), (re.compile(r"\.ln1\."), ".ln_1."),
               (re.compile(r"\.ln2\."), ".ln_2."), (re.compile(r"^ln_final\."), "ln_f."))
_CORE_TO_TL = ((re.compile(r"(^|\.)(ln_1|ln_2|ln_f)\.hook_normalized$"), r"\1\2.hook_out"),
               (re.compile(r"(^|\.)(ln_1|ln_2|ln_f)\.hook_standardized$"), r"\1\2.hook_normalized"),
               (re.compile(r"^h\.(\d+)\."), r"blocks.\1."), (re.compile(r"\.ln_1\."), ".ln1."),
               (re.compile(r"\.ln_2\."), ".ln2."), (re.compile(r"^ln_f\."), "ln_final."))

#: :func:`act_name`'s short names → the point's path inside a block (``None``: outside the blocks).
ACT_NAMES = {
    "embed": "hook_embed", "pos_embed": "hook_pos_embed", "resid_pre": "hook_resid_pre",
    "resid_mid": "hook_resid_mid", "resid_post": "hook_resid_post", "attn_out": "hook_attn_out",
    "mlp_out": "hook_mlp_out", "q": "attn.hook_q", "k": "attn.hook_k", "v": "attn.hook_v",
    "attn_scores": "attn.hook_attn_scores", "scores": "attn.hook_attn_scores", "pattern": "attn.hook_pattern",
    "attn": "attn.hook_pattern", "z": "attn.hook_z", "result": "attn.hook_result", "pre": "mlp.hook_pre",
    "post": "mlp.hook_post", "normalized": None, "scale": None,
}


def canonical_name(name: str) -> str:
    """A capture point's path in this model for a TransformerLens name (``blocks.0.attn.hook_q`` →
    ``h.0.attn.hook_q``, ``blocks.0.ln1.hook_scale`` → ``h.0.ln_1.hook_scale``; a LayerNorm's
    ``hook_normalized`` → ``hook_standardized`` and its ``hook_out`` → ``hook_normalized``, e.g.
    ``ln_final.hook_out`` → ``ln_f.hook_normalized``); our own paths come back unchanged."""
    for pattern, repl in _TL_TO_CORE:
        name = pattern.sub(repl, name)
    return name


def tl_name(name: str) -> str:
    """TransformerLens' name for one of our capture-point paths (the inverse of :func:`canonical_name`)."""
    for pattern, repl in _CORE_TO_TL:
        name = pattern.sub(repl, name)
    return name


def act_name(kind: str, layer: int | None = None, sub: str | None = None) -> str:
    """The path of a point from a short name, as TransformerLens' ``utils.get_act_name``:
    ``act_name("pattern", 0)`` → ``h.0.attn.hook_pattern``, ``act_name("resid_pre", 2)`` →
    ``h.2.hook_resid_pre``, ``act_name("normalized", 1, "ln2")`` → ``h.1.ln_2.hook_standardized``
    (TransformerLens' meaning: before the weight and bias), ``act_name("scale")`` →
    ``ln_f.hook_scale``, ``act_name("embed")`` → ``hook_embed``.

    Raises:
        ValueError: an unknown short name (the message lists the known ones), or a block
            activation without a layer.
    """
    if kind not in ACT_NAMES:
        raise ValueError(f"activation name {kind!r} is unknown; expected one of {sorted(ACT_NAMES)} or a full "
                         f"hook name such as 'blocks.0.attn.hook_z'")
    if kind in ("embed", "pos_embed"):
        return ACT_NAMES[kind]
    if kind in ("normalized", "scale"):
        point = "hook_standardized" if kind == "normalized" else "hook_scale"
        if layer is None:
            return f"ln_f.{point}"
        return f"h.{layer}.{canonical_name('.' + (sub or 'ln1') + '.')[1:]}{point}"
    if layer is None:
        raise ValueError(f"activation {kind!r} is inside the blocks: give its layer, e.g. ({kind!r}, 0)")
    return f"h.{layer}.{ACT_NAMES[kind]}"


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Every capture point of ``model`` by path (``model.named_modules()`` order: forward order)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, HookPoint)}


def select_points(points: dict[str, HookPoint], which: NameFilter | Iterable[str] | None) -> list[str]:
    """The paths in ``points`` that ``which`` names.

    Args:
        points: from :func:`hook_points`.
        which: None (every point), one name in either spelling, a list of names, or a predicate
            ``f(name) -> bool`` called with our path and with TransformerLens' name (either true
            selects the point).

    Raises:
        ValueError: a name that is not a capture point of the model (the message lists close ones).
    """
    if which is None:
        return list(points)
    if callable(which):
        return [n for n in points if which(n) or which(tl_name(n))]
    names = [which] if isinstance(which, str) else list(which)
    out = []
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"hook name {name!r} must be a string (a capture point's name) or a predicate")
        path = canonical_name(name)
        if path not in points:
            last = name.split(".")[-1]
            near = [tl_name(p) for p in points if p.endswith(last)][:5]
            raise ValueError(f"{name!r} is not a capture point of this model"
                             + (f"; e.g. {near}" if near else "; see gpt2mha.core.hooks.hook_points(model)"))
        if path not in out:
            out.append(path)
    return out


@contextlib.contextmanager
def attached(model: nn.Module, fwd_hooks: Iterable[tuple[NameFilter, HookFn]]) -> Iterator[list]:
    """Attach ``fwd_hooks`` for the ``with`` block, then remove exactly those (also on error).

    Args:
        model: the module holding the points.
        fwd_hooks: ``[(name_or_filter, fn)]`` as TransformerLens' ``run_with_hooks``: a name in
            either spelling or a predicate (:func:`select_points`), and ``fn(tensor, hook) ->
            tensor | None``. Every forward inside the block runs them: a plain call, each
            prefill and decode step on a :class:`~gpt2mha.core.kv_cache.KVCache`, ``generate``
            (its decode view shares these points).

    Yields:
        The handles (``handle.remove()`` detaches one early).

    Raises:
        ValueError: a pair that is not ``(name, callable)``, or an unknown name.
    """
    points = hook_points(model)
    handles = []
    try:
        for pair in fwd_hooks:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and callable(pair[1])):
                raise ValueError(f"fwd_hooks entries must be (hook name or filter, fn(tensor, hook)) pairs; got {pair!r}")
            for path in select_points(points, pair[0]):
                handles.append(points[path].add_hook(pair[1]))
        yield handles
    finally:
        for h in handles:
            h.remove()


def reset_hooks(model: nn.Module) -> None:
    """Detach every hook from every capture point of ``model`` (TransformerLens' ``reset_hooks``)."""
    for point in hook_points(model).values():
        point.remove_hooks()


class _StopForward(Exception):
    """Raised by :func:`record` once the last activation it needs has been seen."""


def record(model: nn.Module, names: list[str], run: Callable[[], object], stop: bool = False,
           detach: bool = True) -> dict[str, torch.Tensor]:
    """The activations at the capture points ``names`` while ``run()`` runs the model.

    Args:
        model: the module holding the points (paths as in ``model.named_modules()``).
        names: capture-point paths, e.g. ``["h.0.hook_resid_pre", "ln_f.hook_normalized"]``, or
            their TransformerLens names (``blocks.0.hook_resid_pre``, :func:`canonical_name`).
        run: calls the model (once).
        stop: stop the forward as soon as every named point has been reached (the rest of the
            model is not computed; ``run``'s result is lost).
        detach: store detached tensors (no autograd graph kept alive).

    Returns:
        ``{name: tensor}`` keyed by the names as given (the last value seen at each point, as
        the forward saw it, i.e. after any hook attached before this call replaced it).

    Raises:
        ValueError: a name that is not a :class:`HookPoint` of ``model`` (the message lists
            close ones).
    """
    points = hook_points(model)
    paths = select_points(points, list(names))
    seen: dict[str, torch.Tensor] = {}

    def keep(path):
        def fn(x, hook):
            seen[path] = x.detach() if detach else x
            if stop and len(seen) == len(paths):
                raise _StopForward
        return fn
    handles = [points[path].add_hook(keep(path)) for path in paths]
    try:
        run()
    except _StopForward:
        pass
    finally:
        for h in handles:
            h.remove()
    return {name: seen[canonical_name(name)] for name in names if canonical_name(name) in seen}
