"""An OpenAI-compatible HTTP server (FastAPI on uvicorn) over the continuous-batching scheduler.

Endpoints (the OpenAI completions API, as llama.cpp's server and vLLM expose it):

- ``POST /v1/completions``: ``model``, ``prompt`` (a string or a list of strings),
  ``max_tokens`` (default 16), ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``
  (server-sent events ending in ``data: [DONE]``), ``stream_options.include_usage``, and
  ``top_k`` as an extension. With ``temperature: 0`` or a ``seed``, each choice's text equals
  offline ``generate`` with the same arguments (``gpt2mha generate PROMPT --temperature …
  --seed …`` for one prompt; for a list, row i of ``generate(prompts, seed=…)``).
- ``GET /v1/models``, ``GET /health`` (running/queued counts, slots, tokens/s).

Bad requests get HTTP 400 with OpenAI's error object ``{"error": {"message", "type", "param",
"code"}}`` naming the field (also a string that is not Unicode text, and more prompts than the
server can ever hold at once); a body over ``max_body_bytes``, 413; a queue that is full right
now, 429 with ``Retry-After``; shutting down, 503. The app never touches tensors: it reads the
body, then parses, checks and tokenizes it in a worker thread (so a large body does not stall
the event loop), submits to the :class:`~gpt2mha.scheduler.Scheduler` thread, and relays its
text events. One log line per request (logger ``gpt2mha.serve``).

Shutdown (:class:`GracefulServer`): uvicorn stops accepting connections and in-flight requests
may finish for ``graceful_timeout`` seconds; past it the scheduler cancels what is left, so a
non-streamed request gets a 503 error object and a stream an error event then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from .scheduler import ExceedsCapacity, QueueFull, SamplingParams, Scheduler, ShuttingDown

log = logging.getLogger("gpt2mha.serve")

MAX_STOP = 4            # as OpenAI: up to 4 stop sequences
RETRY_AFTER_S = 1
#: Default limit of a request body (``gpt2mha serve --max-body-bytes``): far above any prompt
#: the context admits (1024 GPT-2 tokens are at most 128 KiB), and a few ms of JSON to parse.
DEFAULT_MAX_BODY_BYTES = 4 << 20
#: After ``graceful_timeout`` the scheduler cancels what is left; requests get this long to
#: answer before uvicorn cancels their tasks itself (:class:`GracefulServer`).
CANCEL_GRACE_S = 10.0


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions`` (OpenAI's fields; types checked strictly)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | list[str]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # accepted at their neutral values only (clients send some of them by default)
    n: int = 1
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    user: str | None = None


#: What each field must be, for the messages of type errors.
EXPECTED = {
    "model": "a string", "prompt": "a string or a list of strings", "max_tokens": "an integer",
    "temperature": "a number", "top_p": "a number", "top_k": "an integer", "seed": "an integer",
    "stop": "a string or a list of strings", "stream": "a boolean", "stream_options": "an object {include_usage: bool}",
    "n": "an integer", "best_of": "an integer", "echo": "a boolean", "logprobs": "an integer",
    "presence_penalty": "a number", "frequency_penalty": "a number", "logit_bias": "an object of numbers",
    "suffix": "a string", "user": "a string",
}


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def parse_request(raw: bytes) -> CompletionRequest:
    """The request body (JSON, whatever the Content-Type) as a :class:`CompletionRequest`.

    Raises:
        APIError: 400 for malformed JSON (no param) or a field of the wrong type, an unknown
            field, a missing prompt, a string that is not Unicode text (param = that field).
    """
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"The request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "The request body is not valid JSON: nested too deeply") from None
    check_unicode(data)
    try:
        return CompletionRequest.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def check_unicode(data, where: str = "", param: str | None = None) -> None:
    """Every string of the parsed body (values and keys, at any depth) must be Unicode text:
    JSON's ``\\ud800``-``\\udfff`` escapes that are not a surrogate pair decode to lone
    surrogates, which no tokenizer (nor UTF-8) can encode.

    Raises:
        APIError: 400 naming the top-level field (``param``) and the string's place in it.
    """
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = data[e.start:e.end].encode("utf-8", "backslashreplace").decode("ascii")
            raise APIError(400, f"Invalid '{where or 'body'}': the string has a lone UTF-16 surrogate ({bad}) at "
                                f"character {e.start}, which is not Unicode text (a \\ud800-\\udbff escape must be "
                                f"followed by a \\udc00-\\udfff one)", param) from None
    elif isinstance(data, dict):
        for key, value in data.items():
            name = f"{where}.{key}" if where else key
            check_unicode(key, name.encode("utf-8", "backslashreplace").decode("ascii"), param or
                          key.encode("utf-8", "backslashreplace").decode("ascii"))
            check_unicode(value, name, param or key)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            check_unicode(value, f"{where}[{i}]", param)


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's first error as a 400 naming the field."""
    err = errors[0]
    loc = [x for x in err.get("loc", ()) if x != "body"]
    kind = err.get("type", "")
    if not loc:
        return APIError(400, "The request body must be a JSON object of completion parameters")
    param = str(loc[0])
    if kind == "extra_forbidden":
        name = ".".join(str(x) for x in loc)
        return APIError(400, f"Unrecognized request argument supplied: {name}", name)
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'", param)
    got = json.dumps(err.get("input"))[:60]
    where = param + "".join(f"[{x}]" for x in loc[1:] if isinstance(x, int))   # not pydantic's union branches
    return APIError(400, f"Invalid type for '{where}': expected {EXPECTED.get(param, 'another type')}, got {got}", param)


