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
  (:func:`~gpt2mha.serving.scheduler.pick_choices`), ``presence_penalty``,
  ``frequency_penalty``, ``logit_bias``, and as extensions ``top_k``, ``min_p`` and vLLM's
  repetition control (``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
  ``stop_token_ids``, ``include_stop_str_in_output``; transformers' ``no_repeat_ngram_size``,
  :class:`~gpt2mha.inference.params.SamplingParams`); ``null`` for any
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
tensors: its routes (:mod:`.completions`, :class:`~gpt2mha.serving.chat.ChatCompletions`) read
the body, then parse, check and tokenize it in a worker thread (so a large body does not stall
the event loop), submit to the :class:`~gpt2mha.serving.scheduler.Scheduler` thread, and relay
its text events. One log line per request (logger ``gpt2mha.serve``).

Shutdown (:class:`GracefulServer`): uvicorn stops accepting connections and in-flight requests
may finish for ``graceful_timeout`` seconds; past it the scheduler cancels what is left, so a
non-streamed request gets a 503 error object and a stream an error event then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .. import kernels
from ..core import checks
from ..core.classifier import ClassifierConfig
from ..inference.decoders import choose_decoder
from . import chat, tokens
from .address import check_address
from .completions import DRAIN_BYTES, Completions, Relay, read_body   # noqa: F401  (DRAIN_BYTES: the API as before)
from .protocol import MAX_STOP, APIError, cancelled_error, sse, validation_error
from .scheduler import Scheduler

log = logging.getLogger("gpt2mha.serve")

#: Default limit of a request body (``gpt2mha serve --max-body-bytes``): far above any prompt
#: the context admits (1024 GPT-2 tokens are at most 128 KiB), and a few ms of JSON to parse.
DEFAULT_MAX_BODY_BYTES = 4 << 20
#: After ``graceful_timeout`` the scheduler cancels what is left; requests get this long to
#: answer before uvicorn cancels their tasks itself (:class:`GracefulServer`).
CANCEL_GRACE_S = 10.0
#: The chat template served by default: the built-in ``plain`` one
#: (:data:`~gpt2mha.serving.chat.DEFAULT_CHAT_TEMPLATE`), so chat-first clients work on a default server.
DEFAULT_CHAT_TEMPLATE = chat.BUILTIN_TEMPLATES[chat.DEFAULT_CHAT_TEMPLATE]


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


