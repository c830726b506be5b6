"""Answer events from the workers to the web processes: many requests' events in one pub/sub message.

A worker publishes a batch on STREAM_CHANNEL once per engine step or short window: every text delta that
step produced, for every request, and the end of each answer (an API answer's end larger than
contract.INLINE_FINAL_BYTES as a stub, {request_id, stored: true}, read from contract.final_key). Each web
process reads every batch once and hands each event to the connections it serves: the conversation's
Socket.IO room (`room`), and the HTTP request waiting for it (`api`). One message per window instead of one
per delta per request keeps the cost of a token on both sides small.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# An API request's worker has begun it (before its first token): the web's answer timeout counts from here, so time
# spent waiting in the queue is not taken for a silent worker.
STARTED = "started"


@dataclass(frozen=True)
class StreamEvent:
    """`token` {request_id, text, offset}, `done` or `error` (the chat's own event bodies), `started` {request_id}
    (API requests only), and where it goes."""

    name: str
    data: dict
    room: str | None = None    # the conversation's Socket.IO room
    api: bool = False          # an HTTP request on some web process waits for it

    def encode(self) -> list:
        return [self.name, self.room, self.api, self.data]


def target(job: dict) -> tuple[str | None, bool]:
    """Where a job's events go: its Socket.IO room, and whether an HTTP client waits for them."""
    return job.get("room"), bool(job.get("channel"))


def event_for(job: dict, name: str, data: dict) -> StreamEvent:
    room, api = target(job)
    return StreamEvent(name, data, room, api)


def encode_batch(events: list[StreamEvent]) -> str:
    return json.dumps([e.encode() for e in events], separators=(",", ":"))


def decode_batch(raw: bytes | str) -> list[StreamEvent]:
    return [StreamEvent(name, data, room, api) for name, room, api, data in json.loads(raw)]
