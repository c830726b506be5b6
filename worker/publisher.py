"""One thread streams every answer's text: each window's deltas, for all requests, go to Redis in one message."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from messaging.contract import STREAM_CHANNEL, STREAMED_TTL_S, streamed_key
from messaging.stream import encode_batch, event_for
from worker.engine import Event, RequestFinished, TokenDelta

log = logging.getLogger(__name__)

# Text is sent at most this often (per worker, for all requests together), unless something cannot wait:
# a request's first text, or the end of an answer. Slower engine steps are sent as each one comes.
DEFAULT_WINDOW_S = 0.05


@dataclass
class Answer:
    """A request this worker is answering: how far its text has got, and its end once it comes."""

    job: dict
    shown: int                  # characters clients were already sent, by this delivery or an earlier one
    produced: int = 0           # characters this delivery has generated
    ends: queue.Queue[RequestFinished] = field(default_factory=queue.Queue)

    def unseen(self, text: str) -> tuple[str, int] | None:
        """The part of the next `text` that no client was sent yet, with its offset in the answer."""
        start, self.produced = self.produced, self.produced + len(text)
        if self.produced <= self.shown:
            return None
        new = text[max(0, self.shown - start):]
        self.shown = self.produced
        return new, self.produced - len(new)

    def wait(self) -> RequestFinished:
        return self.ends.get()


class Publisher:
    """Reads the engine's output for every tracked request and sends it on, one Redis transaction per window.

    The engine hands each step's events, for all requests, to this one thread. Their text is held back for up
    to `window_s` since the last send, so a fast engine's steps are sent together: one pub/sub message and one
    round trip carry every request's new text, however many requests and steps it covers. A request's first
    text and every answer's end go out at once.
    """

    def __init__(self, client: redis.Redis, on_redis_error: Callable[[], None],
                 window_s: float = DEFAULT_WINDOW_S) -> None:
        self.redis, self.on_redis_error, self.window_s = client, on_redis_error, window_s
        self.outbox: queue.Queue[list[Event]] = queue.Queue()   # the engine puts each step's events here
        self.answers: dict[str, Answer] = {}
        self.lock = threading.Lock()
        self.blind = False   # text deltas are failing to reach Redis
        self.pending: dict[str, list[str]] = {}   # request id -> text not sent yet, in order
        self.sent_at = 0.0   # monotonic time of the last send
        self.batches = 0     # messages published, for tests and benchmarks
        threading.Thread(target=self._run, name="publisher", daemon=True).start()

    def track(self, job: dict, shown: int) -> Answer | None:
        """Start following a request before it is submitted, so none of its events go unclaimed; None when
        this worker is answering it already (a second delivery of a request under way)."""
        with self.lock:
            if job["request_id"] in self.answers:
                return None
            answer = self.answers[job["request_id"]] = Answer(job, shown)
        return answer

    def forget(self, request_id: str) -> None:
        with self.lock:
            self.answers.pop(request_id, None)

    def _run(self) -> None:
        while True:
            wait = None if not self.pending else max(0.0, self.sent_at + self.window_s - time.monotonic())
            try:
                events = self.outbox.get(timeout=wait)
                while not self.outbox.empty():   # fell behind the engine: take the steps that piled up together
                    events += self.outbox.get_nowait()
            except queue.Empty:
                events = []
            try:
                self.publish(events)
            except Exception:   # never leave a request waiting for an end that this thread dropped
                log.exception("publishing answers failed")
                self.pending.clear()
                self._hand_over_ends(events)

    def publish(self, events: list[Event]) -> None:
        """Take in a step's events; send what is due (everything, once the window has passed)."""
        urgent = False
        for event in events:
            if isinstance(event, TokenDelta) and event.text:
                parts = self.pending.get(event.request_id)
                if parts is None:
                    parts = self.pending[event.request_id] = []
                    with self.lock:
                        answer = self.answers.get(event.request_id)
                    urgent |= answer is not None and answer.produced == 0   # its first text
                parts.append(event.text)
            elif isinstance(event, RequestFinished):
                urgent = True   # its last text goes out before its end can
        if self.pending and (urgent or time.monotonic() - self.sent_at >= self.window_s):
            self.flush()
        self._hand_over_ends(events)   # after the text: a request's end is never sent before its last delta

    def flush(self) -> None:
        pending, self.pending = self.pending, {}
        self.sent_at = time.monotonic()
        with self.lock:
            answers = {rid: self.answers.get(rid) for rid in pending}
        deltas = [(answer, unseen) for rid, parts in pending.items()
                  if (answer := answers[rid]) is not None and (unseen := answer.unseen("".join(parts)))]
        if deltas:
            self.send(deltas)

    def send(self, deltas: list[tuple[Answer, tuple[str, int]]]) -> None:
        """Every request's text delta in one message, and the stream positions after them, in one transaction:
        a worker killed here has either shown a text and recorded its position, or neither, so a redelivery
        never shows text twice, even to a client that ignores offsets. While Redis is down the deltas are lost
        (the final event carries the whole text, and clients see the gap in the offsets)."""
        events, pipe = [], self.redis.pipeline(transaction=True)
        for answer, (text, offset) in deltas:
            rid = answer.job["request_id"]
            events.append(event_for(answer.job, "token", {"request_id": rid, "text": text, "offset": offset}))
            pipe.set(streamed_key(rid), offset + len(text), ex=STREAMED_TTL_S)
        pipe.publish(STREAM_CHANNEL, encode_batch(events))
        try:
            pipe.execute()
        except redis.RedisError as exc:
            self.on_redis_error()
            if not self.blind:
                log.warning("cannot stream answers while Redis is unreachable (%s); their ends are sent later", exc)
            self.blind = True
            return
        self.batches += 1
        if self.blind:
            self.blind = False
            log.info("streaming answers again")

    def _hand_over_ends(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, RequestFinished):
                with self.lock:
                    answer = self.answers.pop(event.request_id, None)
                if answer is not None:
                    answer.ends.put(event)


def publish_event(client: redis.Redis | redis.client.Pipeline, job: dict, name: str, data: dict) -> None:
    """One event (an answer's end) on the stream, on its own."""
    client.publish(STREAM_CHANNEL, encode_batch([event_for(job, name, data)]))

