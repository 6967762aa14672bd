"""Interventions as one-liners: head ablation, activation patching, the logit lens and direct
logit attribution, all through the capture points (:mod:`gpt2mha.core.hooks`) and the
activation cache (:mod:`gpt2mha.learn.activations`).

* :func:`ablate_heads`: the logits with heads zeroed or replaced by their mean output
  (``hook_z`` of the head set to 0 or to its mean; the head then adds nothing, or its average,
  to ``c_proj``'s input).
* :func:`patch`: activation patching (Meng et al. 2022, "Locating and editing factual
  associations"; Wang et al. 2022, "Interpretability in the wild"): run the corrupted prompt
  with one activation copied from the clean run, for every layer and head or position, and
  measure a metric such as :func:`logit_diff`.
* :func:`lens_logits` / :func:`logit_lens`: the residual stream before each layer decoded
  through ``ln_f`` and the LM head (nostalgebraist 2020, "interpreting GPT: the logit lens").
* :func:`direct_logit_attribution`: each head's output, scaled as the final LayerNorm scales the
  stream, dotted with a token's unembedding (Elhage et al. 2021, "A mathematical framework").

Sources for the conventions: TransformerLens' ``patching.get_act_patch_*``,
``ActivationCache.accumulated_resid``/``logit_attrs``; tests/test_transformer_lens.py compares.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from ..core.hooks import ACT_NAMES, act_name, attached, canonical_name
from .activations import ActivationCache, run_with_cache

#: Activations with a head axis: ``[B, T, h, d]`` (q, k, v, z, result) and ``[B, h, T, S]`` (patterns).
HEAD_VECTORS = ("q", "k", "v", "z", "result")
HEAD_PATTERNS = ("pattern", "attn_scores", "scores", "attn")


def parse_heads(text: str | Sequence, n_layer: int, n_head: int) -> list[tuple[int, int]]:
    """Heads as ``[(layer, head)]`` from ``"0.3,1.5"`` (layer.head, 0-based) or a list of pairs.

    Raises:
        ValueError: a malformed entry, or a layer or head outside the model (the message names it).
    """
    items = [t.strip() for t in text.split(",") if t.strip()] if isinstance(text, str) else list(text)
    if not items:
        raise ValueError(f"heads={text!r} names no head; expected layer.head pairs such as '0.3,1.5'")
    heads = []
    for item in items:
        try:
            l, h = (int(p) for p in item.split(".")) if isinstance(item, str) else (int(item[0]), int(item[1]))
        except (ValueError, TypeError, IndexError):
            raise ValueError(f"head {item!r} is not layer.head (e.g. '0.3' = layer 0, head 3)") from None
        if not 0 <= l < n_layer:
            raise ValueError(f"head {item!r}: layer {l} is out of range; the model has {n_layer} layers (0..{n_layer - 1})")
        if not 0 <= h < n_head:
            raise ValueError(f"head {item!r}: head {h} is out of range; the model has {n_head} heads (0..{n_head - 1})")
        if (l, h) not in heads:
            heads.append((l, h))
    return heads


def head_means(model, idx: torch.Tensor, layers: Sequence[int], **forward_kwargs) -> dict[int, torch.Tensor]:
    """Each head's mean ``hook_z`` over the batch and positions of ``idx``: ``{layer: [h, head_dim]}``."""
    _, cache = run_with_cache(model, idx, [act_name("z", l) for l in set(layers)], **forward_kwargs)
    return {l: cache["z", l].float().mean(dim=(0, 1)) for l in set(layers)}


