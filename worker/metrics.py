"""The worker's Prometheus metrics, published to Redis so that any web process can serve them at /metrics."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from messaging.classes import CLASSES, ttft_objectives
from messaging import workers
from messaging.jobs import service_class
from models import FINISH_REASONS

if TYPE_CHECKING:   # published from the worker's heartbeat thread; only the types come from the engine
    from worker.engine import EngineStats, RequestFinished

log = logging.getLogger(__name__)

# A few missed publications (every 2 s) are tolerated; a dead worker's series vanish soon after.
SNAPSHOT_TTL_S = 10

QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                 320.0, 640.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0)


class _EngineCollector:
    """Gauges and engine-lifetime counters read from the latest EngineStats at each publication."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("supportbot_worker_info", "The model this worker serves.", labels=["model"])
        info.add_metric([self.model], 1)
        yield info
        s = self.stats
        if s is None:
            return
        gauges = (
            ("supportbot_num_requests_running", "Requests in the engine's running batch.", s.running),
            ("supportbot_num_requests_waiting", "Requests handed to the engine and waiting for a slot.", s.waiting),
            ("supportbot_kv_cache_usage_ratio", "Share of the KV-cache blocks in use (1 = full).", s.kv_usage),
            ("supportbot_batch_num_seqs", "Sequences in the engine's latest forward pass.", s.last_batch_seqs),
            ("supportbot_batch_num_tokens", "Tokens in the engine's latest forward pass.", s.last_batch_tokens),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = (
            ("supportbot_num_preemptions", "Requests preempted because the KV cache ran out.", s.preemptions),
            ("supportbot_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
             s.prefix_cache_hit_tokens),
            ("supportbot_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.",
             s.prefix_cache_query_tokens),
            ("supportbot_engine_steps", "Forward passes the engine has run.", s.steps),
            ("supportbot_continued_requests", "Requests handed back mid-answer (a worker stopped) that went on from "
             "the tokens their customer was shown.", s.continued),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


class WorkerMetrics:
    """Request histograms observed as each record is stored, plus the engine's state, in one registry."""

    def __init__(self, worker: str, model: str) -> None:
        self.worker = worker
        self.registry = CollectorRegistry()
        reg = self.registry
        # Latencies by service class (interactive, standard, bulk): each class has its own objective.
        self.queue_time = Histogram("supportbot_request_queue_time_seconds",
                                    "Seconds from enqueue to admission into the running batch.", ["class"],
                                    buckets=QUEUE_BUCKETS, registry=reg)
        self.ttft = Histogram("supportbot_time_to_first_token_seconds",
                              "Seconds from enqueue to the first output token.", ["class"], buckets=TTFT_BUCKETS,
                              registry=reg)
        self.tpot = Histogram("supportbot_time_per_output_token_seconds",
                              "Mean seconds per output token after the first, per request.", ["class"],
                              buckets=TPOT_BUCKETS, registry=reg)
        self.e2e = Histogram("supportbot_e2e_request_latency_seconds", "Seconds from enqueue to the request's end.",
                             ["class"], buckets=E2E_BUCKETS, registry=reg)
        # Attainment of the class's TTFT objective: ttft_objective_met / time_to_first_token_seconds_count.
        self.objectives = ttft_objectives()
        self.objective_met = Counter("supportbot_ttft_objective_met",
                                     "Requests whose first token came within their class's TTFT objective.",
                                     ["class"], registry=reg)
        objective = Gauge("supportbot_ttft_objective_seconds", "Each class's time-to-first-token objective "
                          "(TTFT_OBJECTIVE_<CLASS>_S).", ["class"], registry=reg)
        for cls in CLASSES:   # every class present from the start, so rate() sees the first request
            for metric in (self.queue_time, self.ttft, self.tpot, self.e2e, self.objective_met):
                metric.labels(cls)
            objective.labels(cls).set(self.objectives[cls])
        self.success = Counter("supportbot_request_success", "Finished requests by finish reason.",
                               ["finish_reason"], registry=reg)
        for reason in FINISH_REASONS:   # every reason present from the start, so rate() sees the first one
            self.success.labels(reason)
        self.prompt_tokens = Counter("supportbot_prompt_tokens", "Prompt tokens of finished requests.", registry=reg)
        self.generation_tokens = Counter("supportbot_generation_tokens", "Tokens generated for finished requests.",
                                         registry=reg)
        self.engine = _EngineCollector(model)
        reg.register(self.engine)

    def observe(self, job: dict, done: RequestFinished, first_token_time: float | None = None,
                admitted_time: float | None = None) -> None:
        """Once per stored record; times count from the web app's enqueue, as in request_records.
        `first_token_time` and `admitted_time`: when the customer saw the first token and when the request was first
        admitted, where an earlier delivery showed text (a handed-back answer); TPOT stays this delivery's own."""
        start = job.get("enqueued_at") or done.arrival_time
        cls = service_class(job)
        admitted = admitted_time if admitted_time is not None else done.admitted_time
        if admitted is not None:
            self.queue_time.labels(cls).observe(max(0.0, admitted - start))
        first = first_token_time if first_token_time is not None else done.first_token_time
        if first is not None:
            ttft = max(0.0, first - start)
            self.ttft.labels(cls).observe(ttft)
            if ttft <= self.objectives[cls]:
                self.objective_met.labels(cls).inc()
        if done.tpot is not None:
            self.tpot.labels(cls).observe(max(0.0, done.tpot))
        self.e2e.labels(cls).observe(max(0.0, done.finished_time - start))
        self.success.labels(done.finish_reason).inc()
        self.prompt_tokens.inc(done.prompt_tokens)
        self.generation_tokens.inc(done.completion_tokens - done.continued_tokens)   # this worker's own

    def exposition(self, stats: EngineStats | None) -> bytes:
        self.engine.stats = stats
        return generate_latest(self.registry)

    def publish(self, r: redis.Redis, stats: EngineStats | None) -> None:
        """Never raises: the heartbeat thread that calls it must keep beating."""
        try:
            workers.publish_snapshot(r, self.worker, self.exposition(stats), SNAPSHOT_TTL_S)
        except redis.RedisError as exc:
            log.warning("could not publish metrics: %s", exc)
        except Exception:
            log.exception("could not publish metrics")
