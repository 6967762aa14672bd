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
  (:func:`~gpt2mha.inference.sequence.pick_choices`), ``presence_penalty``,
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
  (:mod:`.tokens`). Every ``GET`` route answers ``HEAD`` too (load balancers' health checks),
  and every route ``OPTIONS`` (200 with ``Allow``).

Bad requests get HTTP 400 with OpenAI's error object ``{"error": {"message", "type", "param",
"code"}}`` naming the field (:mod:`.protocol`: also a string that is not Unicode text, and more
prompts than the server can ever hold at once); an unknown route, 404, and a known one with
another method, 405, in the same object; a body over ``max_body_bytes``, 413; a queue
that is full right now, 429 with ``Retry-After``; shutting down, 503. The app never touches
tensors: its routes (:mod:`.completions`, :class:`~gpt2mha.serving.chat.ChatCompletions`) read
the body, then parse, check and tokenize it in a worker thread (so a large body does not stall
the event loop), submit to the :class:`~gpt2mha.inference.scheduler.Scheduler` thread, and relay
its text events. One log line per request (logger ``gpt2mha.serve``).

``gpt2mha serve`` runs this app behind :class:`~gpt2mha.serving.operate.Operations` (probes
``/live`` and ``/health``, ``/version``, ``/metrics``, API keys, request ids): the port opens at
once and the model loads in a background thread (:func:`serve`).