def ablation_hooks(heads: Sequence[tuple[int, int]], means: dict[int, torch.Tensor] | None = None) -> list:
    """``fwd_hooks`` that ablate ``heads`` at ``hook_z`` ``[B, T, h, head_dim]``: to 0, or (given
    ``means`` from :func:`head_means`) to the head's mean. For :func:`~gpt2mha.learn.activations.
    run_with_hooks`, ``model.hooks(...)`` around ``generate``, or a KV-cache loop."""
    by_layer: dict[int, list[int]] = {}
    for l, h in heads:
        by_layer.setdefault(l, []).append(h)

    def hook_for(l, hs):
        def fn(z, hook):
            z = z.clone()
            z[:, :, hs] = 0 if means is None else means[l][hs].to(z.dtype)
            return z
        return fn
    return [(act_name("z", l), hook_for(l, hs)) for l, hs in by_layer.items()]


def ablate_heads(model, idx: torch.Tensor, heads, mean: bool = False, reference: torch.Tensor | None = None,
                 **forward_kwargs) -> torch.Tensor:
    """Logits ``[B, T, n_vocab]`` with ``heads`` ablated.

    Args:
        heads: ``"0.3,1.5"`` or ``[(layer, head)]`` (:func:`parse_heads`).
        mean: replace each head's output by its mean over the batch and positions of
            ``reference`` (default ``idx``) instead of zeroing it.

    Raises:
        ValueError: as :func:`parse_heads`, or bad forward arguments.
    """
    c = model.config
    heads = parse_heads(heads, c.n_layer, c.n_head)
    means = head_means(model, idx if reference is None else reference, [l for l, _ in heads]) if mean else None
    with attached(model, ablation_hooks(heads, means)):
        return model(idx, **forward_kwargs).logits


def logit_diff(answer: int, wrong: int | None = None, pos: int = -1) -> Callable[[torch.Tensor], torch.Tensor]:
    """A metric for :func:`patch`: ``logits[:, pos, answer] - logits[:, pos, wrong]`` averaged over
    the batch (without ``wrong``: the answer's log-probability)."""
    def metric(logits: torch.Tensor) -> torch.Tensor:
        last = logits[:, pos].float()
        if wrong is None:
            return last.log_softmax(-1)[:, answer].mean()
        return (last[:, answer] - last[:, wrong]).mean()
    return metric


#: Smallest ``|clean - corrupt|`` (the metric's units: a logit difference or a log-probability, both
#: in nats) for which :meth:`Patching.normalized` is worth reading: a corruption that moves the
#: answer's odds by less than a factor e leaves a gap that the incidental effect of patching
#: almost anything is a sizeable share of, so shares far outside [0, 1] appear (clean 3.529,
#: corrupt 3.642 gave 1.57).
MIN_METRIC_GAP = 1.0


class Patching(NamedTuple):
    """What :func:`patch` returns.

    Attributes:
        values: the metric with each activation patched, shaped by ``axes``.
        axes: axis names, e.g. ``("layer", "head")``, ``("layer", "pos")``, ``("layer", "pos", "head")``.
        clean, corrupt: the metric on the clean and on the unpatched corrupted run.
        hook: the patched activation's short name (``"z"``, ``"resid_pre"``, …).
    """

    values: torch.Tensor
    axes: tuple
    clean: float
    corrupt: float
    hook: str

    def normalized(self) -> torch.Tensor:
        """``(values - corrupt) / (clean - corrupt)``: 1 = the patch restores the clean metric,
        0 = no effect.

        Raises:
            ValueError: clean and corrupt metrics are equal (nothing to restore).
        """
        if self.clean == self.corrupt:
            raise ValueError(f"the clean and corrupted runs give the same metric ({self.clean}); nothing to normalise")
        return (self.values - self.corrupt) / (self.clean - self.corrupt)

    def normalization_warning(self, min_gap: float = MIN_METRIC_GAP) -> str | None:
        """Why :meth:`normalized` means little here, or None: the clean and corrupted metrics
        differ by less than ``min_gap`` (:data:`MIN_METRIC_GAP`)."""
        gap = abs(self.clean - self.corrupt)
        if gap >= min_gap:
            return None
        return (f"the clean and corrupted metrics differ by only {gap:.3g} ({self.clean:.4g} vs {self.corrupt:.4g}; "
                f"less than {min_gap:g}), so the restored share divides by a near-zero gap and means little: read "
                f"the raw values, or choose a CORRUPT prompt that moves the answer more")


