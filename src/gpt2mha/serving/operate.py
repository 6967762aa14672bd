"""Operating the server: what stands in front of the API app (:func:`~gpt2mha.serving.server.create_app`)
in ``gpt2mha serve`` — probes, ``/version``, ``/metrics``, API keys, request ids, the loading and
draining phases.

:class:`Operations` is an ASGI app. It answers these routes itself (GET, HEAD and OPTIONS; another
method is a 405):

- ``/live``: liveness, 200 whenever the process serves HTTP, while it loads and drains too
  (``{"status": "ok", "phase": ...}``); a Kubernetes ``livenessProbe``.
- ``/health``: readiness, 200 ``{"status": "ok", ...}`` with the scheduler's counts once the model
  is loaded and warmed up; 503 with ``status`` ``"loading"``, ``"draining"`` (after SIGTERM),
  ``"queue_full"`` (a one-sequence request would get 429 now) or ``"failed"`` (the model did not
  load); a ``readinessProbe`` or a load balancer's health check.
- ``/version``: ``{"version", "model"}``.
- ``/metrics``: Prometheus' text format (:mod:`.metrics`); 404 with ``--no-metrics``.

Everything else goes to the API app, through these steps:

1. ``X-Request-Id``: the client's (printable ASCII, at most :data:`MAX_REQUEST_ID` characters)
   or a new one, sent back on the answer and written in the request's log line
   (:data:`request_id`).
2. With an API key, every route but the four above needs ``Authorization: Bearer KEY``
   (compared in constant time); else 401 in OpenAI's error shape, as OpenAI answers a wrong
   key. ``OPTIONS`` (CORS preflight, which carries no credentials) passes.
3. While the model loads: 503 ``code: model_loading`` with ``Retry-After`` (``model_load_failed``
   once loading failed, while the server stops). While draining: 503 (shutting down) with
   ``Retry-After``; requests already inside go on.

The draining itself (when SIGTERM comes, how long in-flight requests get) is
:class:`~gpt2mha.serving.server.GracefulServer`'s; the loading, :func:`~gpt2mha.serving.server.serve`'s.

Sources: Kubernetes' liveness/readiness/startup probes; OpenAI's error objects (401
``invalid_api_key``); RFC 6750 (``WWW-Authenticate: Bearer``); vLLM's ``--api-key`` (``/v1`` routes).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import hmac
import logging
import re
import threading
import uuid

from fastapi.responses import JSONResponse, Response

from .protocol import RETRY_AFTER_S, APIError, submit_error
from ..inference.scheduler import ShuttingDown

log = logging.getLogger("gpt2mha.serve")

LOADING, READY, DRAINING, FAILED = "loading", "ready", "draining", "failed"
#: The routes :class:`Operations` answers itself; open without an API key.
OPEN_ROUTES = ("/live", "/health", "/version", "/metrics")
#: The longest ``X-Request-Id`` kept from a client (longer, or with other than printable ASCII: a new one).
MAX_REQUEST_ID = 128
REQUEST_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID}}}")
#: The request id of the request being answered (``"-"`` outside one), for its log line.
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("gpt2mha_request_id", default="-")


def check_api_key(api_key: str | None) -> str | None:
    """Raises ValueError unless ``api_key`` is None or a non-empty string without whitespace or
    control characters (what an ``Authorization: Bearer`` header can carry)."""
    if api_key is None:
        return None
    if not isinstance(api_key, str) or not re.fullmatch(r"[\x21-\x7e]+", api_key):
        raise ValueError("api_key must be a non-empty string of printable ASCII without spaces "
                         "(what an Authorization: Bearer header carries)")
    return api_key


def digest(value: bytes) -> bytes:
    """SHA-256 of ``value``: keys are compared as digests, so the time taken tells nothing of the
    key's length or contents."""
    return hashlib.sha256(value).digest()


