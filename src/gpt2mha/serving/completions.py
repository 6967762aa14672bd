"""The routes that generate: ``POST /v1/completions`` (:class:`Completions`) and the
plumbing it shares with chat (:class:`~gpt2mha.serving.chat.ChatCompletions`): reading a body
under a size limit (:func:`read_body`), the scheduler thread's events relayed to the event loop
(:class:`Relay`), whole answers and server-sent event streams, one log line per request.
:mod:`.server` builds the app from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..inference.params import MAX_COMPLETION_LOGPROBS
from .protocol import (CLIP, MAX_STOP, APIError, check_prompt_count, check_request, check_stop,
                       check_stream_options, choice, choice_answer, completion_logprobs, encode_prompts, failure,
                       join_logprobs, parse_request, prompt_echo, sampling_params, sse, submit_error,
                       usage)
from .operate import request_id
from ..inference.scheduler import ExceedsCapacity, QueueFull, Scheduler, ShuttingDown
from ..inference.sequence import Sequence, pick_choices
from .structured import check_grammar
from ..inference.text_stream import CANCELLED, ERROR

log = logging.getLogger("gpt2mha.serve")


class Relay:
    """Hands the scheduler thread's events to the event loop's request queues in batches.

    ``send`` (any thread) appends ``(queue, item)`` to a pending list; only the first event of a
    batch wakes the loop (one ``call_soon_threadsafe``, i.e. one write to its self-pipe), and
    the loop then moves everything pending into the queues at once. A decode step of 16 rows
    thus costs one wake-up instead of 16, and the scheduler thread spends less time holding
    the GIL the loop needs.
    """

    def __init__(self):
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pending: list = []
        self.lock = threading.Lock()

    def send(self, queue: asyncio.Queue, item) -> None:
        """Queue ``item`` for ``queue`` (from any thread); wakes the loop if none is pending."""
        with self.lock:
            self.pending.append((queue, item))
            wake = len(self.pending) == 1
        if wake:
            with contextlib.suppress(RuntimeError):   # the loop may be closed at shutdown
                self.loop.call_soon_threadsafe(self.flush)

    def flush(self) -> None:
        """Move every pending item into its queue (on the loop)."""
        with self.lock:
            pending, self.pending = self.pending, []
        for queue, item in pending:
            queue.put_nowait(item)


#: A body over the limit is still read (and dropped) up to this many bytes past it, so that the
#: client, still sending, reads the 413 instead of a connection reset.
DRAIN_BYTES = 64 << 20


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused past ``limit`` bytes (declared in Content-Length or counted
    while a chunked body arrives).

    Raises:
        APIError: 413 (``code="request_too_large"``) naming the size and the limit.
    """
    declared = request.headers.get("content-length", "")
    declared = int(declared) if declared.isdigit() else None
    chunks, size = [], 0
    if declared is None or declared <= limit + DRAIN_BYTES:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > limit + DRAIN_BYTES:
                break
    if (declared or 0) > limit or size > limit:
        got = f"{declared} bytes" if declared is not None else f"over {limit} bytes"
        raise APIError(413, f"The request body is {got}; this server accepts at most {limit} bytes "
                            f"(gpt2mha serve --max-body-bytes)", type="invalid_request_error",
                       code="request_too_large")
    return b"".join(chunks)




