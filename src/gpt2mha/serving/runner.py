"""The model side of serving: one KV cache of slots, prefill, decode steps and sampling.

:class:`Runner` owns the decode view of the model (:func:`gpt2mha.inference.fast.for_decoding`,
built once) and ONE :class:`~gpt2mha.core.kv_cache.KVCache` of ``slots`` rows: row ``s`` holds
the sequence in slot ``s``, from cache index 0 at its own length. The scheduler
(:mod:`.scheduler`) decides which slot each sequence takes and asks for:

- :meth:`Runner.open`: the slot's sampler (``sample_next``'s arguments and its own generator);
- :meth:`Runner.prefill`: new prompts into their slots (:func:`prefill_row`: each prompt alone,
  written in place from index 0, as :func:`gpt2mha.inference.generate.generate` prefills each
  of a list of prompts), and each one's first token;
- :meth:`Runner.decode`: one forward over rows ``0 … n-1`` (``n`` = highest slot asked + 1), idx
  ``[n, 1]``, each row at its own position over exactly its own keys (the cache plans it),
  and each asked slot's next token;
- :meth:`Runner.release`: the slot's row emptied;
- :meth:`Runner.score`: the model's log-probabilities of a prompt's own tokens (``echo`` with
  ``logprobs``), one forward of that prompt alone, apart from the slots.

Everything goes in and out as Python ints (slots, token ids): the scheduler never sees a
tensor. No row's numbers depend on the others (batch invariance): a prompt is prefilled alone,
a decode step attends each row over exactly its own keys (:attr:`CacheStep.groups
<gpt2mha.core.kv_cache.CacheStep.groups>`), and the decode view's products give a row the
same bits in a batch of any size, so a sequence's logits are those of ``generate`` for its
prompt alone, bit for bit. Each row is sampled from its row of logits with its own generator
(:func:`~gpt2mha.inference.sampling.sample_next`), so a sequence draws exactly as its prompt
alone in ``generate`` (one draw per token, the first from the prefill); greedy rows share one
argmax. A fault while sampling one row is returned as that row's result, not raised.

A slot opened with penalties or a logit bias samples from adjusted logits
(:func:`~gpt2mha.inference.sampling.adjust_logits`, its generated tokens counted here), as
``generate`` does with the same arguments. A slot opened with ``logprobs=k`` also gets each
token's log-probability and the k most probable ids (:attr:`Runner.logprobs`), always from the
model's raw logits (``log_softmax``, before penalties, bias, temperature and filtering: the
model's distribution, as OpenAI reports it and as lm-evaluation-harness needs for its scores).

Sources: continuous batching over a static cache with one indexed write per step, as in Orca
(Yu et al., OSDI 2022), vLLM and gpt-fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import checks
from ..core.kv_cache import KVCache
from ..inference.fast import for_decoding, invariant_by_default
from ..inference.sampling import (MIN_TEMPERATURE, adjust_logits, bias_vector, check_finite, sample_next,
                                  token_logprobs)

#: One token's log-probability and the most probable ids with theirs: ``(logprob, [(id, logprob), ...])``.
TokenLogprob = tuple[float, list[tuple[int, float]]]


@dataclass
class Sampler:
    """How one slot draws its tokens: :func:`~gpt2mha.inference.sampling.sample_next`'s
    arguments and the slot's own generator (seeded once, one draw per token)."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    bias: torch.Tensor | None = None          # [vocab_size] float32, or None
    counts: torch.Tensor | None = None        # [1, vocab_size]: generated tokens, when a penalty is set
    logprobs: int | None = None               # report each token's logprob and this many top ids

    @property
    def greedy(self) -> bool:
        """Whether this is argmax (temperature 0, or below what float32 can divide by)."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def adjusted(self) -> bool:
        """Whether the logits are adjusted (penalties or a bias) before sampling."""
        return self.counts is not None or self.bias is not None


def prefill_row(model, cache: KVCache, row: int, prompt: list[int]) -> torch.Tensor:
    """One forward over ``prompt`` alone, written into row ``row`` of ``cache`` from index 0
    (:meth:`KVCache.row`): the same call, shapes and numbers as ``generate`` prefills that prompt with.

    Args:
        model: the decode view of a GPT-2 (its inputs are not checked again).
        cache: the slots' cache; ``row`` must be empty (length 0).
        prompt: token ids, non-empty, within the vocabulary and context.

    Returns:
        The last position's logits ``[1, n_vocab]`` (float32).
    """
    ids = torch.tensor([prompt], dtype=torch.long, device=cache.k.device)             # [1, T]
    return model(ids, cache=cache.row(row), last_only=True, validate=False).logits[:, -1]


class Runner:
    """Runs the model for the serving scheduler over one slotted KV cache.

    Args:
        model: a :class:`~gpt2mha.core.model.GPT2` (float or quantized; put in eval mode and
            used only through its decode view from then on).
        slots: rows of the cache, i.e. sequences decoded together at most (>= 1).
        vocab_size: sample only ids below it (the tokenizer's vocabulary; default the model's).
        batch_invariant: float32 products on a multiple of 4 rows, so each sequence's logits are
            bitwise ``generate``'s for its prompt alone (``generate(..., batch_invariant=)``, the
            same value); None: :func:`~gpt2mha.inference.fast.invariant_by_default`.

    Attributes:
        model: the model as given; ``decoder`` its decode view (shares every parameter).
        cache: the :class:`KVCache` ``[n_layer, slots, n_head, n_ctx, head_dim]``, in the
            model's dtype: ``2 · n_layer · slots · n_ctx · n_embd`` values (1.2 GB for 124M in
            float32 with 16 slots; 38 MB for the built-in model).

    Raises:
        ValueError: slots < 1, a vocab_size outside ``[1, n_vocab]``, a batch_invariant that is
            not True, False or None.
    """

    def __init__(self, model, slots: int, vocab_size: int | None = None, batch_invariant: bool | None = None):
        c = model.config
        slots = checks.as_int(slots, "slots", minimum=1)
        vocab_size = c.n_vocab if vocab_size is None else checks.as_int(vocab_size, "vocab_size", minimum=1)
        if vocab_size > c.n_vocab:
            raise ValueError(f"vocab_size={vocab_size} must be in [1, n_vocab={c.n_vocab}]")
        self.model = model.eval()
        if batch_invariant is None:
            batch_invariant = invariant_by_default(self.model)
        self.decoder = for_decoding(self.model, batch_invariant=checks.flag(batch_invariant, "batch_invariant"))
        p = self.model.wte.weight
        self.device = p.device
        self.cache = KVCache(c.n_layer, slots, c.n_head, c.n_ctx, c.head_dim, dtype=p.dtype, device=p.device)
        self.vocab_size = vocab_size
        self.samplers: list[Sampler | None] = [None] * slots
        self.last: list[int] = [0] * slots                     # each slot's newest token: its next input
        self.steps: list[int] = [0] * slots                    # tokens each slot has sampled (for errors)
        #: each slot's newest token's :data:`TokenLogprob` (None unless opened with ``logprobs``)
        self.logprobs: list[TokenLogprob | None] = [None] * slots

    @property
    def slots(self) -> int:
        """Rows of the cache (the most sequences decoded together)."""
        return self.cache.batch_size

    def open(self, slot: int, seed: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, *,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0, logit_bias: dict[int, float] | None = None,
             logprobs: int | None = None) -> None:
        """Give ``slot`` its sampler: ``sample_next``'s arguments and a generator seeded with
        ``seed`` (in ``[0, 2**63)``) on the model's device. The row itself is filled by
        :meth:`prefill`.

        Args:
            presence_penalty, frequency_penalty, logit_bias: as
                :func:`~gpt2mha.inference.generate.generate` (checked by the caller: penalties in
                [-2, 2], bias ``{id below vocab_size: value in [-100, 100]}``).
            logprobs: None, or k >= 0: keep each sampled token's :data:`TokenLogprob` with the
                k most probable ids in :attr:`logprobs`.

        Raises:
            ValueError: the slot is out of range or in use (not released since it was opened).
        """
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot={slot} is out of range [0, {self.slots})")
        if self.samplers[slot] is not None:
            raise ValueError(f"slot={slot} is in use; release it first")
        generator = torch.Generator(device=self.device).manual_seed(seed)
        counts = (torch.zeros(1, self.vocab_size, dtype=torch.float32, device=self.device)
                  if presence_penalty or frequency_penalty else None)
        self.samplers[slot] = Sampler(temperature, top_k, top_p, generator, presence_penalty, frequency_penalty,
                                      bias_vector(logit_bias or {}, self.vocab_size, self.device), counts, logprobs)

    def release(self, slot: int) -> None:
        """Empty ``slot``: its row's length is 0 again and its sampler is dropped."""
        self.cache.reset(slot)
        self.samplers[slot] = None
        self.last[slot] = 0
        self.steps[slot] = 0
        self.logprobs[slot] = None

    @torch.inference_mode()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> list[int | Exception]:
        """Prefill ``prompts[i]`` into slot ``slots[i]`` (each opened first) and sample each
        one's first token from its row of the prefill's logits.

        Returns:
            one result per slot: the token id, or the exception its sampling raised.

        Raises:
            Exception: whatever the forward raised (nothing was written to the slots then).
        """
        logits = []
        try:
            for slot, prompt in zip(slots, prompts):
                logits.append(prefill_row(self.decoder, self.cache, slot, prompt))
        except Exception:
            for slot in slots:                                  # nothing half-written stays in a slot
                self.cache.reset(slot)
            raise
        return self._next_tokens(slots, torch.cat(logits), rows=range(len(slots)))

    @torch.inference_mode()
    def decode(self, slots: list[int]) -> list[int | Exception]:
        """One decode step for the sequences in ``slots`` (each prefilled, its last token
        known): one forward over rows ``0 … max(slots)`` with each row's newest token, then
        each asked slot's next token. Rows in between that were not asked (free slots: length
        0, they read only their own key) are computed and keep their length.

        Returns:
            one result per slot: the token id, or the exception its sampling raised.

        Raises:
            Exception: whatever the forward raised (then every asked slot has failed).
        """
        n = max(slots) + 1
        rows = self.cache.rows(n)
        before = rows.lengths
        ids = torch.tensor(self.last[:n], dtype=torch.long, device=self.device)[:, None]    # [n, 1]
        logits = self.decoder(ids, cache=rows, last_only=True, validate=False).logits[:, -1]   # [n, n_vocab]
        asked = set(slots)
        rows.trim([n_ + 1 if row in asked else n_ for row, n_ in enumerate(before)])   # the others keep theirs
        return self._next_tokens(slots, logits, rows=slots)

    def _next_tokens(self, slots: list[int], logits: torch.Tensor, rows) -> list[int | Exception]:
        """Slot ``slots[i]``'s next token from ``logits[rows[i]]`` (``logits [R, n_vocab]``), and
        its :data:`TokenLogprob` when the slot asked for them."""
        greedy = None
        out = []
        for slot, row in zip(slots, rows):
            try:
                s = self.samplers[slot]
                if s.greedy and not s.adjusted:
                    if greedy is None:                          # one argmax for every greedy row
                        ids = logits[:, :self.vocab_size].argmax(dim=-1)
                        greedy, top = ids.tolist(), logits.gather(-1, ids[:, None])   # a NaN is argmax's maximum
                    check_finite(top[row], self.steps[slot])
                    token = greedy[row]
                else:
                    token = self.sample(slot, logits[row:row + 1])
                if s.logprobs is not None:
                    chosen, top = token_logprobs(logits[row:row + 1, :self.vocab_size],
                                                 torch.tensor([token]), s.logprobs)
                    self.logprobs[slot] = (chosen[0], top[0])
                if s.counts is not None:
                    s.counts[0, token] += 1
                self.last[slot] = token
                self.steps[slot] += 1
                out.append(token)
            except Exception as e:                              # this row fails; the others go on
                out.append(e)
        return out

    def sample(self, slot: int, logits: torch.Tensor) -> int:
        """The next token of ``slot`` from its logits ``[1, n_vocab]``: ``sample_next`` with its
        sampler (ids below ``vocab_size`` only), after its penalties and bias."""
        s = self.samplers[slot]
        logits = logits[:, :self.vocab_size]
        if s.adjusted:
            logits = adjust_logits(logits, s.counts, s.presence_penalty, s.frequency_penalty, s.bias)
        return int(sample_next(logits, s.temperature, s.top_k, s.top_p, s.generator, step=self.steps[slot])[0])

    @torch.inference_mode()
    def score(self, prompt: list[int], k: int) -> list[TokenLogprob]:
        """The model's log-probability of each token of ``prompt`` after the ones before it, and
        the ``k`` most probable ids there: ``len(prompt) - 1`` entries, for tokens 1 … T-1
        (token 0 has no context). One forward of ``[1, T]`` through the decode view, without the
        cache and apart from every slot, so a prompt scores the same whatever else is running.

        Source: ``log_softmax`` of the logits at position t-1 read at token t, as the loss of
        :class:`~gpt2mha.core.model.GPT2` (and lm-evaluation-harness's ``loglikelihood``).
        """
        if len(prompt) < 2:
            return []
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        logits = self.decoder(ids, validate=False).logits[0, :-1, :self.vocab_size]      # [T-1, V]
        chosen, top = token_logprobs(logits, ids[0, 1:], k)
        return list(zip(chosen, top))
