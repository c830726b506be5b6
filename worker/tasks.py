"""The generation task and the worker process's signals: one WorkerRuntime per process, one Job per request."""

from __future__ import annotations

import logging
import threading

from celery import states
from celery.signals import (task_postrun, task_received, worker_init, worker_ready, worker_shutdown,
                            worker_shutting_down)

from messaging.contract import GENERATE_TASK
from worker.celery_app import celery
from worker.job import Job
from worker.runtime import WorkerRuntime

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
    Job(runtime(), job).run()