class Completions:
    """``POST /v1/completions`` over ``scheduler``, serving its model as ``model_name``.

    ``max_tokens_overflow``: what ``max_tokens`` past the room a prompt leaves in the context
    gets (:data:`~gpt2mha.serving.protocol.MAX_TOKENS_OVERFLOW`: ``"clip"``, the default, or
    ``"refuse"``, a 400); a clipped request is logged.

    One instance per app: :meth:`handle` reads the body (413 past ``max_body_bytes``), has it
    parsed, checked and tokenized in a worker thread (:meth:`prepare`), submits the prompts and
    answers with the whole completion (:meth:`collect`) or a server-sent event stream
    (:meth:`stream`). The scheduler thread's events reach the request through one
    :class:`Relay`: every event of a stream, only each sequence's last for a whole answer (the
    sequences keep their own text), so that a whole answer wakes the loop once per sequence,
    not once per token. Every request is cancelled in the scheduler when its answer ends, however
    it ends (a client that hangs up frees its slots at once), and logged in one line.
    """

    #: The answers' ``object`` and id prefix (OpenAI's).
    OBJECT, CHUNK_OBJECT, ID_PREFIX = "text_completion", "text_completion", "cmpl-"
    #: The most ``logprobs`` a request may ask for (OpenAI's completions limit).
    MAX_LOGPROBS = MAX_COMPLETION_LOGPROBS

    def __init__(self, scheduler: Scheduler, model_name: str, max_body_bytes: int, max_stop: int = MAX_STOP,
                 relay: Relay | None = None, max_tokens_overflow: str = CLIP,
                 adapters: dict[str, int] | None = None):
        self.scheduler, self.model_name, self.max_body_bytes = scheduler, model_name, max_body_bytes
        self.max_stop, self.overflow = max_stop, max_tokens_overflow
        self.relay = Relay() if relay is None else relay
        self.adapters = dict(adapters or {})          # LoRA adapter name → index (serve --lora name=DIR)

    def served_name(self, name: str | None) -> str:
        """The name a request's ``model`` is checked against: itself when it names a LoRA
        adapter of this server, else the base model's."""
        return name if name in self.adapters else self.model_name

    async def handle(self, request: Request):
        """The answer to one request (raises :class:`~gpt2mha.serving.protocol.APIError`, which
        the app answers as OpenAI's error object)."""
        t0 = time.monotonic()
        raw = await read_body(request, self.max_body_bytes)
        loop = asyncio.get_running_loop()
        body, prompts = await loop.run_in_executor(None, self.prepare, raw)       # off the loop
        events = asyncio.Queue()
        self.relay.loop = loop                        # the server's one loop

        stream = body.stream

        def on_event(seq, text, done):                # scheduler thread → this request's queue
            if stream or done:                        # a whole answer waits only for the ends: no wake-up a token
                self.relay.send(events, (seq, text, done))

        try:
            seqs = self.scheduler.submit(prompts, sampling_params(body), on_event, clip=self.overflow == CLIP,
                                         adapter=self.adapters.get(body.model))
        except (ExceedsCapacity, QueueFull, ShuttingDown) as e:
            raise submit_error(e) from None
        head = {"id": f"{self.ID_PREFIX}{secrets.token_hex(12)}", "object": self.OBJECT, "created": int(time.time()),
                "model": self.served_name(body.model)}
        clipped = sorted({s.params.max_tokens for s in seqs if s.params.max_tokens < body.max_tokens})
        if clipped:
            log.info("request %s max_tokens=%d clipped to %s: the room its prompts leave in the %d-token context "
                     "(--max-tokens-overflow clip)", head["id"], body.max_tokens, ",".join(map(str, clipped)),
                     self.scheduler.n_ctx)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(self.stream(seqs, events, head, include_usage, t0),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self.collect(seqs, events, head, request, t0)

    def prepare(self, raw: bytes):
        """Parse, check and tokenize a body (in a worker thread: tokenizing is the costly part).

        Raises:
            APIError: 400/404 naming the field (:mod:`.protocol`).
        """
        s = self.scheduler
        body = parse_request(raw)
        self.check(body)
        return body, encode_prompts(body, s.tokenizer, s.n_ctx, n_vocab=min(s.tokenizer.n_vocab, s.n_vocab),
                                    overflow=self.overflow)

    def check(self, body) -> None:
        """The checks of a parsed request (:mod:`.protocol`): model, values, stop strings (at
        most ``max_stop``), ``stream_options`` only with ``stream``, the prompt count, and its
        structured output's grammar compiled for the served tokenizer (:mod:`.structured`)."""
        s = self.scheduler
        params = check_request(body, self.served_name(body.model), s.engine.vocab_size, self.MAX_LOGPROBS)
        check_stop(body, self.max_stop)
        check_stream_options(body)
        check_prompt_count(body, s.capacity, s.max_batch, s.max_queue)
        check_grammar(params, s.engine, body)

    def whole_choice(self, index: int, seq: Sequence) -> dict:
        """A finished sequence as ``choices[index]`` of a whole answer."""
        return choice_answer(self.scheduler.tokenizer, index, seq)

    def chunk_choices(self, seq: Sequence, text: str, finished: bool, seen: list[int]) -> list[dict]:
        """The ``choices`` entries of the stream chunk(s) for ``seq``'s next event (``seen``:
        events received per sequence so far), one chunk each."""
        return [self.chunk(self.scheduler.tokenizer, seq, text, finished, seen)]

    async def collect(self, seqs: list[Sequence], events: asyncio.Queue, head: dict, request: Request, t0: float):
        """The whole completion as one JSON answer, once every sequence is done; 499 (and the
        sequences cancelled) if the client hangs up first."""
        status = 200

        async def drain():                            # the sequences keep their own text
            done = 0
            while done < len(seqs):
                seq, text, finished = await events.get()
                done += finished

        waiter, watcher = asyncio.ensure_future(drain()), asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not waiter.done():                     # the client went away: free its slots now
                status = 499
                return JSONResponse({}, status_code=499)
            err = failure(seqs)
            if err is not None:
                status = err.status
                return err.response()
            choices = [self.whole_choice(index, s) for index, s in pick_choices(seqs)]
            return JSONResponse({**head, "choices": choices, "usage": usage(seqs)})
        except BaseException:                         # the task cancelled: a shutdown's last resort (AnswerCancelled)
            status = 503
            raise
        finally:
            for t in (waiter, watcher):
                t.cancel()
            self.end(seqs, head["id"], t0, status)

    async def stream(self, seqs: list[Sequence], events: asyncio.Queue, head: dict, include_usage: bool, t0: float):
        """Server-sent events: one chunk per piece of text (the chunks ready together in one
        write), an error event if a sequence failed or was cancelled, the usage chunk when asked,
        then ``data: [DONE]``."""
        status, head = 200, {**head, "object": self.CHUNK_OBJECT}
        seen = [0] * len(seqs)                        # events received, per sequence
        try:
            done, out = 0, []
            while done < len(seqs):
                seq, text, finished = await events.get()
                if finished and seq.finish_reason in (ERROR, CANCELLED):
                    err = failure([seq])
                    status = err.status
                    out.append(sse(err.body()))
                    break
                done += finished
                for c in self.chunk_choices(seq, text, finished, seen):
                    out.append(sse({**head, "choices": [c]}))
                if events.empty():                    # one write for the chunks that are ready
                    yield "".join(out)
                    out = []
            else:
                if include_usage:
                    out.append(sse({**head, "choices": [], "usage": usage(seqs)}))
            yield "".join(out) + sse("[DONE]")
        except BaseException:                         # client gone (the response task is cancelled)
            status = 503 if self.scheduler.stopping else 499
            raise
        finally:
            self.end(seqs, head["id"], t0, status)

    @staticmethod
    def chunk(tok, seq: Sequence, text: str, finished: bool, seen: list[int]) -> dict:
        """A stream chunk's choice for ``seq``'s next event: its text (after the echoed prompt on
        its first one) and, with ``logprobs``, those of the tokens that event covers
        (``seq.marks``, set by the scheduler before the event)."""
        k = seen[seq.index]
        seen[seq.index] += 1
        echo, prompt_lp = prompt_echo(tok, seq) if k == 0 else ("", None)
        lp = None
        if seq.params.logprobs is not None:
            start = seq.marks[k - 1] if k else 0
            shift = len(tok.decode(seq.prompt_ids)) if seq.params.echo else 0
            lp = join_logprobs(prompt_lp, completion_logprobs(tok, seq, start, seq.marks[k], shift))
        return choice(seq.index, echo + text, seq.finish_reason if finished else None, lp)

    def end(self, seqs: list[Sequence], rid: str, t0: float, status: int) -> None:
        """A request's answer has ended: cancel what is left of its sequences, log its line."""
        for s in seqs:
            self.scheduler.cancel(s)
        log_request(rid, seqs, t0, status)


async def disconnected(request: Request) -> None:
    """Returns once the client has hung up."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def log_request(rid: str, seqs: list[Sequence], t0: float, status: int) -> None:
    """One log line for a request: its id, its ``X-Request-Id`` (:data:`~gpt2mha.serving.operate.request_id`),
    status, tokens (and those of the prompts served from the prefix cache), queue wait, time to
    first token, total time, finish reasons."""
    starts = [s.t_admit - s.t_submit for s in seqs if s.t_admit is not None]
    firsts = [s.t_first - s.t_submit for s in seqs if s.t_first is not None]
    ms = lambda xs: f"{1000 * max(xs):.1f}ms" if xs else "-"           # noqa: E731
    log.info("request %s request_id=%s status=%s prompts=%d prompt_tokens=%d cached_tokens=%d generated_tokens=%d "
             "queue_wait=%s ttft=%s total=%.1fms finish=%s", rid, request_id.get(), status, len(seqs),
             sum(len(s.prompt_ids) for s in seqs), sum(s.cached_tokens for s in seqs), sum(len(s.tokens) for s in seqs), ms(starts), ms(firsts), 1000 * (time.monotonic() - t0),
             ",".join(str(s.finish_reason) for s in seqs))
