"""A sequence the scheduler runs (:class:`Sequence`: a prompt being continued, from submission
to its finish) and the choice of the returned ones among a request's candidates
(:func:`pick_choices`: ``best_of``). Holds no tensor."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .params import SamplingParams
from .text_stream import TextStream


@dataclass(eq=False)
class Sequence:
    """One prompt being continued, from submission to its finish.

    ``on_event(seq, text, done)`` is called from the scheduler's thread with each new piece
    of text (never empty) and once with ``done=True`` (then :attr:`finish_reason` is
    ``"stop"``, ``"length"``, ``"cancelled"`` or ``"error"``, with :attr:`error` set for the last).
    The done event carries the text's last piece, sampled in the same step (empty when nothing
    is left: the end-of-text token, a stop string with no text held back, a failure), so that
    a stream's last text chunk carries the finish reason, as OpenAI's do.
    Before each call the count of tokens whose text has been sent (:meth:`TextStream.released
    <gpt2mha.inference.text_stream.TextStream.released>`) is appended to :attr:`marks`, so the
    k-th event covers ``tokens[marks[k-1]:marks[k]]`` (for streamed logprobs).

    ``index`` is its place among the request's sequences (``prompt_index · per_prompt + j``);
    ``logprobs`` holds one :data:`~gpt2mha.inference.engine.TokenLogprob` per generated token when
    asked (or ranked), ``prompt_logprobs`` one per prompt token after the first with ``echo``.
    """

    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[["Sequence", str, bool], None]
    index: int = 0
    prompt_index: int = 0
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    marks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    slot: int | None = None
    cancelled: bool = False
    t_submit: float = 0.0
    t_admit: float | None = None
    t_first: float | None = None
    t_last: float | None = None
    t_end: float | None = None
    cached_tokens: int = 0
    stream: TextStream | None = None
    adapter: int | None = None                  # the LoRA adapter's index (inference/lora.py; None: the base)
    exception: Exception | None = None          # what failed it (finish_reason "error")
    sliding: bool = False                       # its context is full: each step recomputes its window

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def mean_logprob(seq: Sequence) -> float:
    """``best_of``'s ranking: the mean log-probability of the sequence's generated tokens (the
    model's raw distribution; 0 for none)."""
    return sum(e[0] for e in seq.logprobs) / len(seq.logprobs) if seq.logprobs else 0.0


def pick_choices(seqs: list[Sequence]) -> list[tuple[int, Sequence]]:
    """``(choice index, sequence)`` of a finished request: with ``best_of > n`` the n candidates
    of each prompt with the highest :func:`mean_logprob` (ties: the earlier candidate), indexed
    ``prompt_index · n + rank``; otherwise every sequence at its own index."""
    params = seqs[0].params
    if not params.ranked:
        return [(s.index, s) for s in seqs]
    out = []
    for i in sorted({s.prompt_index for s in seqs}):
        group = sorted((s for s in seqs if s.prompt_index == i), key=lambda s: (-mean_logprob(s), s.index))
        out.extend((i * params.n + r, s) for r, s in enumerate(group[:params.n]))
    return out
