"""One thread streams every answer's text: an engine step's deltas, for all requests, go to Redis together."""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from messaging.connections import SocketIOQueue
from messaging.contract import STREAMED_TTL_S, streamed_key
from worker.engine import Event, RequestFinished, TokenDelta

log = logging.getLogger(__name__)

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
    """Reads the engine's output for every tracked request and sends it on, one Redis transaction per step.

    One thread for all requests, instead of one per request, means one wake-up and one round trip per engine
    step however many requests share the batch: less that competes with the engine loop for the GIL.
    """

    def __init__(self, client: redis.Redis, emitter: SocketIOQueue, on_redis_error: Callable[[], None]) -> None:
        self.redis, self.emitter, self.on_redis_error = client, emitter, on_redis_error
        self.outbox: queue.Queue[list[Event]] = queue.Queue()   # the engine puts each step's events here
        self.answers: dict[str, Answer] = {}
        self.lock = threading.Lock()
        self.blind = False   # text deltas are failing to reach Redis
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
            events = self.outbox.get()
            while not self.outbox.empty():   # fell behind the engine: send the steps that piled up together
                events += self.outbox.get_nowait()
            try:
                self.publish(events)
            except Exception:   # never leave a request waiting for an end that this thread dropped
                log.exception("publishing answers failed")
                self._hand_over_ends(events)

    def publish(self, events: list[Event]) -> None:
        with self.lock:
            answers = {e.request_id: self.answers.get(e.request_id) for e in events}
        texts: dict[str, list[str]] = {}
        for event in events:
            if isinstance(event, TokenDelta) and answers[event.request_id] is not None:
                texts.setdefault(event.request_id, []).append(event.text)
        deltas = [(answers[rid], unseen) for rid, parts in texts.items()
                  if (unseen := answers[rid].unseen("".join(parts)))]
        if deltas:
            self.send(deltas)
        self._hand_over_ends(events)   # after the text: a request's end is never sent before its last delta

    def send(self, deltas: list[tuple[Answer, tuple[str, int]]]) -> None:
        """Text deltas and the stream positions after them, in one transaction: a worker killed here has either
        shown a text and recorded its position, or neither, so a redelivery never shows text twice, even to a
        client that ignores offsets. While Redis is down the deltas are lost (the final event carries the whole
        text, and clients see the gap in the offsets)."""
        pipe = self.redis.pipeline(transaction=True)
        for answer, (text, offset) in deltas:
            job = answer.job
            payload = {"request_id": job["request_id"], "text": text, "offset": offset}
            if job.get("room"):
                pipe.publish(self.emitter.channel, self.emitter.encode("token", payload, job["room"]))
            if job.get("channel"):
                pipe.publish(job["channel"], json.dumps({"event": "token", **payload}))
            pipe.set(streamed_key(job["request_id"]), offset + len(text), ex=STREAMED_TTL_S)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            self.on_redis_error()
            if not self.blind:
                log.warning("cannot stream answers while Redis is unreachable (%s); their ends are sent later", exc)
            self.blind = True
            return
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
