"""Test clients that talk to the running system the way a browser's page and an API user do."""

from __future__ import annotations

import functools
import queue
import time

import requests
import socketio

from bench.socketio_client import InOrderClient


class ChatClient:
    """A browser stand-in: the session cookie from the page, then a websocket Socket.IO connection."""

    def __init__(self, url: str, http: requests.Session | None = None) -> None:
        self.http = http or requests.Session()
        self.http.get(url + "/").raise_for_status()
        self.events: queue.Queue = queue.Queue()
        self.finished: set[str] = set()
        self.sio = InOrderClient(http_session=self.http, reconnection=False)
        for name in ("accepted", "token", "done", "error"):
            self.sio.on(name, lambda data, name=name: self.events.put((name, data)))
        self.sio.connect(url, transports=["websocket"], wait_timeout=10)

    def next(self, timeout: float = 60) -> tuple[str, dict]:
        return self.events.get(timeout=timeout)

    def ask(self, text: str, conversation_id: str | None = None, timeout: float = 60, **extra) -> dict:
        payload = {"text": text, **extra} | ({"conversation_id": conversation_id} if conversation_id else {})
        self.sio.emit("chat_message", payload)
        # An answer already finished can be said again (a worker killed before its ack redelivers it and
        # shows the stored answer once more); the page ignores it, and so does this client.
        while (event := self.next(timeout))[1].get("request_id") in self.finished:
            pass
        name, accepted = event
        assert name == "accepted", (name, accepted)
        tokens, deadline = [], time.monotonic() + timeout
        while True:
            name, data = self.next(max(0.1, deadline - time.monotonic()))
            if data.get("request_id") in self.finished:
                continue
            assert data.get("request_id") == accepted["request_id"], data
            if name == "token":
                tokens.append(data["text"])
            elif name == "done":
                self.finished.add(data["request_id"])
                return {"accepted": accepted, "tokens": tokens, "done": data}
            else:
                raise AssertionError(f"unexpected {name}: {data}")

    def close(self) -> None:
        disconnect(self.sio)


def disconnect(sio: socketio.Client) -> None:
    """Disconnect, waiting at most half a second for the server's websocket close frame.

    The server learns of the disconnect from Socket.IO's own close packet, sent first. Its websocket
    close frame comes back only some of the time, and websocket-client waits 3 s for it by default.
    """
    ws = getattr(sio.eio, "ws", None)
    if ws is not None:
        ws.close = functools.partial(ws.close, timeout=0.5)
    sio.disconnect()
