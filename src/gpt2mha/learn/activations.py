"""Activation caches over the model's capture points, in TransformerLens' terms.

:func:`run_with_cache` runs the model once and keeps the activations at the capture points
(:mod:`gpt2mha.core.hooks`: the same :class:`~gpt2mha.core.hooks.HookPoint` modules every other
tool reads, no second forward loop); :func:`run_with_hooks` runs it with hooks attached for that
one call. The :class:`ActivationCache` answers to our paths (``h.0.attn.hook_z``), to
TransformerLens' names (``blocks.0.attn.hook_z``) and to its short keys (``cache["z", 0]``), and
stacks what an attribution needs: the residual stream after every layer
(:meth:`ActivationCache.accumulated_resid`, the logit lens' input) and each head's share of the
residual stream (:meth:`ActivationCache.stack_head_results`).

Source: TransformerLens' ``HookedRootModule.run_with_cache``/``run_with_hooks`` and
``ActivationCache`` (same arguments and results where both have them; tests/test_transformer_lens.py
holds them equal on the same weights).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Iterable, Iterator

import torch

from ..core.hooks import (HookFn, NameFilter, act_name, attached, canonical_name, hook_points, record, select_points,
                          tl_name)


def _pos(t: torch.Tensor, pos_slice, dim: int) -> torch.Tensor:
    """``t`` sliced along the position axis ``dim``: None keeps all, an int picks one (the axis
    goes), a slice or a list of ints keeps those (TransformerLens' ``Slice``)."""
    if pos_slice is None:
        return t
    if isinstance(pos_slice, int):
        return t.select(dim, pos_slice)
    if isinstance(pos_slice, slice):
        return t[(slice(None),) * (dim % t.dim()) + (pos_slice,)]
    return t.index_select(dim, torch.as_tensor(pos_slice, device=t.device))


class ActivationCache(Mapping):
    """Activations of one forward, by capture point; read-only ``Mapping``.

    Keys are our paths (``h.0.attn.hook_z``, in the model's module order); lookups also take
    TransformerLens' names (``blocks.0.attn.hook_z``, ``ln_final.hook_normalized``) and its short
    keys ``cache["pattern", 0]``, ``cache["resid_post", -1]``, ``cache["normalized", 1, "ln2"]``, ``cache["embed"]``
    (:func:`~gpt2mha.core.hooks.act_name`; negative layers count from the end).

    Shapes (B batch, T new tokens, S keys = cached + new, h heads): ``hook_q/k/v/z [B, T, h,
    head_dim]``, ``hook_attn_scores/hook_pattern [B, h, T, S]``, ``hook_result [B, T, h, n_embd]``,
    residual points ``[B, T, n_embd]``, ``mlp.hook_pre/post [B, T, 4·n_embd]``.

    Args:
        acts: ``{path: tensor}`` as :func:`~gpt2mha.core.hooks.record` returns them.
        model: the model they came from (its ``ln_f``, ``lm_head``, ``c_proj`` weights are read
            by the stacking methods).
    """

    def __init__(self, acts: dict[str, torch.Tensor], model):
        self._acts = {canonical_name(k): v for k, v in acts.items()}
        self.model = model

    def _key(self, key) -> str:
        if isinstance(key, tuple):
            kind, layer, *sub = key
            if isinstance(layer, int) and layer < 0:
                layer += self.model.config.n_layer
            return act_name(kind, layer, *sub)
        if not isinstance(key, str):
            raise KeyError(f"cache keys are hook names or (name, layer) tuples; got {key!r}")
        if key in ("embed", "pos_embed", "normalized", "scale"):   # short names outside the blocks
            return act_name(key)
        return canonical_name(key)

    def __getitem__(self, key) -> torch.Tensor:
        path = self._key(key)
        if path not in self._acts:
            raise KeyError(f"{key!r} ({path}) is not in this cache; it holds {len(self._acts)} activations, e.g. "
                           f"{list(self._acts)[:4]} (pass names_filter to run_with_cache to keep others)")
        return self._acts[path]

    def __contains__(self, key) -> bool:
        try:
            return self._key(key) in self._acts
        except (KeyError, ValueError):
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self._acts)

    def __len__(self) -> int:
        return len(self._acts)

    def tl_keys(self) -> list[str]:
        """The keys in TransformerLens' spelling (``blocks.0.attn.hook_z``)."""
        return [tl_name(k) for k in self._acts]

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} activations: {', '.join(list(self._acts)[:3])}, ...)"

    def remove_batch_dim(self) -> "ActivationCache":
        """A cache of batch-1 activations with the batch axis dropped.

        Raises:
            ValueError: the batch holds more than one row.
        """
        shapes = {v.shape[0] for v in self._acts.values()}
        if shapes != {1}:
            raise ValueError(f"remove_batch_dim needs a batch of 1; this cache has batch sizes {sorted(shapes)}")
        return ActivationCache({k: v[0] for k, v in self._acts.items()}, self.model)

    def ln_scale(self, layer: int | None = None, mlp_input: bool = False) -> torch.Tensor:
        """The LayerNorm divisor ``sqrt(var(x) + eps)`` ``[B, T, 1]`` of a LayerNorm's input in
        this run (TransformerLens' ``hook_scale``), recomputed from the cached residual stream.

        Args:
            layer: the LayerNorm's block, ``ln_1`` (or ``ln_2`` with ``mlp_input``); None, -1
                or n_layer: ``ln_f``.

        Raises:
            KeyError: the residual point it needs (``h.{l}.hook_resid_pre``/``resid_mid`` or the
                last ``hook_resid_post``) is not in the cache.
        """
        L = self.model.config.n_layer
        if layer is None or layer == -1 or layer == L:
            x, ln = self["resid_post", L - 1], self.model.ln_f
        else:
            x, ln = self["resid_mid" if mlp_input else "resid_pre", layer], self.model.h[layer].ln_2 if mlp_input \
                else self.model.h[layer].ln_1
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        return (x.var(dim=-1, unbiased=False, keepdim=True) + ln.eps).sqrt()

    def apply_ln_to_stack(self, stack: torch.Tensor, layer: int | None = None, mlp_input: bool = False,
                          pos_slice=None, recompute_ln: bool = False) -> torch.Tensor:
        """Components of the residual stream ``[N, B, T', n_embd]`` as that LayerNorm sees them.

        Without ``recompute_ln``: each component centred and divided by this run's divisor
        (:meth:`ln_scale`), neither LayerNorm weight nor bias applied (TransformerLens'
        ``apply_ln_to_stack``: the parts then add up to the normalised stream, less the bias,
        over the weight). With ``recompute_ln`` and the final layer: ``ln_f`` applied to each
        component whole, statistics of its own (the logit lens).

        Args:
            stack: ``[N, B, T', n_embd]``; T' the positions ``pos_slice`` kept (None: all).
        """
        L = self.model.config.n_layer
        final = layer is None or layer == -1 or layer == L
        if recompute_ln and final:
            return self.model.ln_f(stack)
        scale = _pos(self.ln_scale(layer, mlp_input), pos_slice, -2)
        stack = stack.to(scale.dtype)
        return (stack - stack.mean(dim=-1, keepdim=True)) / scale

    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice=None, mlp_input: bool = False, return_labels: bool = False):
        """The residual stream before each layer, then after the last: ``[n, B, T', n_embd]``.

        Entries (labels ``"0_pre"``, ``"0_mid"`` (``incl_mid``), …, ``"final_post"``): ``hook_resid_pre``
        of layers ``0..layer-1`` and, when ``layer`` is None/-1/n_layer, the last
        ``hook_resid_post``; with ``mlp_input``, ``hook_resid_mid`` of ``layer`` too.
        ``apply_ln``: through :meth:`apply_ln_to_stack` (``ln_f`` recomputed per entry for the
        final layer). Source: TransformerLens' ``ActivationCache.accumulated_resid``.

        Returns:
            The stack, and with ``return_labels`` also the labels.

        Raises:
            KeyError: a residual point missing from the cache.
        """
        L = self.model.config.n_layer
        layer = L if layer is None or layer == -1 else layer
        parts, labels = [], []
        for l in range(layer + 1):
            if l == L:
                parts.append(self["resid_post", L - 1])
                labels.append("final_post")
                continue
            parts.append(self["resid_pre", l])
            labels.append(f"{l}_pre")
            if (incl_mid and l < layer) or (mlp_input and l == layer):
                parts.append(self["resid_mid", l])
                labels.append(f"{l}_mid")
        stack = torch.stack([_pos(p, pos_slice, -2) for p in parts])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice, recompute_ln=layer == L)
        return (stack, labels) if return_labels else stack

    def head_results(self, layer: int) -> torch.Tensor:
        """Each head's share of layer ``layer``'s attention output ``[B, T, h, n_embd]``: the
        cached ``hook_result`` or, when it was not kept, ``hook_z`` through ``c_proj``'s rows of
        that head (:meth:`~gpt2mha.core.attention.CausalSelfAttention.head_results`). Summed
        over heads, plus ``c_proj.bias``, it is ``hook_attn_out``.

        Raises:
            KeyError: neither ``hook_result`` nor ``hook_z`` of that layer is in the cache.
        """
        if ("result", layer) in self:
            return self["result", layer]
        with torch.no_grad():
            return self.model.h[layer].attn.head_results(self["z", layer])

    def stack_head_results(self, layer: int = -1, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice=None, apply_ln: bool = False):
        """Every head's output in the residual stream, layers ``0..layer-1``: ``[layer·h, B, T', n_embd]``.

        Labels ``"L{l}H{h}"``; ``incl_remainder`` appends the rest of ``hook_resid_post`` of layer
        ``layer-1`` (embeddings, attention biases, MLPs). ``apply_ln``: as the final LayerNorm
        sees them (:meth:`apply_ln_to_stack`, for direct logit attribution).
        Source: TransformerLens' ``ActivationCache.stack_head_results``.

        Raises:
            KeyError: a layer's ``hook_z`` (or ``hook_result``) missing from the cache.
        """
        L = self.model.config.n_layer
        layer = L if layer is None or layer == -1 else layer
        parts, labels = [], []
        for l in range(layer):
            r = _pos(self.head_results(l), pos_slice, -3)               # [B, T', h, n_embd]
            parts.append(r.movedim(-2, 0))
            labels += [f"L{l}H{h}" for h in range(r.shape[-2])]
        if parts:
            stack = torch.cat(parts)
        else:
            stack = torch.zeros(0, *_pos(self["hook_embed"], pos_slice, -2).shape)
        if incl_remainder:
            rest = _pos(self["resid_post", layer - 1], pos_slice, -2) - stack.sum(0)
            stack = torch.cat([stack, rest[None]])
            labels.append("remainder")
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack


