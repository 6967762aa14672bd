"""The explainer's web app (FastAPI) and its server (uvicorn on 127.0.0.1).

Routes (JSON unless said; every ``/api/`` request needs the per-launch token, :mod:`.security`):

- ``GET /?token=T``: the page (HTML), with the token and the first session in it; without the
  right token a short page saying which URL to open;
- ``GET /static/...``: the page's JavaScript, CSS and example modules;
- ``POST /api/session`` ``{prompt, model?}``: a new sequence (``model``: another checkpoint to load);
- ``GET /api/unit?session=&kind=&layer=&head=``: one view's numbers (:meth:`.session.Sequence.unit`);
- ``POST /api/sample`` ``{session, temperature, top_k, top_p}``: the sampling filters' view;
- ``POST /api/step`` ``{session, temperature, top_k, top_p, seed, layer}``: draw, append, decode
  one step on the KV cache; ``POST /api/reset`` ``{session}``: back to the prompt;
- ``POST /api/ablate`` ``{session, heads, mode}``: the next-token distribution with heads ablated;
- ``POST /api/check`` ``{code, class_name?}``: check a module (:mod:`.checker`; 403 when the app
  listens beyond 127.0.0.1).

Bad input is a 400 ``{"error": message}`` naming the field, an unknown session a 404, an answer
the model's NaN or infinite numbers spoil a 422 saying so (:class:`.tensors.NonFiniteError`;
a failed request changes no sequence), never a bare 500: an unexpected failure is a 500 with
the same ``{"error"}`` object.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections import OrderedDict

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ...inference.sampling import NonFiniteLogitsError
from . import security
from .checker import CheckLimits, run_check
from .session import ModelEntry, Sequence
from .tensors import NonFiniteError, check_finite

log = logging.getLogger("gpt2mha.explain")

#: The page's files (HTML template, JavaScript, CSS, example modules).
STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
#: Sequences kept at once (the oldest is dropped; its page is told to reload).
MAX_SESSIONS = 8
#: Largest request body, in bytes.
MAX_BODY = 1 << 20
#: Headers of every page and answer: no framing, no referrer, only this origin's resources.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
                                           "script-src 'self'; connect-src 'self'; frame-ancestors 'none'",
                "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store",
                "X-Content-Type-Options": "nosniff"}


class BadRequest(ValueError):
    """A request the app answers with ``status`` (400 unless said) and ``{"error": message}``."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class Explain:
    """One launch: the default model, the sequences the pages work on, the token and the checker.

    Args:
        entry: the model ``gpt2mha explain`` loaded; prompt: the first sequence's text.
        token: the per-launch secret (default: a new one).
        limits: the checker's limits, or None when it is off; checker_note: why it is off.
        load: ``load(name) -> GPT2`` for a model asked for by the page (None: only ``entry``).
    """

    def __init__(self, entry: ModelEntry, prompt: str, token: str | None = None, limits: CheckLimits | None = None,
                 checker_note: str = "", load=None):
        self.entry, self.prompt, self.token = entry, prompt, token or security.new_token()
        self.limits, self.checker_note, self.load = limits, checker_note, load
        self.models: dict[str, ModelEntry] = {entry.name: entry}
        self.sessions: OrderedDict[str, Sequence] = OrderedDict()
        self.check_lock = threading.Lock()
        self.pristine = Sequence(entry, entry.encode_prompt(prompt))     # each page load forks it

    def warm(self) -> None:
        """Compute what the page shows first (the pipeline, layer 0, head 0 of it, every head's
        small multiple) before it is asked for."""
        seq = self.pristine
        for kind, layer, head in (("pipeline", None, None), ("layer", 0, None), ("head", 0, 0), ("heads", None, None)):
            seq.unit(kind, layer, head)

    def model(self, name: str | None) -> ModelEntry:
        """The model named by the page (None or the launch's: the launch's); a new one is loaded
        and replaces the previous page-loaded one (two models in memory at most).

        Raises:
            ValueError: loading it failed (a path that does not exist, a bad checkpoint).
        """
        if not name or name == self.entry.name:
            return self.entry
        if name not in self.models:
            if self.load is None:
                raise BadRequest("this app runs one model only")
            model = self.load(name)
            for other in [n for n in self.models if n != self.entry.name]:
                del self.models[other]
            self.models[name] = ModelEntry(model, name)
        return self.models[name]

    def new_session(self, prompt, model: str | None = None) -> tuple[str, Sequence]:
        """A new sequence for ``prompt`` on the named model (:meth:`model`); returns ``(id, sequence)``.

        Raises:
            ValueError: an empty prompt, one longer than the context, a model that does not load.
        """
        entry = self.model(model)
        return self.add(Sequence(entry, entry.encode_prompt(prompt)))

    def add(self, seq: Sequence) -> tuple[str, Sequence]:
        """Register ``seq`` under a new id (the oldest beyond :data:`MAX_SESSIONS` is dropped)."""
        sid = secrets.token_urlsafe(12)
        self.sessions[sid] = seq
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)
        return sid, seq

    def session(self, sid) -> Sequence:
        seq = self.sessions.get(sid) if isinstance(sid, str) else None
        if seq is None:
            raise BadRequest("this page's session is gone (the server restarted, or more pages were opened since): "
                             "reload the page", 404)
        self.sessions.move_to_end(sid)
        return seq

    def boot(self) -> dict:
        """What a page load starts from (embedded in its HTML): a session of its own, forked from
        the launch's prompt (:meth:`~.session.Sequence.fork`: its answers already computed)."""
        sid, seq = self.add(self.pristine.fork())
        return {"mode": "live", "token": self.token, "session": sid, "prompt": self.prompt, **seq.summary(),
                "checker": {"on": self.limits is not None, "note": self.checker_note,
                            "timeout_s": self.limits.timeout_s if self.limits else None,
                            "memory_mb": self.limits.memory_mb if self.limits else None}}


