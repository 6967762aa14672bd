"""A lean streaming client for the serving benchmarks: HTTP/1.1 on a plain blocking socket,
one keep-alive connection per simulated client (each client a thread), server-sent events split
by hand.

Why not httpx: the servers under test and their clients share the machine's cores, and
httpx's asynchronous streaming (h11, anyio, its line decoder) cost ~0.47 ms of CPU per streamed
token on the 2-core benchmark machine (``getrusage`` over 1,024 tokens; the same protocol on
asyncio's streams: ~0.22 ms): a tenth of a step of the fastest models, taken from whichever
server was being measured. This client does the same protocol work (one ``POST``, a chunked or
sized body, one JSON document per ``data:`` line) with a ``recv`` and a few splits a chunk, and
every server gets the same client.

``answer(conn, path, body)`` returns a whole (not streamed) JSON answer and the time it arrived.
``stream(conn, path, body)`` yields ``(time, event)`` for each ``data:`` event as it arrives
(``event`` the parsed JSON, or the string ``"[DONE]"``) until the body ends (read it to the end
to reuse the connection; one left early is closed); an HTTP status other than 200 raises
:class:`HTTPError` with the start of the body.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit


class HTTPError(RuntimeError):
    pass


class Connection:
    """One keep-alive HTTP/1.1 connection to ``url`` (``http://host:port``), opened on first use,
    again after an answer that closes it (``Connection: close``, an error), and once more when a
    reused connection turns out closed by the server before answering (``timeout``: seconds a
    ``recv`` may wait)."""

    def __init__(self, url: str, timeout: float = 900.0):
        u = urlsplit(url)
        self.host, self.port, self.timeout = u.hostname, u.port or 80, timeout
        self.sock: socket.socket | None = None
        self.buf = b""

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock, self.buf = None, b""

    def _recv(self) -> bytes:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the server closed the connection")
        return data

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self.buf += self._recv()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self.buf += self._recv()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def post(self, path: str, body: dict):
        """Send ``POST path`` with a JSON body; returns (status, headers: {lower name: value})."""
        data = json.dumps(body).encode()
        request = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                   f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data
        reused = self.sock is not None
        try:
            status = self._send(request)
        except (ConnectionError, BrokenPipeError):
            if not reused:
                raise
            self.close()                              # the server closed the idle connection: once more
            status = self._send(request)
        headers = {}
        while line := self._line():
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        if status in (204, 304) or 100 <= status < 200:
            headers["content-length"] = "0"           # no body, whatever the headers say
        return status, headers

    def _send(self, request: bytes) -> int:
        """Send ``request`` (opening the connection if needed); returns the answer's status."""
        if self.sock is None:
            self.sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(request)
        return int(self._line().split(b" ", 2)[1])

    def body_pieces(self, headers: dict):
        """The response body as it arrives: chunked (each chunk as it comes), sized, or up to the
        connection's close (then in one piece at the close: its events all get that time)."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int(self._line().split(b";", 1)[0], 16):
                piece = self._exactly(size + 2)[:-2]
                yield piece
            while self._line():                      # trailers, then the blank line
                pass
        elif "content-length" in headers:
            yield self._exactly(int(headers["content-length"]))
        else:
            rest = [self.buf]
            while data := self.sock.recv(1 << 16):
                rest.append(data)
            self.close()
            yield b"".join(rest)
        if headers.get("connection", "").lower() == "close":
            self.close()


def stream(conn: Connection, path: str, body: dict):
    """``POST path`` with ``body``; yields ``(perf_counter time, event)`` for every ``data:`` event."""
    status, headers = conn.post(path, body)
    if status != 200:
        text = b"".join(conn.body_pieces(headers))
        conn.close()
        raise HTTPError(f"HTTP {status}: {text[:500]!r}")
    buf, clean = b"", False
    try:
        for piece in conn.body_pieces(headers):
            now = time.perf_counter()
            buf = (buf + piece).replace(b"\r\n", b"\n")
            *events, buf = buf.split(b"\n\n")
            for ev in events:                         # an event's data lines joined by newlines (SSE)
                lines = [line[5:].strip() for line in ev.split(b"\n") if line.startswith(b"data:")]
                if lines:
                    data = b"\n".join(lines)
                    yield now, ("[DONE]" if data == b"[DONE]" else json.loads(data))
        clean = True
    finally:
        if not clean:                                 # left mid-body: the connection cannot be reused
            conn.close()


def answer(conn: Connection, path: str, body: dict) -> tuple[float, dict]:
    """``POST path`` with ``body`` answered whole; returns ``(perf_counter time at its end, the parsed JSON)``."""
    status, headers = conn.post(path, body)
    data = b"".join(conn.body_pieces(headers))
    if status != 200:
        conn.close()
        raise HTTPError(f"HTTP {status}: {data[:500]!r}")
    return time.perf_counter(), json.loads(data)
