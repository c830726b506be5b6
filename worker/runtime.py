"""What one worker process holds and shares among its requests: the engine, the publisher, Redis and SQL, the
cancel listener, the heartbeat and the reaper. A request's own work is worker/job.py's."""

from __future__ import annotations

import json
import logging
import threading
import time

import redis
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from messaging import workers
from messaging.connections import redis_client
from messaging.contract import (CANCEL_CHANNEL, FINAL_TTL_S, INLINE_FINAL_BYTES, MODELS_KEY,
                                admitted_at_key, final_key, job_key, shown_at_key, shown_key)
from messaging.jobs import choices
from messaging.prompt_form import FORM_FIELD, FORM_TTL_S, form_key, tokenizer_key
from messaging.queue import visibility_timeout
from models.db import make_engine, make_session_factory
from worker.engine import EngineConfig, LLMEngine
from worker.engine.dry import DEFAULT_BREAKERS
from worker.engine.sizing import default_slots
from worker.leases import Leases
from worker.metrics import WorkerMetrics
from worker.model_loader import load_model
from worker.prompts import prompt_form
from worker.publisher import Publisher, publish_event
from worker.reaper import Reaper
from worker.settings import WorkerSettings
from worker.token_json import TokenJson

log = logging.getLogger(__name__)

HEARTBEAT_TTL_S = 10
PRUNE_EVERY = 30        # heartbeats (2 s apart) between sweeps of gone workers' model entries
GONE_AFTER_S = 3600
# After Redis was unreachable, a final event is said twice (ECHO_DELAY_S apart) for this long: a web
# process may still be resubscribing when the first one goes out (clients ignore the repeat).
ECHO_WINDOW_S = 15
ECHO_DELAY_S = 2.0


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
                              kv_cache_memory_gib=s.kv_cache_gib, kv_cache_dtype=s.kv_cache_dtype,
                              gpu_memory_utilization=s.gpu_memory_utilization,
                              enforce_eager=s.enforce_eager, attention_backend=s.attention_backend,
                              decode_attention=s.decode_attention, overlap_steps=s.overlap_steps,
                              bulk_token_share=s.bulk_token_share)
        if s.synthetic_token_rate:   # benchmarks of the web tier only (worker/synthetic.py)
            from worker.synthetic import SyntheticEngine
            self.engine = SyntheticEngine(s.synthetic_token_rate, s.max_num_seqs or default_slots("cpu"))
        else:
            # Loaded in the engine's own thread: all torch work in one thread (see LLMEngine.launch).
            self.engine = LLMEngine.launch(
                lambda: LLMEngine(*load_model(s.model, s.device, s.dtype, weights=s.weights), config))
            # DRY's default breakers as token ids now (about a second), not in the first chat's wait
            self.engine.sampler.breakers(DEFAULT_BREAKERS)
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
        # For the web processes' prompt checks (webapp/prompt_check.py); None: they leave them to this worker.
        self.form = prompt_form(tokenizer, self.engine.max_model_len) if tokenizer is not None else None
        self.publisher = Publisher(self.redis, on_redis_error=self._redis_failed, window_s=s.stream_window_s,
                                   describe=self.tokens)
        for target in (self._listen_for_cancels, self._beat):
            threading.Thread(target=target, name=target.__name__, daemon=True).start()
        Reaper(self.redis, self.sessions, s.name, self.stopped, self.finish, s.lost_after_s).start()

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

    def finish(self, event: str, payload: dict, job: dict) -> None:
        """The request's last event, retried until Redis takes it; kept a while for an API listener that was away.
        One larger than INLINE_FINAL_BYTES goes on the stream as a stub: its listener reads it where it is kept."""
        kept = json.dumps({"event": event, **payload}) if job.get("channel") else None
        sent = {"request_id": job["request_id"], "stored": True} if kept and len(kept) > INLINE_FINAL_BYTES else payload

        def send() -> None:
            if kept is not None:
                self.redis.set(final_key(job["request_id"]), kept, ex=FINAL_TTL_S)
            self.emit(event, sent, job)
            # Answered: nothing left to send again, or to continue.
            rid = job["request_id"]
            self.redis.delete(job_key(rid), shown_at_key(rid), admitted_at_key(rid),
                              *(shown_key(rid, i) for i in range(choices(job))))

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
        announced, beats = capacity(self.engine), 0
        while not self.stopped.is_set():
            stats = self.engine.stats()
            try:
                workers.announce(self.redis, self.settings.name, {
                    "model": self.model_name, "running": stats.running, "waiting": stats.waiting,
                    "kv_usage": stats.kv_usage, **announced, "time": time.time()}, HEARTBEAT_TTL_S)
                entry = {"model": self.model_name, "max_model_len": self.engine.max_model_len, "time": time.time()}
                if self.form is not None:
                    entry[FORM_FIELD] = self.keep_form()
                self.redis.hset(MODELS_KEY, self.settings.name, json.dumps(entry))
                if (beats := beats + 1) % PRUNE_EVERY == 0:
                    forget_gone_workers(self.redis)
                self.metrics.publish(self.redis, stats)
            except redis.RedisError as exc:
                self.redis_failed_at = time.monotonic()
                log.debug("no heartbeat this time: %s", exc)
            self.stopped.wait(2)

    def keep_form(self) -> str:
        """Renew the published prompt form and tokenizer (put back if Redis lost them); the form's digest."""
        form, tokenizer_json = self.form
        name = form.digest
        pipe = self.redis.pipeline(transaction=False)
        pipe.expire(form_key(name), FORM_TTL_S)
        pipe.expire(tokenizer_key(form.tokenizer), FORM_TTL_S)
        kept_form, kept_tokenizer = pipe.execute()
        if not kept_tokenizer:   # first, so a form is never there without its tokenizer
            self.redis.set(tokenizer_key(form.tokenizer), tokenizer_json, ex=FORM_TTL_S)
        if not kept_form:
            self.redis.set(form_key(name), form.to_json(), ex=FORM_TTL_S)
        return name


def forget_gone_workers(r: redis.Redis) -> None:
    """Drop the model entries of workers silent for an hour (their names are never used again after a restart),
    and the names of workers whose keys have expired."""
    now = time.time()
    gone = [name for name, raw in r.hgetall(MODELS_KEY).items()
            if now - float(json.loads(raw).get("time", 0)) > GONE_AFTER_S]
    if gone:
        r.hdel(MODELS_KEY, *gone)
    workers.forget_gone(r)


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
