"""The numbers the explainer page draws, read from the model's capture points.

Everything here comes from :func:`~gpt2mha.learn.activations.run_with_cache` (the same capture
points the Python API gives, :mod:`gpt2mha.core.hooks`), for one sequence (batch 1):

* :func:`capture_layers`: per layer, the attention sublayer's tensors in the forward's order
  (``hook_resid_pre``, ``ln_1.hook_normalized``, ``attn.hook_q/k/v``, ``attn.hook_attn_scores``,
  ``attn.hook_pattern``, ``attn.hook_z``, ``hook_attn_out``, ``hook_resid_mid``);
* :func:`layer_unit` and :func:`head_unit`: what the step-by-step view shows for one layer and
  one head of it (``qkv`` is ``hook_q | hook_k | hook_v`` side by side: exactly ``c_attn``'s
  output, whose column blocks they are);
* :func:`pipeline_unit`: tokens, embeddings, the next-token distribution.

Tensors travel as little-endian float32 (or uint8) in base64 (:func:`encode`), so the page
holds the very float32 values the model computed and prints them at its own precision.
"""

from __future__ import annotations

import base64
import math

import torch

from ...core.attention import attention_mask
from ..activations import run_with_cache
from ..heads import token_labels

#: The capture points of one block that the step-by-step view reads (the block's path prefix
#: ``h.{layer}.`` goes before each), in the forward's order.
LAYER_POINTS = ("hook_resid_pre", "ln_1.hook_normalized", "attn.hook_q", "attn.hook_k", "attn.hook_v",
                "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z", "hook_attn_out", "hook_resid_mid")
#: Short names of :data:`LAYER_POINTS` in a capture.
SHORT = {"hook_resid_pre": "resid_pre", "ln_1.hook_normalized": "x", "attn.hook_q": "q", "attn.hook_k": "k",
         "attn.hook_v": "v", "attn.hook_attn_scores": "masked", "attn.hook_pattern": "pattern", "attn.hook_z": "z",
         "hook_attn_out": "attn_out", "hook_resid_mid": "resid_mid"}
#: How many of the most probable next tokens the pipeline view lists (and an exported page's
#: sampling view: the most probable after any temperature are the most probable before it).
TOP_NEXT = 30


class NonFiniteError(ValueError):
    """An answer holds NaN or infinity where the page needs a number: the model's weights or
    activations are not finite (the app answers 422 with the message)."""


def check_finite(answer, where: str = "answer") -> None:
    """Raises :class:`NonFiniteError` naming the first float of ``answer`` (dicts, lists and
    floats, as JSON holds them) that is NaN or infinite; the encoded tensors (base64) may hold
    any float32."""
    if isinstance(answer, float):
        if not math.isfinite(answer):
            raise NonFiniteError(f"the model's numbers are not finite: {where} is {answer} (NaN or infinity in its "
                                 f"weights or activations: is the checkpoint broken?)")
    elif isinstance(answer, dict):
        for key, value in answer.items():
            check_finite(value, f"{where}.{key}")
    elif isinstance(answer, (list, tuple)):
        for i, value in enumerate(answer):
            check_finite(value, f"{where}[{i}]")


def encode(t: torch.Tensor) -> dict:
    """A tensor as ``{"shape": [...], "f32": base64 of its float32 values, little-endian, C order}``."""
    a = t.detach().to(torch.float32).contiguous().cpu().numpy().astype("<f4")
    return {"shape": list(a.shape), "f32": base64.b64encode(a.tobytes()).decode("ascii")}


def encode_u8(t: torch.Tensor) -> dict:
    """Values in [0, 1] as ``{"shape", "u8": base64 of round(255·v)}`` (thumbnails)."""
    a = (t.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).contiguous().cpu().numpy()
    return {"shape": list(a.shape), "u8": base64.b64encode(a.tobytes()).decode("ascii")}