def _kind(hook_name: str) -> tuple[str, list[int] | None]:
    """``(short name, [layer] or None for every layer)`` of ``hook_name``."""
    if hook_name in ACT_NAMES:
        return hook_name, None
    path = canonical_name(hook_name)
    for kind, sub in ACT_NAMES.items():
        if sub and path.startswith("h.") and path.split(".", 2)[2] == sub:
            return kind, [int(path.split(".")[1])]
    raise ValueError(f"hook_name={hook_name!r} cannot be patched; expected a short name "
                     f"({', '.join(k for k in ACT_NAMES if k not in ('embed', 'pos_embed', 'normalized', 'scale'))}) "
                     f"or a block's hook such as 'blocks.0.attn.hook_z'")


def _indices(kind: str, shape: torch.Size, layers: list[int], per_position: bool):
    """``(axes, [(layer, index into the activation)], grid shape)`` for a patching sweep."""
    all_ = slice(None)
    T = shape[1] if kind not in HEAD_PATTERNS else shape[2]
    if kind in HEAD_VECTORS or kind in HEAD_PATTERNS:
        h = shape[2] if kind in HEAD_VECTORS else shape[1]
        def at(p, hd):
            return (all_, p, hd) if kind in HEAD_VECTORS else (all_, hd, p)
        if per_position:
            return ("layer", "pos", "head"), [(l, at(p, hd)) for l in layers for p in range(T) for hd in range(h)], \
                (len(layers), T, h)
        return ("layer", "head"), [(l, at(all_, hd)) for l in layers for hd in range(h)], (len(layers), h)
    if per_position:
        return ("layer", "pos"), [(l, (all_, p)) for l in layers for p in range(T)], (len(layers), T)
    return ("layer",), [(l, (all_,)) for l in layers], (len(layers),)


def patch(model, clean: torch.Tensor, corrupt: torch.Tensor, hook_name: str,
          metric: Callable[[torch.Tensor], torch.Tensor], per_position: bool | None = None,
          batch_size: int = 8, last_only: bool = False) -> Patching:
    """Activation patching: the metric of the corrupted run with one activation from the clean run.

    For every layer (or the one a full name gives) and every head (activations with a head
    axis) or position (residual-stream activations), the corrupted prompt runs with that slice
    of ``hook_name`` replaced by the clean run's, and ``metric(logits)`` is recorded. Up to
    ``batch_size`` patched runs go through the model as one batch (each copy patched at its
    own place; the same numbers as one run each, to float rounding).

    Args:
        model: a :class:`~gpt2mha.GPT2`.
        clean, corrupt: token ids ``[B, T]`` of the same shape.
        hook_name: a short name (``"z"``, ``"resid_pre"``, ``"attn_out"``, ``"pattern"``, …;
            every layer) or a block's hook in either spelling (``"blocks.3.attn.hook_z"``; that layer).
        metric: ``f(logits [B, T, n_vocab]) -> scalar`` (e.g. :func:`logit_diff`).
        per_position: patch one position at a time (default: yes for residual-stream
            activations, no for per-head ones, which are patched at every position at once).
        batch_size: patched runs per forward.
        last_only: compute logits of the last position only (the metric sees ``[B, 1, n_vocab]``).

    Returns:
        :class:`Patching`: values ``[layer, head]``, ``[layer, pos, head]``, ``[layer, pos]`` or ``[layer]``.

    Raises:
        ValueError: clean and corrupt differ in shape, an unknown or unpatchable hook name, or
            batch_size < 1.

    Source: TransformerLens' ``patching.get_act_patch_attn_head_out_all_pos`` (z, all
    positions), ``…_by_pos``, ``get_act_patch_resid_pre`` and the others of that family.
    """
    if not (isinstance(clean, torch.Tensor) and isinstance(corrupt, torch.Tensor)) or clean.shape != corrupt.shape:
        raise ValueError(f"clean and corrupt must be token-id tensors of the same shape [B, T]; got "
                         f"{getattr(clean, 'shape', type(clean).__name__)} and "
                         f"{getattr(corrupt, 'shape', type(corrupt).__name__)} (pad or reword one)")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
    kind, layers = _kind(hook_name)
    if kind in ("embed", "pos_embed", "normalized", "scale"):
        raise ValueError(f"hook_name={hook_name!r}: patch block activations (resid_pre, z, pattern, ...)")
    layers = list(range(model.config.n_layer)) if layers is None else layers
    names = [act_name(kind, l) for l in layers]
    with torch.no_grad():
        clean_logits, cache = run_with_cache(model, clean, names, last_only=last_only)
        corrupt_logits = model(corrupt, last_only=last_only).logits
    if per_position is None:
        per_position = kind not in HEAD_VECTORS and kind not in HEAD_PATTERNS
    axes, jobs, grid = _indices(kind, cache[names[0]].shape, layers, per_position)
    B = clean.shape[0]
    values = []
    with torch.no_grad():
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start:start + batch_size]
            values += _patched_runs(model, corrupt, cache, kind, chunk, B, metric, last_only)
    return Patching(torch.tensor(values).view(grid), axes, float(metric(clean_logits)),
                    float(metric(corrupt_logits)), kind)


