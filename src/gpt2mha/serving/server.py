"""An OpenAI-compatible HTTP server (FastAPI on uvicorn) over the continuous-batching scheduler.

Endpoints (the OpenAI completions API, as llama.cpp's server and vLLM expose it):

- ``POST /v1/completions``: ``model``, ``prompt`` (a string, a list of token ids, or a batch:
  a list of strings or of token-id lists), ``max_tokens`` (default 16), ``temperature``,
  ``top_p``, ``seed``, ``stop`` (up to ``max_stop`` strings, default 64:
  lm-evaluation-harness sends a task's ``until`` strings and the EOS string),
  ``stream`` (server-sent events ending in ``data: [DONE]``), ``stream_options.include_usage``
  (only with ``stream``), ``logprobs`` and ``echo``
  (:func:`~gpt2mha.serving.protocol.choice_answer`; a stream's chunks carry their own tokens'
  logprobs, :meth:`Completions.chunk`), ``n`` and ``best_of``
  (:func:`~gpt2mha.serving.protocol.pick_choices`), ``presence_penalty``,
  ``frequency_penalty``, ``logit_bias``, and ``top_k`` as an extension; ``null`` for any
  optional field means its default. With ``temperature: 0`` or a ``seed``, each choice's text
  equals offline ``generate`` with the same arguments (sequence ``i·m + j`` of P prompts with
  m = best_of or n sequences each is row ``i·m + j`` of ``gpt2mha generate P1 … --num-samples
  m --seed …``; see :mod:`.scheduler`).
- ``POST /v1/chat/completions`` when a chat template is given (:mod:`.chat`); otherwise 400.
- ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health`` (running/queued counts, slots,
  tokens/s); vLLM's ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``
  (:mod:`.tokens`).

Bad requests get HTTP 400 with OpenAI's error object ``{"error": {"message", "type", "param",
"code"}}`` naming the field (:mod:`.protocol`: also a string that is not Unicode text, and more
prompts than the server can ever hold at once); an unknown route, 404, and a known one with
another method, 405, in the same object; a body over ``max_body_bytes``, 413; a queue
that is full right now, 429 with ``Retry-After``; shutting down, 503. The app never touches
tensors: it reads the body, then parses, checks and tokenizes it in a worker thread (so a large
body does not stall the event loop), submits to the
:class:`~gpt2mha.serving.scheduler.Scheduler` thread, and relays its text events. One log line
per request (logger ``gpt2mha.serve``).

Shutdown (:class:`GracefulServer`): uvicorn stops accepting connections and in-flight requests
may finish for ``graceful_timeout`` seconds; past it the scheduler cancels what is left, so a
non-streamed request gets a 503 error object and a stream an error event then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..core import checks
from . import chat, tokens
from .protocol import (MAX_STOP, APIError, cancelled_error, check_logit_bias_ids, check_prompt_count, check_request,
                       check_stop, check_stream_options, choice, choice_answer, completion_logprobs, encode_prompts,
                       failure, join_logprobs, parse_request, pick_choices, prompt_echo, sampling_params, sse,
                       submit_error, usage, validation_error)
from .scheduler import ExceedsCapacity, QueueFull, Scheduler, Sequence, ShuttingDown
from .text_stream import CANCELLED, ERROR

log = logging.getLogger("gpt2mha.serve")

#: Default limit of a request body (``gpt2mha serve --max-body-bytes``): far above any prompt
#: the context admits (1024 GPT-2 tokens are at most 128 KiB), and a few ms of JSON to parse.
DEFAULT_MAX_BODY_BYTES = 4 << 20
#: After ``graceful_timeout`` the scheduler cancels what is left; requests get this long to
#: answer before uvicorn cancels their tasks itself (:class:`GracefulServer`).
CANCEL_GRACE_S = 10.0


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


class AnswerCancelled:
    """ASGI middleware for the last resort of a shutdown: a request whose task uvicorn cancels
    (:data:`CANCEL_GRACE_S` after the scheduler cancelled it, e.g. a client that stopped
    reading) still ends as the API promises, a 503 error object, or for a stream already
    started an error event then ``data: [DONE]``, instead of uvicorn's text/plain 500 and a
    logged traceback. The request's own log line is written by its handler."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "ended": False, "sse": False}

        async def watch(message):
            if message["type"] == "http.response.start":
                state["started"] = True
                state["sse"] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                   for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except asyncio.CancelledError:
            if state["ended"]:
                return
            err = cancelled_error()
            with contextlib.suppress(Exception):
                if not state["started"]:
                    await err.response()(scope, receive, send)
                else:
                    tail = sse(err.body()) + sse("[DONE]") if state["sse"] else ""
                    await send({"type": "http.response.body", "body": tail.encode(), "more_body": False})


