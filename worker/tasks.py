"""The generation task: hand one request to the process-wide engine and stream its answer out."""

from __future__ import annotations

import logging
import threading

from celery import states
from celery.exceptions import Reject
from celery.signals import (task_postrun, task_received, worker_init, worker_ready, worker_shutdown,
                            worker_shutting_down)

from messaging.contract import GENERATE_TASK
from worker import assistant
from messaging.jobs import ECHO, PROMPT, STRUCTURE, TOOLS, replayable, service_class
from structured import Structure, StructureError
from worker.celery_app import celery
from worker.engine import InvalidParamsError, InvalidRequestError, SamplingParams
from worker.prompts import completion_ids
from worker.publisher import Answer
from worker.runtime import Unavailable, WorkerRuntime, api_fields, combined, fit_to_context, outcome

log = logging.getLogger(__name__)

_runtime: WorkerRuntime | None = None
_runtime_lock = threading.Lock()


def runtime() -> WorkerRuntime:
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = WorkerRuntime()
        return _runtime


@worker_init.connect
def _load_before_consuming(**_) -> None:
    # The thread pool never forks, so the model is loaded once, here, before the first task arrives.
    runtime()


@worker_ready.connect
def _announce(**_) -> None:
    # After Celery has set up logging (worker_init comes before it): slots, KV pool, attention, graphs.
    log.info(runtime().describe())


@worker_shutting_down.connect
def _drain(**_) -> None:
    # SIGTERM: nothing new starts; answers under way get a grace period, then go back to the queue.
    if _runtime is not None:
        _runtime.begin_shutdown()


@worker_shutdown.connect
def _stop_engine(**_) -> None:
    if _runtime is not None:
        _runtime.stopped.set()
        _runtime.leases.stop()
        _runtime.engine.shutdown()


@task_received.connect
def _take_lease(request=None, **_) -> None:
    runtime().leases.hold(request.id, request.message.delivery_tag)


@task_postrun.connect
def _drop_lease(task_id=None, state=None, **_) -> None:
    runtime().leases.release(task_id, answered=state == states.SUCCESS)


@celery.task(name=GENERATE_TASK, acks_late=True, reject_on_worker_lost=True)
def generate(job: dict) -> None:
    rt = runtime()
    if rt.draining.is_set():
        raise Reject("this worker is shutting down", requeue=True)
    try:
        answer(rt, job)
    except Unavailable as exc:
        # Never acked as done: the request is answered again (or its stored answer shown) once both are back.
        log.warning("handing %s back to the queue: %s", job["request_id"], exc)
        raise Reject(str(exc), requeue=True) from exc


def answer(rt: WorkerRuntime, job: dict) -> None:
    rid = job["request_id"]
    if replayable(job) and (stored := rt.stored_outcome(job)) is not None:   # answered before: show it again
        log.info("request %s was answered before; not generating again", rid)
        rt.finish(*stored, job)
        return
    if rt.was_cancelled(rid):
        rt.fail(job, "cancelled", "The request was cancelled before it started.")
        return
    # A redelivered request regenerates the same tokens (its seed was fixed when it was accepted),
    # so the customer's stream resumes after what an earlier delivery already showed.
    shown = rt.streamed_chars(rid)
    pending = (assistant.run if assistant.serves(job) else submit)(rt, job, shown)
    if pending is not None:
        conclude(rt, job, pending)


def submit(rt: WorkerRuntime, job: dict, shown: int) -> Answer | None:
    """The answer under way, or None when the request was answered with an error (or is already running)."""
    try:
        params = sampling_params(job)
        if job.get(PROMPT) is not None:   # a completion: the prompt as it is
            prompt_ids = completion_ids(rt.engine, job[PROMPT])
        else:
            # Keep room for an answer, but never so much that no history fits; a long answer ends at "length".
            reserve = min(params.max_new_tokens, rt.engine.max_model_len // 4)
            _, prompt_ids = fit_to_context(rt.engine, job["messages"], reserve=reserve, tools=job.get(TOOLS))
        echo = prompt_text(rt, job, prompt_ids) if job.get(ECHO) else None
        return rt.start_answer(job, prompt_ids, params, shown, echo, service_class=service_class(job))
    except (InvalidRequestError, InvalidParamsError, StructureError) as exc:
        if "already in use" in str(exc):   # the same request is being answered in this process
            return None
        rt.fail(job, "prompt_too_long" if "too long" in str(exc) else "invalid_request", str(exc))
        return None


def sampling_params(job: dict) -> SamplingParams:
    params = SamplingParams(**{k: v for k, v in job.get("params", {}).items() if k != "service_class"})
    if job.get(STRUCTURE) is not None:
        params.structure = Structure.from_json(job[STRUCTURE])
    params.validate()
    return params


def conclude(rt: WorkerRuntime, job: dict, pending: Answer) -> None:
    """Wait while the publisher streams the text, then store the answer and send its end."""
    try:
        pending.wait()
    except BaseException:   # interrupted while waiting: free the slot rather than generate for nobody
        rt.engine.abort(job["request_id"])
        raise
    ends = pending.ordered()
    last = combined(ends)
    if last.finish_reason == "error" and rt.handing_back.is_set():
        log.info("handing %s back to the queue", job["request_id"])
        raise Reject("the worker's shutdown grace period ended", requeue=True)
    # False when another delivery stored (and showed) this answer first; an answer that is not replayed from SQL
    # was generated again, the same, and is shown again.
    if rt.store(job, last) or not replayable(job):
        extra = api_fields(job, ends, rt.tokens, lambda ids: prompt_text(rt, job, ids)) if job.get("channel") \
            else None
        rt.finish(*outcome(job, last.finish_reason, last.text, last.prompt_tokens, last.completion_tokens,
                           extra=extra), job)


def prompt_text(rt: WorkerRuntime, job: dict, ids: list[int]) -> str:
    """A completion's prompt as its client sent it, or its ids decoded."""
    prompt = job.get(PROMPT)
    return prompt if isinstance(prompt, str) else rt.engine.tokenizer.decode(ids)
