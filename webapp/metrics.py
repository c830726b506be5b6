"""GET /metrics: every live worker's metrics merged from Redis, cluster-wide web counters and the queue depth."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import redis
from flask import Blueprint, Flask, Response, current_app, request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from messaging import workers
from messaging.queue import queue_depths

from .auth import bearer_ok, logged_in

log = logging.getLogger(__name__)

bp = Blueprint("metrics", __name__)

# Redis hashes (outcome -> count): every web process increments the same counters, so any of them serves the total.
API_OUTCOMES_KEY = "supportbot:webmetrics:api_requests"
CHAT_OUTCOMES_KEY = "supportbot:webmetrics:chat_messages"
CONNECTION_OUTCOMES_KEY = "supportbot:webmetrics:chat_connections"
OUTCOME_COUNTERS = (
    ("supportbot_api_requests", "POST /v1/chat/completions, /v1/responses and /v1/messages answers by outcome: ok, "
                                "or the error code.",
     API_OUTCOMES_KEY),
    ("supportbot_chat_messages", "Socket.IO chat messages by outcome: accepted, or the error code sent back.",
     CHAT_OUTCOMES_KEY),
    ("supportbot_chat_connections", "Socket.IO connections by outcome: accepted, or why they were refused.",
     CONNECTION_OUTCOMES_KEY),
)


def merge_snapshots(snapshots: dict[str, str]) -> list[Metric]:
    """One family per metric name, each worker's samples labelled `worker`, so the output stays valid text."""
    families: dict[str, Metric] = {}
    for worker, text in sorted(snapshots.items()):
        try:
            parsed = list(text_string_to_metric_families(text))
        except Exception as exc:   # one unreadable snapshot must not hide the others
            log.warning("skipping %s's metrics: %s", worker, exc)
            continue
        for family in parsed:
            if family.name.endswith("_created"):   # per-process start times: noise once merged
                continue
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            if merged.type != family.type:
                log.warning("%s is a %s on %s but a %s elsewhere; skipped", family.name, family.type, worker,
                            merged.type)
                continue
            merged.samples.extend(s._replace(labels={**s.labels, "worker": worker}) for s in family.samples)
    return list(families.values())


class ClusterCollector:
    """Read at scrape time, so every web process serves the same figures."""

    def __init__(self, r: redis.Redis) -> None:
        self.redis = r

    def collect(self) -> Iterator[Metric]:
        r = self.redis
        yield from merge_snapshots(workers.snapshots(r))
        depth = GaugeMetricFamily("supportbot_queue_depth", "Requests in the broker's queues, not yet taken by a "
                                  "worker, by service class.", labels=["class"])
        for service_class, waiting in queue_depths(r).items():
            depth.add_metric([service_class], waiting)
        yield depth
        yield GaugeMetricFamily("supportbot_workers_live", "Workers whose heartbeat is current.",
                                value=len(workers.heartbeats(r)))
        for name, documentation, key in OUTCOME_COUNTERS:
            outcomes = CounterMetricFamily(name, documentation, labels=["outcome"])
            for outcome, total in sorted(r.hgetall(key).items()):
                outcomes.add_metric([outcome.decode()], float(total))
            yield outcomes


def exposition(r: redis.Redis) -> bytes:
    registry = CollectorRegistry()
    registry.register(ClusterCollector(r))
    return generate_latest(registry)


def api_outcome(status: int, body: object) -> str:
    if status == 200:
        return "ok"
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) and code else f"http_{status}"


def count(key: str, outcome: str) -> None:
    """One more `outcome` in a cluster-wide counter; a Redis that is away costs the count, never the request."""
    try:
        current_app.extensions["redis"].hincrby(key, outcome, 1)
    except redis.RedisError as exc:
        log.warning("could not count %s in %s: %s", outcome, key, exc)


def count_api_response(response: Response) -> Response:
    if request.endpoint in ("api.chat_completions", "api.responses", "api.messages"):
        body = None if response.status_code == 200 or response.is_streamed else response.get_json(silent=True)
        count(API_OUTCOMES_KEY, api_outcome(response.status_code, body))
    return response


def init_app(app: Flask) -> None:
    app.after_request(count_api_response)
    app.register_blueprint(bp)


@bp.get("/metrics")
def metrics():
    if not (logged_in() or bearer_ok()):
        return Response("Log in as an operator, or send Authorization: Bearer $METRICS_TOKEN.\n", 401,
                        {"WWW-Authenticate": 'Bearer realm="metrics"'}, mimetype="text/plain")
    try:
        body = exposition(current_app.extensions["redis"])
    except redis.RedisError as exc:
        return Response(f"Redis unreachable: {exc}\n", 503, mimetype="text/plain")
    return Response(body, headers={"Content-Type": CONTENT_TYPE_LATEST, "Cache-Control": "no-store"})