def page_html(boot: dict) -> str:
    """``static/index.html`` with ``boot`` embedded as JSON (``<`` escaped: no tag can end the script)."""
    with open(os.path.join(STATIC, "index.html"), encoding="utf-8") as f:
        template = f.read()
    return template.replace("__BOOT__", json.dumps(boot).replace("<", "\\u003c"))


async def _body(request: Request) -> dict:
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise BadRequest(f"the request is {len(raw):,} bytes; at most {MAX_BODY:,}", 413)
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _int(value, name: str) -> int:
    try:
        if isinstance(value, bool) or value is None or float(value) != int(float(value)):
            raise ValueError
        return int(float(value))
    except (ValueError, TypeError, OverflowError):
        raise BadRequest(f"{name}={value!r} must be an integer") from None


def _num(value, name: str) -> float:
    try:
        if isinstance(value, bool) or value is None:
            raise ValueError
        return float(value)
    except (ValueError, TypeError):
        raise BadRequest(f"{name}={value!r} must be a number") from None


def create_app(state: Explain):
    """The FastAPI app over ``state`` (wrap it in :class:`.security.Guard` to serve it)."""
    app = FastAPI(title="gpt2mha explain", docs_url=None, redoc_url=None, openapi_url=None)

    def answer(fn, *args):
        async def run():
            try:
                result = await run_in_threadpool(fn, *args)
                check_finite(result)
                return JSONResponse(result, headers={"Cache-Control": "no-store"})
            except BadRequest as e:
                return JSONResponse({"error": str(e)}, status_code=e.status)
            except (NonFiniteError, NonFiniteLogitsError) as e:
                return JSONResponse({"error": f"{e}" if isinstance(e, NonFiniteError) else
                                     f"the model's numbers are not finite: {e}"}, status_code=422)
            except ValueError as e:
                return JSONResponse({"error": str(e)}, status_code=400)
            except Exception as e:                              # a bug: still an answer the page shows
                log.exception("explain: %s failed", getattr(fn, "__name__", "request"))
                return JSONResponse({"error": f"the app failed on this request: {type(e).__name__}: {e}"},
                                    status_code=500)
        return run()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return JSONResponse({"error": f"{exc.detail}: {request.method} {request.url.path}"}, status_code=exc.status_code)

    @app.get("/")
    async def index(request: Request):
        given = request.query_params.get("token", "")
        if not hmac.compare_digest(given.encode(), state.token.encode()):
            return HTMLResponse("<!doctype html><meta charset=utf-8><title>gpt2mha explain</title><p>Open the address "
                                "<code>gpt2mha explain</code> printed: it holds this launch's token "
                                "(<code>/?token=…</code>).</p>", status_code=403, headers=PAGE_HEADERS)
        boot = await run_in_threadpool(state.boot)
        return HTMLResponse(page_html(boot), headers=PAGE_HEADERS)

    @app.post("/api/session")
    async def session(request: Request):
        try:
            body = await _body(request)
        except BadRequest as e:
            return JSONResponse({"error": str(e)}, status_code=e.status)

        def make():
            sid, seq = state.new_session(body.get("prompt"), body.get("model"))
            return {"session": sid, **seq.summary()}
        return await answer(make)

    @app.get("/api/unit")
    async def unit(request: Request):
        q = request.query_params

        def get():
            seq = state.session(q.get("session"))
            layer = _int(q["layer"], "layer") if "layer" in q else None
            head = _int(q["head"], "head") if "head" in q else None
            return seq.unit(q.get("kind", ""), layer, head)
        return await answer(get)

    def with_body(fn):
        async def route(request: Request):
            try:
                body = await _body(request)
            except BadRequest as e:
                return JSONResponse({"error": str(e)}, status_code=e.status)
            return await answer(fn, body)
        return route

    def sampling_fields(body):
        return (_num(body.get("temperature", 1.0), "temperature"), _int(body.get("top_k", 0), "top_k"),
                _num(body.get("top_p", 1.0), "top_p"))

    def sample(body):
        return state.session(body.get("session")).sampling(*sampling_fields(body))

    def step(body):
        seed = body.get("seed")
        seed = None if seed in (None, "") else _int(seed, "seed")
        return state.session(body.get("session")).step(*sampling_fields(body), seed=seed,
                                                       layer=_int(body.get("layer", 0), "layer"))

    def reset(body):
        return state.session(body.get("session")).reset()

    def ablate(body):
        return state.session(body.get("session")).ablate(body.get("heads"), body.get("mode", "zero"))

    def check(body):
        if state.limits is None:
            raise BadRequest(f"the checker is off: {state.checker_note}", 403)
        if not state.check_lock.acquire(blocking=False):
            raise BadRequest("a check is already running; wait for it", 429)
        try:
            return run_check(body.get("code"), body.get("class_name") or None, state.limits)
        finally:
            state.check_lock.release()

    for path, fn in (("sample", sample), ("step", step), ("reset", reset), ("ablate", ablate), ("check", check)):
        app.add_api_route(f"/api/{path}", with_body(fn), methods=["POST"])
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def guarded_app(state: Explain, host: str, port: int | None = None) -> security.Guard:
    """:func:`create_app` behind :class:`.security.Guard`: the Host names it answers to are the
    loopback names, plus ``host`` when it is a name or an address other than a wildcard (an app
    bound to 0.0.0.0 or :: answers to any Host)."""
    hosts = None if host in ("0.0.0.0", "::", "") else tuple(dict.fromkeys([*security.LOOPBACK, host.strip("[]").lower()]))
    return security.Guard(create_app(state), state.token, hosts, port)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``(host, port)`` (port 0: a free one).

    Raises:
        ValueError: the address cannot be bound (in use, unknown host), naming it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(64)
    sock.set_inheritable(True)
    return sock


