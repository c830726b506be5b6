"""What one worker process holds: the engine, the Socket.IO emitter, the database and Redis listeners."""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import UTC, datetime

import redis
from flask_socketio import SocketIO
from sqlalchemy.exc import IntegrityError

from models import Message, RequestRecord
from models.db import make_engine, make_session_factory
from worker.celery_app import CANCEL_CHANNEL, HEARTBEAT_PREFIX, visibility_timeout
from worker.engine import EngineConfig, InvalidRequestError, LLMEngine, RequestFinished
from worker.leases import Leases
from worker.metrics import WorkerMetrics
from worker.model_loader import load_model
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)

HEARTBEAT_TTL_S = 10
STREAMED_TTL_S = 3600


def streamed_key(request_id: str) -> str:
    return f"supportbot:streamed:{request_id}"


def utc(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=UTC)


class WorkerRuntime:
    def __init__(self, settings: WorkerSettings | None = None) -> None:
        self.settings = settings or WorkerSettings()
        s = self.settings
        model, tokenizer = load_model(s.model, s.device, s.dtype)
        self.model_name = getattr(model, "name_or_source", s.model or "default")
        self.engine = LLMEngine(model, tokenizer, EngineConfig(
            max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
            kv_cache_memory_gib=s.kv_cache_gib))
        self.engine.start()
        self.redis = redis.Redis.from_url(s.redis_url)
        self.metrics = WorkerMetrics(s.name, self.model_name)
        self.leases = Leases(self.redis, visibility_timeout())
        self.leases.start()
        self.emitter = SocketIO(message_queue=s.redis_url)   # emits into every web process's rooms
        self.sessions = make_session_factory(make_engine(s.database_url))
        self._stop = threading.Event()
        self.draining = threading.Event()       # shutting down: start nothing new
        self.handing_back = threading.Event()   # grace period over: unfinished answers go back to the queue
        for target in (self._listen_for_cancels, self._beat):
            threading.Thread(target=target, name=target.__name__, daemon=True).start()
        log.info("worker %s ready with %s (%d slots)", s.name, self.model_name, s.max_num_seqs)

    # ---- outputs ----------------------------------------------------------------------------

    def emit(self, event: str, payload: dict, job: dict) -> None:
        """To the conversation's Socket.IO room, and to the request's own channel for HTTP clients."""
        if job.get("room"):
            self.emitter.emit(event, payload, to=job["room"])
        if job.get("channel"):
            self.redis.publish(job["channel"], json.dumps({"event": event, **payload}))

    def stream_text(self, job: dict, text: str) -> None:
        """Send a text delta and count it, so a redelivery of this request resumes after it."""
        self.emit("token", {"request_id": job["request_id"], "text": text}, job)
        key = streamed_key(job["request_id"])
        self.redis.pipeline(transaction=False).incrby(key, len(text)).expire(key, STREAMED_TTL_S).execute()

    def streamed_chars(self, request_id: str) -> int:
        return int(self.redis.get(streamed_key(request_id)) or 0)

    def store(self, job: dict, done: RequestFinished) -> bool:
        """Write the answer and the latency record together; False if this request was answered before."""
        with self.sessions() as db:
            record = db.get(RequestRecord, job["request_id"])
            if record is None:   # the web app could not write it (e.g. a direct enqueue): keep one anyway
                record = RequestRecord(request_id=job["request_id"], conversation_id=job.get("conversation_id"),
                                       source=job.get("source", "chat"), enqueued_at=utc(job["enqueued_at"]))
                db.add(record)
            record.model, record.worker = self.model_name, self.settings.name
            record.admitted_at, record.first_token_at = utc(done.admitted_time), utc(done.first_token_time)
            record.finished_at = utc(done.finished_time)
            record.prompt_tokens, record.completion_tokens = done.prompt_tokens, done.completion_tokens
            record.cached_tokens, record.batch_size = done.cached_tokens, done.mean_batch_size
            record.finish_reason, record.error = done.finish_reason, done.error
            if job.get("conversation_id") and done.text:
                db.add(Message(conversation_id=job["conversation_id"], role="assistant", content=done.text,
                               request_id=job["request_id"]))
            try:
                db.commit()
            except IntegrityError:   # another delivery stored its answer first
                db.rollback()
                return False
        self.metrics.observe(job, done)
        return True

    def stored_outcome(self, job: dict) -> tuple[str, dict] | None:
        """The final event of a request whose answer is already stored, or None."""
        with self.sessions() as db:
            record = db.get(RequestRecord, job["request_id"])
            if record is None or record.finished_at is None:
                return None
            answer = db.query(Message).filter_by(request_id=job["request_id"]).one_or_none()
            return outcome(job, record.finish_reason, answer.content if answer else "", record.prompt_tokens or 0,
                           record.completion_tokens or 0, record.error)

    def fail(self, job: dict, code: str, message: str) -> None:
        """A request that cannot be answered still ends with a record and an `error` event."""
        now = time.time()
        done = RequestFinished(request_id=job["request_id"], text="", token_ids=[], finish_reason="error",
                               prompt_tokens=0, completion_tokens=0, cached_tokens=0, arrival_time=now,
                               admitted_time=None, first_token_time=None, finished_time=now,
                               mean_batch_size=0.0, error=message)
        self.store(job, done)
        self.emit("error", {"request_id": job["request_id"], "code": code, "message": message,
                            "retryable": code != "prompt_too_long"}, job)

    def begin_shutdown(self) -> None:
        self.draining.set()
        timer = threading.Timer(self.settings.shutdown_grace_s, self._hand_back)
        timer.daemon = True
        timer.start()

    def _hand_back(self) -> None:
        stats = self.engine.stats()
        if stats.running or stats.waiting:
            log.info("shutdown grace period over: handing %d requests back to the queue",
                     stats.running + stats.waiting)
        self.handing_back.set()
        self.engine.shutdown()   # every open stream ends with an error event, which the tasks turn into requeues

    # ---- background threads -------------------------------------------------------------------

    def _listen_for_cancels(self) -> None:
        while not self._stop.is_set():
            try:
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(CANCEL_CHANNEL)
                for message in pubsub.listen():
                    self.engine.abort(message["data"].decode())
            except redis.ConnectionError:
                log.warning("lost Redis while listening for cancellations; retrying")
                time.sleep(1)

    def _beat(self) -> None:
        """A key with a short TTL: /readyz sees a live worker while it keeps being refreshed."""
        while not self._stop.is_set():
            stats = self.engine.stats()
            try:
                self.redis.set(HEARTBEAT_PREFIX + self.settings.name, json.dumps({
                    "model": self.model_name, "running": stats.running, "waiting": stats.waiting,
                    "kv_usage": stats.kv_usage, "time": time.time()}), ex=HEARTBEAT_TTL_S)
                self.metrics.publish(self.redis, stats)
            except redis.ConnectionError:
                pass
            self._stop.wait(2)


def outcome(job: dict, finish_reason: str, text: str, prompt_tokens: int, completion_tokens: int,
            error: str | None = None) -> tuple[str, dict]:
    """The event that ends a request for its client: `done`, or `error` when generation failed."""
    if finish_reason == "error":
        return "error", {"request_id": job["request_id"], "code": "generation_failed", "retryable": True,
                         "message": error or "The assistant failed while answering; please send your message again."}
    return "done", {"request_id": job["request_id"], "conversation_id": job.get("conversation_id"), "text": text,
                    "finish_reason": finish_reason, "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens}


def fit_to_context(engine: LLMEngine, messages: list[dict], reserve: int) -> tuple[list[dict], list[int]]:
    """Drop the oldest turns (never the system prompt or the newest message) until the prompt fits.

    Returns the kept messages and their rendered prompt ids, so the template is rendered once.
    """
    messages = list(messages)
    budget = engine.max_model_len - reserve
    first = 1 if messages and messages[0].get("role") == "system" else 0
    while len(ids := engine.render_chat(messages)) > budget:
        if len(messages) - first <= 1:
            raise InvalidRequestError("This message is too long for the assistant to answer; "
                                      "shorten it or split it into several messages.")
        del messages[first]
    return messages, ids
