"""This web process's end of the answer stream: one Redis subscription for every customer it serves.

The workers publish batches of answer events (messaging/stream.py). One listener per web process reads
them, on the same connection as Flask-SocketIO's message queue, and hands each event to the conversation's
Socket.IO room here, if it has members here, and to the HTTP request waiting for it here, if any. A
thousand streaming HTTP requests share that one subscription instead of holding a Redis connection each.
"""

from __future__ import annotations

import json
import queue

from engineio import packet as eio_packet
from socketio import packet as sio_packet

from messaging.connections import SocketIOQueue
from messaging.contract import STREAM_CHANNEL
from messaging.stream import decode_batch


class StreamQueue(SocketIOQueue):
    """Flask-SocketIO's message queue that also delivers the workers' answer events."""

    def __init__(self, url: str) -> None:
        super().__init__(url, extra_channels=(STREAM_CHANNEL,))
        self.waiters: dict[str, queue.Queue] = {}   # request id -> the HTTP request's events

    def start(self) -> None:
        """Listen from now on (Socket.IO itself starts listening only at the first Socket.IO connection)."""
        server = self.server
        if server is not None and not server.manager_initialized:
            server.manager_initialized = True
            self.initialize()

    def wait_for(self, request_id: str) -> queue.Queue:
        """Events of `request_id` for an HTTP request of this process, from now until `stop_waiting`."""
        events: queue.Queue = queue.Queue()
        self.waiters[request_id] = events
        return events

    def stop_waiting(self, request_id: str) -> None:
        self.waiters.pop(request_id, None)

    def on_message(self, channel: str, data: bytes) -> None:
        """Each event to this process's members of its room, and to its HTTP request if it waits here."""
        rooms = self.rooms.get("/", {})
        for event in decode_batch(data):
            if event.room is not None and event.room in rooms:
                self.emit_here(event.name, event.data, event.room)
            if event.api and (waiter := self.waiters.get(event.data["request_id"])) is not None:
                waiter.put({"event": event.name, **event.data})

    def emit_here(self, name: str, data: dict, room: str) -> None:
        """What `emit(name, data, room=room)` sends to this process's sockets in the room, with less work per
        event: the Socket.IO event packet (type 2, default namespace, no ack id) is written once, as JSON text
        with no binary parts to look for, and handed to each socket as it is."""
        text = str(sio_packet.EVENT) + json.dumps([name, data], separators=(",", ":"))
        pkt = eio_packet.Packet(eio_packet.MESSAGE, text)
        for _, eio_sid in self.get_participants("/", room):
            self.server._send_eio_packet(eio_sid, pkt)