def decode(d: dict) -> torch.Tensor:
    """The inverse of :func:`encode` / :func:`encode_u8` (tests, and the export's own checks)."""
    import numpy as np

    if "f32" in d:
        a = np.frombuffer(base64.b64decode(d["f32"]), dtype="<f4")
    else:
        a = np.frombuffer(base64.b64decode(d["u8"]), dtype=np.uint8)
    return torch.from_numpy(a.copy()).reshape(d["shape"])


def config_dict(config) -> dict:
    """The model's sizes the page prints: ``n_layer, n_head, n_embd, head_dim, n_ctx, n_vocab, tokenizer``."""
    return {"n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd, "head_dim": config.head_dim,
            "n_ctx": config.n_ctx, "n_vocab": config.n_vocab, "tokenizer": config.tokenizer}


def check_ids(ids, config) -> torch.Tensor:
    """``ids`` (a list of token ids) as ``[1, T]`` int64, checked.

    Raises:
        ValueError: no tokens, more than ``n_ctx``, or an id outside the vocabulary.
    """
    if len(ids) == 0:
        raise ValueError("the prompt is empty: type at least one character")
    if len(ids) > config.n_ctx:
        raise ValueError(f"the prompt is {len(ids)} tokens but this model's context is n_ctx={config.n_ctx} tokens; "
                         f"shorten it to at most {config.n_ctx}")
    bad = [i for i in ids if not 0 <= int(i) < config.n_vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {config.n_vocab})")
    return torch.tensor([list(ids)], dtype=torch.long)


def capture_layers(model, idx: torch.Tensor, layers) -> dict[int, dict[str, torch.Tensor]]:
    """The attention tensors of ``layers`` for ``idx [1, T]``, batch axis dropped.

    Returns:
        ``{layer: {"resid_pre", "x", "attn_out", "resid_mid": [T, n_embd]; "q", "k", "v", "z":
        [T, n_head, head_dim]; "masked", "pattern": [n_head, T, T]}}`` (``masked``: the scores
        after the mask, ``hook_attn_scores``). The forward stops after the last layer asked for.
    """
    layers = sorted(set(layers))
    names = [f"h.{l}.{p}" for l in layers for p in LAYER_POINTS]
    with torch.no_grad():
        _, cache = run_with_cache(model, idx.to(model.wte.weight.device), names, stop=True)
    return {l: {SHORT[p]: cache[f"h.{l}.{p}"][0].float() for p in LAYER_POINTS} for l in layers}


def qkv_of(cap: dict) -> torch.Tensor:
    """``c_attn``'s output ``[T, 3·n_embd]``: q | k | v, each ``[T, n_head·head_dim]`` (head h at
    columns ``h·head_dim`` of its block), rebuilt from ``hook_q/k/v`` (views of those columns)."""
    T = cap["q"].shape[0]
    return torch.cat([cap[n].reshape(T, -1) for n in "qkv"], dim=-1)


def layer_unit(cap: dict, layer: int) -> dict:
    """The layer-wide tensors of the step-by-step view: ``resid_pre`` (the block's input), ``x``
    (after ln_1), ``qkv`` ``[T, 3·n_embd]``, ``mask`` = ``attention_mask(T, T)`` (1 = may
    attend; every head's), ``concat`` (the heads' outputs side by side, ``[T, n_embd]``:
    c_proj's input), ``attn_out`` (c_proj's output) and ``resid_mid`` (the residual add), each
    :func:`encode` d."""
    T = cap["z"].shape[0]
    return {"layer": layer, "T": T, "resid_pre": encode(cap["resid_pre"]), "x": encode(cap["x"]),
            "mask": encode(attention_mask(T, T).float()),
            "qkv": encode(qkv_of(cap)), "concat": encode(cap["z"].reshape(T, -1)),
            "attn_out": encode(cap["attn_out"]), "resid_mid": encode(cap["resid_mid"])}