def _patched_runs(model, corrupt, cache: ActivationCache, kind: str, chunk, B: int, metric, last_only) -> list[float]:
    """One forward of ``len(chunk)`` copies of ``corrupt``, copy i patched at ``chunk[i]``."""
    def hook_for(layer):
        clean = cache[kind, layer]
        def fn(x, hook):
            x = x.clone()
            for i, (l, index) in enumerate(chunk):
                if l == layer:
                    rows = x[i * B:(i + 1) * B]
                    rows[index] = clean[index].to(x.dtype)
            return x
        return fn
    layers = sorted({l for l, _ in chunk})
    with attached(model, [(act_name(kind, l), hook_for(l)) for l in layers]):
        logits = model(corrupt.repeat(len(chunk), 1), last_only=last_only).logits
    return [float(metric(logits[i * B:(i + 1) * B])) for i in range(len(chunk))]


def lens_logits(model, cache: ActivationCache, pos_slice=None, layers: Sequence[int] | None = None) -> torch.Tensor:
    """The logit lens: the residual stream before each layer and after the last, through ``ln_f``
    and the LM head: ``[n_layer + 1, B, T', n_vocab]`` (entry ``n_layer`` is the model's logits).

    Args:
        cache: from :func:`~gpt2mha.learn.activations.run_with_cache` with every
            ``hook_resid_pre`` and the last ``hook_resid_post``.
        pos_slice: positions to keep (None: all; an int drops the axis).
        layers: entries of the stack to decode (default all; ``[n_layer]`` = the final stream).

    Source: ``accumulated_resid(apply_ln=True)`` of TransformerLens decoded by its unembedding.
    """
    stack = cache.accumulated_resid(pos_slice=pos_slice)
    if layers is not None:
        stack = stack[list(layers)]
    with torch.no_grad():
        return model.lm_head(model.ln_f(stack))


class Lens(NamedTuple):
    """What :func:`logit_lens` returns: ``ids``/``probs`` ``[n_layer + 1, B, T, top_k]`` (the top
    tokens of each decoded stream and their probabilities), ``labels`` (``"0_pre"``, …,
    ``"final_post"``) and ``target_probs`` ``[n_layer + 1, B, T]`` (each position's next token
    in ``idx``, the last position's is 0) ."""

    ids: torch.Tensor
    probs: torch.Tensor
    labels: list
    target_probs: torch.Tensor


