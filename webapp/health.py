"""Liveness (/healthz), readiness (/readyz), and what a client is told while Redis or the database is away."""

from __future__ import annotations

import logging

import redis
from flask import Blueprint, current_app, jsonify, request
from sqlalchemy import text
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from messaging import workers

from .sockets import reply, socketio

log = logging.getLogger(__name__)

bp = Blueprint("health", __name__)

# A lost or refused connection, as opposed to a bug: the client may simply try again shortly.
OUTAGES = (redis.ConnectionError, redis.TimeoutError, OperationalError, InterfaceError, PoolTimeout)
RETRY_AFTER_S = 5


@bp.get("/healthz")
def healthz():
    return jsonify(status="ok")


@bp.get("/readyz")
def readyz():
    checks = {}
    try:
        r = current_app.extensions["redis"]
        r.ping()
        checks["redis"] = "ok"
        live = workers.heartbeats(r)
        checks["worker"] = f"{len(live)} live" if live else "none: start the worker (make run does)"
    except Exception as exc:
        checks["redis"] = f"unreachable: {exc}"
        checks["worker"] = "unknown"
    try:
        with current_app.extensions["db"]() as db:
            db.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"unreachable: {exc}"
    ready = checks["redis"] == "ok" and checks["database"] == "ok" and checks["worker"].endswith("live")
    return jsonify(status="ready" if ready else "not ready", checks=checks), 200 if ready else 503


def outage_error(exc: Exception) -> dict:
    """The `error` body for a request that met an outage; nothing was queued, so sending again is safe."""
    what = "storage" if isinstance(exc, (OperationalError, InterfaceError, PoolTimeout)) else "queue"
    return {"code": f"{what}_unavailable", "retryable": True,
            "message": "The assistant is briefly unavailable; please send your message again in a few seconds."}


@bp.app_errorhandler(redis.ConnectionError)
@bp.app_errorhandler(redis.TimeoutError)
@bp.app_errorhandler(OperationalError)
@bp.app_errorhandler(InterfaceError)
@bp.app_errorhandler(PoolTimeout)
def http_outage(exc: Exception):
    log.warning("%s %s during an outage: %s", request.method, request.path, exc)
    body = outage_error(exc)
    error = {"message": body["message"], "type": "api_error", "param": None, "code": body["code"]}
    return jsonify(error=error), 503, {"Retry-After": str(RETRY_AFTER_S)}


@socketio.on_error_default
def socket_error(exc: Exception) -> None:
    """A Socket.IO event that failed is answered with an `error` event rather than with silence."""
    if isinstance(exc, OUTAGES):
        log.warning("Socket.IO %r during an outage: %s", request.event.get("message"), exc)
        body = outage_error(exc)
    else:
        log.error("Socket.IO %r failed", request.event.get("message"), exc_info=exc)
        body = {"code": "internal_error", "retryable": True,
                "message": "Something went wrong on our side; please send your message again."}
    if request.event.get("message") not in ("connect", "disconnect"):
        reply("error", body)
