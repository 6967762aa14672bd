"""Whether the server can listen on an address, checked before anything slow: ``gpt2mha serve``
asks it before torch is imported and the model loaded, so a port in use is one error line at
once instead of a loaded model, "Application startup complete" and uvicorn's exit.

Imports nothing but the standard library (the command's argument checks run before torch).
"""

from __future__ import annotations

import errno
import socket


def check_address(host: str, port: int) -> None:
    """Raises ValueError unless a TCP socket can be bound to ``host:port`` now, as uvicorn binds
    it (IPv6 when ``host`` has a colon, else IPv4; ``SO_REUSEADDR``, so a port whose last
    connections are in TIME_WAIT passes, and one another process listens on does not). The
    socket is closed at once: another process could still take the port before the server
    binds it (uvicorn then fails as before).

    Raises:
        ValueError: naming ``--host``/``--port``, the address and the system's reason (e.g.
            ``[Errno 98] Address already in use``, or a host name that does not resolve).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: cannot listen on {host}:{port}: the host does not resolve ({e}); "
                         f"expected an address or name of this machine (127.0.0.1, 0.0.0.0, ::1, ...)") from None
    except OSError as e:
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        hint = ("another process is listening there: choose another --port (0: any free port) or stop it"
                if e.errno == errno.EADDRINUSE else "expected an address of this machine and a port it may use")
        raise ValueError(f"--port {port} / --host {host!r}: cannot listen on {where}: {e}; {hint}") from None