def url_of(host: str, port: int, token: str) -> str:
    """The address to open: ``http://HOST:PORT/?token=TOKEN``."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else (f"[{host}]" if ":" in host else host)
    return f"http://{shown}:{port}/?token={token}"


def serve(state: Explain, host: str = "127.0.0.1", port: int = 8765, open_browser: bool = False, announce=print) -> None:
    """Serve the explainer until Ctrl-C (``gpt2mha explain``); ``announce`` gets the URL line."""
    import uvicorn

    sock = bind(host, port)
    port = sock.getsockname()[1]
    app = guarded_app(state, host, port)
    url = url_of(host, port, state.token)
    announce(f"gpt2mha explain: open {url}  (Ctrl-C stops it)")
    sys.stdout.flush()                                                # a pipe or a log sees it at once
    if open_browser:
        import webbrowser
        threading.Timer(0.5, webbrowser.open, args=(url,)).start()
    server = uvicorn.Server(uvicorn.Config(app, access_log=False, log_level="warning"))
    server.run(sockets=[sock])


@contextlib.contextmanager
def serve_in_thread(state: Explain, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
    """The app served by uvicorn in a background thread for the ``with`` block (tests, the
    benchmark); yields ``(base_url, page_url)`` (``page_url`` carries the token). Stopped on exit.

    Raises:
        RuntimeError: the server did not start within ``timeout`` seconds.
    """
    import uvicorn

    sock = bind(host, port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(guarded_app(state, host, port), access_log=False, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), name="gpt2mha-explain",
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the explain server did not start on {host}:{port}")
            time.sleep(0.01)
        yield f"http://{host}:{port}", url_of(host, port, state.token)
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
