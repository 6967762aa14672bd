"""Sampling the next token, as OpenAI's ``sample_sequence`` (``src/sample.py``) does.

``logits / temperature``, then top-k (keep logits >= the k-th largest), then top-p (keep the
largest logits whose cumulative probability stays within p, at least one), optionally min-p
(keep tokens at least ``min_p`` times as probable as the most probable one), then a draw.
Each row of a batch may draw from its own generator, seeded by :func:`row_seed`, so a row
samples exactly as its prompt alone.
"""

from __future__ import annotations

import torch

#: Temperatures below float32's smallest normal number sample as temperature 0 (greedy): the
#: limit of ``softmax(logits / t)`` as t → 0 puts all the mass on the largest logit.
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


def row_seed(seed: int, row: int) -> int:
    """The seed of row ``row``'s generator when a batch is sampled with ``seed``.

    Row 0 uses ``seed`` itself, so a one-prompt call samples exactly as before and row i of a
    batch samples as that prompt alone with ``row_seed(seed, i)``; other rows take seeds spread
    by the 64-bit golden-ratio constant, in ``[0, 2**63)``.
    """
    return seed if row == 0 else (seed + row * 0x9E3779B97F4A7C15) % 2**63


def row_generators(seed: int, batch_size: int, device) -> list[torch.Generator]:
    """One private generator per row, row i seeded with :func:`row_seed` ``(seed, i)``."""
    return [torch.Generator(device=device).manual_seed(row_seed(seed, i)) for i in range(batch_size)]


def top_k_logits(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, V]`` → same with every logit below the k-th largest set to -inf (k = 0: unchanged)."""
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_logits(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering as ``top_p_logits`` in openai/gpt-2: keep the logits at least as large
    as the last one whose (inclusive) cumulative probability is <= p; always keep the top one."""
    if p >= 1.0:
        return logits
    sorted_logits = torch.sort(logits, dim=-1, descending=True).values       # [B, V]
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    last = ((cumulative <= p).sum(dim=-1, keepdim=True) - 1).clamp(min=0)  # [B, 1]
    min_values = sorted_logits.gather(-1, last)
    return logits.masked_fill(logits < min_values, float("-inf"))


def min_p_logits(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Min-p filtering: keep the tokens whose probability is at least ``min_p`` times the most
    probable one's (``[B, V]`` → same, the others -inf; min_p = 0: unchanged). Source:
    Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling", as transformers' ``MinPLogitsWarper``."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    keep = probs >= min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | list[torch.Generator] | None = None, min_p: float = 0.0) -> torch.Tensor:
    """Next token ids ``[B]`` (int64) from last-position logits ``[B, V]``.

    Temperature 0 (or below :data:`MIN_TEMPERATURE`) is argmax. Logits are shifted by their row
    maximum before dividing by the temperature (softmax does not change), so a tiny temperature
    cannot overflow to inf. Then top-k, top-p and min-p filtering, in that order (transformers'
    order). ``generator`` is one generator for the whole batch, or a list with one per row (row
    i drawn from ``generator[i]``, as if sampled alone).
    """
    logits = logits.float()
    if temperature < MIN_TEMPERATURE:
        return logits.argmax(dim=-1)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature      # <= 0: no overflow
    logits = min_p_logits(top_p_logits(top_k_logits(logits, top_k), top_p), min_p)
    probs = torch.softmax(logits, dim=-1)
    if isinstance(generator, (list, tuple)):
        return torch.cat([torch.multinomial(probs[i:i + 1], 1, generator=g) for i, g in enumerate(generator)]).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


