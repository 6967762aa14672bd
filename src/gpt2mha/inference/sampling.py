"""Sampling the next token, as OpenAI's ``sample_sequence`` (``src/sample.py``) does.

``logits / temperature``, then top-k (keep logits >= the k-th largest), then top-p (keep the
largest logits whose cumulative probability stays within p, at least one), optionally min-p
(keep tokens at least ``min_p`` times as probable as the most probable one), then a draw.
Each row of a batch may draw from its own generator, seeded by :func:`row_seed`, so a row
samples exactly as its prompt alone.

Before all of that the raw logits may be adjusted (:meth:`RowSampler.adjust`), in this order:

1. ``repetition_penalty`` over the prompt's and the generated tokens
   (:func:`repetition_penalty_logits`, transformers' and vLLM's; vLLM applies it before its
   frequency and presence penalties too);
2. OpenAI's presence/frequency penalties for the tokens generated so far, then ``logit_bias``
   added per token id (:func:`adjust_logits`);
3. bans, -inf: a token that would repeat an n-gram (``no_repeat_ngram_size``,
   :func:`ngram_bans`), and the end-of-text and stop tokens before ``min_tokens`` new tokens;
4. ``structured_outputs``' mask, -inf: every token its grammar does not accept next
   (:mod:`~gpt2mha.inference.structured`; where vLLM applies its grammar bitmask too, before
   temperature and the filters, so that top-k/top-p/min-p choose among allowed tokens only).

Each field alone equals transformers' processor and vLLM's. transformers and vLLM add
``logit_bias`` before the repetition penalty; here the OpenAI adjustments keep their place (and
their bits) after it, so ``logit_bias`` with ``repetition_penalty`` gives ``l/r + b`` where they
give ``(l + b)/r`` (for a positive logit): the same bans (-100) and forcings (+100), other
biases scaled differently.

Log-probabilities reported to users (:func:`token_logprobs`) are the model's own,
``log_softmax`` of the raw logits, untouched by any of these.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .params import MIN_TEMPERATURE, SamplingParams


def row_seed(seed: int, row: int) -> int:
    """The seed of row ``row``'s generator when a batch is sampled with ``seed``.

    Row 0 uses ``seed`` itself, so a one-prompt call samples exactly as before and row i of a
    batch samples as that prompt alone with ``row_seed(seed, i)``; other rows take seeds spread
    by the 64-bit golden-ratio constant, in ``[0, 2**63)``.
    """
    return seed if row == 0 else (seed + row * 0x9E3779B97F4A7C15) % 2**63


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


class NonFiniteLogitsError(RuntimeError):
    """The model's logits hold NaN or +inf (or no finite value) where a token is to be chosen
    or scored: its weights or its inputs hold NaN/inf, or its activations overflow (e.g. the
    attention's scores ``q · k``). No token can be chosen from them (greedy would pick an
    arbitrary id, a draw has no distribution), and no loss, probability or effect computed from
    them means anything."""


def check_finite(top: torch.Tensor, step: int | None = None, rows: list[int] | None = None,
                 what: str = "logits", on: str = "") -> None:
    """Raises :class:`NonFiniteLogitsError` naming ``step`` and the rows unless every row's
    largest logit ``top [B]`` (or ``[B, 1]``) is finite. NaN anywhere in a row makes its
    maximum NaN, +inf makes it +inf, so one reduction, which the sampler computes anyway,
    checks the whole row. ``rows``: the rows' names in the message (default their indices;
    ``[]``: none); ``what``: what the values are (default logits); ``on``: what the model ran
    on (e.g. ``"PROMPT"``), named in the message."""
    ok = torch.isfinite(top).flatten()
    if not bool(ok.all()):
        bad = (~ok).nonzero().flatten().tolist()
        names = bad if rows is None else [rows[i] for i in bad] if rows else []
        at = "" if step is None else f" at step {step}"
        where = f" (rows {names})" if names else ""
        raise NonFiniteLogitsError(f"the model produced NaN or infinite {what}{f' on {on}' if on else ''}{at}{where}; "
                                   f"its weights or inputs hold NaN/inf, or its activations overflow")


def check_logits(logits: torch.Tensor, what: str = "logits", on: str = "") -> torch.Tensor:
    """``logits [..., V]`` unchanged when each row along the last axis has a finite maximum
    (:func:`check_finite`: no NaN, no +inf, not all -inf); the check of every command that
    runs a model (``generate`` through the sampler, ``perplexity``, ``ablate``, ``patch``,
    ``lens``, ``heads``).

    Raises:
        NonFiniteLogitsError: a row is not finite (the message names ``what`` and ``on``).
    """
    check_finite(logits.detach().amax(dim=-1), rows=[], what=what, on=on)
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | list[torch.Generator] | None = None, min_p: float = 0.0,
                step: int | None = None, rows: list[int] | None = None) -> torch.Tensor:
    """Next token ids ``[B]`` (int64) from last-position logits ``[B, V]``.

    Temperature 0 (or below :data:`MIN_TEMPERATURE`) is argmax. Logits are shifted by their row
    maximum before dividing by the temperature (softmax does not change), so a tiny temperature
    cannot overflow to inf. Then top-k, top-p and min-p filtering, in that order (transformers'
    order). ``generator`` is one generator for the whole batch, or a list with one per row (row
    i drawn from ``generator[i]``, as if sampled alone). ``step``: which new token this is
    (0-based), and ``rows``: the rows' names, for the error message (:func:`check_finite`).

    Raises:
        NonFiniteLogitsError: a row's logits hold NaN or +inf (:func:`check_finite`).
    """
    logits = logits.float()
    if temperature < MIN_TEMPERATURE:
        ids = logits.argmax(dim=-1)                                          # a NaN is argmax's maximum
        check_finite(logits.gather(-1, ids[:, None]), step, rows)
        return ids
    top = logits.amax(dim=-1, keepdim=True)
    check_finite(top, step, rows)
    logits = (logits - top) / temperature                                    # <= 0: no overflow
    logits = min_p_logits(top_p_logits(top_k_logits(logits, top_k), top_p), min_p)
    probs = torch.softmax(logits, dim=-1)
    if isinstance(generator, (list, tuple)):
        return torch.cat([torch.multinomial(probs[i:i + 1], 1, generator=g) for i, g in enumerate(generator)]).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)




def bias_vector(bias: dict[int, float], vocab_size: int, device) -> torch.Tensor | None:
    """A checked ``{id: bias}`` as a dense float32 ``[vocab_size]`` tensor (None when empty)."""
    if not bias:
        return None
    vec = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    vec[torch.tensor(list(bias), dtype=torch.long, device=device)] = torch.tensor(
        list(bias.values()), dtype=torch.float32, device=device)
    return vec


def repetition_penalty_logits(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """``logits [B, V]`` (float32) with every logit where ``seen [B, V]`` (bool: the token is in
    the prompt or was generated) divided by ``penalty`` when positive, multiplied by it when
    negative; a new tensor (``penalty`` 1: ``logits`` itself).

    Source: transformers' ``RepetitionPenaltyLogitsProcessor`` (the same float32 operations, so
    the same bits), vLLM's ``repetition_penalty``; CTRL (Keskar et al. 2019).
    """
    if penalty == 1:
        return logits
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def ngram_bans(ngrams: dict, history: list[int], n: int) -> set[int]:
    """The tokens that would complete an n-gram already in ``history``: those that followed the
    last ``n - 1`` tokens of ``history`` before (``ngrams``: each ``(n-1)``-tuple of ``history``
    → the set of tokens that followed it, :meth:`RowSampler.accept` keeps it). n = 1: every
    token in ``history``. Source: transformers' ``NoRepeatNGramLogitsProcessor`` (over the whole
    ``input_ids``: the prompt and the tokens generated)."""
    if n == 0 or len(history) < n:
        return set()
    return ngrams.get(tuple(history[len(history) - n + 1:]), set())


def add_ngram(ngrams: dict, history: list[int], n: int) -> None:
    """Record the n-gram that ends ``history``'s last token (none while it holds fewer than n)."""
    if len(history) >= n:
        ngrams.setdefault(tuple(history[len(history) - n:-1]), set()).add(history[-1])