class Operations:
    """The ASGI app ``gpt2mha serve`` runs: probes, ``/version``, ``/metrics``, API keys and
    request ids in front of the API app, which :meth:`attach` hands it once the model is loaded.

    Args:
        model_name: the served name (``/version``, ``/health``, the metrics' ``model_name``).
        api_key: the key every route but :data:`OPEN_ROUTES` needs (None: no authentication).
        metrics: serve ``/metrics`` (:class:`~gpt2mha.serving.metrics.ServerMetrics`).

    Its lifespan starts the attached scheduler (if :meth:`attach` did not) and stops it.

    Raises:
        ValueError: an api_key that is empty or holds whitespace or control characters.
    """

    def __init__(self, model_name: str, api_key: str | None = None, metrics: bool = True):
        self.model_name = model_name
        self._key = None if check_api_key(api_key) is None else digest(api_key.encode())
        if metrics:
            from .metrics import ServerMetrics
            self.metrics = ServerMetrics(model_name)
        else:
            self.metrics = None
        self.scheduler = None
        self.api = None
        self.error: BaseException | None = None
        self.draining = False
        self.in_flight = 0                            # requests handed to the API app, not yet answered
        self._lock = threading.Lock()
        self._serving = False                         # the lifespan has started
        self._closed = False

    # ----------------------------------------------------------------------- the phases
    def attach(self, scheduler, api, start: bool = True) -> None:
        """Serve ``api`` (the app of :func:`~gpt2mha.serving.server.create_app` over
        ``scheduler``) from now on. ``start``: start the scheduler now, in the calling thread
        (the one that loaded the model: :meth:`Scheduler.start
        <gpt2mha.inference.scheduler.Scheduler.start>` releases its OpenMP workers); otherwise
        the lifespan's startup starts it. Nothing is started once :meth:`close` has run."""
        if self.metrics is not None:
            self.metrics.watch(scheduler)
        with self._lock:
            if self._closed:
                return
            self.scheduler, self.api = scheduler, api
            if start or self._serving:
                scheduler.start()

    def fail(self, error: BaseException) -> None:
        """The model could not be loaded: readiness says ``"failed"`` until the server stops."""
        self.error = error

    def drain(self) -> int:
        """Refuse new requests from now on (503) and say so in readiness; returns the number of
        requests in flight, which go on."""
        self.draining = True
        return self.in_flight

    def close(self) -> None:
        """Stop the scheduler (its queued and running sequences are cancelled) and start none later."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            scheduler = self.scheduler
        if scheduler is not None:
            scheduler.stop()

    @property
    def phase(self) -> str:
        """``"loading"``, ``"ready"``, ``"draining"`` or ``"failed"``."""
        if self.error is not None:
            return FAILED
        if self.draining:
            return DRAINING
        if self.api is None or not self.scheduler.ready:
            return LOADING
        return READY

    # -------------------------------------------------------------------------- the probes
    def live(self) -> Response:
        return JSONResponse({"status": "ok", "phase": self.phase})

    def health(self) -> Response:
        """Readiness: 200 ``ok`` with the scheduler's counts, or 503 saying why not."""
        phase = self.phase
        stats = self.scheduler.stats() if self.scheduler is not None else {}
        body = {"status": phase, "model": self.model_name, **stats}
        if phase == FAILED:
            body["error"] = f"{type(self.error).__name__}: {self.error}"
        elif phase == DRAINING:
            body["in_flight"] = self.in_flight
        elif phase == READY:
            full = stats["queued"] >= stats["free_slots"] + stats["max_queue"]
            body["status"] = "queue_full" if full else "ok"
            if not full:
                return JSONResponse(body)
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    def version(self) -> Response:
        from ..version import __version__
        return JSONResponse({"version": __version__, "model": self.model_name})

    def metrics_text(self) -> Response:
        if self.metrics is None:
            return APIError(404, "Metrics are off on this server (gpt2mha serve --no-metrics)",
                            code="metrics_off").response()
        body, content_type = self.metrics.exposition()
        return Response(body, media_type=content_type)

    # ---------------------------------------------------------------------------- ASGI
    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.lifespan(receive, send)
        if scope["type"] != "http":                   # (websockets: none of the API's routes)
            return await self.forward(scope, receive, send) if self.api is not None else None
        rid = given_request_id(scope) or uuid.uuid4().hex
        token = request_id.set(rid)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            path, method = scope["path"], scope["method"]
            if path in OPEN_ROUTES:
                answer = self.probe(path, method)
            elif self._key is not None and method != "OPTIONS" and not self.authorized(scope):
                answer = unauthorized(scope)
            elif self.draining:
                answer = submit_error(ShuttingDown("the server is draining (SIGTERM)")).response()
            elif self.error is not None:
                answer = APIError(503, f"The model failed to load ({type(self.error).__name__}: {self.error}); the "
                                       f"server is stopping", type="server_error", code="model_load_failed").response()
            elif self.api is None:
                answer = APIError(503, "The model is loading; retry shortly (GET /health says ok once it is ready)",
                                  type="server_error", code="model_loading",
                                  headers={"Retry-After": str(RETRY_AFTER_S)}).response()
            else:
                return await self.forward(scope, receive, send_with_id)
            await answer(scope, receive, send_with_id)
        finally:
            request_id.reset(token)

    async def forward(self, scope, receive, send):
        """Hand the request to the API app, counted in :attr:`in_flight` until it is answered."""
        self.in_flight += 1
        try:
            await self.api(scope, receive, send)
        finally:
            self.in_flight -= 1

    def probe(self, path: str, method: str) -> Response:
        if method == "OPTIONS":                               # RFC 9110 §9.3.7, as the API's routes answer it
            return Response(status_code=200, headers={"Allow": "GET, HEAD, OPTIONS"})
        if method not in ("GET", "HEAD"):
            return APIError(405, f"Invalid method for URL ({method} {path}): this route accepts GET, HEAD, OPTIONS",
                            headers={"Allow": "GET, HEAD, OPTIONS"}).response()
        return {"/live": self.live, "/health": self.health, "/version": self.version,
                "/metrics": self.metrics_text}[path]()

    def authorized(self, scope) -> bool:
        """Whether the request carries ``Authorization: Bearer KEY`` with the key (constant time)."""
        given = header(scope, b"authorization") or b""
        scheme, _, credentials = given.partition(b" ")
        return hmac.compare_digest(digest(credentials.strip()), self._key) and scheme.lower() == b"bearer"

    async def lifespan(self, receive, send):
        """ASGI lifespan: start the attached scheduler at startup, stop it at shutdown."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                with self._lock:
                    self._serving = True
                    if self.scheduler is not None:
                        self.scheduler.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await asyncio.get_running_loop().run_in_executor(None, self.close)
                await send({"type": "lifespan.shutdown.complete"})
                return


def header(scope, name: bytes) -> bytes | None:
    """The request's first header ``name`` (lower-case bytes), or None."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


def given_request_id(scope) -> str | None:
    """The client's ``X-Request-Id`` when it is printable ASCII of at most :data:`MAX_REQUEST_ID`
    characters (safe to log and echo), else None."""
    value = header(scope, b"x-request-id")
    if value is None:
        return None
    text = value.decode("latin-1").strip()
    return text if REQUEST_ID.fullmatch(text) else None


def unauthorized(scope) -> Response:
    """401 in OpenAI's shape (``invalid_api_key``), with ``WWW-Authenticate: Bearer`` (RFC 6750)."""
    given = (header(scope, b"authorization") or b"").partition(b" ")[2].strip()
    message = ("Missing API key: send it as 'Authorization: Bearer KEY' (the openai client's api_key)"
               if not given else "Incorrect API key provided")
    log.info("request %s status=401 path=%s error=%s", request_id.get(), scope["path"], message)
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}).response()
