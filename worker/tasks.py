"""The generation task: hand one request to the process-wide engine and stream its answer out."""

from __future__ import annotations

import logging
import threading

from celery.signals import worker_init, worker_shutdown

from worker.celery_app import GENERATE_TASK, cancelled_key, celery
from worker.engine import InvalidParamsError, InvalidRequestError, SamplingParams, TokenDelta
from worker.runtime import WorkerRuntime, fit_to_context

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


@worker_shutdown.connect
def _stop_engine(**_) -> None:
    if _runtime is not None:
        _runtime.engine.shutdown()


@celery.task(name=GENERATE_TASK, acks_late=True, reject_on_worker_lost=True)
def generate(job: dict) -> None:
    rt = runtime()
    rid = job["request_id"]
    if rt.answered(rid):   # a redelivery of a request already answered: show it, do not generate again
        log.info("request %s was answered before; not generating again", rid)
        return
    if rt.redis.exists(cancelled_key(rid)):
        rt.fail(job, "cancelled", "The request was cancelled before it started.")
        return
    try:
        params = SamplingParams(**job.get("params", {}))
        params.validate()
        # Keep room for an answer, but never so much that no history fits; a long answer ends at "length".
        reserve = min(params.max_new_tokens, rt.engine.max_model_len // 4)
        _, prompt_ids = fit_to_context(rt.engine, job["messages"], reserve=reserve)
        stream = rt.engine.submit(rid, prompt_token_ids=prompt_ids, params=params)
    except (InvalidRequestError, InvalidParamsError) as exc:
        if "already in use" in str(exc):   # the same request is being answered in this process
            return
        rt.fail(job, "prompt_too_long" if "too long" in str(exc) else "invalid_request", str(exc))
        return
    for event in stream:
        if isinstance(event, TokenDelta):
            if event.text:
                rt.emit("token", {"request_id": rid, "text": event.text}, job)
            continue
        if not rt.store(job, event):
            return
        if event.finish_reason == "error":
            rt.emit("error", {"request_id": rid, "code": "generation_failed", "retryable": True,
                              "message": "The assistant failed while answering; please send your message again."},
                    job)
        else:
            rt.emit("done", {"request_id": rid, "conversation_id": job.get("conversation_id"), "text": event.text,
                             "finish_reason": event.finish_reason, "prompt_tokens": event.prompt_tokens,
                             "completion_tokens": event.completion_tokens}, job)
