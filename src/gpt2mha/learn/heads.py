"""Per-head attention maps of a GPT-2 and the role each head plays.

:func:`attention_maps` reads every layer's attention pattern ``[B, h, T, T]`` at the capture
points ``h.{layer}.attn.hook_pattern`` (:mod:`gpt2mha.core.hooks`); :func:`role_scores` and
:func:`relative_scores` turn the maps into per-head scores (weight on the previous token, the
first token, the token itself), :func:`induction_scores` measures induction heads on a random
sequence repeated twice, and :func:`assign_roles` gives each head its strongest role when it
clears :data:`ROLE_THRESHOLD`. :func:`analyse_heads` does all of it for a prompt; the pictures
and the HTML page are drawn by :mod:`gpt2mha.learn.heads_html`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..core import checks
from .activations import run_with_cache


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
    """Every head's attention weights for ``idx``, read from the activation cache
    (:func:`~gpt2mha.learn.activations.run_with_cache`) at ``blocks.{layer}.attn.hook_pattern``
    (a hook there makes the layer run the explicit attention core, whose softmaxed pattern it sees).

    Args:
        model: a :class:`~gpt2mha.GPT2`.
        idx: token ids ``[B, T]``, ``1 <= T <= n_ctx``.

    Returns:
        ``[n_layer, B, n_head, T, T]`` float32; row i of a map is query token i's weights over
        keys 0..i (the causal mask makes the rest exactly 0).

    Raises:
        ValueError: idx is not an integer tensor ``[B, T]`` on the model's device, T is 0 or
            longer than the model's context, or ids are outside the vocabulary
            (:func:`~gpt2mha.core.checks.token_ids`).
    """
    checks.token_ids(idx, model.config.n_vocab, on=model.wte.weight.device)
    n_ctx = model.config.n_ctx
    if idx.shape[1] > n_ctx:
        raise ValueError(f"the prompt is {idx.shape[1]} tokens but the model's context is n_ctx={n_ctx} tokens; "
                         f"shorten it to at most {n_ctx}")
    L = model.config.n_layer
    was_training = model.training
    model.eval()                                                  # no dropout on the weights
    try:
        with torch.no_grad():                                     # stop: ends after the last layer's pattern
            _, cache = run_with_cache(model, idx, [f"blocks.{l}.attn.hook_pattern" for l in range(L)], stop=True)
    finally:
        model.train(was_training)
    return torch.stack([cache["pattern", l].float() for l in range(L)])   # [n_layer, B, h, T, T]


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
#: tests/test_heads.py holds that).
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
    idx = repeated_random_tokens(model.config, n, batch, seed).to(model.wte.weight.device)
    return induction_from_maps(attention_maps(model, idx))


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
    weights = attention_maps(model, torch.tensor([ids], dtype=torch.long, device=model.wte.weight.device))
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
