"""Liveness (/healthz) and readiness (/readyz: Redis, SQL and a live worker)."""

from __future__ import annotations

from flask import Blueprint, current_app, jsonify
from sqlalchemy import text

from worker.celery_app import HEARTBEAT_PREFIX

bp = Blueprint("health", __name__)


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
        workers = list(r.scan_iter(HEARTBEAT_PREFIX + "*"))
        checks["worker"] = f"{len(workers)} live" if workers else "none: start the worker (make run does)"
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