class Completions:
    """``POST /v1/completions`` over ``scheduler``, serving its model as ``model_name``.

    One instance per app: :meth:`handle` reads the body (413 past ``max_body_bytes``), has it
    parsed, checked and tokenized in a worker thread (:meth:`prepare`), submits the prompts and
    answers with the whole completion (:meth:`collect`) or a server-sent event stream
    (:meth:`stream`). The scheduler thread's events reach the request through one
    :class:`Relay`. Every request is cancelled in the scheduler when its answer ends, however
    it ends (a client that hangs up frees its slots at once), and logged in one line.
    """

    #: The answers' ``object`` and id prefix (OpenAI's).
    OBJECT, CHUNK_OBJECT, ID_PREFIX = "text_completion", "text_completion", "cmpl-"

    def __init__(self, scheduler: Scheduler, model_name: str, max_body_bytes: int, max_stop: int = MAX_STOP,
                 relay: Relay | None = None):
        self.scheduler, self.model_name, self.max_body_bytes = scheduler, model_name, max_body_bytes
        self.max_stop = max_stop
        self.relay = Relay() if relay is None else relay

    async def handle(self, request: Request):
        """The answer to one request (raises :class:`~gpt2mha.serving.protocol.APIError`, which
        the app answers as OpenAI's error object)."""
        t0 = time.monotonic()
        raw = await read_body(request, self.max_body_bytes)
        loop = asyncio.get_running_loop()
        body, prompts = await loop.run_in_executor(None, self.prepare, raw)       # off the loop
        events = asyncio.Queue()
        self.relay.loop = loop                        # the server's one loop

        def on_event(seq, text, done):                # scheduler thread → this request's queue
            self.relay.send(events, (seq, text, done))

        try:
            seqs = self.scheduler.submit(prompts, sampling_params(body), on_event)
        except (ExceedsCapacity, QueueFull, ShuttingDown) as e:
            raise submit_error(e) from None
        head = {"id": f"{self.ID_PREFIX}{secrets.token_hex(12)}", "object": self.OBJECT, "created": int(time.time()),
                "model": self.model_name}
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
        return body, encode_prompts(body, s.tokenizer, s.n_ctx, n_vocab=min(s.tokenizer.n_vocab, s.n_vocab))

    def check(self, body) -> None:
        """The checks of a parsed request (:mod:`.protocol`): model, values, stop strings (at
        most ``max_stop``), ``stream_options`` only with ``stream``, and the prompt count."""
        s = self.scheduler
        check_request(body, self.model_name)
        check_stop(body, self.max_stop)
        check_stream_options(body)
        check_logit_bias_ids(body, s.runner.vocab_size)
        check_prompt_count(body, s.capacity, s.max_batch, s.max_queue)

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