def logit_lens(model, idx: torch.Tensor, top_k: int = 5, **forward_kwargs) -> Lens:
    """The top ``top_k`` tokens of the residual stream before every layer and after the last,
    decoded through ``ln_f`` and the LM head, one layer at a time (memory: one
    ``[B, T, n_vocab]`` at once).

    Raises:
        ValueError: top_k not in ``[1, n_vocab]``, or bad forward arguments.
    """
    V = model.config.n_vocab
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= V:
        raise ValueError(f"top_k={top_k!r} must be an integer in [1, n_vocab={V}]")
    L = model.config.n_layer
    names = [act_name("resid_pre", l) for l in range(L)] + [act_name("resid_post", L - 1)]
    _, cache = run_with_cache(model, idx, names, **forward_kwargs)
    stack, labels = cache.accumulated_resid(return_labels=True)
    ids, probs, target = [], [], []
    nxt = torch.cat([idx[:, 1:], idx[:, -1:]], dim=1)
    with torch.no_grad():
        for entry in stack:
            p = model.lm_head(model.ln_f(entry)).float().softmax(-1)            # [B, T, V]
            top = p.topk(top_k, dim=-1)
            ids.append(top.indices)
            probs.append(top.values)
            t = p.gather(-1, nxt[..., None])[..., 0]
            t[:, -1] = 0
            target.append(t)
    return Lens(torch.stack(ids), torch.stack(probs), labels, torch.stack(target))


def direct_logit_attribution(model, cache: ActivationCache, answer, wrong=None, pos: int = -1) -> torch.Tensor:
    """Each head's direct effect on a logit (or a logit difference) at position ``pos``:
    ``[B, n_layer, n_head]``.

    A head's output ``r`` reaches the logits through ``ln_f`` only: ``γ ⊙ (r - mean(r)) / σ``
    (σ: this run's ``ln_f`` divisor, frozen) dotted with the token's unembedding row. Summed over
    every component of the residual stream (embeddings, every head, attention biases, MLPs),
    plus ``β · W_U[answer]``, it is the logit itself. Equals TransformerLens' ``logit_attrs`` of
    ``stack_head_results(apply_ln=True)`` on an ``ln_f``-folded model.

    Args:
        cache: with every layer's ``hook_z`` (or ``hook_result``) and the last ``hook_resid_post``.
        answer, wrong: token ids (ints, or ``[B]`` tensors); with ``wrong``, the attribution to
            ``logit[answer] - logit[wrong]``.

    Raises:
        KeyError: an activation it needs missing from the cache.
    """
    L, H = model.config.n_layer, model.config.n_head
    stack = cache.stack_head_results(pos_slice=pos, apply_ln=True)                # [L·h, B, n_embd]
    W = model.output_weight().detach()
    direction = W[torch.as_tensor(answer)].float()
    if wrong is not None:
        direction = direction - W[torch.as_tensor(wrong)].float()
    direction = direction * model.ln_f.weight.detach().float()                     # [n_embd] or [B, n_embd]
    out = (stack.float() * direction).sum(-1)                                      # [L·h, B]
    return out.T.reshape(-1, L, H)


def next_token_shift(before: torch.Tensor, after: torch.Tensor, top: int = 5) -> dict:
    """How the next-token distribution moves from logits ``before [n_vocab]`` to ``after [n_vocab]``.

    Returns:
        ``{"kl": KL(before ‖ after) in nats, "max_logit_change": max |Δlogit|, "top_before",
        "top_after": token ids, "tokens": [{"id", "before", "after"}]}`` for the union of both
        top-``top`` lists, ordered by the probability before.
    """
    p, q = before.float().log_softmax(-1), after.float().log_softmax(-1)
    ids_b, ids_a = p.topk(top).indices.tolist(), q.topk(top).indices.tolist()
    ids = sorted(set(ids_b) | set(ids_a), key=lambda i: -float(p[i]))
    return {"kl": float((p.exp() * (p - q)).sum()), "max_logit_change": float((after - before).abs().max()),
            "top_before": ids_b, "top_after": ids_a,
            "tokens": [{"id": i, "before": float(p[i].exp()), "after": float(q[i].exp())} for i in ids]}
