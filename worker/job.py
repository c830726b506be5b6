"""One request from the queue to its stored answer: its prompt, tool rounds, streaming, record, cancel and retry."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from functools import partial

import redis
from celery.exceptions import Reject
from sqlalchemy.exc import IntegrityError

from messaging.contract import admitted_at_key, cancelled_key, shown_at_key, shown_key, streamed_key
from messaging.generation import Generation, GenerationError
from messaging.jobs import ECHO, HTTP_REQUEST_ID, PROMPT, STRUCTURE, TEMPLATE, TOOLS, choices, replayable, service_class
from messaging.prompts import TemplateOptions
from messaging.stream import STARTED
from models import Message, RequestRecord
from structured import Structure, StructureError, Tool, ToolError
from worker import assistant, continuation
from worker.continuation import Shown
from worker.ends import api_fields, combined, echoed_prompt, outcome
from worker.engine import InvalidParamsError, InvalidRequestError, RequestFinished, SamplingParams
from worker.prompts import TemplateRefused, completion_ids, fit_to_context
from worker.publisher import Answer
from worker.runtime import Unavailable, WorkerRuntime

log = logging.getLogger(__name__)

# While an answer runs, how often its cancel key is looked at.
CANCEL_CHECK_S = 1.0
# Errors the client caused: they say what to change, and sending the request again does not help.
CLIENT_ERRORS = ("prompt_too_long", "context_length_exceeded", "invalid_request", "invalid_messages")
# How the engine and worker/prompts.py say that a prompt does not fit the model's context.
TOO_LONG = ("too long", "context holds", "KV cache holds")


def utc(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=UTC)


def engine_params(job: dict) -> dict:
    """The engine's SamplingParams fields, from the queued request read with the checks the web app made
    (messaging/generation.py; GenerationError if it does not pass). The service class travels beside them."""
    return Generation.from_wire(job.get("params") or {}).engine_fields()


def sampling_params(job: dict) -> SamplingParams:
    params = SamplingParams(**engine_params(job))
    if job.get(STRUCTURE) is not None:
        params.structure = Structure.from_json(job[STRUCTURE])
    params.validate()
    return params


def refusal_code(exc: Exception, job: dict) -> str:
    """The error code of a request refused before it ran: an API client hears OpenAI's code for a prompt too long."""
    if any(words in str(exc) for words in TOO_LONG):
        return "context_length_exceeded" if job.get("source") == "api" else "prompt_too_long"
    return TemplateRefused.code if isinstance(exc, TemplateRefused) else "invalid_request"   # as the web says it


