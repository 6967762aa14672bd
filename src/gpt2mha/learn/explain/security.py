"""Who may talk to the explainer: the per-launch token, the ``Host`` and ``Origin`` checks.

The page can run code a learner pastes (the checker), so a request the learner did not make
from the page must never reach it:

* every ``/api/`` request carries the per-launch secret token (``X-Explain-Token``), which
  only the page holds (it is in the HTML the server sends; another site cannot read that page,
  the browser's same-origin policy stops it);
* the ``Host`` header must name the address the app listens on (127.0.0.1, localhost, [::1]
  or the ``--host`` given) at its port: a DNS-rebinding page reaches 127.0.0.1 under its own
  host name, which is refused, so it never sees the page or its token;
* an ``Origin`` header (browsers send one with every cross-origin request and with same-origin
  POSTs) must be the app's own, and ``Sec-Fetch-Site`` on ``/api/`` must be ``same-origin`` (or
  ``none``: typed by the user): a page the learner has open elsewhere cannot POST to it.

:func:`refusal` decides; :class:`Guard` is the ASGI middleware that answers 403 with the reason.
"""

from __future__ import annotations

import hmac
import json
import secrets
from urllib.parse import urlsplit

#: The header carrying the per-launch token.
TOKEN_HEADER = "x-explain-token"
#: Host names that are this machine's loopback interface.
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def new_token() -> str:
    """A per-launch secret: 32 random bytes, URL-safe base64."""
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a ``--host`` value) binds this machine's loopback interface only."""
    return host.strip("[]").lower() in LOOPBACK or host.startswith("127.")


def split_host(value: str) -> tuple[str, int | None]:
    """``"127.0.0.1:8000"`` → ``("127.0.0.1", 8000)``, ``"[::1]:80"`` → ``("::1", 80)``;
    a malformed value → ``("", None)``."""
    try:
        u = urlsplit("//" + value)
        return (u.hostname or "").lower(), u.port
    except ValueError:
        return "", None


def refusal(method: str, path: str, headers: dict[str, str], token: str, hosts: tuple[str, ...] | None,
            port: int | None) -> str | None:
    """Why a request must be refused (403), or None to let it through.

    Args:
        method, path: the request's; headers: lower-case names → values.
        token: this launch's secret; hosts: the host names the app answers to (None: any, for an
            app bound beyond loopback with no name given); port: the port it listens on (None:
            not known yet, not checked).
    """
    name, hport = split_host(headers.get("host", ""))
    if hosts is not None and (name not in hosts or (port is not None and hport not in (port, None))):
        return f"foreign Host header {headers.get('host', '')!r}: this app answers to {', '.join(hosts)} only"
    origin = headers.get("origin")
    if origin is not None:
        u = urlsplit(origin) if origin != "null" else None
        try:
            oport = u.port if u else None
        except ValueError:
            oport = -1
        same = (u is not None and u.scheme == "http" and (u.hostname or "").lower() == name
                and (oport or 80) == (hport or 80))
        if not same:
            return f"cross-origin request from {origin!r} refused"
    api = path.startswith("/api/")
    if api and headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return f"cross-site request refused (Sec-Fetch-Site: {headers['sec-fetch-site']})"
    if api and not hmac.compare_digest(headers.get(TOKEN_HEADER, "").encode(), token.encode()):
        what = "missing" if TOKEN_HEADER not in headers else "wrong"
        return f"{what} token: requests to the API need this launch's token (reload the page gpt2mha explain printed)"
    return None


class Guard:
    """ASGI middleware: :func:`refusal` for every HTTP request; a refused one gets 403 and
    ``{"error": reason}``. ``port`` may be set after the server binds (port 0)."""

    def __init__(self, app, token: str, hosts: tuple[str, ...] | None, port: int | None = None):
        self.app, self.token, self.hosts, self.port = app, token, hosts, port

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        reason = refusal(scope["method"], scope["path"], headers, self.token, self.hosts, self.port)
        if reason is None:
            return await self.app(scope, receive, send)
        body = json.dumps({"error": reason}).encode()
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