def check_request(body: CompletionRequest, model_name: str, n_ctx: int) -> None:
    """Value checks OpenAI makes (and ours): raises :class:`APIError` 400/404 naming the field."""
    if body.model is not None and body.model != model_name:
        raise APIError(404, f"The model '{body.model}' does not exist; this server serves '{model_name}'",
                       "model", code="model_not_found")
    if body.max_tokens < 0:
        raise APIError(400, f"max_tokens={body.max_tokens} must be >= 0", "max_tokens")
    if not (math.isfinite(body.temperature) and body.temperature >= 0):
        raise APIError(400, f"temperature={body.temperature} must be a number >= 0 (0 means greedy)", "temperature")
    if not (math.isfinite(body.top_p) and 0 < body.top_p <= 1):
        raise APIError(400, f"top_p={body.top_p} must be in (0, 1]", "top_p")
    if body.top_k < 0:
        raise APIError(400, f"top_k={body.top_k} must be >= 0 (0: no top-k filtering)", "top_k")
    if body.seed is not None and not 0 <= body.seed < 2**63:
        raise APIError(400, f"seed={body.seed} must be in [0, 2**63)", "seed")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOP or any(s == "" for s in stops):
        raise APIError(400, f"stop must be up to {MAX_STOP} non-empty strings, got {stops!r}", "stop")
    unsupported = dict(n=body.n != 1, best_of=body.best_of not in (None, 1), echo=body.echo,
                       logprobs=body.logprobs is not None, presence_penalty=body.presence_penalty != 0,
                       frequency_penalty=body.frequency_penalty != 0, logit_bias=bool(body.logit_bias),
                       suffix=body.suffix is not None)
    for name, bad in unsupported.items():
        if bad:
            raise APIError(400, f"{name}={getattr(body, name)!r} is not supported by this server "
                                f"(only its default)", name)
    if isinstance(body.prompt, list) and not body.prompt:
        raise APIError(400, "prompt is an empty list; give at least one prompt", "prompt")