Shutdown (:class:`GracefulServer`): SIGTERM drains: readiness answers 503 at once, new requests
503, and requests in flight may finish for ``graceful_timeout`` seconds while the port stays
open; past it the scheduler cancels what is left, so a non-streamed request gets a 503 error
object and a stream an error event then ``data: [DONE]``; then uvicorn stops.
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
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from .. import kernels
from ..core import checks
from ..core.classifier import ClassifierConfig
from ..inference.decoders import choose_decoder
from . import chat, tokens
from .address import check_address
from .completions import DRAIN_BYTES, Completions, Relay, read_body   # noqa: F401  (DRAIN_BYTES: the API as before)
from .operate import Operations, request_id
from .protocol import CLIP, MAX_STOP, MAX_TOKENS_OVERFLOW, APIError, cancelled_error, sse, validation_error
from ..inference.scheduler import Scheduler

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
               max_tokens_overflow: str = CLIP, classifier=None) -> FastAPI:
    """The ASGI app serving ``scheduler``'s model as ``model_name``; request bodies over
    ``max_body_bytes`` get 413; requests may carry up to ``max_stop`` stop strings;
    ``/v1/chat/completions`` renders messages with ``chat_template`` (Jinja source, default the
    built-in plain one, :data:`DEFAULT_CHAT_TEMPLATE`; None: that route answers 400,
    :func:`~gpt2mha.serving.chat.no_template_error`); ``max_tokens`` past the room a prompt
    leaves in the context is clipped to it (``max_tokens_overflow="clip"``, the default: the
    completion ends with ``finish_reason: "length"`` where the context does, as llama.cpp's
    server) or refused with a 400 (``"refuse"``, as OpenAI and vLLM;
    :data:`~gpt2mha.serving.protocol.MAX_TOKENS_OVERFLOW`); ``classifier``: a
    :class:`~gpt2mha.core.classifier.GPT2Classifier` served at ``/v1/classify`` instead of the
    generation routes (:mod:`.classify`).

    Every error, the app's own and the router's (404 unknown route, 405 wrong method), is
    OpenAI's ``{"error": {"message", "type", "param", "code"}}`` object.

    The app's lifespan starts the scheduler's thread and, at shutdown, stops it (queued and
    running sequences are cancelled; uvicorn first lets in-flight responses finish, see
    :class:`GracefulServer`). gpt2mha's C++ kernels are loaded here, before the server answers
    (no request waits on them; where none load, the one warning says which routes run instead).

    Raises:
        ValueError: max_body_bytes < 1, max_stop < 1, a max_tokens_overflow other than "clip" or
            "refuse", or a chat template that is not valid Jinja.
    """
    max_body_bytes = checks.as_int(max_body_bytes, "max_body_bytes", minimum=1)
    max_stop = checks.as_int(max_stop, "max_stop", minimum=1)
    if max_tokens_overflow not in MAX_TOKENS_OVERFLOW:
        raise ValueError(f"max_tokens_overflow={max_tokens_overflow!r}; expected one of "
                         f"{', '.join(MAX_TOKENS_OVERFLOW)}")
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
    completions = Completions(scheduler, model_name, max_body_bytes, max_stop, relay, max_tokens_overflow, adapters)
    app = FastAPI(title="gpt2mha", description="OpenAI-compatible completions over gpt2mha", lifespan=lifespan)
    app.add_middleware(AnswerCancelled)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_server_error)
    app.add_api_route("/health", health, methods=READ)
    app.add_api_route("/v1/models", models, methods=READ)
    app.add_api_route("/v1/models/{model_id:path}", model, methods=READ)
    app.add_api_route("/v1/completions", completions.handle, methods=["POST"])
    app.add_api_route("/v1/chat/completions", no_chat if template is None else chat.ChatCompletions(
        template, scheduler, model_name, max_body_bytes, max_stop, relay, max_tokens_overflow, adapters).handle,
        methods=["POST"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", tokenizer_info, methods=READ)
    if classifier is not None:
        from . import classify
        classify.add_routes(app, classifier, tok, model_name, max_body_bytes)
    return app


#: The methods of the routes that only read: GET, and HEAD (what load balancers' health checks
#: send: the same status and headers, no body).
READ = ["GET", "HEAD"]
#: The order an ``Allow`` header lists methods in.
METHOD_ORDER = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allow_header(methods) -> str:
    """The ``Allow`` header of a route answering ``methods``: them and OPTIONS, which every route
    answers, in :data:`METHOD_ORDER` (``"GET, HEAD, OPTIONS"``)."""
    methods = {m.upper() for m in methods} | {"OPTIONS"}
    return ", ".join(m for m in METHOD_ORDER if m in methods)


async def on_validation_error(request: Request, exc: RequestValidationError):
    """FastAPI's own validation errors as OpenAI's 400 naming the field."""
    return validation_error(exc.errors()).response()


async def on_api_error(request: Request, exc: APIError):
    """An :class:`~gpt2mha.serving.protocol.APIError` as its answer, logged in one line."""
    log.info("request %s status=%d param=%s error=%s", request_id.get(), exc.status, exc.param, exc.message)
    return exc.response()


async def on_http_error(request: Request, exc: HTTPException):
    """The router's errors as OpenAI's error object: 404 for an unknown route (OpenAI's
    ``Invalid URL (METHOD /path)``), 405 for a known route with another method (its ``Allow``
    header listing every method the route answers, :func:`allow_header`), any other with its
    status and Starlette's detail. ``OPTIONS`` on a known route is no error: 200 with ``Allow``
    and no body (RFC 9110 §9.3.7)."""
    where = f"{request.method} {request.url.path}"
    headers = exc.headers
    if exc.status_code == 404:
        message = f"Invalid URL ({where}): no such route on this server"
    elif exc.status_code == 405:
        headers = {k: v for k, v in (exc.headers or {}).items() if k.lower() != "allow"}
        routed = next((v for k, v in (exc.headers or {}).items() if k.lower() == "allow"), "")
        headers["Allow"] = allow_header(m.strip() for m in routed.split(",") if m.strip())
        if request.method == "OPTIONS":
            return Response(status_code=200, headers=headers)
        message = f"Invalid method for URL ({where}): this route accepts {headers['Allow']}"
    else:
        message = f"{exc.detail} ({where})"
    return await on_api_error(request, APIError(exc.status_code, message, headers=headers))


async def on_server_error(request: Request, exc: Exception):
    """An unexpected exception in a route as a 500 error object (Starlette logs the traceback)."""
    return APIError(500, f"The server failed on this request: {type(exc).__name__}: {exc}",
                    type="server_error").response()


class GracefulServer(uvicorn.Server):
    """uvicorn's server with a shutdown that drains first and keeps the API's promises.

    On SIGTERM (or ``should_exit``) the server drains (:meth:`drained`): the port stays open,
    readiness (``/health``) answers 503 ``"draining"`` and new requests 503
    (:meth:`Operations.drain <gpt2mha.serving.operate.Operations.drain>`), while the requests in
    flight go on. Once none is left, or ``graceful_timeout`` seconds later, uvicorn's own shutdown
    runs (the port closes, the lifespan stops the scheduler); at the timeout the scheduler first
    cancels every sequence still queued or running
    (:meth:`~gpt2mha.inference.scheduler.Scheduler.cancel_all`), so each request ends through its
    own handler: a non-streamed one with a 503 error object, a stream with an error event then
    ``data: [DONE]``, one log line each. uvicorn's own cancellation of the request tasks comes
    :data:`CANCEL_GRACE_S` later, as a last resort (:class:`AnswerCancelled` answers those). A
    second SIGINT ends the draining at once.
    """

    def __init__(self, config: "uvicorn.Config", ops: Operations, graceful_timeout: float):
        check_graceful_timeout(graceful_timeout)
        config.timeout_graceful_shutdown = CANCEL_GRACE_S
        super().__init__(config)
        self.ops, self.graceful_timeout = ops, graceful_timeout
        self.drain_deadline: float | None = None

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s); once it says to exit, exit only when :meth:`drained`."""
        return await super().on_tick(counter) and self.drained()

    def drained(self) -> bool:
        """Start draining (the first call) and say whether it is over: nothing in flight, or the
        graceful timeout passed (then what is left is cancelled), or a second SIGINT."""
        now = time.monotonic()
        if self.drain_deadline is None:
            self.drain_deadline = now + self.graceful_timeout
            n = self.ops.drain()
            if self.ops.error is None:
                log.info("draining: /health answers 503 and new requests 503; %d request(s) in flight get up to "
                         "%gs", n, self.graceful_timeout)
        if self.ops.in_flight == 0:
            return True
        if now >= self.drain_deadline or self.force_exit:
            self.cancel_in_flight()
            return True
        return False

    def cancel_in_flight(self) -> None:
        """Cancel every queued or running sequence (their requests then answer 503), log one line."""
        n = self.ops.scheduler.cancel_all() if self.ops.scheduler is not None else 0
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


def operated_app(scheduler: Scheduler, model_name: str, api_key: str | None = None, metrics: bool = True,
                 **kwargs) -> Operations:
    """:func:`create_app` over ``scheduler`` (``kwargs``: its options) behind
    :class:`~gpt2mha.serving.operate.Operations` (probes, ``/version``, ``/metrics`` unless
    ``metrics`` is False, ``api_key``, request ids): the app :func:`serve_in_thread` runs, for an
    in-process client (``TestClient``). Its lifespan starts the scheduler and stops it.

    Raises:
        ValueError: as :func:`create_app` and :class:`~gpt2mha.serving.operate.Operations`.
    """
    ops = Operations(model_name, api_key=api_key, metrics=metrics)
    ops.attach(scheduler, create_app(scheduler, model_name, **kwargs), start=False)
    return ops


def serve(model, tokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 16,
          max_queue: int = 256, graceful_timeout: float = 30.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          chat_template: str | None = DEFAULT_CHAT_TEMPLATE, max_stop: int = MAX_STOP,
          batch_invariant: bool | None = None, compile: bool = False, api_key: str | None = None,
          metrics: bool = True, load=None, max_tokens_overflow: str = CLIP, lora: dict | None = None,
          prefix_cache_mb: float | None = None) -> None:
    """Serve ``model`` until SIGINT/SIGTERM (``gpt2mha serve``).

    The port opens at once, behind :class:`~gpt2mha.serving.operate.Operations`: ``/live`` answers
    200 from the start, ``/health`` 503 ``"loading"`` and the API 503 ``model_loading`` while a
    background thread calls ``load()`` (when given: a function returning ``(model, tokenizer)``,
    e.g. reading and quantizing a checkpoint; ``model`` and ``tokenizer`` are then unused), builds
    the scheduler and the app and warms the route up (with ``compile``, compiles it); then
    ``/health`` says ``"ok"``. The thread runs as many threads as ``torch.get_num_threads()`` in
    the calling thread. If loading fails, the server stops and its exception is raised here.

    On SIGTERM the server drains (:class:`GracefulServer`): readiness and new requests get 503,
    in-flight requests may finish for ``graceful_timeout`` seconds, then what is left is
    cancelled (503 / a stream's error event); the scheduler is stopped and this returns normally.

    ``chat_template``, ``max_stop``, ``max_body_bytes``, ``max_tokens_overflow``: as :func:`create_app`; ``batch_invariant``:
    as :class:`~gpt2mha.inference.scheduler.Scheduler`; ``compile``: decode on the compiled step
    (:func:`~gpt2mha.inference.decoders.choose_decoder`, as ``generate(compile=True)``);
    ``api_key``: the key every route but the probes, ``/version`` and ``/metrics`` needs
    (``Authorization: Bearer``); ``metrics``: serve ``/metrics``; ``lora``: ``{name: adapter
    path}`` applied unmerged (:func:`~gpt2mha.inference.lora.apply_lora`), each served as its own
    model id over the one base. A classifier (:class:`~gpt2mha.core.classifier.GPT2Classifier`)
    is served at ``/v1/classify`` (:mod:`.classify`); ``prefix_cache_mb``: as
    :class:`~gpt2mha.inference.scheduler.Scheduler` (None: sized from free memory; 0: off).

    Raises:
        ValueError: a port outside [0, 65535] or one that cannot be listened on now (in use,
            :func:`~gpt2mha.serving.address.check_address`), a negative or non-finite graceful_timeout,
            a bad api_key, max_body_bytes < 1, max_stop < 1, a chat template that is not valid Jinja,
            a max_tokens_overflow other than "clip" or "refuse", or bad max_batch/max_queue (:class:`~gpt2mha.inference.scheduler.Scheduler`); after the
            server stopped, whatever ``load`` raised.
        RuntimeError: the server could not start (e.g. the address is in use or the host
            unknown; uvicorn logs the reason).
    """
    import signal

    import torch

    check_port(port)
    check_graceful_timeout(graceful_timeout)
    check_address(host, port)                     # a port in use: ValueError now, not after the app starts
    max_body_bytes = checks.as_int(max_body_bytes, "max_body_bytes", minimum=1)
    if lora and compile:
        raise ValueError("lora with compile: the compiled step runs no adapters; serve them on the decode view")
    max_stop = checks.as_int(max_stop, "max_stop", minimum=1)
    ops = Operations(model_name, api_key=api_key, metrics=metrics)
    config = uvicorn.Config(ops, host=host, port=port, access_log=False, log_level="info")
    server = GracefulServer(config, ops, graceful_timeout)
    n_threads = torch.get_num_threads()

    def build():
        from ..inference.threads import adopt_threads

        adopt_threads(n_threads)
        t0 = time.monotonic()
        try:
            m, tok = load() if load is not None else (model, tokenizer)
            if lora:
                from ..inference.lora import apply_lora
                apply_lora(m, lora)
            route = choose_decoder(m.eval(), compile=compile, batch_invariant=batch_invariant)
            scheduler = Scheduler(m, tok, max_batch=max_batch, max_queue=max_queue, batch_invariant=batch_invariant,
                                  route=route, prefix_cache_mb=prefix_cache_mb)
            app = create_app(scheduler, model_name, max_body_bytes=max_body_bytes, chat_template=chat_template,
                             max_stop=max_stop, max_tokens_overflow=max_tokens_overflow,
                             classifier=m if isinstance(m.config, ClassifierConfig) else None)
            log.info("model %s loaded in %.1f s; warming up", model_name, time.monotonic() - t0)
            ops.attach(scheduler, app)            # starts the scheduler in this thread, which warms it up
        except BaseException as e:                # the server stops; serve() raises it
            log.error("loading the model failed: %s: %s", type(e).__name__, e)
            ops.fail(e)
            server.should_exit = True

    loader = threading.Thread(target=build, name="gpt2mha-load", daemon=True)
    # uvicorn re-raises the signal it shut down on; a no-op SIGTERM handler makes that a clean exit (0)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        loader.start()
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        ops.close()
    if ops.error is not None:
        raise ops.error
    if not server.started:
        raise RuntimeError(f"the server did not start on {host}:{port} (the reason is logged above)")


@contextlib.contextmanager
def serve_in_thread(scheduler: Scheduler, model_name: str, host: str = "127.0.0.1", port: int = 0,
                    timeout: float = 30.0, graceful_timeout: float | None = None,
                    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, chat_template: str | None = DEFAULT_CHAT_TEMPLATE,
                    max_stop: int = MAX_STOP, api_key: str | None = None, metrics: bool = True,
                    max_tokens_overflow: str = CLIP, classifier=None):
    """Run the app (:func:`operated_app`: the API behind the probes, ``/metrics`` and
    ``api_key``) with uvicorn in a background thread for the ``with`` block; yields the base URL
    (``http://host:port``, the real port when ``port`` is 0). For tests and scripts that want the
    real server in their own process. On exit the server shuts down as ``gpt2mha serve`` does on
    SIGTERM (it drains: in-flight responses get ``graceful_timeout`` seconds, default
    ``timeout``, then are cancelled: :class:`GracefulServer`) and the scheduler is stopped.
    ``max_body_bytes``, ``chat_template``, ``max_stop``, ``max_tokens_overflow``, ``classifier``: as
    :func:`create_app`.

    The block starts once the engine is warmed up (``/health`` answers ``"ok"``), or once
    ``timeout`` has passed.

    Raises:
        RuntimeError: the server did not start within ``timeout`` seconds.
    """
    graceful_timeout = timeout if graceful_timeout is None else graceful_timeout
    ops = operated_app(scheduler, model_name, api_key=api_key, metrics=metrics, max_body_bytes=max_body_bytes,
                       chat_template=chat_template, max_stop=max_stop, max_tokens_overflow=max_tokens_overflow,
                       classifier=classifier)
    config = uvicorn.Config(ops, host=host, port=port, access_log=False, log_level="warning")
    server = GracefulServer(config, ops, graceful_timeout)
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
