"""Continuous batching: the queue, the slots and the loop that decides what runs: the one
driver of the :class:`~gpt2mha.inference.engine.Engine`. The server runs it continuously, in a
thread of its own (:meth:`Scheduler.start`); ``generate()`` runs it to completion in the
caller's thread (:meth:`Scheduler.run_until_idle`: every sequence submitted at once, admitted in
order in the first step), so a sampling option, a stop rule or the sliding window acts the same
offline, in the CLI and served.

The loop (:meth:`Scheduler.step`):

1. free the slots of cancelled sequences;
2. admit waiting sequences into free slots: each gets a slot and a seed, then each is
   prefilled alone, in its slot, by the :class:`~gpt2mha.inference.engine.Engine` (the one
   ``generate()`` runs, on the route it takes), which samples its first token;
3. one decode step for every running sequence at once (:meth:`Engine.decode
   <gpt2mha.inference.engine.Engine.decode>`: each row at its own position, attending only to its
   own keys); a sequence with ``sliding_window`` whose row of the cache is full is computed
   alone over its last ``n_ctx`` tokens, positions restarting at 0, from then on;
4. turn each new token into UTF-8-safe text (:class:`~gpt2mha.inference.text_stream.TextStream`),
   send it, and free the slot of every sequence that finished (length, end of text, a stop
   string, a ``structured_outputs`` grammar that is complete: ``"stop"``, even at its
   ``max_tokens``-th token) at once.

A sequence's logits are, bit for bit, the ones ``generate`` computes for its prompt alone,
whatever else runs beside it, in whichever slot, admitted whenever (batch invariance: the
engine prefills it alone and computes nothing of a row from the other rows; float32 weights
need ``batch_invariant=True``), and it is sampled with a generator seeded with its seed: its
greedy or seeded text is ``generate``'s. A request of P prompts with ``n`` choices each
(``best_of`` candidates when given) is P·m sequences, m = best_of or n; sequence ``i·m + j``
(prompt i, candidate j) is seeded ``row_seed(seed, i·m + j)``, as row ``i·m + j`` of
``generate`` over the prompts each repeated m times (``gpt2mha generate P1 P2 …
--num-samples m --seed S``).

This module holds no tensor: the engine takes and returns slots and token ids.

Sources: continuous ("iteration-level") batching as in Orca (Yu et al., OSDI 2022) and vLLM.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from dataclasses import replace
from typing import Callable

from ..core import checks
from .decoders import Route
from .engine import Engine
from .prompts import as_prompts
from .params import SamplingParams
from .prefix_cache import PrefixCache, default_budget_mb
from .sampling import row_seed
from .threads import adopt_threads, release_openmp_workers
from .sequence import Sequence
from .text_stream import CANCELLED, ERROR, LENGTH, STOP, TextStream

log = logging.getLogger("gpt2mha.serve")

#: Seconds of recent steps that :meth:`Scheduler.stats`'s tokens per second is measured over.
RATE_WINDOW_S = 10.0


class QueueFull(Exception):
    """More sequences were submitted than free slots plus room in the queue right now (HTTP 429:
    retry later)."""


class ExceedsCapacity(ValueError):
    """More sequences in one submission than the scheduler can ever hold at once
    (``max_batch + max_queue``): retrying cannot help (HTTP 400)."""


class ShuttingDown(Exception):
    """The scheduler is stopping and takes no new work (HTTP 503)."""


class Scheduler:
    """Owns the queue of waiting sequences and the slots of running ones, and an
    :class:`~gpt2mha.inference.engine.Engine` (the model, its route and its cache, one row per
    slot: the engine ``generate()`` runs too); one thread runs :meth:`step` in a loop.

    Args:
        model: a :class:`~gpt2mha.core.model.GPT2` (put in eval mode; used only by this scheduler).
        tokenizer: its tokenizer (for text and, with BPE, the end-of-text token that stops a
            sequence with finish_reason ``"stop"``); None: no text (sequences with stop strings
            or structured outputs are refused; ``generate()`` without them).
        max_batch: slots, i.e. sequences decoded together at most (>= 1).
        max_queue: sequences that may wait for a slot beyond the free ones (>= 0); more is
            refused with :class:`QueueFull`.
        batch_invariant: as :class:`~gpt2mha.inference.engine.Engine` (None: on unless the block
            weights are float32).
        route: the decoder (:func:`~gpt2mha.inference.decoders.choose_decoder`; None: chosen for
            the model as ``generate`` chooses it).
        prefix_cache_mb: the prefix cache's budget in MiB
            (:class:`~gpt2mha.inference.prefix_cache.PrefixCache`; None: sized from the memory
            available, :func:`~gpt2mha.inference.prefix_cache.default_budget_mb`; 0: no prefix
            cache). On a route that cannot keep a suffix's bits it is off whatever the budget
            (``engine.prefix_cache_off`` says why).
        engine: run this :class:`~gpt2mha.inference.engine.Engine` (``generate()`` makes one
            over a cache sized for its call) instead of making one: its slots are ``max_batch``,
            its route, prefix cache and ``eos_token_id`` are the ones used (the arguments for
            them are ignored).
        draw_seeds: a sequence without a seed draws a random one of its own (the server); False:
            it samples from torch's global generator (``generate()``'s rule, so that
            ``torch.manual_seed`` fixes its tokens).

    Attributes:
        after_tokens: None, or a function called (in the loop's thread) after each engine call
            that sampled tokens: the admissions' prefills of a step, then its decode step
            (``generate()``'s ``on_token``).
        log_failures: whether a failed sequence is logged (``generate()`` raises its exception
            instead).

    Memory: see :class:`~gpt2mha.inference.engine.Engine` (38 MB of cache for the built-in model
    with 16 slots, 1.2 GB for 124M in float32).

    Raises:
        ValueError: max_batch < 1 or max_queue < 0.
    """

    def __init__(self, model, tokenizer, max_batch: int = 16, max_queue: int = 256,
                 batch_invariant: bool | None = None, route: Route | None = None,
                 prefix_cache_mb: float | None = None, engine: Engine | None = None, draw_seeds: bool = True):
        self.max_queue = checks.as_int(max_queue, "max_queue")
        self.draw_seeds = checks.flag(draw_seeds, "draw_seeds")
        self.tokenizer = tokenizer
        self.n_ctx, self.n_vocab = model.config.n_ctx, model.config.n_vocab
        if engine is None:
            self.max_batch = checks.as_int(max_batch, "max_batch", minimum=1)
            if prefix_cache_mb is None:
                prefix_cache_mb = default_budget_mb()
            store = PrefixCache(prefix_cache_mb) if prefix_cache_mb else None
            vocab = self.n_vocab if tokenizer is None else min(tokenizer.n_vocab, self.n_vocab)
            engine = Engine(model, self.max_batch, route, vocab_size=vocab, batch_invariant=batch_invariant,
                            eos_token_id=getattr(tokenizer, "eot_token", None), tokenizer=tokenizer,
                            prefix_cache=store)
        self.engine = engine
        self.max_batch = engine.slots
        self.after_tokens: Callable[[], None] | None = None
        self.log_failures = True
        self.slots: list[Sequence | None] = [None] * self.max_batch
        self.waiting: collections.deque[Sequence] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.counts = collections.Counter()          # finished sequences by finish_reason, tokens, steps
        self._recent = collections.deque()           # (time, tokens) of the last engine calls, for tokens/s
        self._recent_tokens = 0                      # the tokens _recent holds
        self._cancels = 0                            # cancellations the loop has not handled yet
        self._running: list[Sequence] | None = None  # the sequences in slots, in slot order (None: to list again)
        self._running_slots: list[int] = []
        self._sliding = False                        # whether one of them has sliding_window
        self._ready = threading.Event()              # set by warm_up
        #: what the sequences are reported to (:class:`~gpt2mha.serving.metrics.ServerMetrics`), or None
        self.metrics = None

    # ------------------------------------------------------------------------- app side
    def submit(self, prompts: list[list[int]], params: SamplingParams,
               on_event: Callable[[Sequence, str, bool], None], clip: bool = False,
               adapter: int | None = None) -> list[Sequence]:
        """Queue ``params.per_prompt`` sequences per prompt (all or none) and return them in
        order: prompt i's candidate j has ``index = i * per_prompt + j`` (its seed rule) and
        ``prompt_index = i``. With ``clip``, a prompt whose ``max_tokens`` goes past the context
        runs with ``max_tokens`` the room left (``n_ctx - len(prompt)``; its ``params`` say so),
        ending with finish_reason ``"length"`` where the context ends. A prompt with
        ``params.sliding_window`` may run past the context, and be longer than it (its last
        ``n_ctx`` tokens are prefilled). ``adapter``: the LoRA
        adapter they run with (an index of the model's :class:`~gpt2mha.inference.lora.LoraState`;
        None: the base model).

        Raises:
            ValueError: ``params`` not a :class:`~gpt2mha.inference.params.SamplingParams` (which
                checked its own fields), a logit_bias id outside the vocabulary, a
                ``structured_outputs`` grammar refused for this tokenizer
                (:class:`~gpt2mha.inference.params.GrammarError`), an empty prompt,
                ids that are not integers or outside the vocabulary, prompt + max_tokens
                longer than n_ctx without ``sliding_window`` (with ``clip``: a prompt longer than
                n_ctx; the caller checks these first for clear HTTP errors), or stop strings on a
                scheduler without a tokenizer.
            ExceedsCapacity: more prompts than :attr:`capacity`, i.e. never admissible.
            QueueFull: not enough free slots plus queue room for all of them now.
            ShuttingDown: after :meth:`stop`.
        """
        prompts = self._check(prompts, params, clip)
        now = time.monotonic()
        m = params.per_prompt
        seqs = [Sequence(ids, self._fitted(params, ids) if clip else params, on_event, index=i * m + j,
                         prompt_index=i, t_submit=now, adapter=adapter)
                for i, ids in enumerate(prompts) for j in range(m)]
        with self._cv:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            free = self.slots.count(None)
            if len(self.waiting) + len(seqs) > free + self.max_queue:
                self.counts["rejected"] += len(seqs)
                raise QueueFull(f"{len(self.waiting)} sequences wait for {self.max_batch} slots "
                                f"(max_queue={self.max_queue}); retry later")
            self.waiting.extend(seqs)
            self._cv.notify()
        return seqs

    def _fitted(self, params: SamplingParams, ids: list[int]) -> SamplingParams:
        """``params`` with ``max_tokens`` at most the room ``ids`` leave in the context."""
        room = self.n_ctx - len(ids)
        return params if params.max_tokens <= room or params.sliding_window else replace(params, max_tokens=room)

    def _check(self, prompts, params: SamplingParams, clip: bool = False) -> list[list[int]]:
        """:meth:`submit`'s checks; returns the prompts as lists of Python ints."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams; got {type(params).__name__}")
        params.check_vocab(self.engine.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={params.stop!r}: stop strings are found in the text, and this scheduler has no "
                             f"tokenizer")
        self.engine.grammar(params)                     # compiled (and kept) before any slot is taken
        m = params.per_prompt
        if len(prompts) * m > self.capacity:
            each = f" x {m} sequences each (best_of/n)" if m > 1 else ""
            raise ExceedsCapacity(f"{len(prompts)} prompts{each} in one request; this server holds at most "
                                  f"{self.capacity} sequences at once (max_batch={self.max_batch} running + "
                                  f"max_queue={self.max_queue} waiting), so it can never admit them: send at most "
                                  f"{self.capacity} per request")
        prompts = as_prompts(prompts)
        for i, ids in enumerate(prompts):
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if min(ids) < 0 or max(ids) >= self.n_vocab:
                raise ValueError(f"prompt {i} has ids outside [0, n_vocab={self.n_vocab})")
            if len(ids) + (0 if clip else params.max_tokens) > self.n_ctx and not params.sliding_window:
                raise ValueError(f"prompt {i}: {len(ids)} tokens + max_tokens={params.max_tokens} > n_ctx={self.n_ctx}")
        return prompts

    @property
    def capacity(self) -> int:
        """The most sequences that can be queued or running at once: ``max_batch + max_queue``."""
        return self.max_batch + self.max_queue

    @property
    def stopping(self) -> bool:
        """Whether :meth:`cancel_all` or :meth:`stop` was called (new work is refused)."""
        return self._stopping

    def cancel(self, seq: Sequence) -> None:
        """Stop ``seq``: its slot (or queue place) is freed at the next step, before any more
        decoding. No effect on a finished sequence."""
        if not seq.done:
            seq.cancelled = True
            with self._cv:
                self._cancels += 1
                self._cv.notify()

    def stats(self) -> dict:
        """Running/queued counts, slots, finished counts and generated tokens per second
        (over the last :data:`RATE_WINDOW_S` seconds). Every submitted sequence is counted in
        exactly one of queued, running, completed, cancelled and failed (a queued one cancelled
        stays queued until the loop's next step, which the cancel wakes)."""
        with self._cv:
            queued = len(self.waiting)
            self._forget_old(time.monotonic())
            running = sum(s is not None for s in self.slots)
            return dict(ready=self.ready, route=self.engine.route.decoder.name, running=running, queued=queued,
                        slots=self.max_batch, free_slots=self.max_batch - running,
                        max_queue=self.max_queue, tokens_per_second=round(self._recent_tokens / RATE_WINDOW_S, 2),
                        completed=self.counts[STOP] + self.counts[LENGTH], cancelled=self.counts[CANCELLED],
                        failed=self.counts[ERROR], rejected=self.counts["rejected"],
                        generated_tokens=self.counts["tokens"], decode_steps=self.counts["steps"],
                        prefix_cache=self.prefix_cache_stats())

    def describe_prefix_cache(self) -> str:
        """One line for the log: the prefix cache's budget, or why it is off."""
        store = self.engine.prefix_cache
        if store is None:
            return f"off ({self.engine.prefix_cache_off or '--no-prefix-cache'})"
        return f"on, {store.budget / 2**20:g} MiB, exact on the {self.engine.route.decoder.name}"

    def prefix_cache_stats(self) -> dict:
        """The prefix cache's ``{"queries", "hits", "blocks", "used_mb", "evictions"}`` (token
        counts; :meth:`~gpt2mha.inference.prefix_cache.PrefixCache.stats`), or ``{"off": why}``."""
        store = self.engine.prefix_cache
        if store is None:
            return {"off": self.engine.prefix_cache_off or "--no-prefix-cache"}
        return store.stats()

    def occupancy(self) -> tuple[int, int, float]:
        """``(running, queued, kv_cache_usage)`` now: sequences in a slot, sequences waiting for
        one, and the fraction (0-1) of the cache's ``max_batch × n_ctx`` positions that the
        running sequences' tokens hold (the ``/metrics`` gauges)."""
        with self._cv:
            lengths = self.engine.cache.lengths
            held = [lengths[s.slot] for s in self.slots if s is not None]
            return len(held), len(self.waiting), sum(held) / (self.max_batch * self.n_ctx)

    def _forget_old(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent_tokens -= self._recent.popleft()[1]

    # ----------------------------------------------------------------------- the thread
    @property
    def ready(self) -> bool:
        """Whether :meth:`warm_up` has run (the server's ``/health`` says ``"loading"`` until then)."""
        return self._ready.is_set()

    def warm_up(self) -> None:
        """Run the engine once (:meth:`~gpt2mha.inference.engine.Engine.warm_up`: its kernels
        loaded, a compiled step compiled, the prefix cache's exactness measured) so that no
        request pays for it, and log the route and the prefix cache."""
        if not self.ready:
            t0 = time.monotonic()
            self.engine.warm_up()
            log.info("route: %s; warmed up in %.1f s", self.engine.route.describe(), time.monotonic() - t0)
            log.info("prefix cache: %s", self.describe_prefix_cache())
            self._ready.set()

    @property
    def alive(self) -> bool:
        """Whether the scheduler's thread is running: started (:meth:`start`) and neither stopped
        nor ended by an exception its loop does not catch (a replica's health check,
        :mod:`gpt2mha.serving.ray_app`)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until :meth:`warm_up` has run (at most ``timeout`` seconds); returns :attr:`ready`."""
        return self._ready.wait(timeout)

    def start(self) -> None:
        """Start the thread that warms the engine up (:meth:`warm_up`), then runs :meth:`step`
        whenever there is work (requests submitted meanwhile wait in the queue). It runs as many
        threads as ``torch.get_num_threads()`` in the calling thread now, and the calling
        thread's idle OpenMP workers are released (:mod:`gpt2mha.inference.threads`: with them
        alive the runtime throttles every barrier of the steps, ~0.6x on 2 cores)."""
        if self._thread is None:
            import torch
            n = torch.get_num_threads()
            release_openmp_workers()
            self._thread = threading.Thread(target=self._run, args=(n,), name="gpt2mha-scheduler", daemon=True)
            self._thread.start()

    def cancel_all(self) -> int:
        """Refuse new work (:class:`ShuttingDown`) and cancel every queued or running sequence;
        each ends with finish_reason ``"cancelled"`` at the thread's next step. Does not wait.
        Returns the number of sequences cancelled by this call."""
        with self._cv:
            self._stopping = True
            live = [s for s in list(self.waiting) + self.slots if s is not None and not s.cancelled and not s.done]
            for seq in live:
                seq.cancelled = True
            self._cancels += 1
            self._cv.notify()
        return len(live)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Refuse new work, cancel everything queued or running, and join the thread."""
        self.cancel_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        else:
            self.step()

    def run_until_idle(self, max_steps: int = 100_000) -> int:
        """Run :meth:`step` in the calling thread (no :meth:`start`) until nothing is queued or
        running; returns the number of steps. For scripts and tests that drive the loop themselves.

        Raises:
            RuntimeError: still busy after ``max_steps`` steps.
        """
        for n in range(max_steps):
            if self.idle():
                return n
            self.step()
        raise RuntimeError(f"the scheduler is still busy after max_steps={max_steps} steps")

    def idle(self) -> bool:
        """Whether nothing is queued or running."""
        with self._cv:
            return not self.waiting and all(s is None for s in self.slots)

    def _run(self, n_threads: int) -> None:
        adopt_threads(n_threads)
        try:
            self.warm_up()
        except Exception:                             # served as it can be: each request then fails alone
            log.exception("warming the engine up failed")
            self._ready.set()
        while True:
            with self._cv:
                while not self._stopping and not self.waiting and all(s is None for s in self.slots):
                    self._cv.wait()
            try:
                self.step()
            except Exception:                         # a bug in the loop itself: keep serving
                log.exception("scheduler step failed")
            with self._cv:
                if self._stopping and not self.waiting and all(s is None for s in self.slots):
                    return

    # ------------------------------------------------------------------------- the loop
    def step(self) -> None:
        """One iteration: finish cancelled sequences (running or queued), move waiting ones into
        free slots and prefill them, one decode step.

        Each move between the queue, the slots and the finished counts is made under the lock,
        so :meth:`stats` always sees every submitted sequence in exactly one of them.
        """
        if self.waiting or self._cancels:
            with self._cv:
                self._cancels = 0
                for seq in self.slots:
                    if seq is not None and seq.cancelled:
                        self._finish(seq, CANCELLED)
                for seq in [s for s in self.waiting if s.cancelled]:
                    self.waiting.remove(seq)
                    self._finish(seq, CANCELLED)
                admit = []
                while self.waiting and None in self.slots:
                    seq = self.waiting.popleft()
                    seq.slot = self.slots.index(None)
                    self.slots[seq.slot] = seq
                    admit.append(seq)
                    self._running = None
            if admit:
                self._admit(admit)
        if self._running is None:                    # the slots changed: list their sequences again
            with self._cv:
                running = self._running = [s for s in self.slots if s is not None]
                self._running_slots = [s.slot for s in running]
                self._sliding = any(s.params.sliding_window for s in running)
        if self._running:
            self._decode()

    def _admit(self, seqs: list[Sequence]) -> None:
        """Give each new sequence (already in its slot) its text stream and seed, prefill them
        (one engine call; each prompt alone in its slot: one that fails fails alone) and accept
        each first token."""
        now = time.monotonic()
        live = []
        for seq in seqs:
            seq.t_admit = now
            p = seq.params
            if self.metrics is not None:
                self.metrics.admitted(seq)
            try:
                seq.stream = TextStream(self.tokenizer, p.stop, p.max_tokens, p.stop_token_ids, p.ignore_eos,
                                        p.min_tokens, p.include_stop_str_in_output, self.engine.eos_token_id)
                if p.echo and p.logprobs is not None:
                    seq.prompt_logprobs = self.engine.score(seq.prompt_ids, p.logprobs, adapter=seq.adapter)
                    seq.cached_tokens = self.engine.score_cached
                if p.max_tokens == 0:
                    self._finish(seq, LENGTH)
                    continue
                seed = row_seed(p.seed, seq.index) if p.seed is not None else \
                    secrets.randbits(63) if self.draw_seeds else None
                logprobs = p.logprobs if p.logprobs is not None else 0 if p.ranked else None
                self.engine.open(seq.slot, p, seed, logprobs=logprobs, row=seq.index, prompt=seq.prompt_ids,
                                 adapter=seq.adapter)
                live.append(seq)
            except Exception as e:
                self._fail(seq, e)
        if live:
            try:
                self._prefill(live)
            except Exception:                        # a forward failed and nothing was kept: each alone,
                for seq in live:                     # so that the one that fails fails and the others go on
                    try:
                        self._prefill([seq])
                    except Exception as e:
                        self._fail(seq, e)
        if self.after_tokens is not None:
            self.after_tokens()

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Prefill ``seqs`` into their slots (one engine call) and accept each first token."""
        n = self.n_ctx                                 # a longer prompt (sliding_window): its last n_ctx tokens
        results = self.engine.prefill([s.slot for s in seqs], [s.prompt_ids[-n:] for s in seqs])
        for seq in seqs:
            seq.cached_tokens = self.engine.cached[seq.slot]
        self._take(seqs, results)

    def _decode(self) -> None:
        """One decode step over every running sequence."""
        running = self._running
        windows = self._windows(running) if self._sliding else None
        try:
            results = self.engine.decode(self._running_slots, windows)
        except Exception as e:                       # the batched step itself failed: all of its rows fail
            for seq in running:
                self._fail(seq, e)
            return
        self._take(running, results, step=1)
        if self.after_tokens is not None:
            self.after_tokens()

    def _windows(self, running: list[Sequence]) -> dict[int, list[int]]:
        """The sliding windows of this step: ``{slot: its last n_ctx tokens}`` for each running
        sequence with ``sliding_window`` whose row of the cache is full, or was (from then on
        each step computes it alone over its window: :meth:`Engine.forward
        <gpt2mha.inference.engine.Engine.forward>`)."""
        lengths, full = self.engine.cache.lengths, self.engine.cache.max_len
        out = {}
        for seq in running:
            if seq.params.sliding_window and (seq.sliding or lengths[seq.slot] >= full):
                seq.sliding = True
                out[seq.slot] = (seq.prompt_ids + seq.tokens)[-self.n_ctx:]
        return out

    def _take(self, seqs: list[Sequence], results: list[int | Exception], step: int = 0) -> None:
        """An engine call's results (``results[i]`` for ``seqs[i]``): accept each token, or fail
        its sequence; then count the tokens (and ``step`` decode steps) under the lock."""
        now = time.monotonic()
        samplers = self.engine.samplers
        n = 0
        for seq, token in zip(seqs, results):
            try:
                if isinstance(token, Exception):
                    raise token
                n += 1
                self._accept(seq, token, samplers[seq.slot], now)
            except Exception as e:
                self._fail(seq, e)
        with self._cv:
            self.counts["tokens"] += n
            self.counts["steps"] += step
            self._recent.append((now, n))
            self._recent_tokens += n
            self._forget_old(now)

    def _accept(self, seq: Sequence, token: int, sampler, now: float) -> bool:
        """Record a token ``sampler`` (the sequence's) sampled, send its text; finish the sequence
        if it is done. Returns whether it goes on."""
        if seq.t_first is None:
            seq.t_first = now
        if self.metrics is not None:
            self.metrics.token(seq, now, seq.t_last)
        seq.t_last = now
        seq.tokens.append(token)
        if sampler.logprobs is not None:
            seq.logprobs.append(sampler.last_logprob)
        delta, reason = seq.stream.add(token)
        if reason != STOP and sampler.complete:
            reason = STOP                               # its grammar is complete: nothing can follow
        if reason is not None:
            return self._finish(seq, reason, text=delta)
        if delta:
            self._send(seq, delta)
        return True

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, text: str = "") -> bool:
        """Free the sequence's slot and count it (together, under the lock), then send the done
        event carrying the rest of its text: ``text`` (the last token's) and what the stream
        still held. Returns False."""
        newly = not seq.done
        if newly and reason in (STOP, LENGTH) and seq.stream is not None:
            text += seq.stream.finish()
            seq.text = seq.stream.text
        with self._cv:
            if seq.slot is not None:
                self.engine.release(seq.slot)
                self.slots[seq.slot] = None
                seq.slot = None
                self._running = None
            if newly:
                seq.finish_reason, seq.error, seq.t_end = reason, error, time.monotonic()
                self.counts[reason] += 1
        if newly:
            if self.metrics is not None:
                self.metrics.finished(seq)
            try:
                self._send(seq, text if reason in (STOP, LENGTH) else "", True)
            except Exception:
                log.exception("on_event failed")
        return False

    @staticmethod
    def _send(seq: Sequence, text: str, done: bool = False) -> None:
        """Call ``seq.on_event`` after marking how many of its tokens the text sent so far covers."""
        seq.marks.append(seq.stream.released if seq.stream is not None else 0)
        seq.on_event(seq, text, done)

    def _fail(self, seq: Sequence, e: Exception) -> None:
        if self.log_failures:
            log.error("sequence failed: %s: %s", type(e).__name__, e)
        if seq.exception is None:
            seq.exception = e
        self._finish(seq, ERROR, f"{type(e).__name__}: {e}")