def default_names(points: Iterable[str]) -> list[str]:
    """Every capture point but the opt-in ``hook_result`` (it costs ``[B, T, h, n_embd]`` per
    layer and a separate projection per head; ask for it by name or filter)."""
    return [p for p in points if not p.endswith("attn.hook_result")]


def run_with_cache(model, idx: torch.Tensor, names_filter: NameFilter | Iterable[str] | None = None, *,
                   stop: bool = False, **forward_kwargs) -> tuple[torch.Tensor | None, ActivationCache]:
    """Run ``model(idx, **forward_kwargs)`` once and keep the activations at the capture points.

    Args:
        model: a :class:`~gpt2mha.GPT2`.
        idx: token ids ``[B, T]``.
        names_filter: which points: None (all but ``hook_result``, :func:`default_names`), a
            name in either spelling, a list of names, or a predicate of the name (called with
            both spellings, :func:`~gpt2mha.core.hooks.select_points`).
        stop: end the forward once every selected point was reached (logits are then None).
        forward_kwargs: passed to the forward (``cache=`` a KVCache: each prefill or decode
            step is one call, its activations those of the new tokens; ``attention_mask``, …).

    Returns:
        ``(logits [B, T, n_vocab], cache)`` (:class:`ActivationCache`, detached tensors). A
        hook on ``hook_attn_scores``/``hook_pattern`` runs the explicit attention core: the
        logits then differ from the SDPA core's by float rounding.

    Raises:
        ValueError: an unknown name, or whatever the forward raises for bad arguments.
    """
    points = hook_points(model)
    names = default_names(points) if names_filter is None else select_points(points, names_filter)
    out = []
    acts = record(model, names, lambda: out.append(model(idx, **forward_kwargs)), stop=stop)
    return (out[0].logits if out else None), ActivationCache(acts, model)


def run_with_hooks(model, idx: torch.Tensor, fwd_hooks: Iterable[tuple[NameFilter, HookFn]] = (),
                   **forward_kwargs) -> torch.Tensor:
    """``model(idx, **forward_kwargs).logits`` with ``fwd_hooks`` attached for this call only.

    Args:
        fwd_hooks: ``[(name_or_filter, fn(tensor, hook) -> tensor | None)]``; a returned tensor
            replaces the activation (:func:`~gpt2mha.core.hooks.attached`).

    Returns:
        logits ``[B, T, n_vocab]`` (TransformerLens' ``run_with_hooks`` returns the logits too).

    Raises:
        ValueError: a malformed pair or an unknown name.
    """
    with attached(model, fwd_hooks):
        return model(idx, **forward_kwargs).logits