def create_app(scheduler: Scheduler, model_name: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               chat_template: str | None = DEFAULT_CHAT_TEMPLATE, max_stop: int = MAX_STOP,
               classifier=None) -> FastAPI:
    """The ASGI app serving ``scheduler``'s model as ``model_name``; request bodies over
    ``max_body_bytes`` get 413; requests may carry up to ``max_stop`` stop strings;
    ``/v1/chat/completions`` renders messages with ``chat_template`` (Jinja source, default the
    built-in plain one, :data:`DEFAULT_CHAT_TEMPLATE`; None: that route answers 400,
    :func:`~gpt2mha.serving.chat.no_template_error`); ``classifier``: a
    :class:`~gpt2mha.core.classifier.GPT2Classifier` served at ``/v1/classify`` instead of the
    generation routes (:mod:`.classify`).

    Every error, the app's own and the router's (404 unknown route, 405 wrong method), is
    OpenAI's ``{"error": {"message", "type", "param", "code"}}`` object.

    The app's lifespan starts the scheduler's thread and, at shutdown, stops it (queued and
    running sequences are cancelled; uvicorn first lets in-flight responses finish, see
    :class:`GracefulServer`). gpt2mha's C++ kernels are loaded here, before the server answers
    (no request waits on them; where none load, the one warning says which routes run instead).

    Raises:
        ValueError: max_body_bytes < 1, max_stop < 1, or a chat template that is not valid Jinja.
    """
    max_body_bytes = checks.as_int(max_body_bytes, "max_body_bytes", minimum=1)
    max_stop = checks.as_int(max_stop, "max_stop", minimum=1)
    kernels.load()
    started = [time.time()]
    tok, n_ctx = scheduler.tokenizer, scheduler.n_ctx
    n_vocab = min(tok.n_vocab, scheduler.n_vocab)
    template = None if chat_template is None else chat.ChatTemplate(
        chat_template, chat.special_tokens(tok.name, n_ctx))
    info = tokens.tokenizer_info(tok, n_ctx, n_vocab, chat_template)
    lora = getattr(scheduler.engine.model, "lora_state", None)          # serve --lora name=DIR: one model id each
    adapters = {name: i for i, name in enumerate(lora.names)} if lora is not None else {}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        started[0] = time.time()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, scheduler.stop)

    def card(name=model_name):
        parent = {"parent": model_name} if name != model_name else {}
        return {"id": name, "object": "model", "created": int(started[0]), "owned_by": "gpt2mha",
                "max_model_len": n_ctx, **parent}

    async def health():                               # 503 "loading" until the engine is warmed up
        stats = scheduler.stats()
        if not stats["ready"]:
            return JSONResponse({"status": "loading", "model": model_name, **stats}, status_code=503)
        return {"status": "ok", "model": model_name, **stats}

    async def models():
        return {"object": "list", "data": [card(), *map(card, adapters)]}

    async def model(model_id: str):
        if model_id != model_name and model_id not in adapters:
            raise APIError(404, f"The model '{model_id}' does not exist; this server serves '{model_name}'",
                           "model", code="model_not_found")
        return card(model_id)

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
    completions = Completions(scheduler, model_name, max_body_bytes, max_stop, relay, adapters)
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
    app.add_api_route("/v1/chat/completions", no_chat if template is None else chat.ChatCompletions(
        template, scheduler, model_name, max_body_bytes, max_stop, relay, adapters).handle, methods=["POST"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", tokenizer_info, methods=["GET"])
    if classifier is not None:
        from . import classify
        classify.add_routes(app, classifier, tok, model_name, max_body_bytes)
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
          chat_template: str | None = DEFAULT_CHAT_TEMPLATE, max_stop: int = MAX_STOP,
          batch_invariant: bool | None = None, compile: bool = False, lora: dict | None = None) -> None:
    """Serve ``model`` until SIGINT/SIGTERM (``gpt2mha serve``). On SIGTERM uvicorn stops
    accepting connections and lets in-flight responses finish; past ``graceful_timeout``
    seconds what is left is cancelled (503 / a stream's error event, :class:`GracefulServer`);
    the scheduler is stopped and this returns normally. ``chat_template`` and ``max_stop``: as
    :func:`create_app`; ``batch_invariant``: as :class:`~gpt2mha.serving.scheduler.Scheduler`;
    ``compile``: decode on the compiled step (:func:`~gpt2mha.inference.decoders.choose_decoder`,
    as ``generate(compile=True)``), compiled while ``/health`` says ``"loading"``; ``lora``:
    ``{name: adapter path}`` applied unmerged (:func:`~gpt2mha.inference.lora.apply_lora`), each
    served as its own model id over the one base.

    Raises:
        ValueError: a port outside [0, 65535] or one that cannot be listened on now (in use,
            :func:`~gpt2mha.serving.address.check_address`), a negative or non-finite graceful_timeout,
            max_body_bytes < 1, max_stop < 1, a chat template that is not valid Jinja, or bad
            max_batch/max_queue (:class:`~gpt2mha.serving.scheduler.Scheduler`).
        RuntimeError: the server could not start (e.g. the address is in use or the host
            unknown; uvicorn logs the reason).
    """
    import signal

    check_port(port)
    check_graceful_timeout(graceful_timeout)
    check_address(host, port)                     # a port in use: ValueError now, not after the app starts
    if lora:
        if compile:
            raise ValueError("lora with compile: the compiled step runs no adapters; serve them on the decode view")
        from ..inference.lora import apply_lora
        apply_lora(model, lora)
    route = choose_decoder(model.eval(), compile=compile, batch_invariant=batch_invariant)
    scheduler = Scheduler(model, tokenizer, max_batch=max_batch, max_queue=max_queue, batch_invariant=batch_invariant,
                          route=route)
    app = create_app(scheduler, model_name, max_body_bytes=max_body_bytes, chat_template=chat_template,
                     max_stop=max_stop, classifier=model if isinstance(model.config, ClassifierConfig) else None)
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
                    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, chat_template: str | None = DEFAULT_CHAT_TEMPLATE,
                    max_stop: int = MAX_STOP, classifier=None):
    """Run the app with uvicorn in a background thread for the ``with`` block; yields the base
    URL (``http://host:port``, the real port when ``port`` is 0). For tests and scripts that
    want the real server in their own process. On exit the server shuts down as
    ``gpt2mha serve`` does on SIGTERM (in-flight responses get ``graceful_timeout`` seconds,
    default ``timeout``, then are cancelled: :class:`GracefulServer`) and the scheduler is stopped.
    ``max_body_bytes``, ``chat_template``, ``max_stop``, ``classifier``: as :func:`create_app`.

    The block starts once the engine is warmed up (``/health`` answers ``"ok"``), or once
    ``timeout`` has passed.

    Raises:
        RuntimeError: the server did not start within ``timeout`` seconds.
    """
    graceful_timeout = timeout if graceful_timeout is None else graceful_timeout
    app = create_app(scheduler, model_name, max_body_bytes=max_body_bytes, chat_template=chat_template,
                     max_stop=max_stop, classifier=classifier)
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
    scheduler.wait_ready(max(0.0, deadline - time.monotonic()))     # /health "ok": the engine is warmed up
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(graceful_timeout + CANCEL_GRACE_S + 5)
