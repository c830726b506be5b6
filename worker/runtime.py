"""What one worker process holds: the engine, the Socket.IO emitter, the database and Redis listeners."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import replace
from functools import partial
from datetime import UTC, datetime

import redis
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from messaging.connections import redis_client
from messaging.contract import (CANCEL_CHANNEL, FINAL_TTL_S, HEARTBEAT_PREFIX, INLINE_FINAL_BYTES, cancelled_key,
                                final_key, job_key, streamed_key)
from messaging.jobs import ECHO
from messaging.queue import visibility_timeout
from models import Message, RequestRecord
from models.db import make_engine, make_session_factory
from worker.engine import EngineConfig, InvalidRequestError, LLMEngine, RequestFinished, SamplingParams, TokenLogprob
from worker.engine.sizing import default_slots
from worker.leases import Leases
from worker.metrics import WorkerMetrics
from worker.model_loader import load_model
from worker.publisher import Answer, Publisher, publish_event
from worker.reaper import Reaper
from worker.prompts import render_chat
from worker.settings import WorkerSettings
from worker.token_json import TokenJson

log = logging.getLogger(__name__)

HEARTBEAT_TTL_S = 10
# After Redis was unreachable, a final event is said twice (ECHO_DELAY_S apart) for this long: a web
# process may still be resubscribing when the first one goes out (clients ignore the repeat).
ECHO_WINDOW_S = 15
ECHO_DELAY_S = 2.0


def utc(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=UTC)


class Unavailable(Exception):
    """Redis or the database stayed unreachable for longer than the worker waits; the request goes back."""


def transient_sql_error(exc: Exception) -> bool:
    """A lost or refused database connection, as opposed to a bad statement."""
    if isinstance(exc, (OperationalError, InterfaceError, PoolTimeout)):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def with_retries(action, is_transient, limit_s: float, what: str, max_pause_s: float = 5.0):
    """Run `action` until it succeeds, pausing longer after each transient failure, for at most `limit_s`."""
    deadline, pause, failures = time.monotonic() + limit_s, 0.25, 0
    while True:
        try:
            result = action()
            if failures:
                log.info("%s succeeded after %d failed attempts", what, failures)
            return result
        except Exception as exc:
            if not is_transient(exc):
                raise
            failures += 1
            if time.monotonic() + pause > deadline:
                raise Unavailable(f"{what}: {exc}") from exc
            if failures == 1:
                log.warning("%s failed (%s); retrying for up to %.0f s", what, exc, limit_s)
            time.sleep(pause)
            pause = min(max_pause_s, pause * 2)


class WorkerRuntime:
    def __init__(self, settings: WorkerSettings | None = None) -> None:
        self.settings = settings or WorkerSettings()
        s = self.settings
        config = EngineConfig(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                              kv_cache_memory_gib=s.kv_cache_gib, gpu_memory_utilization=s.gpu_memory_utilization,
                              enforce_eager=s.enforce_eager, attention_backend=s.attention_backend,
                              decode_attention=s.decode_attention, overlap_steps=s.overlap_steps)
        if s.synthetic_token_rate:   # benchmarks of the web tier only (bench/synthetic.py)
            from bench.synthetic import SyntheticEngine
            self.engine = SyntheticEngine(s.synthetic_token_rate, s.max_num_seqs or default_slots("cpu"))
        else:
            # Loaded in the engine's own thread: all torch work in one thread (see LLMEngine.launch).
            self.engine = LLMEngine.launch(
                lambda: LLMEngine(*load_model(s.model, s.device, s.dtype, weights=s.weights), config))
        self.model_name = getattr(self.engine.runner.model, "name_or_source", s.model or "default")
        self.redis = redis_client(s.redis_url)
        self.metrics = WorkerMetrics(s.name, self.model_name)
        self.leases = Leases(self.redis, visibility_timeout())
        self.leases.start()
        self.sessions = make_session_factory(make_engine(s.database_url))
        self.stopped = threading.Event()
        self.draining = threading.Event()       # shutting down: start nothing new
        self.handing_back = threading.Event()   # grace period over: unfinished answers go back to the queue
        self.redis_failed_at = -ECHO_WINDOW_S        # monotonic time of the latest failure seen
        tokenizer = getattr(self.engine, "tokenizer", None)
        self.tokens = TokenJson(tokenizer) if tokenizer is not None else None
        self.publisher = Publisher(self.redis, on_redis_error=self._redis_failed, window_s=s.stream_window_s,
                                   describe=self.tokens)
        for target in (self._listen_for_cancels, self._beat):
            threading.Thread(target=target, name=target.__name__, daemon=True).start()
        Reaper(self, s.lost_after_s).start()

    def describe(self) -> str:
        """The start line: model, device, slots, how the KV pool was sized, attention and decode graphs."""
        size = capacity(self.engine)
        runner = getattr(self.engine, "runner", None)
        line = (f"worker {self.settings.name} ready with {self.model_name} on {size['device']}: {size['slots']} slots, "
                f"{size['step_tokens']} tokens per step, KV pool {size['kv_blocks']} blocks ({size['kv_tokens']} tokens, "
                f"{(size['kv_bytes'] or 0) / 2**30:.2f} GiB) sized by {size['kv_sizing']}")
        if runner is not None:
            line += "; " + runner.describe_steps()
            report = getattr(runner.model, "weights_report", None)
            if report is not None:
                line += "; " + report.describe()
                if self.settings.weights.strip().lower() == "auto":
                    line += " (WEIGHTS=auto, the device's measured best; set WEIGHTS to choose)"
        return line

    # ---- outputs ----------------------------------------------------------------------------

    def emit(self, event: str, payload: dict, job: dict) -> None:
        """On the stream every web process reads: to the conversation's Socket.IO room, and to the HTTP client
        waiting for the request."""
        publish_event(self.redis, job, event, payload)

    def start_answer(self, job: dict, prompt_ids: list[int], params: SamplingParams, shown: int,
                     echo: str | None = None, service_class: str = "standard") -> Answer | None:
        """Submit a request to the engine; its text streams out from the publisher's thread, past the first
        `shown` characters (what clients were sent by an earlier delivery). `echo`: the prompt's text, for a
        client that asked for it before the answer. Bad requests raise here; None when this worker is answering
        the request already."""
        answer = self.publisher.track(job, shown)
        if answer is None:
            return None
        if echo is not None:
            answer.echo = partial(echoed_prompt, echo, prompt_ids, tokens=self.tokens)
            answer.echo_waits = params.prompt_logprobs is not None
        try:
            # Queued by acceptance time: the task threads hand requests over in no particular order.
            self.engine.submit(job["request_id"], prompt_token_ids=prompt_ids, params=params,
                               arrival_time=job.get("enqueued_at"), outbox=self.publisher.outbox,
                               service_class=service_class)
        except BaseException:
            self.publisher.forget(job["request_id"])
            raise
        return answer

    def streamed_chars(self, request_id: str) -> int:
        return int(self.redis_retrying(lambda: self.redis.get(streamed_key(request_id)), "reading a stream position")
                   or 0)

    def was_cancelled(self, request_id: str) -> bool:
        return bool(self.redis_retrying(lambda: self.redis.exists(cancelled_key(request_id)),
                                        "checking for a cancellation"))

    def finish(self, event: str, payload: dict, job: dict) -> None:
        """The request's last event, retried until Redis takes it; kept a while for an API listener that was away.
        One larger than INLINE_FINAL_BYTES goes on the stream as a stub: its listener reads it where it is kept."""
        kept = json.dumps({"event": event, **payload}) if job.get("channel") else None
        sent = {"request_id": job["request_id"], "stored": True} if kept and len(kept) > INLINE_FINAL_BYTES else payload

        def send() -> None:
            if kept is not None:
                self.redis.set(final_key(job["request_id"]), kept, ex=FINAL_TTL_S)
            self.emit(event, sent, job)
            self.redis.delete(job_key(job["request_id"]))   # answered: nothing left to send again

        self.redis_retrying(send, f"sending the end of {job['request_id']}")
        if time.monotonic() - self.redis_failed_at < ECHO_WINDOW_S:
            time.sleep(ECHO_DELAY_S)
            try:
                self.emit(event, sent, job)
            except redis.RedisError:
                pass

    def _redis_failed(self) -> None:
        self.redis_failed_at = time.monotonic()

    def redis_retrying(self, action, what: str):
        def transient(exc: Exception) -> bool:
            if isinstance(exc, redis.RedisError):
                self._redis_failed()
                return True
            return False

        # Short pauses: the web processes are back within a second or so of Redis, and so should this be.
        return with_retries(action, transient, self.settings.redis_retry_s, what, max_pause_s=1.0)

    def sql_retrying(self, action, what: str):
        return with_retries(action, transient_sql_error, self.settings.sql_retry_s, what)

    def store(self, job: dict, done: RequestFinished) -> bool:
        """Write the answer and the latency record together; False if this request was answered before.

        A database that is briefly away is waited for (SQL_RETRY_S); the write is one transaction, so a retry
        never stores half of it, and the answer's unique request id keeps a retry from storing it twice.
        """
        stored = self.sql_retrying(lambda: self._write(job, done), f"storing the answer to {job['request_id']}")
        if stored:
            self.metrics.observe(job, done)
        return stored

    def _write(self, job: dict, done: RequestFinished) -> bool:
        with self.sessions() as db:
            record = db.get(RequestRecord, job["request_id"])
            if record is None:   # the web app could not write it (e.g. a direct enqueue): keep one anyway
                record = RequestRecord(request_id=job["request_id"], conversation_id=job.get("conversation_id"),
                                       source=job.get("source", "chat"), enqueued_at=utc(job["enqueued_at"]),
                                       api_key=job.get("api_key"))
                db.add(record)
            record.model, record.worker = self.model_name, self.settings.name
            record.admitted_at, record.first_token_at = utc(done.admitted_time), utc(done.first_token_time)
            record.finished_at = utc(done.finished_time)
            record.prompt_tokens, record.completion_tokens = done.prompt_tokens, done.completion_tokens
            record.cached_tokens, record.batch_size = done.cached_tokens, done.mean_batch_size
            record.finish_reason, record.error = done.finish_reason, done.error
            for role, content in job.get("tool_messages", ()) if job.get("conversation_id") else ():
                db.add(Message(conversation_id=job["conversation_id"], role=role, content=content))
            if job.get("conversation_id") and done.text:
                db.add(Message(conversation_id=job["conversation_id"], role="assistant", content=done.text,
                               request_id=job["request_id"]))
            try:
                db.commit()
            except IntegrityError:   # another delivery stored its answer first
                db.rollback()
                return False
        return True

    def stored_outcome(self, job: dict) -> tuple[str, dict] | None:
        """The final event of a request whose answer is already stored, or None."""
        return self.sql_retrying(lambda: self._read_outcome(job), f"looking up {job['request_id']}")

    def _read_outcome(self, job: dict) -> tuple[str, dict] | None:
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
        self.finish("error", {"request_id": job["request_id"], "code": code, "message": message,
                              "retryable": code not in ("prompt_too_long", "invalid_request")}, job)

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
        lost = False
        while not self.stopped.is_set():
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(CANCEL_CHANNEL)
                if lost:
                    log.info("listening for cancellations again")
                    lost = False
                while not self.stopped.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self.engine.abort(message["data"].decode())
            except redis.RedisError as exc:
                # A cancel sent meanwhile is lost; its key (cancelled_key) still stops a request not yet started.
                if not lost:
                    log.warning("lost Redis while listening for cancellations (%s); retrying", exc)
                lost = True
                self.stopped.wait(1)
            finally:
                pubsub.close()

    def _beat(self) -> None:
        """A key with a short TTL: /readyz sees a live worker while it keeps being refreshed, and the web app
        sizes its queue and connection limits from the capacity it announces."""
        announced = capacity(self.engine)
        while not self.stopped.is_set():
            stats = self.engine.stats()
            try:
                self.redis.set(HEARTBEAT_PREFIX + self.settings.name, json.dumps({
                    "model": self.model_name, "running": stats.running, "waiting": stats.waiting,
                    "kv_usage": stats.kv_usage, **announced, "time": time.time()}), ex=HEARTBEAT_TTL_S)
                self.metrics.publish(self.redis, stats)
            except redis.RedisError as exc:
                self.redis_failed_at = time.monotonic()
                log.debug("no heartbeat this time: %s", exc)
            self.stopped.wait(2)


def capacity(engine) -> dict:
    """What this worker can hold at once: engine slots, KV-cache blocks (and their tokens and bytes), its device."""
    config, runner = engine.config, getattr(engine, "runner", None)
    blocks = getattr(runner, "num_blocks", None) or getattr(config, "num_blocks", None)
    block_size = getattr(config, "block_size", None)
    pool = getattr(runner, "kv", None)
    tensors = pool if isinstance(pool, (list, tuple)) else [pool] if pool is not None else []
    kv_bytes = sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "numel")) or None
    sizing = getattr(runner, "sizing", None)
    return {"slots": config.max_num_seqs, "step_tokens": config.max_num_batched_tokens,
            "device": str(getattr(engine, "device", "unknown")),
            "kv_blocks": blocks, "kv_block_size": block_size,
            "kv_tokens": blocks * block_size if blocks and block_size else None, "kv_bytes": kv_bytes,
            # How the pool got its size: num_blocks, a fixed KV_CACHE_GIB, or a share of the GPU's memory.
            "kv_sizing": sizing.describe(config) if sizing else None}


def outcome(job: dict, finish_reason: str, text: str, prompt_tokens: int, completion_tokens: int,
            error: str | None = None, extra: dict | None = None) -> tuple[str, dict]:
    """The event that ends a request for its client: `done`, or `error` when generation failed. `extra`: the API's
    own fields (each choice, the echoed prompt), which the chat's events never carry."""
    if finish_reason == "error":
        return "error", {"request_id": job["request_id"], "code": "generation_failed", "retryable": True,
                         "message": error or "The assistant failed while answering; please send your message again."}
    return "done", {"request_id": job["request_id"], "conversation_id": job.get("conversation_id"), "text": text,
                    "finish_reason": finish_reason, "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens, **(extra or {})}


def combined(ends: list[RequestFinished]) -> RequestFinished:
    """One record of a request's choices: the first's text and timings, every choice's tokens; an error in any
    choice is the request's."""
    first = ends[0]
    failed = next((e for e in ends if e.finish_reason == "error"), None)
    return replace(first, completion_tokens=sum(e.completion_tokens for e in ends),
                   finish_reason=failed.finish_reason if failed else first.finish_reason,
                   error=failed.error if failed else first.error,
                   first_token_time=min((e.first_token_time for e in ends if e.first_token_time is not None),
                                        default=None),
                   finished_time=max(e.finished_time for e in ends), finished=True)


def api_fields(job: dict, ends: list[RequestFinished], tokens: TokenJson | None, prompt_text) -> dict:
    """What an API client's final event carries beyond the chat's: each choice (text, end, tokens,
    log-probabilities) and, for an echo, the prompt's text and log-probabilities."""
    fields: dict = {"choices": [
        {"index": e.index, "text": e.text, "finish_reason": e.finish_reason, "completion_tokens": e.completion_tokens,
         **({"logprobs": [tokens(x) for x in e.logprobs]} if e.logprobs is not None and tokens else {})}
        for e in ends]}
    if job.get(ECHO):
        first = ends[0]
        fields["prompt"] = echoed_prompt(prompt_text(first.prompt_token_ids), first.prompt_token_ids,
                                         first.prompt_logprobs, tokens)
    return fields


def echoed_prompt(text: str, ids: list[int], entries: list[TokenLogprob | None] | None,
                  tokens: TokenJson | None) -> dict:
    """An echo's prompt for its client: the text and, when asked, each prompt token's log-probabilities."""
    prompt: dict = {"text": text}
    if entries is not None and tokens is not None:
        prompt["logprobs"] = [tokens(entry) if entry is not None else
                              {**tokens.one(token, 0.0), "logprob": None, "top_logprobs": None}
                              for token, entry in zip(ids, entries)]
    return prompt


def fit_to_context(engine: LLMEngine, messages: list[dict], reserve: int,
                   tools: list[dict] | None = None) -> tuple[list[dict], list[int]]:
    """Drop the oldest turns (never the system prompt or the newest message) until the prompt fits.

    Returns the kept messages and their rendered prompt ids (with `tools`, if any), so the template is rendered once.
    """
    messages = list(messages)
    budget = engine.max_model_len - reserve
    first = 1 if messages and messages[0].get("role") == "system" else 0
    while len(ids := render_chat(engine, messages, tools)) > budget:
        if len(messages) - first <= 1:
            raise InvalidRequestError("This message is too long for the assistant to answer; "
                                      "shorten it or split it into several messages.")
        del messages[first]
    return messages, ids
