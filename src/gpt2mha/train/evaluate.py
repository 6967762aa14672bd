"""Perplexity and bits per byte of a model on a text, with a strided sliding window.

Each window holds up to n_ctx tokens; after the first, a window moves on by ``stride`` tokens
and only its last ``stride`` tokens are scored, each with up to ``n_ctx - stride`` tokens of
context before it (the method of transformers' "Perplexity of fixed-length models" guide).
Every token after the first is scored exactly once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .. import distributed
from ..inference.sampling import check_logits
from ..io.tokenizer import tokenizer_for
from ..progress import progress_bar


@dataclass
class PerplexityResult:
    """``loss_per_token`` (nats), ``perplexity`` = exp(loss), ``bits_per_byte`` = total nats /
    (ln 2 · bytes), ``tokens`` scored, ``bytes`` of UTF-8 text they cover."""

    loss_per_token: float
    perplexity: float
    bits_per_byte: float
    tokens: int
    bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def perplexity(model, text: str, stride: int | None = None, progress: bool = False) -> PerplexityResult:
    """Score ``text`` with ``model`` (its config's tokenizer).

    Args:
        model: a :class:`~gpt2mha.core.model.GPT2`.
        text: the text; must encode to at least 2 tokens.
        stride: window step in tokens, ``1 <= stride <= n_ctx`` (default n_ctx // 2).
        progress: show a progress bar of the windows on stderr (when it is a terminal).

    Returns:
        :class:`PerplexityResult`. ``bytes`` counts the UTF-8 bytes of the whole text; the
        first token (which nothing predicts) is not scored.

    Raises:
        ValueError: text too short, or stride out of range.
        NonFiniteLogitsError: the model's logits hold NaN or +inf in a window
            (:func:`~gpt2mha.inference.sampling.check_logits`): there is no loss to report.

    :func:`distributed_perplexity` deals the same windows over ``torchrun``'s ranks.
    """
    ids, stride = encode_for_scoring(model, text, stride)
    nats, tokens = score_windows(model, ids, strided_windows(ids.numel(), model.config.n_ctx, stride), progress)
    return result_from(nats, tokens, text)


def encode_for_scoring(model, text: str, stride: int | None) -> tuple[torch.Tensor, int]:
    """``text``'s token ids ``[N]`` (int64) and the checked stride (default n_ctx // 2).

    Raises:
        ValueError: stride outside ``[1, n_ctx]`` or fewer than 2 tokens.
    """
    n_ctx = model.config.n_ctx
    stride = n_ctx // 2 if stride is None else stride
    if not 1 <= stride <= n_ctx:
        raise ValueError(f"stride={stride} must be in [1, n_ctx={n_ctx}]")
    ids = torch.tensor(tokenizer_for(model.config).encode(text), dtype=torch.long)
    if ids.numel() < 2:
        raise ValueError(f"text encodes to {ids.numel()} token(s); need at least 2 to measure perplexity")
    return ids, stride


def strided_windows(N: int, n_ctx: int, stride: int) -> list[tuple[int, int, int]]:
    """The windows over ``N`` tokens as ``(begin, prev, end)``: inputs ``ids[begin:end-1]`` (at
    most n_ctx), scoring targets ``prev … end-1``. The first window scores up to n_ctx targets,
    every later one ``stride``; together they score targets ``1 … N-1`` exactly once."""
    windows, prev = [], 1                                      # prev: next target index to score
    while prev < N:
        end = min(prev + (n_ctx if prev == 1 else stride), N)   # score targets prev … end-1
        windows.append((max(0, end - 1 - n_ctx), prev, end))   # inputs begin … end-2 (<= n_ctx)
        prev = end
    return windows


@torch.inference_mode()
def score_windows(model, ids: torch.Tensor, windows, progress: bool = False) -> tuple[float, int]:
    """Summed next-token loss (nats, float64 sum of per-window float32 sums) and number of
    targets scored over ``windows`` (from :func:`strided_windows`) of ``ids [N]``; ``progress``:
    a bar of the windows on stderr (when it is a terminal).

    Raises:
        NonFiniteLogitsError: a window's scored logits hold NaN or +inf (checked when its loss
            is not finite, naming the window's tokens).
    """
    total_nats, tokens = 0.0, 0
    for begin, prev, end in progress_bar(windows, desc="perplexity", unit="window", enabled=progress):
        logits = model(ids[None, begin:end - 1], last_only=False).logits[0]  # predicts begin+1 … end-1
        n = end - prev
        nats = F.cross_entropy(logits[-n:].float(), ids[end - n:end], reduction="sum").item()
        if not math.isfinite(nats):                                     # NaN/+inf logits: no loss to report
            check_logits(logits[-n:], on=f"the window of tokens {begin}..{end - 1}")
        total_nats += nats
        tokens += n
    return total_nats, tokens


def result_from(total_nats: float, scored: int, text: str) -> PerplexityResult:
    """:class:`PerplexityResult` from summed nats over ``scored`` tokens of ``text``."""
    n_bytes = len(text.encode("utf-8"))
    loss = total_nats / scored
    return PerplexityResult(loss, math.exp(loss), total_nats / (math.log(2) * n_bytes), scored, n_bytes)


def distributed_perplexity(model, text: str, stride: int | None = None, progress: bool = False):
    """:func:`perplexity` with the strided windows dealt round-robin over the
    ranks (rank r scores windows r, r+N, …); the summed nats and token counts are all-reduced in
    float64, so every rank returns the single-process figure (up to summation order, ~1e-15).
    ``progress``: rank 0 shows a bar of its windows on stderr (when it is a terminal).

    Raises:
        ValueError, NonFiniteLogitsError: as :func:`perplexity`.
    """
    ids, stride = encode_for_scoring(model, text, stride)
    ids = ids.to(next(model.parameters()).device)
    di = distributed.info()
    windows = strided_windows(ids.numel(), model.config.n_ctx, stride)[di.rank::di.world_size]
    nats, tokens = score_windows(model, ids, windows, progress and di.is_main)
    nats, tokens = distributed.all_reduce_sum([nats, tokens], device=di.device if di.backend == "nccl" else None)
    return result_from(nats, int(tokens), text)