def raw_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q kᵀ / √head_dim`` for one head (``q, k [T, head_dim]`` → ``[T, T]``), before the mask,
    in the order the explicit core computes it (product, then times ``1/√head_dim``)."""
    return (q.float() @ k.float().T) * (1.0 / math.sqrt(k.shape[-1]))


def head_unit(cap: dict, layer: int, head: int) -> dict:
    """One head's steps: ``q, k, v`` ``[T, head_dim]`` (head h's columns of the three blocks),
    ``scores`` ``[T, T]`` = ``q kᵀ/√head_dim`` (``hook_attn_scores`` where the mask lets a
    query read the key; computed from q and k above it, where the capture holds the mask's fill:
    the page draws the masked scores from these and the layer's mask), ``pattern``
    (``hook_pattern``, rows sum to 1), ``rowsum`` ``[T]`` and ``z`` ``[T, head_dim]`` (``hook_z``: A·v)."""
    q, k, v = (cap[n][:, head] for n in "qkv")
    T = q.shape[0]
    mask = attention_mask(T, T)
    masked, pattern = cap["masked"][head], cap["pattern"][head]
    scores = torch.where(mask, masked, raw_scores(q, k))
    return {"layer": layer, "head": head, "T": T, "q": encode(q), "k": encode(k), "v": encode(v),
            "scores": encode(scores),
            "pattern": encode(pattern), "rowsum": encode(pattern.double().sum(-1)), "z": encode(cap["z"][:, head]),
            "scale": 1.0 / math.sqrt(q.shape[-1])}


def token_pieces(tok, ids) -> list[dict]:
    """One ``{"id", "label", "bytes"}`` per token: its printable label
    (:func:`~gpt2mha.learn.heads.token_labels`) and its bytes in hex (a BPE token is 1+ bytes,
    a byte token exactly one)."""
    labels = token_labels(tok, ids)
    return [{"id": int(i), "label": lab, "bytes": tok.decode_bytes([i]).hex(" ")} for i, lab in zip(ids, labels)]


def output_names(config) -> tuple[str, ...] | None:
    """A classifier's label names (its head's outputs), None for a language model."""
    return getattr(config, "label_names", None)


def top_tokens(tok, logits: torch.Tensor, n: int = TOP_NEXT, names=None) -> list[dict]:
    """The ``n`` most probable tokens of ``softmax(logits [n_vocab])``: ``{"id", "label", "p",
    "logit"}``; with ``names`` (a classifier's labels) the outputs are labelled by them."""
    probs = logits.float().softmax(-1)
    top = probs.topk(min(n, probs.shape[-1]))
    ids = top.indices.tolist()
    labels = [names[i] for i in ids] if names else token_labels(tok, ids)
    return [{"id": i, "label": lab, "p": float(p), "logit": float(logits[i])}
            for i, lab, p in zip(ids, labels, top.values.tolist())]


def pipeline_unit(model, tok, idx: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """The pipeline at a glance for ``idx [1, T]``: tokens (:func:`token_pieces`), ``embed``
    (``hook_embed``: ``wte[ids]``), ``pos`` (``hook_pos_embed``: ``wpe[0..T-1]``), ``h0`` (their
    sum, block 0's input), ``ln_f`` (``ln_f.hook_normalized``), each ``[T, n_embd]``, and the
    next-token distribution of the last position (:func:`top_tokens`) and its logits
    ``last_logits [n_vocab]`` (an exported page filters them itself). For a classifier the last
    view is its head's: ``next`` lists the labels by probability (``classifier``: their names).

    Returns:
        ``(unit, logits [T, n_vocab])``.
    """
    with torch.no_grad():
        logits, cache = run_with_cache(model, idx.to(model.wte.weight.device),
                                       ["hook_embed", "hook_pos_embed", "h.0.hook_resid_pre", "ln_f.hook_normalized"])
    ids = idx[0].tolist()
    unit = {"config": config_dict(model.config), "tokens": token_pieces(tok, ids), "T": len(ids),
            "embed": encode(cache["hook_embed"][0]), "pos": encode(cache["hook_pos_embed"][0]),
            "h0": encode(cache["h.0.hook_resid_pre"][0]), "ln_f": encode(cache["ln_f.hook_normalized"][0]),
            "next": top_tokens(tok, logits[0, -1], names=output_names(model.config)),
            "last_logits": encode(logits[0, -1])}
    if output_names(model.config):
        unit["classifier"] = list(output_names(model.config))
    return unit, logits[0].float()