def encode_prompts(body: CompletionRequest, tokenizer, n_ctx: int) -> list[list[int]]:
    """Token ids of each prompt; raises :class:`APIError` for an empty or too long prompt or
    prompt + max_tokens beyond the context.

    A prompt whose UTF-8 length alone proves it longer than ``n_ctx`` tokens (at least
    ``ceil(bytes / tokenizer.max_token_bytes)`` of them) is refused without being tokenized, so
    the work per prompt is bounded by ``n_ctx · max_token_bytes`` bytes whatever its size."""
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    longest = getattr(tokenizer, "max_token_bytes", None)
    out = []
    for i, text in enumerate(prompts):
        where = "prompt" if isinstance(body.prompt, str) else f"prompt[{i}]"
        if text == "":
            raise APIError(400, f"{where} is empty; give at least one character to continue", "prompt")
        if longest:
            n_bytes = len(text.encode("utf-8", "surrogatepass"))
            at_least = -(-n_bytes // longest)
            if at_least > n_ctx:
                count = f"{at_least}" if longest == 1 else f"at least {at_least} ({n_bytes} bytes)"
                raise APIError(400, f"{where} has {count} tokens; this model's maximum context length is "
                                    f"{n_ctx} tokens", "prompt", code="context_length_exceeded")
        try:
            ids = tokenizer.encode(text)
        except UnicodeError:                          # parse_request refuses these first
            raise APIError(400, f"{where} is not Unicode text", "prompt") from None
        if len(ids) > n_ctx:
            raise APIError(400, f"{where} has {len(ids)} tokens; this model's maximum context length is "
                                f"{n_ctx} tokens", "prompt", code="context_length_exceeded")
        if len(ids) + body.max_tokens > n_ctx:
            raise APIError(400, f"This model's maximum context length is {n_ctx} tokens, however you requested "
                                f"{len(ids) + body.max_tokens} tokens ({len(ids)} in {where}, {body.max_tokens} for "
                                f"the completion); lower max_tokens or shorten the prompt", "max_tokens",
                           code="context_length_exceeded")
        out.append(ids)
    return out


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
        with self.lock:
            self.pending.append((queue, item))
            wake = len(self.pending) == 1
        if wake:
            with contextlib.suppress(RuntimeError):   # the loop may be closed at shutdown
                self.loop.call_soon_threadsafe(self.flush)

    def flush(self) -> None:
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
            err = APIError(503, "The request was cancelled: the server is shutting down", type="server_error")
            with contextlib.suppress(Exception):
                if not state["started"]:
                    await err.response()(scope, receive, send)
                else:
                    tail = "data: " + json.dumps(err.body()) + "\n\ndata: [DONE]\n\n" if state["sse"] else ""
                    await send({"type": "http.response.body", "body": tail.encode(), "more_body": False})


def create_app(scheduler: Scheduler, model_name: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The ASGI app serving ``scheduler``'s model as ``model_name``; request bodies over
    ``max_body_bytes`` get 413.

    The app's lifespan starts the scheduler's thread and, at shutdown, stops it (queued and
    running sequences are cancelled; uvicorn first lets in-flight responses finish, see
    :class:`GracefulServer`).

    Raises:
        ValueError: max_body_bytes < 1.
    """
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes!r} must be an integer >= 1")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        started[0] = time.time()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, scheduler.stop)

    started = [time.time()]
    app = FastAPI(title="gpt2mha", description="OpenAI-compatible completions over gpt2mha", lifespan=lifespan)
    app.add_middleware(AnswerCancelled)
    tokenizer, n_ctx = scheduler.tokenizer, scheduler.n_ctx
    relay = Relay()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return validation_error(exc.errors()).response()

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        log.info("request - status=%d param=%s error=%s", exc.status, exc.param, exc.message)
        return exc.response()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, **scheduler.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(started[0]),
                                             "owned_by": "gpt2mha", "max_model_len": n_ctx}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.monotonic()
        raw = await read_body(request, max_body_bytes)
        body, prompts = await asyncio.get_running_loop().run_in_executor(None, prepare, raw)   # off the loop
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        params = SamplingParams(max_tokens=body.max_tokens, temperature=body.temperature, top_k=body.top_k,
                                top_p=body.top_p, seed=body.seed, stop=stops)
        events = asyncio.Queue()
        relay.loop = asyncio.get_running_loop()       # the server's one loop

        def on_event(seq, text, done):                # scheduler thread → this request's queue
            relay.send(events, (seq, text, done))

        try:
            seqs = scheduler.submit(prompts, params, on_event)
        except ExceedsCapacity as e:
            raise APIError(400, str(e), "prompt", code="too_many_prompts") from None
        except QueueFull as e:
            raise APIError(429, f"The server is busy: {e}", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ShuttingDown as e:
            raise APIError(503, f"The server is shutting down: {e}", type="server_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        rid, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(seqs, events, head, include_usage, t0),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await collect(seqs, events, head, request, t0)

    def prepare(raw: bytes):
        """Parse, check and tokenize a body (in a worker thread: tokenizing is the costly part)."""
        body = parse_request(raw)
        check_request(body, model_name, n_ctx)
        n = 1 if isinstance(body.prompt, str) else len(body.prompt)
        if n > scheduler.capacity:                    # never admissible: not a 429 to retry
            raise APIError(400, f"prompt is a list of {n} prompts; this server holds at most {scheduler.capacity} "
                                f"sequences at once (--max-batch {scheduler.max_batch} running + --max-queue "
                                f"{scheduler.max_queue} waiting), so it can never admit them: send at most "
                                f"{scheduler.capacity} prompts per request", "prompt", code="too_many_prompts")
        return body, encode_prompts(body, tokenizer, n_ctx)

    def usage(seqs) -> dict:
        p, c = sum(len(s.prompt_ids) for s in seqs), sum(len(s.tokens) for s in seqs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def log_request(rid, seqs, t0, status):
        starts = [s.t_admit - s.t_submit for s in seqs if s.t_admit is not None]
        firsts = [s.t_first - s.t_submit for s in seqs if s.t_first is not None]
        ms = lambda xs: f"{1000 * max(xs):.1f}ms" if xs else "-"           # noqa: E731
        log.info("request %s status=%s prompts=%d prompt_tokens=%d generated_tokens=%d queue_wait=%s ttft=%s "
                 "total=%.1fms finish=%s", rid, status, len(seqs), sum(len(s.prompt_ids) for s in seqs),
                 sum(len(s.tokens) for s in seqs), ms(starts), ms(firsts), 1000 * (time.monotonic() - t0),
                 ",".join(str(s.finish_reason) for s in seqs))

    def failure(seqs) -> APIError | None:
        bad = [s for s in seqs if s.finish_reason in ("error", "cancelled")]
        if not bad:
            return None
        s = bad[0]
        if s.finish_reason == "cancelled":
            return APIError(503, "The request was cancelled: the server is shutting down", type="server_error")
        return APIError(500, f"The server failed on this request: {s.error}", type="server_error")

    async def collect(seqs, events, head, request: Request, t0):
        texts, status = [[] for _ in seqs], 200

        async def drain():
            done = 0
            while done < len(seqs):
                seq, text, finished = await events.get()
                texts[seq.index].append(text)
                done += finished

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        waiter, watcher = asyncio.ensure_future(drain()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not waiter.done():                     # the client went away: free its slots now
                status = 499
                return JSONResponse({}, status_code=499)
            err = failure(seqs)
            if err is not None:
                status = err.status
                return err.response()
            choices = [{"index": s.index, "text": "".join(texts[s.index]), "logprobs": None,
                        "finish_reason": s.finish_reason} for s in seqs]
            return JSONResponse({**head, "choices": choices, "usage": usage(seqs)})
        except BaseException:                         # the task cancelled: a shutdown's last resort (AnswerCancelled)
            status = 503
            raise
        finally:
            for t in (waiter, watcher):
                t.cancel()
            for s in seqs:
                scheduler.cancel(s)
            log_request(head["id"], seqs, t0, status)

    async def stream(seqs, events, head, include_usage, t0):
        status = 200
        chunk = lambda choices, **kw: "data: " + json.dumps({**head, "choices": choices, **kw}) + "\n\n"  # noqa: E731
        try:
            done, out = 0, []
            while done < len(seqs):
                seq, text, finished = await events.get()
                if finished and seq.finish_reason in ("error", "cancelled"):
                    err = failure([seq])
                    status = err.status
                    out.append("data: " + json.dumps(err.body()) + "\n\n")
                    break
                done += finished
                out.append(chunk([{"index": seq.index, "text": text, "logprobs": None,
                                   "finish_reason": seq.finish_reason if finished else None}]))
                if events.empty():                    # one write for the chunks that are ready
                    yield "".join(out)
                    out = []
            else:
                if include_usage:
                    out.append(chunk([], usage=usage(seqs)))
            yield "".join(out) + "data: [DONE]\n\n"
        except BaseException:                         # client gone (the response task is cancelled)
            status = 503 if scheduler.stopping else 499
            raise
        finally:
            for s in seqs:
                scheduler.cancel(s)
            log_request(head["id"], seqs, t0, status)

    return app


class GracefulServer(uvicorn.Server):
    """uvicorn's server with a shutdown that keeps the API's promises past the graceful timeout.

    On SIGTERM (or ``should_exit``) uvicorn stops accepting connections and waits for in-flight
    requests. ``graceful_timeout`` seconds later the scheduler cancels every sequence still
    queued or running (:meth:`~gpt2mha.scheduler.Scheduler.cancel_all`) and refuses new ones,
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
          max_queue: int = 256, graceful_timeout: float = 30.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
    """Serve ``model`` until SIGINT/SIGTERM (``gpt2mha serve``). On SIGTERM uvicorn stops
    accepting connections and lets in-flight responses finish; past ``graceful_timeout``
    seconds what is left is cancelled (503 / a stream's error event, :class:`GracefulServer`);
    the scheduler is stopped and this returns normally.

    Raises:
        ValueError: a port outside [0, 65535], a negative or non-finite graceful_timeout,
            max_body_bytes < 1, or bad max_batch/max_queue (:class:`~gpt2mha.scheduler.Scheduler`).
        RuntimeError: the server could not start (e.g. the address is in use or the host
            unknown; uvicorn logs the reason).
    """
    import signal

    check_port(port)
    check_graceful_timeout(graceful_timeout)
    scheduler = Scheduler(model, tokenizer, max_batch=max_batch, max_queue=max_queue)
    app = create_app(scheduler, model_name, max_body_bytes=max_body_bytes)
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
                    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """Run the app with uvicorn in a background thread for the ``with`` block; yields the base
    URL (``http://host:port``, the real port when ``port`` is 0). For tests and scripts that
    want the real server in their own process. On exit the server shuts down as
    ``gpt2mha serve`` does on SIGTERM (in-flight responses get ``graceful_timeout`` seconds,
    default ``timeout``, then are cancelled: :class:`GracefulServer`) and the scheduler is stopped.

    Raises:
        RuntimeError: the server did not start within ``timeout`` seconds.
    """
    import threading

    graceful_timeout = timeout if graceful_timeout is None else graceful_timeout
    config = uvicorn.Config(create_app(scheduler, model_name, max_body_bytes=max_body_bytes), host=host, port=port,
                            access_log=False, log_level="warning")
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