class Job:
    """A queued request as this worker answers it. `rt` holds what the process shares (engine, Redis, SQL,
    publisher); everything about this one request happens here."""

    def __init__(self, rt: WorkerRuntime, spec: dict) -> None:
        self.rt, self.spec = rt, spec
        self.request_id: str = spec["request_id"]
        # When an earlier delivery first showed this answer's text, and when its engine admitted it: its customer's
        # first token and the end of their wait in the queue, kept in its record.
        self.first_shown: float | None = None
        self.first_admitted: float | None = None

    def run(self) -> None:
        """The Celery task's work. Raises Reject (the request goes back to the queue) while the worker shuts down,
        or while Redis or the database stay away. Any other fault ends the request with an `internal_error`
        (retryable) and its record, so no request is dropped unanswered."""
        if self.rt.draining.is_set():
            raise Reject("this worker is shutting down", requeue=True)
        try:
            self.answer()
        except Unavailable as exc:
            # Never acked as done: the request is answered again (or its stored answer shown) once both are back.
            log.warning("handing %s back to the queue: %s", self.request_id, exc)
            raise Reject(str(exc), requeue=True) from exc
        except Reject:   # handed back (the shutdown's grace period ended)
            raise
        except Exception as exc:   # a fault of this worker's: the client is told, and the request has its record
            log.exception("could not answer %s", self.request_id)
            try:
                self.fail("internal_error", f"The worker failed while answering this request ({type(exc).__name__}); "
                                            "it was not answered. Send it again; if it fails again, tell the "
                                            "server's operator (the worker's log names the cause).")
            except Unavailable as down:   # the failure cannot be recorded now: the request comes back later
                raise Reject(str(down), requeue=True) from down

    def answer(self) -> None:
        if replayable(self.spec) and (stored := self.stored_outcome()) is not None:   # answered before: show it again
            log.info("request %s was answered before; not generating again", self.request_id)
            self.finish(*stored)
            return
        if self.was_cancelled():
            self.fail("cancelled", "The request was cancelled before it started.")
            return
        if self.spec.get(HTTP_REQUEST_ID):
            log.info("answering %s (x-request-id %s)", self.request_id, self.spec[HTTP_REQUEST_ID])
        self.announce_start()
        # A redelivered request goes on from the tokens an earlier delivery showed of each choice, and each
        # choice's stream resumes after their characters. Where it cannot (worker/continuation.py), it is generated
        # again: the same tokens where the numerics are the same (its seed was fixed when it was accepted).
        shown = [self.streamed_chars(i) for i in range(choices(self.spec))]
        earlier = [self.shown_answer(i, chars) if chars else None for i, chars in enumerate(shown)]
        if any(shown):
            self.first_shown, self.first_admitted = self.shown_since()
        pending = self.with_tools(shown, earlier[0]) if assistant.serves(self.spec) else self.submit(shown, earlier)
        if pending is not None:
            self.conclude(pending)

    # ---- generating ---------------------------------------------------------------------------------

    def submit(self, shown: list[int], earlier: list[Shown | None]) -> Answer | None:
        """The answer under way, or None when the request was answered with an error (or is already running)."""
        job, engine = self.spec, self.rt.engine
        try:
            params = sampling_params(job)
            if job.get(PROMPT) is not None:   # a completion: the prompt as it is
                prompt_ids = completion_ids(engine, job[PROMPT])
            else:
                # Keep room for an answer, but never so much that no history fits; a long answer ends at "length".
                reserve = min(params.max_new_tokens, engine.max_model_len // 4)
                _, prompt_ids = fit_to_context(engine, job["messages"], reserve=reserve, tools=job.get(TOOLS),
                                               options=TemplateOptions.from_json(job.get(TEMPLATE)))
            echo = self.prompt_text(prompt_ids) if job.get(ECHO) else None
            continued = [(e.tokens(engine.tokenizer, params.skip_special_tokens) if e else None) or []
                         for e in earlier]
            return self.start(prompt_ids, params, shown, echo, continued)
        except (InvalidRequestError, InvalidParamsError, StructureError, GenerationError) as exc:
            if "already in use" in str(exc):   # the same request is being answered in this process
                return None
            self.fail(refusal_code(exc, self.spec), str(exc))
            return None

    def start(self, prompt_ids: list[int], params: SamplingParams, shown: list[int], echo: str | None = None,
              continued: list[list[int]] | None = None) -> Answer | None:
        """Submit the request to the engine; its text streams out from the publisher's thread, past the first
        `shown` characters of each choice (what clients were sent by an earlier delivery, written by its tokens in
        `continued`). `echo`: the prompt's text, for a client that asked for it before the answer. Bad requests
        raise here; None when this worker is answering the request already."""
        publisher = self.rt.publisher
        answer = publisher.track(self.spec, shown)
        if answer is None:
            return None
        if echo is not None:
            answer.echo = partial(echoed_prompt, echo, prompt_ids,
                                  tokens=self.rt.tokens.for_job(self.spec) if self.rt.tokens is not None else None)
            answer.echo_waits = params.prompt_logprobs is not None
        try:
            # Queued by acceptance time: the task threads hand requests over in no particular order.
            continuation.submit(self.rt.engine, self.request_id, prompt_ids, continued, params=params,
                                arrival_time=self.spec.get("enqueued_at"), outbox=publisher.outbox,
                                service_class=service_class(self.spec))
        except BaseException:
            publisher.forget(self.request_id)
            raise
        return answer

    def with_tools(self, shown: list[int], earlier: Shown | None = None) -> Answer | None:
        """A chat message whose assistant has tools or grounded answers: the lookups and tool rounds run here, and
        only the text meant for the customer streams out. None when the request was answered with an error or is
        running already."""
        job, publisher = self.spec, self.rt.publisher
        try:
            tools = [Tool.from_openai(spec, f"tools[{i}]") for i, spec in enumerate(job.get("tools") or [])]
            grounding = assistant.grounding(job)
            base = SamplingParams(**engine_params(job))
            base.validate()
            first = assistant.first_structure(tools, job.get("tool_choice") or "auto")
        except (ToolError, InvalidParamsError, GenerationError) as exc:
            self.fail("invalid_request", str(exc))
            return None
        answer = publisher.track(job, shown)
        if answer is None:
            return None
        relay = assistant.Relay(publisher.outbox, self.request_id)
        try:
            grounded = assistant.look_up(self.rt, job, grounding) if grounding else None
            done = assistant.converse(self.rt, job, tools, base, first, relay, self.was_cancelled, grounded,
                                      lead=grounding is not None and grounding.mode == "lead", shown=earlier)
        except (InvalidRequestError, InvalidParamsError) as exc:
            publisher.forget(self.request_id)
            self.fail(refusal_code(exc, self.spec), str(exc))
            return None
        except BaseException:   # interrupted: free the slot rather than generate for nobody
            self.rt.engine.abort(self.request_id)
            publisher.forget(self.request_id)
            raise
        relay.end(done)
        return answer

    def conclude(self, pending: Answer) -> None:
        """Wait while the publisher streams the text, then store the answer and send its end."""
        try:
            # A cancel normally reaches the engine through the cancel channel at once; one published while this
            # worker could not hear it (a pause, a Redis reconnection) is found by its key within CANCEL_CHECK_S.
            aborted = False
            while pending.wait(CANCEL_CHECK_S) is None:
                if not aborted and self.was_cancelled():
                    self.rt.engine.abort(self.request_id)
                    aborted = True
        except BaseException:   # interrupted while waiting: free the slot rather than generate for nobody
            self.rt.engine.abort(self.request_id)
            raise
        ends = pending.ordered()
        last = combined(ends)
        if last.finish_reason == "error" and self.rt.handing_back.is_set():
            log.info("handing %s back to the queue", self.request_id)
            raise Reject("the worker's shutdown grace period ended", requeue=True)
        # False when another delivery stored (and showed) this answer first; an answer that is not replayed from
        # SQL was generated again, the same, and is shown again.
        if self.store(last) or not replayable(self.spec):
            extra = api_fields(self.spec, ends, self.rt.tokens, self.prompt_text) if self.spec.get("channel") \
                else None
            self.finish(*outcome(self.spec, last.finish_reason, last.text, last.prompt_tokens,
                                 last.completion_tokens, extra=extra))

    def prompt_text(self, ids: list[int]) -> str:
        """A completion's prompt as its client sent it, or its ids decoded."""
        prompt = self.spec.get(PROMPT)
        return prompt if isinstance(prompt, str) else self.rt.engine.tokenizer.decode(ids)

    # ---- what Redis knows of it ---------------------------------------------------------------------

    def streamed_chars(self, index: int = 0) -> int:
        rt = self.rt
        return int(rt.redis_retrying(lambda: rt.redis.get(streamed_key(self.request_id, index)),
                                     "reading a stream position") or 0)

    def shown_answer(self, index: int, chars: int) -> Shown | None:
        """What an earlier delivery showed of choice `index`, with the tokens that wrote it; None without a record
        of all `chars` characters."""
        rt = self.rt
        entries = rt.redis_retrying(lambda: rt.redis.lrange(shown_key(self.request_id, index), 0, -1),
                                    "reading what was shown of an answer")
        earlier = Shown.read(entries, chars)
        if earlier is None:
            log.info("no record of the %d characters shown of %s (choice %d): generating it again", chars,
                     self.request_id, index)
        return earlier

    def shown_since(self) -> tuple[float | None, float | None]:
        """When an earlier delivery first sent text of this answer, and when its engine admitted it; None where no
        time was kept."""
        rt = self.rt
        keys = shown_at_key(self.request_id), admitted_at_key(self.request_id)
        times = rt.redis_retrying(lambda: rt.redis.mget(keys), "reading when an answer began")

        def seconds(at: bytes | None) -> float | None:
            try:
                return float(at) if at is not None else None
            except ValueError:
                return None
        return seconds(times[0]), seconds(times[1])

    def first_token_time(self, done: RequestFinished) -> float | None:
        """The customer's first token: an earlier delivery's first text where there was one."""
        times = [t for t in (self.first_shown, done.first_token_time) if t is not None]
        return min(times, default=None)

    def admitted_time(self, done: RequestFinished) -> float | None:
        """The end of the customer's wait in the queue: an earlier delivery's admission where it showed text, and
        never after their first text (a grounded answer's lead goes out before its generation is admitted, and a
        delivery stopped in between kept no admission)."""
        first = self.first_token_time(done) if self.first_shown is not None else None
        times = [t for t in (self.first_admitted, done.admitted_time, first) if t is not None]
        return min(times, default=None)

    def was_cancelled(self) -> bool:
        rt = self.rt
        return bool(rt.redis_retrying(lambda: rt.redis.exists(cancelled_key(self.request_id)),
                                      "checking for a cancellation"))

    def announce_start(self) -> None:
        """Tell the web process an API client waits on that a worker has begun: its answer timeout counts from here,
        not from when the request was queued. Best effort: without it the first token says the same."""
        if not self.spec.get("channel"):
            return
        try:
            self.rt.emit(STARTED, {"request_id": self.request_id}, self.spec)
        except redis.RedisError as exc:
            log.debug("could not say that %s started: %s", self.request_id, exc)

    def finish(self, event: str, payload: dict) -> None:
        self.rt.finish(event, payload, self.spec)

    def fail(self, code: str, message: str) -> None:
        """A request that cannot be answered still ends with a record and an `error` event."""
        now = time.time()
        done = RequestFinished(request_id=self.request_id, text="", token_ids=[], finish_reason="error",
                               prompt_tokens=0, completion_tokens=0, cached_tokens=0, arrival_time=now,
                               admitted_time=None, first_token_time=None, finished_time=now,
                               mean_batch_size=0.0, error=message)
        self.store(done)
        self.finish("error", {"request_id": self.request_id, "code": code, "message": message,
                              "retryable": code not in CLIENT_ERRORS})

    # ---- its record ---------------------------------------------------------------------------------

    def store(self, done: RequestFinished) -> bool:
        """Write the answer and the latency record together; False if this request was answered before.

        A database that is briefly away is waited for (SQL_RETRY_S); the write is one transaction, so a retry
        never stores half of it, and the answer's unique request id keeps a retry from storing it twice.
        """
        stored = self.rt.sql_retrying(lambda: self._write(done), f"storing the answer to {self.request_id}")
        if stored:
            self.rt.metrics.observe(self.spec, done, self.first_token_time(done), self.admitted_time(done))
        return stored

    def _write(self, done: RequestFinished) -> bool:
        job, rt = self.spec, self.rt
        with rt.sessions() as db:
            record = db.get(RequestRecord, self.request_id)
            if record is None:   # the web app could not write it (e.g. a direct enqueue): keep one anyway
                record = RequestRecord(request_id=self.request_id, conversation_id=job.get("conversation_id"),
                                       source=job.get("source", "chat"), enqueued_at=utc(job["enqueued_at"]),
                                       api_key=job.get("api_key"), http_request_id=job.get(HTTP_REQUEST_ID))
                db.add(record)
            record.model, record.worker = rt.model_name, rt.settings.name
            record.admitted_at, record.first_token_at = utc(self.admitted_time(done)), utc(self.first_token_time(done))
            record.finished_at = utc(done.finished_time)
            record.prompt_tokens, record.completion_tokens = done.prompt_tokens, done.completion_tokens
            record.continued_tokens = done.continued_tokens
            record.cached_tokens, record.batch_size = done.cached_tokens, done.mean_batch_size
            record.finish_reason, record.error = done.finish_reason, done.error
            for role, content in job.get("tool_messages", ()) if job.get("conversation_id") else ():
                db.add(Message(conversation_id=job["conversation_id"], role=role, content=content))
            if job.get("conversation_id") and done.text:
                db.add(Message(conversation_id=job["conversation_id"], role="assistant", content=done.text,
                               request_id=self.request_id))
            try:
                db.commit()
            except IntegrityError:   # another delivery stored its answer first
                db.rollback()
                return False
        return True

    def stored_outcome(self) -> tuple[str, dict] | None:
        """The final event of a request whose answer is already stored, or None."""
        return self.rt.sql_retrying(self._read_outcome, f"looking up {self.request_id}")

    def _read_outcome(self) -> tuple[str, dict] | None:
        with self.rt.sessions() as db:
            record = db.get(RequestRecord, self.request_id)
            if record is None or record.finished_at is None:
                return None
            answer = db.query(Message).filter_by(request_id=self.request_id).one_or_none()
            return outcome(self.spec, record.finish_reason, answer.content if answer else "",
                           record.prompt_tokens or 0, record.completion_tokens or 0, record.error)