class NoTokenAllowedError(ValueError):
    """Every token of the vocabulary is banned (by ``no_repeat_ngram_size`` and ``min_tokens``):
    there is nothing to sample."""


def adjust_logits(logits: torch.Tensor, counts: torch.Tensor | None = None, presence_penalty: float = 0.0,
                  frequency_penalty: float = 0.0, bias: torch.Tensor | None = None) -> torch.Tensor:
    """OpenAI's adjustments of the raw logits before sampling (float32 ``[B, V]`` → same):

    ``logits[j] - counts[j] * frequency_penalty - (counts[j] > 0) * presence_penalty + bias[j]``

    where ``counts [B, V]`` is how often each token was generated so far in that row (the prompt
    does not count) and ``bias [V]`` a dense :func:`bias_vector`. Source: OpenAI's API reference,
    "Parameter details" of frequency and presence penalties (its ``mu[j] -> mu[j] - c[j] *
    alpha_frequency - float(c[j] > 0) * alpha_presence``), and ``logit_bias``. Nothing given:
    ``logits`` itself.
    """
    logits = logits.float()
    if counts is not None and (presence_penalty or frequency_penalty):
        counts = counts.to(logits.dtype)
        logits = logits - counts * frequency_penalty - (counts > 0).to(logits.dtype) * presence_penalty
    if bias is not None:
        logits = logits + bias
    return logits


