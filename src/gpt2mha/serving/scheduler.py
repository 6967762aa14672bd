"""Continuous batching: one scheduler owns the model and a slotted static KV cache.

The loop (:meth:`Scheduler.step`, run by one background thread in the server):

1. free the slots of cancelled sequences;
2. admit waiting sequences into free slots: they are prefilled in batches of similar prompt
   lengths (:func:`length_groups`), left-padded (the same forward over a
   :class:`~gpt2mha.kv_cache.KVCache` that :func:`gpt2mha.generate.generate` runs for a list
   of prompts), each one's first token is sampled from its row of the prefill's logits, and
   its keys/values (pads skipped) are copied into its slot;
3. one decode step for every running sequence at once: ``GPT2.step`` over the
   :class:`~gpt2mha.kv_cache.SlotCache`, each row at its own position with its own key mask;
4. sample each row with its own generator, turn tokens into UTF-8-safe text, and free the slot
   of every sequence that finished (length, end of text, a stop string) at once.

A sequence's tokens are the ones ``generate`` gives for its prompt alone: each row attends to
exactly its own keys, and its row of logits is sampled with :func:`~gpt2mha.generate.sample_next`
and a generator seeded with its seed (one draw per token, the first from the prefill), as the
offline loop does for one prompt (prompt i of a list: ``row_seed(seed, i)``, as row i of a
batch there). Batched matrix products may round differently from a batch
of one (~1e-6 in the logits), so a near-tie between the top two logits could in principle
break differently; the tests compare whole texts on the built-in model.

Sources: continuous ("iteration-level") batching as in Orca (Yu et al., OSDI 2022) and vLLM;
the static cache with one indexed write per step as in gpt-fast.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .generate import check_sampling, left_pad, row_seed, sample_next
from .kv_cache import KVCache, SlotCache
from .tokenizer import StreamDecoder

log = logging.getLogger("gpt2mha.serve")


class QueueFull(Exception):
    """More sequences were submitted than free slots plus room in the queue right now (HTTP 429:
    retry later)."""


class ExceedsCapacity(ValueError):
    """More sequences in one submission than the scheduler can ever hold at once
    (``max_batch + max_queue``): retrying cannot help (HTTP 400)."""


class ShuttingDown(Exception):
    """The scheduler is stopping and takes no new work (HTTP 503)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt (the fields of an OpenAI completions request).

    Attributes:
        max_tokens: tokens to generate at most (>= 0).
        temperature, top_k, top_p: as :func:`~gpt2mha.generate.sample_next` (temperature 0: greedy).
        seed: seeds the sequence's own ``torch.Generator`` (None: a random seed); prompt i of a
            request uses ``row_seed(seed, i)``, as row i of a batch in ``generate`` (prompt 0: seed).
        stop: strings that end the text (cut before the first one; finish_reason ``"stop"``).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


