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

from typing import Callable

import torch
from torch import nn


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


class _StopForward(Exception):
    """Raised by :func:`record` once the last activation it needs has been seen."""


def record(model: nn.Module, names: list[str], run: Callable[[], object], stop: bool = False,
           detach: bool = True) -> dict[str, torch.Tensor]:
    """The activations at the capture points ``names`` while ``run()`` runs the model.

    Args:
        model: the module holding the points (paths as in ``model.named_modules()``).
        names: capture-point paths, e.g. ``["h.0.hook_resid_pre", "ln_f.hook_normalized"]``.
        run: calls the model (once).
        stop: stop the forward as soon as every named point has been reached (the rest of the
            model is not computed; ``run``'s result is lost).
        detach: store detached tensors (no autograd graph kept alive).

    Returns:
        ``{name: tensor}`` (the last value seen at each point, as the forward saw it).

    Raises:
        ValueError: a name that is not a :class:`HookPoint` of ``model`` (the message lists
            close ones).
    """
    points = dict(model.named_modules())
    for name in names:
        if not isinstance(points.get(name), HookPoint):
            near = [p for p, m in points.items() if isinstance(m, HookPoint) and name.split(".")[-1] in p][:5]
            raise ValueError(f"{name!r} is not a capture point of this model" + (f"; e.g. {near}" if near else ""))
    seen: dict[str, torch.Tensor] = {}

    def keep(name):
        def fn(x, hook):
            seen[name] = x.detach() if detach else x
            if stop and len(seen) == len(set(names)):
                raise _StopForward
        return fn
    handles = [points[name].add_hook(keep(name)) for name in set(names)]
    try:
        run()
    except _StopForward:
        pass
    finally:
        for h in handles:
            h.remove()
    return seen