class ChatCompletions(Completions):
    """``POST /v1/chat/completions``: the messages rendered by ``template``
    (:class:`~gpt2mha.serving.chat.ChatTemplate`) into one prompt of token ids, continued as a
    completion, answered in OpenAI's ``chat.completion`` / ``chat.completion.chunk`` shapes."""

    OBJECT, CHUNK_OBJECT, ID_PREFIX = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def __init__(self, template: "chat.ChatTemplate", *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.template = template

    def prepare(self, raw: bytes):
        """Parse and check a chat body, render its messages and tokenize them.

        Raises:
            APIError: 400/404 naming the field (:mod:`.chat`, :mod:`.protocol`).
        """
        s = self.scheduler
        body = chat.parse_chat_request(raw)
        tokens.check_model(body.model, self.model_name)                 # before rendering anything
        request = chat.completion_request(body, self.template, s.tokenizer, s.n_ctx)
        self.check(request)
        return request, encode_prompts(request, s.tokenizer, s.n_ctx)

    def whole_choice(self, index: int, seq: Sequence) -> dict:
        return chat.message_choice(index, seq.text, seq.finish_reason)

    def chunk_choices(self, seq: Sequence, text: str, finished: bool, seen: list[int]) -> list[dict]:
        """A choice's first chunk carries the role (``{"role": "assistant", "content": ""}``), as
        OpenAI's do; the finish reason comes with the last text, or alone with an empty delta."""
        index, finish_reason = seq.index, seq.finish_reason if finished else None
        first = seen[index] == 0
        seen[index] += 1
        out = [chat.delta_choice(index, {"role": "assistant", "content": ""}, None)] if first else []
        if text or finish_reason is None:
            out.append(chat.delta_choice(index, {"content": text}, finish_reason))
        else:
            out.append(chat.delta_choice(index, {}, finish_reason))
        return out


async def disconnected(request: Request) -> None:
    """Returns once the client has hung up."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def log_request(rid: str, seqs: list[Sequence], t0: float, status: int) -> None:
    """One log line for a request: status, tokens, queue wait, time to first token, total time,
    finish reasons."""
    starts = [s.t_admit - s.t_submit for s in seqs if s.t_admit is not None]
    firsts = [s.t_first - s.t_submit for s in seqs if s.t_first is not None]
    ms = lambda xs: f"{1000 * max(xs):.1f}ms" if xs else "-"           # noqa: E731
    log.info("request %s status=%s prompts=%d prompt_tokens=%d generated_tokens=%d queue_wait=%s ttft=%s "
             "total=%.1fms finish=%s", rid, status, len(seqs), sum(len(s.prompt_ids) for s in seqs),
             sum(len(s.tokens) for s in seqs), ms(starts), ms(firsts), 1000 * (time.monotonic() - t0),
             ",".join(str(s.finish_reason) for s in seqs))


def create_app(scheduler: Scheduler, model_name: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               chat_template: str | None = None, max_stop: int = MAX_STOP) -> FastAPI:
    """The ASGI app serving ``scheduler``'s model as ``model_name``; request bodies over
    ``max_body_bytes`` get 413; requests may carry up to ``max_stop`` stop strings;
    ``/v1/chat/completions`` renders messages with ``chat_template`` (Jinja source; None: that
    route answers 400, :func:`~gpt2mha.serving.chat.no_template_error`).

    Every error, the app's own and the router's (404 unknown route, 405 wrong method), is
    OpenAI's ``{"error": {"message", "type", "param", "code"}}`` object.

    The app's lifespan starts the scheduler's thread and, at shutdown, stops it (queued and
    running sequences are cancelled; uvicorn first lets in-flight responses finish, see
    :class:`GracefulServer`).

    Raises:
        ValueError: max_body_bytes < 1, max_stop < 1, or a chat template that is not valid Jinja.
    """
    max_body_bytes = checks.as_int(max_body_bytes, "max_body_bytes", minimum=1)
    max_stop = checks.as_int(max_stop, "max_stop", minimum=1)
    started = [time.time()]
    tok, n_ctx = scheduler.tokenizer, scheduler.n_ctx
    n_vocab = min(tok.n_vocab, scheduler.n_vocab)
    template = None if chat_template is None else chat.ChatTemplate(
        chat_template, chat.special_tokens(tok.name, n_ctx))
    info = tokens.tokenizer_info(tok, n_ctx, n_vocab, chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        started[0] = time.time()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, scheduler.stop)

    def card():
        return {"id": model_name, "object": "model", "created": int(started[0]), "owned_by": "gpt2mha",
                "max_model_len": n_ctx}

    async def health():
        return {"status": "ok", "model": model_name, **scheduler.stats()}

    async def models():
        return {"object": "list", "data": [card()]}

    async def model(model_id: str):
        if model_id != model_name:
            raise APIError(404, f"The model '{model_id}' does not exist; this server serves '{model_name}'",
                           "model", code="model_not_found")
        return card()

    async def no_chat(request: Request):
        await read_body(request, max_body_bytes)
        raise chat.no_template_error(model_name)

    async def tokenize(request: Request):
        raw = await read_body(request, max_body_bytes)
        return await asyncio.get_running_loop().run_in_executor(
            None, tokens.tokenize, raw, tok, model_name, n_ctx, template)

    async def detokenize(request: Request):
        raw = await read_body(request, max_body_bytes)
        return await asyncio.get_running_loop().run_in_executor(
            None, tokens.detokenize, raw, tok, model_name, n_vocab)

    async def tokenizer_info():
        return info

    relay = Relay()
    completions = Completions(scheduler, model_name, max_body_bytes, max_stop, relay)
    app = FastAPI(title="gpt2mha", description="OpenAI-compatible completions over gpt2mha", lifespan=lifespan)
    app.add_middleware(AnswerCancelled)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_server_error)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", model, methods=["GET"])
    app.add_api_route("/v1/completions", completions.handle, methods=["POST"])
    app.add_api_route("/v1/chat/completions", no_chat if template is None else ChatCompletions(
        template, scheduler, model_name, max_body_bytes, max_stop, relay).handle, methods=["POST"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", tokenizer_info, methods=["GET"])
    return app


async def on_validation_error(request: Request, exc: RequestValidationError):
    """FastAPI's own validation errors as OpenAI's 400 naming the field."""
    return validation_error(exc.errors()).response()


async def on_api_error(request: Request, exc: APIError):
    """An :class:`~gpt2mha.serving.protocol.APIError` as its answer, logged in one line."""
    log.info("request - status=%d param=%s error=%s", exc.status, exc.param, exc.message)
    return exc.response()


async def on_http_error(request: Request, exc: HTTPException):
    """The router's errors as OpenAI's error object: 404 for an unknown route (OpenAI's
    ``Invalid URL (METHOD /path)``), 405 for a known route with another method (its ``Allow``
    header kept), any other with its status and Starlette's detail."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"Invalid URL ({where}): no such route on this server"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow")
        message = f"Invalid method for URL ({where})" + (f": this route accepts {allowed}" if allowed else "")
    else:
        message = f"{exc.detail} ({where})"
    return await on_api_error(request, APIError(exc.status_code, message,
                                                headers=exc.headers))


async def on_server_error(request: Request, exc: Exception):
    """An unexpected exception in a route as a 500 error object (Starlette logs the traceback)."""
    return APIError(500, f"The server failed on this request: {type(exc).__name__}: {exc}",
                    type="server_error").response()


class GracefulServer(uvicorn.Server):
    """uvicorn's server with a shutdown that keeps the API's promises past the graceful timeout.

    On SIGTERM (or ``should_exit``) uvicorn stops accepting connections and waits for in-flight
    requests. ``graceful_timeout`` seconds later the scheduler cancels every sequence still
    queued or running (:meth:`~gpt2mha.serving.scheduler.Scheduler.cancel_all`) and refuses new ones,
    so each request ends through its own handler: a non-streamed one with a 503 error object, a
    stream with an error event then ``data: [DONE]``, one log line each. uvicorn's own
    cancellation of the request tasks comes :data:`CANCEL_GRACE_S` later, as a last resort
    (:class:`AnswerCancelled` answers those).
    """

    def __init__(self, config: "uvicorn.Config", scheduler: Scheduler, graceful_timeout: float):
        check_graceful_timeout(graceful_timeout)
        config.timeout_graceful_shutdown = graceful_timeout + CANCEL_GRACE_S
        super().__init__(config)
        self.scheduler, self.graceful_timeout = scheduler, graceful_timeout

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's shutdown, with :meth:`cancel_in_flight` due ``graceful_timeout`` s after it starts."""
        timer = asyncio.get_running_loop().call_later(self.graceful_timeout, self.cancel_in_flight)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            timer.cancel()

    def cancel_in_flight(self) -> None:
        """Cancel every queued or running sequence (their requests then answer 503), log one line."""
        n = self.scheduler.cancel_all()
        if n:
            log.warning("graceful timeout of %gs exceeded: cancelling %d in-flight sequence(s)", self.graceful_timeout, n)


def check_graceful_timeout(graceful_timeout: float) -> None:
    """Raises ValueError unless ``graceful_timeout`` is a finite number of seconds >= 0."""
    if isinstance(graceful_timeout, bool) or not isinstance(graceful_timeout, (int, float)) or not (
            math.isfinite(graceful_timeout) and graceful_timeout >= 0):
        raise ValueError(f"graceful_timeout={graceful_timeout!r} must be a finite number of seconds >= 0")


def check_port(port: int) -> None:
    """Raises ValueError unless ``port`` is an integer in [0, 65535] (0: any free port)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port={port!r} must be an integer in [0, 65535] (0: any free port)")


def serve(model, tokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 16,
          max_queue: int = 256, graceful_timeout: float = 30.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          chat_template: str | None = None, max_stop: int = MAX_STOP, batch_invariant: bool | None = None) -> None:
    """Serve ``model`` until SIGINT/SIGTERM (``gpt2mha serve``). On SIGTERM uvicorn stops
    accepting connections and lets in-flight responses finish; past ``graceful_timeout``
    seconds what is left is cancelled (503 / a stream's error event, :class:`GracefulServer`);
    the scheduler is stopped and this returns normally. ``chat_template`` and ``max_stop``: as
    :func:`create_app`; ``batch_invariant``: as :class:`~gpt2mha.serving.scheduler.Scheduler`.

    Raises:
        ValueError: a port outside [0, 65535], a negative or non-finite graceful_timeout,
            max_body_bytes < 1, max_stop < 1, a chat template that is not valid Jinja, or bad
            max_batch/max_queue (:class:`~gpt2mha.serving.scheduler.Scheduler`).
        RuntimeError: the server could not start (e.g. the address is in use or the host
            unknown; uvicorn logs the reason).
    """
    import signal

    check_port(port)
    check_graceful_timeout(graceful_timeout)
    scheduler = Scheduler(model, tokenizer, max_batch=max_batch, max_queue=max_queue, batch_invariant=batch_invariant)
    app = create_app(scheduler, model_name, max_body_bytes=max_body_bytes, chat_template=chat_template,
                     max_stop=max_stop)
    config = uvicorn.Config(app, host=host, port=port, access_log=False, log_level="info")
    # uvicorn re-raises the signal it shut down on; a no-op SIGTERM handler makes that a clean exit (0)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    server = GracefulServer(config, scheduler, graceful_timeout)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not server.started:
        raise RuntimeError(f"the server did not start on {host}:{port} (the reason is logged above)")


@contextlib.contextmanager
def serve_in_thread(scheduler: Scheduler, model_name: str, host: str = "127.0.0.1", port: int = 0,
                    timeout: float = 30.0, graceful_timeout: float | None = None,
                    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, chat_template: str | None = None,
                    max_stop: int = MAX_STOP):
    """Run the app with uvicorn in a background thread for the ``with`` block; yields the base
    URL (``http://host:port``, the real port when ``port`` is 0). For tests and scripts that
    want the real server in their own process. On exit the server shuts down as
    ``gpt2mha serve`` does on SIGTERM (in-flight responses get ``graceful_timeout`` seconds,
    default ``timeout``, then are cancelled: :class:`GracefulServer`) and the scheduler is stopped.
    ``max_body_bytes``, ``chat_template``, ``max_stop``: as :func:`create_app`.

    Raises:
        RuntimeError: the server did not start within ``timeout`` seconds.
    """
    graceful_timeout = timeout if graceful_timeout is None else graceful_timeout
    app = create_app(scheduler, model_name, max_body_bytes=max_body_bytes, chat_template=chat_template,
                     max_stop=max_stop)
    config = uvicorn.Config(app, host=host, port=port, access_log=False, log_level="warning")
    server = GracefulServer(config, scheduler, graceful_timeout)
    thread = threading.Thread(target=server.run, name="gpt2mha-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(graceful_timeout + CANCEL_GRACE_S + 5)