class TextStream:
    """Token ids → text deltas that never split a UTF-8 character or show part of a stop string.

    ``push(ids)`` returns the text that is now certain, holding back an incomplete multi-byte
    character (:class:`~gpt2mha.tokenizer.StreamDecoder`) and any tail that could still grow
    into a stop string; once a stop string appears, the text is cut before it and
    :attr:`stopped` is set. ``finish()`` returns the rest (an incomplete trailing character
    becomes U+FFFD, as ``bytes.decode(errors="replace")``).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.decoder = StreamDecoder(tokenizer)
        self.stop = tuple(stop)
        self.text = ""          # all decoded text so far (cut at a stop string once found)
        self.sent = 0           # characters of text already returned
        self.stopped = False

    def push(self, ids) -> str:
        if self.stopped:
            return ""
        self.text += self.decoder.push(ids)
        return self._release(final=False)

    def finish(self) -> str:
        if not self.stopped:
            self.text += self.decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        cut = min((i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            end = cut
        elif final:
            end = len(self.text)
        else:                   # hold back the longest tail that is the start of a stop string
            hold = max((n for s in self.stop for n in range(min(len(s) - 1, len(self.text) - self.sent), 0, -1)
                        if self.text.endswith(s[:n])), default=0)
            end = len(self.text) - hold
        delta, self.sent = self.text[self.sent:end], max(self.sent, end)
        return delta


@dataclass(eq=False)
class Sequence:
    """One prompt being continued, from submission to its finish.

    ``on_event(seq, text, done)`` is called from the scheduler's thread with each new piece
    of text (never empty) and once with ``done=True`` (then :attr:`finish_reason` is
    ``"stop"``, ``"length"``, ``"cancelled"`` or ``"error"``, with :attr:`error` set for the last).
    """

    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[["Sequence", str, bool], None]
    index: int = 0
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    slot: int | None = None
    cancelled: bool = False
    t_submit: float = 0.0
    t_admit: float | None = None
    t_first: float | None = None
    t_end: float | None = None
    generator: torch.Generator | None = None
    stream: TextStream | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


#: Padding a prefill batch may add, as a fraction of its real prompt tokens (:func:`length_groups`).
PREFILL_PAD_WASTE = 0.1


def length_groups(seqs: list[Sequence], waste: float = PREFILL_PAD_WASTE) -> list[list[Sequence]]:
    """``seqs`` cut into prefill batches of similar prompt lengths (shortest first), each padded
    to at most ``(1 + waste)`` times its real tokens: the built-in model's prefill is
    compute-bound, so a batch padded to its longest prompt wastes work (16 prompts of 10-60
    bytes: 61 ms as one batch, 52 ms one by one, 43 ms in groups with 10% padding, one thread)."""
    groups, current, total = [], [], 0
    for seq in sorted(seqs, key=lambda s: len(s.prompt_ids)):
        n = len(seq.prompt_ids)
        if current and (len(current) + 1) * n > (1 + waste) * (total + n):
            groups.append(current)
            current, total = [], 0
        current.append(seq)
        total += n
    return groups + [current] if current else groups


class Scheduler:
    """Owns the model, its :class:`~gpt2mha.kv_cache.SlotCache` (one slot per running
    sequence) and the queue of waiting sequences; one thread runs :meth:`step` in a loop.

    Args:
        model: a :class:`~gpt2mha.model.GPT2` (put in eval mode; used only by this scheduler).
        tokenizer: its tokenizer (for text and, with BPE, the end-of-text token that stops a
            sequence with finish_reason ``"stop"``).
        max_batch: slots, i.e. sequences decoded together at most (>= 1).
        max_queue: sequences that may wait for a slot beyond the free ones (>= 0); more is
            refused with :class:`QueueFull`.

    Memory: the cache holds ``2 · n_layer · max_batch · n_ctx · n_embd`` values in the model's
    dtype (1.2 GB for 124M in float32 with 16 slots; 38 MB for the built-in model).

    Raises:
        ValueError: max_batch < 1 or max_queue < 0.
    """

    def __init__(self, model, tokenizer, max_batch: int = 16, max_queue: int = 256):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch={max_batch!r} must be an integer >= 1")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue={max_queue!r} must be an integer >= 0")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        c = model.config
        self.n_ctx = c.n_ctx
        p = next(model.parameters())
        self.device = p.device
        self.cache = SlotCache(c.n_layer, max_batch, c.n_head, c.n_ctx, c.head_dim, dtype=p.dtype, device=p.device)
        self.eot = tokenizer.eot_token
        self.vocab_size = min(tokenizer.n_vocab, c.n_vocab)
        self.slots: list[Sequence | None] = [None] * max_batch
        self.waiting: collections.deque[Sequence] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.counts = collections.Counter()          # finished sequences by finish_reason, tokens, steps
        self._recent = collections.deque()           # (time, tokens) of the last steps, for tokens/s

    # ------------------------------------------------------------------------- app side
    def submit(self, prompts: list[list[int]], params: SamplingParams,
               on_event: Callable[[Sequence, str, bool], None]) -> list[Sequence]:
        """Queue one sequence per prompt (all or none) and return them, index = position.

        Raises:
            ValueError: an empty prompt, ids outside the vocabulary, bad sampling values, or
                prompt + max_tokens longer than n_ctx (the caller checks these first for
                clear HTTP errors; this is the last guard).
            ExceedsCapacity: more prompts than :attr:`capacity`, i.e. never admissible.
            QueueFull: not enough free slots plus queue room for all of them now.
            ShuttingDown: after :meth:`stop`.
        """
        check_sampling(params.temperature, params.top_k, params.top_p)
        if len(prompts) > self.capacity:
            raise ExceedsCapacity(f"{len(prompts)} prompts in one request; this server holds at most {self.capacity} "
                                  f"sequences at once (max_batch={self.max_batch} running + max_queue={self.max_queue} "
                                  f"waiting), so it can never admit them: send at most {self.capacity} per request")
        if isinstance(params.max_tokens, bool) or not isinstance(params.max_tokens, int) or params.max_tokens < 0:
            raise ValueError(f"max_tokens={params.max_tokens!r} must be an integer >= 0")
        for i, ids in enumerate(prompts):
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if min(ids) < 0 or max(ids) >= self.model.config.n_vocab:
                raise ValueError(f"prompt {i} has ids outside [0, n_vocab={self.model.config.n_vocab})")
            if len(ids) + params.max_tokens > self.n_ctx:
                raise ValueError(f"prompt {i}: {len(ids)} tokens + max_tokens={params.max_tokens} > n_ctx={self.n_ctx}")
        now = time.monotonic()
        seqs = [Sequence(list(ids), params, on_event, index=i, t_submit=now) for i, ids in enumerate(prompts)]
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
                self._cv.notify()

    def stats(self) -> dict:
        """Running/queued counts, slots, finished counts and generated tokens per second
        (over the last 10 s)."""
        with self._cv:
            queued = sum(not s.cancelled for s in self.waiting)
            now = time.monotonic()
            while self._recent and self._recent[0][0] < now - 10.0:
                self._recent.popleft()
            recent = sum(n for _, n in self._recent)
            running = sum(s is not None for s in self.slots)
            return dict(running=running, queued=queued, slots=self.max_batch, free_slots=self.max_batch - running,
                        max_queue=self.max_queue, tokens_per_second=round(recent / 10.0, 2),
                        completed=self.counts["stop"] + self.counts["length"], cancelled=self.counts["cancelled"],
                        failed=self.counts["error"], rejected=self.counts["rejected"],
                        generated_tokens=self.counts["tokens"], decode_steps=self.counts["steps"])

    # ----------------------------------------------------------------------- the thread
    def start(self) -> None:
        """Start the thread that runs :meth:`step` whenever there is work."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpt2mha-scheduler", daemon=True)
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
        with torch.inference_mode(), self.model.decoding():
            for n in range(max_steps):
                if self.idle():
                    return n
                self.step()
        raise RuntimeError(f"the scheduler is still busy after max_steps={max_steps} steps")

    def idle(self) -> bool:
        """Whether nothing is queued or running."""
        with self._cv:
            return not self.waiting and all(s is None for s in self.slots)

    def _run(self) -> None:
        with torch.inference_mode(), self.model.decoding():
            while True:
                with self._cv:
                    while not self._stopping and not self.waiting and all(s is None for s in self.slots):
                        self._cv.wait()
                try:
                    self.step()
                except Exception:                     # a bug in the loop itself: keep serving
                    log.exception("scheduler step failed")
                with self._cv:
                    if self._stopping and not self.waiting and all(s is None for s in self.slots):
                        return

    # ------------------------------------------------------------------------- the loop
    @torch.inference_mode()
    def step(self) -> None:
        """One iteration: free cancelled slots, admit waiting sequences, one decode step."""
        for slot, seq in enumerate(self.slots):
            if seq is not None and seq.cancelled:
                self._finish(seq, "cancelled")
        admit = []
        with self._cv:
            while self.waiting and len(admit) < self.slots.count(None):
                seq = self.waiting.popleft()
                if seq.cancelled:
                    self._finish(seq, "cancelled")
                else:
                    admit.append(seq)
        if admit:
            self._admit(admit)
        with self._cv:                               # cancelled while waiting: out of the queue at once
            gone = [s for s in self.waiting if s.cancelled]
            for s in gone:
                self.waiting.remove(s)
        for s in gone:
            self._finish(s, "cancelled")
        if any(s is not None for s in self.slots):
            self._decode()

    def _admit(self, seqs: list[Sequence]) -> None:
        """Prefill new sequences (one left-padded batch, as ``generate`` runs a list of prompts),
        sample each one's first token, and put each that goes on in a free slot. If the batched
        prefill fails, each is prefilled alone, so only a sequence that fails alone fails."""
        now = time.monotonic()
        live = []
        for seq in seqs:
            seq.t_admit = now
            p = seq.params
            try:
                seed = row_seed(p.seed, seq.index) if p.seed is not None else secrets.randbits(63)
                seq.generator = torch.Generator(device=self.device).manual_seed(seed)
                seq.stream = TextStream(self.tokenizer, p.stop)
                if p.max_tokens == 0:
                    self._finish(seq, "length")
                else:
                    live.append(seq)
            except Exception as e:
                self._fail(seq, e)
        for group in length_groups(live):
            try:
                self._prefill(group)
            except Exception:
                for seq in group:
                    if not seq.done and seq.slot is None:
                        try:
                            self._prefill([seq])
                        except Exception as e:           # this request fails; the others go on
                            self._fail(seq, e)

    def _prefill(self, seqs: list[Sequence]) -> None:
        """One forward over the prompts of ``seqs`` (left-padded, positions from the mask) into a
        :class:`KVCache`; the first token of each from its row's last logits."""
        if not seqs:
            return
        c = self.model.config
        ids, mask = left_pad([s.prompt_ids for s in seqs])     # left padding: every row ends at T
        ids, mask = ids.to(self.device), mask.to(self.device)
        T = ids.shape[1]
        cache = KVCache(c.n_layer, len(seqs), c.n_head, T, c.head_dim, dtype=self.cache.k.dtype, device=self.device)
        padded = len(seqs) > 1 and any(len(s.prompt_ids) < T for s in seqs)
        logits = self.model(ids, attention_mask=mask if padded else None, cache=cache, last_only=True).logits
        for i, seq in enumerate(seqs):                         # logits [B, 1, n_vocab]
            if self._accept(seq, self._sample(seq, logits[i:i + 1, -1])):
                slot = self.slots.index(None)
                self.cache.load(slot, cache, row=i, start=T - len(seq.prompt_ids))
                seq.slot = slot
                self.slots[slot] = seq

    def _decode(self) -> None:
        """One decode step over slots ``0 … rows-1`` (rows = highest occupied slot + 1)."""
        rows = max(i for i, s in enumerate(self.slots) if s is not None) + 1
        running = [(i, s) for i, s in enumerate(self.slots[:rows]) if s is not None]
        try:
            last = [s.tokens[-1] if s is not None else 0 for s in self.slots[:rows]]
            ids = torch.tensor(last, dtype=torch.long, device=self.device)[:, None]      # [rows, 1]
            position_ids, mask = self.cache.begin(rows)
            logits = self.model.step(ids, self.cache, mask, position_ids)[:, -1]         # [rows, n_vocab]
            greedy = logits[:, :self.vocab_size].argmax(dim=-1).tolist()
        except Exception as e:                       # the batched step itself failed: all of its rows fail
            self.cache._rows = 0
            for _, seq in running:
                self._fail(seq, e)
            return
        self.counts["steps"] += 1
        for i, seq in running:
            try:
                token = greedy[i] if seq.params.temperature == 0 else self._sample(seq, logits[i:i + 1])
                self._accept(seq, token)
            except Exception as e:
                self._fail(seq, e)

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> int:
        """The next token of ``seq`` from its logits ``[1, n_vocab]``: ``sample_next`` with its generator."""
        p = seq.params
        return int(sample_next(logits[:, :self.vocab_size], p.temperature, p.top_k, p.top_p, seq.generator)[0])

    def _accept(self, seq: Sequence, token: int) -> bool:
        """Record a sampled token, send its text; finish the sequence if it is done. Returns
        whether it goes on."""
        now = time.monotonic()
        if seq.t_first is None:
            seq.t_first = now
        seq.tokens.append(token)
        with self._cv:
            self.counts["tokens"] += 1
            self._recent.append((now, 1))
            while self._recent[0][0] < now - 10.0:     # keep the last 10 s only
                self._recent.popleft()
        if self.eot is not None and token == self.eot:
            return self._finish(seq, "stop")
        delta = seq.stream.push([token])
        if delta:
            seq.on_event(seq, delta, False)
        if seq.stream.stopped:
            return self._finish(seq, "stop")
        if len(seq.tokens) >= seq.params.max_tokens:
            return self._finish(seq, "length")
        return True

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> bool:
        """Free the sequence's slot, send the rest of its text and the done event. Returns False."""
        if seq.slot is not None:
            self.cache.release(seq.slot)
            self.slots[seq.slot] = None
            seq.slot = None
        if seq.done:
            return False
        if reason in ("stop", "length") and seq.stream is not None:
            delta = seq.stream.finish()
            if delta:
                seq.on_event(seq, delta, False)
            seq.text = seq.stream.text
        seq.finish_reason, seq.error, seq.t_end = reason, error, time.monotonic()
        with self._cv:
            self.counts[reason] += 1
        try:
            seq.on_event(seq, "", True)
        except Exception:
            log.exception("on_event failed")
        return False

    def _fail(self, seq: Sequence, e: Exception) -> None:
        log.error("sequence failed: %s: %s", type(e).__name__, e)
        self._finish(seq, "error", f"{type(e).__name__}: {e}")
