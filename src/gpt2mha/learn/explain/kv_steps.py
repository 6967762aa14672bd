"""Generation with the KV cache, one token at a time, and the sampling filters shown live.

:func:`sampling_view` applies the library's own filters (:mod:`gpt2mha.inference.sampling`:
temperature, then ``top_k_logits``, then ``top_p_logits``, OpenAI's ``sample_sequence``
semantics) to the last position's logits and says what each one removed; :func:`draw` samples
with ``sample_next`` itself, so the token drawn comes from exactly the distribution shown.
:func:`prefill` and :func:`decode_step` run the model with OpenAI's ``past``
``[B, n_layer, 2, n_head, T, head_dim]``: a step feeds one new token (nd = 1 query) and attends
over every cached key plus its own (ns = T + 1); the new query's row of scores and weights is
read at ``hook_attn_scores`` / ``hook_pattern`` of every layer.
"""

from __future__ import annotations

import torch

from ...core.attention import attention_mask
from ...core.hooks import record
from ...inference.params import SamplingParams
from ...inference.sampling import MIN_TEMPERATURE, sample_next, top_k_logits, top_p_logits
from ..heads import token_labels
from .tensors import encode

#: Tokens listed in the sampling view (the most probable after temperature).
VIEW_TOKENS = 30


def check_sampling(temperature, top_k, top_p, seed=None) -> tuple[float, int, float, int | None]:
    """The sampling fields of a request, checked as every entry point checks them
    (:class:`~gpt2mha.inference.params.SamplingParams`: a finite temperature >= 0, top_k >= 0,
    top_p in (0, 1], ``seed`` None or in ``[0, 2**63)``); returns ``(temperature, top_k, top_p, seed)``.

    Raises:
        ValueError: naming the field and its value.
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    return params.temperature, params.top_k, params.top_p, params.seed


def filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, ...]:
    """What ``sample_next`` computes before its draw, step by step, for ``logits [n_vocab]``.

    Returns:
        ``(p_temperature, after_k, after_p, p_final)``, each ``[n_vocab]``: the softmax of the
        max-shifted logits over the temperature, the logits top-k kept (-inf elsewhere), then
        top-p, and the distribution the draw uses. Temperature below
        :data:`~gpt2mha.inference.sampling.MIN_TEMPERATURE` is greedy: all the mass on the argmax.
    """
    logits = logits.float()[None]
    if temperature < MIN_TEMPERATURE:
        one = torch.zeros_like(logits)
        one[0, logits.argmax(-1)] = 1.0
        kept = torch.where(one > 0, logits, float("-inf"))
        return one[0], kept[0], kept[0], one[0]
    scaled = (logits - logits.amax(-1, keepdim=True)) / temperature
    after_k = top_k_logits(scaled, top_k)
    after_p = top_p_logits(after_k, top_p)
    return scaled.softmax(-1)[0], after_k[0], after_p[0], after_p.softmax(-1)[0]


def sampling_view(tok, logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                  n: int = VIEW_TOKENS) -> dict:
    """The next-token distribution and what each filter removes, for the page's sliders.

    Args:
        logits: ``[n_vocab]``, the last position's.

    Returns:
        ``{"tokens": [{"id", "label", "p_model", "p_temp", "kept_k", "kept_p", "p_final"}] for the
        n most probable after temperature, "removed_k", "removed_k_mass", "removed_p",
        "removed_p_mass" (tokens and probability after temperature each filter removed; top-p
        counts only what top-k kept), "kept" (tokens left), "vocab", "greedy"}``.
    """
    p_model = logits.float().softmax(-1)
    p_temp, after_k, after_p, p_final = filtered(logits, temperature, top_k, top_p)
    kept_k, kept_p = torch.isfinite(after_k), torch.isfinite(after_p)
    order = p_temp.argsort(descending=True)[:n].tolist()
    if temperature < MIN_TEMPERATURE:
        order = p_model.argsort(descending=True)[:n].tolist()
    labels = token_labels(tok, order)
    rows = [{"id": i, "label": lab, "p_model": float(p_model[i]), "p_temp": float(p_temp[i]),
             "kept_k": bool(kept_k[i]), "kept_p": bool(kept_p[i]), "p_final": float(p_final[i])}
            for i, lab in zip(order, labels)]
    removed_p = kept_k & ~kept_p
    return {"tokens": rows, "removed_k": int((~kept_k).sum()), "removed_k_mass": float(p_temp[~kept_k].sum()),
            "removed_p": int(removed_p.sum()), "removed_p_mass": float(p_temp[removed_p].sum()),
            "kept": int(kept_p.sum()), "vocab": int(logits.shape[-1]), "greedy": temperature < MIN_TEMPERATURE,
            "temperature": temperature, "top_k": top_k, "top_p": top_p}


def draw(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator) -> int:
    """One token id drawn by :func:`~gpt2mha.inference.sampling.sample_next` from ``logits [n_vocab]``
    (``generator`` advanced as ``generate`` advances a row's own generator)."""
    return int(sample_next(logits[None], temperature, top_k, top_p, generator=[generator])[0])


def prefill(model, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [T, n_vocab], past [1, n_layer, 2, n_head, T, head_dim])`` for ``idx [1, T]``."""
    with torch.no_grad():
        out = model(idx)
    return out.logits[0].float(), out.present


def decode_step(model, past: torch.Tensor, token: int) -> dict:
    """Feed ``token`` after the cached ``past [1, n_layer, 2, n_head, T, head_dim]``.

    Returns:
        ``{"logits": [n_vocab], "past": [1, n_layer, 2, n_head, T + 1, head_dim], "scores",
        "pattern": [n_layer, n_head, T + 1]}``: the new query's masked scores and weights over the
        T cached keys and its own (``hook_attn_scores``, ``hook_pattern`` with nd = 1, ns = T + 1).
    """
    L = model.config.n_layer
    names = [f"h.{l}.attn.{p}" for l in range(L) for p in ("hook_attn_scores", "hook_pattern")]
    idx = torch.tensor([[token]], dtype=torch.long, device=past.device)
    out = []
    with torch.no_grad():
        acts = record(model, names, lambda: out.append(model(idx, past=past)))
    present = out[0].present                                         # [1, L, 2, h, 1, head_dim]
    rows = {p: torch.stack([acts[f"h.{l}.attn.hook_{p}"][0, :, 0].float() for l in range(L)])
            for p in ("attn_scores", "pattern")}
    return {"logits": out[0].logits[0, -1].float(), "past": torch.cat([past, present], dim=4),
            "scores": rows["attn_scores"], "pattern": rows["pattern"]}


def step_unit(tok, token: int, past_before: tuple, step: dict, full_row: torch.Tensor, layer: int) -> dict:
    """What the page shows after a step: the token, the cache's shape before and after, the mask
    ``attention_mask(1, T + 1)``, every head's new row (``scores``, ``pattern`` ``[n_layer, n_head,
    T + 1]``) and, for ``layer``, how far its rows are from the last rows of a full forward
    without the cache (``full_row [n_head, T + 1]``)."""
    S = step["pattern"].shape[-1]
    return {"token": {"id": token, "label": token_labels(tok, [token])[0]},
            "past_before": list(past_before), "past_after": list(step["past"].shape), "nd": 1, "ns": S,
            "mask": encode(attention_mask(1, S).float()), "scores": encode(step["scores"]),
            "pattern": encode(step["pattern"]), "layer": layer,
            "full_max_diff": float((step["pattern"][layer] - full_row).abs().max())}