#: The log-probability reported for a token of probability 0 (a logit of -inf): JSON has no
#: -Infinity, and vLLM's server reports -9999.0 the same way.
MIN_LOGPROB = -9999.0


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The model's log-probabilities of ``tokens`` and the ``k`` most probable ids, per row.

    Args:
        logits: raw logits ``[R, V]`` (any float dtype; computed in float32).
        tokens: ``[R]`` ids, the token chosen at each row.
        k: how many of the most probable ids to list (0 … V).

    Returns:
        ``(chosen, top)``: ``chosen[r]`` = ``log_softmax(logits[r])[tokens[r]]`` and ``top[r]``
        the ``(id, logprob)`` pairs of the ``k`` largest, most probable first, plus the chosen
        token when it is not among them (as OpenAI's ``logprobs``: "the API will always return
        the logprob of the sampled token"). All values come from one float32 ``log_softmax``, so
        a chosen token that is the argmax has a logprob exactly equal to ``top[r][0]``'s. A token
        of probability 0 (logit -inf) is reported at :data:`MIN_LOGPROB`.

    Raises:
        NonFiniteLogitsError: a row's logits hold NaN or +inf.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)                  # [R, V]
    check_finite(lp.amax(dim=-1), rows=[])                          # NaN/+inf: no distribution to report
    lp = lp.clamp_(min=MIN_LOGPROB)                                 # a banned (-inf) token: JSON has no -inf
    chosen = lp.gather(-1, tokens.view(-1, 1).to(lp.device)).squeeze(-1).tolist()
    top = []
    if k > 0:
        values, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
        pairs = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        pairs = [[] for _ in chosen]
    for row, (token, logprob) in enumerate(zip(tokens.tolist(), chosen)):
        if all(i != token for i, _ in pairs[row]):
            pairs[row].append((token, logprob))
        top.append(pairs[row])
    return chosen, top


class RowSampler:
    """One sequence's sampler, the one ``generate()`` and the server both use: its
    :class:`~gpt2mha.inference.params.SamplingParams`, its own generator, the counts of the
    tokens it generated (for the penalties), its ``logit_bias`` as a dense vector, and, for
    ``repetition_penalty`` and ``no_repeat_ngram_size``, the tokens of its prompt and generated.

    Args:
        params: how to sample (checked; its logit_bias ids below ``vocab_size``).
        seed: this row's seed (``row_seed(params.seed, index)``), or None for torch's global
            generator.
        vocab_size: ids below it are sampled (the logits given are cut to it).
        device: the logits' device.
        logprobs: None, or k: :meth:`sample` records each token's log-probability and the k most
            likely ids in :attr:`last_logprob` (``(logprob, [(id, logprob), …])``).
        row: the batch row an error names (``generate``'s), or None.
        eos_token_id: the end-of-text id that ``min_tokens`` bans with ``stop_token_ids`` (None:
            none; ignored with ``ignore_eos``).
        prompt: the tokens before the first one sampled (:meth:`begin`), or None to give them later.
        grammar: with ``params.structured_outputs``, its
            :class:`~gpt2mha.inference.structured.Grammar` compiled for the tokenizer (this row
            takes its own state of it); None without.

    Attributes:
        steps: tokens sampled so far (the step a :class:`NonFiniteLogitsError` names).
        begun: whether :meth:`begin` has been given the prompt.
        grammar: this row's :class:`~gpt2mha.inference.structured.GrammarState`, or None.

    Raises:
        ValueError: ``params.structured_outputs`` without a ``grammar``.
    """

    def __init__(self, params: SamplingParams, seed: int | None, vocab_size: int, device, logprobs: int | None = None,
                 row: int | None = None, eos_token_id: int | None = None, prompt=None, grammar=None):
        self.params, self.vocab_size, self.logprobs = params, vocab_size, logprobs
        self.label = [] if row is None else [row]               # the row an error names (generate's batch row)
        self.generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
        self.bias = bias_vector(dict(params.logit_bias), vocab_size, device)
        penalized = params.presence_penalty or params.frequency_penalty
        self.counts = torch.zeros(1, vocab_size, dtype=torch.float32, device=device) if penalized else None
        self.seen = torch.zeros(1, vocab_size, dtype=torch.bool, device=device) if params.repetition_penalty != 1 \
            else None
        eos = () if eos_token_id is None or params.ignore_eos else (eos_token_id,)
        self.ends = {t for t in (*params.stop_token_ids, *eos) if t < vocab_size}      # what min_tokens bans
        self.history: list[int] | None = [] if params.no_repeat_ngram_size else None
        self.ngrams: dict = {}
        self.steps = 0
        self.begun = False
        self.last_logprob = None
        if params.structured_outputs is not None and grammar is None:
            raise ValueError("structured_outputs needs its grammar compiled for the model's tokenizer "
                             "(gpt2mha.inference.structured.compile_for)")
        self.grammar = grammar.start() if params.structured_outputs is not None else None
        if prompt is not None:
            self.begin(prompt)

    def begin(self, prompt) -> None:
        """Take the prompt's token ids (a list or a 1-D tensor): ``repetition_penalty`` and
        ``no_repeat_ngram_size`` read them with the tokens generated."""
        self.begun = True
        if self.seen is None and self.history is None:
            return
        ids = [int(t) for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
        if self.seen is not None:
            kept = [t for t in ids if t < self.vocab_size]
            self.seen[0, torch.tensor(kept, dtype=torch.long, device=self.seen.device)] = True
        if self.history is not None:
            for t in ids:
                self.history.append(t)
                add_ngram(self.ngrams, self.history, self.params.no_repeat_ngram_size)

    def banned(self) -> set[int]:
        """The ids banned at this step: the n-grams' (``no_repeat_ngram_size``) and, before
        ``min_tokens`` new tokens, the end-of-text and stop tokens.

        Raises:
            NoTokenAllowedError: they are every id of the vocabulary.
        """
        p = self.params
        bans = set()
        if self.history is not None:
            bans = {t for t in ngram_bans(self.ngrams, self.history, p.no_repeat_ngram_size) if t < self.vocab_size}
        if self.steps < p.min_tokens:
            bans = bans | self.ends
        if len(bans) >= self.vocab_size:
            raise NoTokenAllowedError(f"no token can be sampled at step {self.steps}: no_repeat_ngram_size="
                                      f"{p.no_repeat_ngram_size} with min_tokens={p.min_tokens} bans all "
                                      f"{self.vocab_size} tokens of the vocabulary")
        return bans

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """The row's logits ``[1, V]`` after, in this order, its repetition penalty
        (:func:`repetition_penalty_logits`), its presence/frequency penalties and bias
        (:func:`adjust_logits`), its bans set to -inf (:meth:`banned`), and every token its
        grammar does not accept next set to -inf (``structured_outputs``; with ``ignore_eos``
        the end-of-text token too).

        Raises:
            NoTokenAllowedError: every token is banned, or the grammar allows none of those left.
            ValueError: the grammar's matcher failed (:meth:`GrammarState.allowed
                <gpt2mha.inference.structured.GrammarState.allowed>`).
        """
        p = self.params
        if not p.adjusted:
            return logits
        if self.seen is not None:
            logits = repetition_penalty_logits(logits.float(), self.seen, p.repetition_penalty)
        logits = adjust_logits(logits, self.counts, p.presence_penalty, p.frequency_penalty, self.bias)
        bans = self.banned()
        if self.grammar is not None:
            return self.mask(logits, bans)
        if bans:
            logits = logits.index_fill(-1, torch.tensor(sorted(bans), dtype=torch.long, device=logits.device),
                                       float("-inf"))
        return logits

    def mask(self, logits: torch.Tensor, bans: set[int]) -> torch.Tensor:
        """``logits [1, V]`` with -inf wherever the grammar does not accept the token next or
        ``bans`` holds it (a new tensor; this row's mask alone, the cost one bit mask of V bits).

        Raises:
            NoTokenAllowedError: no token is left.
        """
        allowed = self.grammar.allowed(self.vocab_size, end=not self.params.ignore_eos)      # bool [V]
        if bans:
            allowed[sorted(bans)] = False
        if not allowed.any():
            why = f" with the bans of no_repeat_ngram_size / min_tokens ({len(bans)} tokens)" if bans else ""
            raise NoTokenAllowedError(f"no token can be sampled at step {self.steps}: the structured output's "
                                      f"grammar allows none of the {self.vocab_size} tokens{why}")
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
            # NumPy's select over a view of the same memory: ~20 µs for 50,257 logits against
            # ~2 ms for masked_fill with 2 busy threads (each torch op starts the OpenMP team)
            return torch.from_numpy(np.where(allowed, logits.numpy(), np.float32(-np.inf)))
        keep = torch.from_numpy(allowed).to(logits.device)
        return logits.masked_fill(~keep, float("-inf"))

    @property
    def complete(self) -> bool:
        """Whether this row's grammar is complete (``structured_outputs``: nothing can follow,
        or its end token was taken): the sequence ends here, finish reason ``"stop"``."""
        return self.grammar is not None and self.grammar.complete

    def sample(self, logits: torch.Tensor) -> int:
        """The next token from this row's raw logits ``[1, V']`` (cut to ``vocab_size``):
        :meth:`draw`, then :meth:`accept`.

        Raises:
            NonFiniteLogitsError: the logits hold NaN or inf.
        """
        logits = logits[:, :self.vocab_size]
        token = self.draw(logits)
        self.accept(logits, token)
        return token

    def draw(self, logits: torch.Tensor) -> int:
        """A token drawn from raw logits ``[1, V]`` (penalties, bias, temperature, filters, this
        row's generator), recording nothing.

        Raises:
            NonFiniteLogitsError: the logits hold NaN or inf.
        """
        p = self.params
        return int(sample_next(self.adjust(logits), p.temperature, p.top_k, p.top_p, self.generator, p.min_p,
                               step=self.steps, rows=self.label)[0])

    def accept(self, logits: torch.Tensor | None, token: int) -> None:
        """Record ``token``, chosen from raw ``logits [1, V]``: its count, its logprobs, its
        n-gram, its grammar's next state, the step (``logits`` is read only for the logprobs:
        None without them).

        Raises:
            ValueError: the row's grammar does not allow ``token`` here (nothing is recorded)."""
        if self.grammar is not None:
            self.grammar.accept(token)
        if self.logprobs is not None:
            chosen, top = token_logprobs(logits[:, :self.vocab_size], torch.tensor([token]), self.logprobs)
            self.last_logprob = (chosen[0], top[0])
        if self.counts is not None:
            self.counts[0, token] += 1
        if self.seen is not None:
            self.seen[0, token] = True
        if self.history is not None:
            self.history.append(token)
            add_ngram(self.ngrams, self.history, self.params.no_repeat_ngram_size)
        self.steps += 1


def argmax_rows(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Each row's argmax of ``logits [R, V]`` and the logit there, as Python lists: the first
    maximal index, a NaN counting as the maximum (``torch.argmax`` and ``numpy.argmax`` agree on
    both). On the CPU in float32, NumPy's argmax over a view of the same memory: ~6 µs for
    50,257 logits against ~58 µs for ``torch.argmax`` with 2 threads (its reduction starts the
    OpenMP team), 1-2% of an int4 124M step; elsewhere torch's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        a = logits.numpy()                                      # no copy: a strided view
        ids = a.argmax(axis=-1)
        return ids.tolist(), a[np.arange(a.shape[0]), ids].tolist()
    ids = logits.argmax(dim=-1)
    return ids.tolist(), logits.gather(-1, ids[:, None])[:, 0].tolist()


def sample_rows(samplers: list[RowSampler], logits: torch.Tensor, rows) -> list[int | Exception]:
    """Each sampler's next token from its row of ``logits [R, V]`` (``rows[i]`` for
    ``samplers[i]``): the token id, or the exception its sampling raised (that row alone fails).
    Greedy rows without penalties or bias share one argmax over the batch (the same ids as
    alone: an argmax reads only its row)."""
    greedy = top = None
    out: list[int | Exception] = []
    for s, row in zip(samplers, rows):
        try:
            if s.params.greedy and not s.params.adjusted:
                if greedy is None:
                    greedy, top = argmax_rows(logits[:, :s.vocab_size])
                if not math.isfinite(top[row]):                 # a NaN is argmax's maximum
                    check_finite(torch.tensor([top[row]]), s.steps, s.label)
                token = greedy[row]
            else:
                token = s.draw(logits[row:row + 1, :s.vocab_size])
            s.accept(logits[row:row + 1] if s.logprobs is not None else None, token)
            out.append(token)
        except Exception as e:                                  # this row fails; the others go on
            out.append(e)
    return out
