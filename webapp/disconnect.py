"""Whether the client of the HTTP request being served has gone away, while its answer is still being waited for."""

from __future__ import annotations

import select
import socket

from flask import request


def client_gone() -> bool:
    """True once the client closed its connection. A client waiting for a whole answer sends nothing more, so its
    socket turns readable only when it closes (or resets) it; one that sends another request on the same
    connection meanwhile is still there. Without the server's socket (another WSGI server) it is never gone."""
    sock = request.environ.get("gunicorn.socket")
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):   # reset by the peer, or already closed here
        return True
