"""Whether the client of the HTTP request being served has gone away, while its answer is still being waited for."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator

from flask import request

CLIENT_CHECK_S = 1.0   # how often a client waiting for a whole answer is checked for


class ClientGone(Exception):
    """The client went away while its whole answer was awaited; the events were closed."""


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


def final_event(events: Iterator[dict]) -> dict | None:
    """A job's last event (done or error; None: it never came), read while the client waits for the whole answer:
    raises ClientGone, having closed the events, once the client is checked and found gone."""
    final, checked = None, time.monotonic()
    for event in events:
        if time.monotonic() - checked >= CLIENT_CHECK_S:
            checked = time.monotonic()
            if client_gone():
                events.close()
                raise ClientGone
        if event["event"] not in ("token", "waiting"):
            final = event
    return final
