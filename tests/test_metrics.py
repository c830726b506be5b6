"""Prometheus metrics: the worker's histograms, their merge across workers, and /metrics on the running stack."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import requests
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.clients import ChatClient
from models.db import upgrade
from webapp import create_app
from webapp.metrics import merge_snapshots
from worker.engine import EngineStats, RequestFinished
from worker.local_redis import start_redis
from messaging.contract import snapshot_key
from messaging.classes import CLASSES
from worker.metrics import WorkerMetrics

HISTOGRAMS = ("supportbot_time_to_first_token_seconds", "supportbot_time_per_output_token_seconds",
              "supportbot_e2e_request_latency_seconds", "supportbot_request_queue_time_seconds")
TOKEN = "unit-test-metrics-token-0123456789"


def finished(rid: str, admitted: float | None, first: float | None, end: float, tokens: int,
             reason: str = "stop") -> RequestFinished:
    return RequestFinished(request_id=rid, text="x", token_ids=[1] * tokens, finish_reason=reason, prompt_tokens=30,
                           completion_tokens=tokens, cached_tokens=0, arrival_time=100.1, admitted_time=admitted,
                           first_token_time=first, finished_time=end, mean_batch_size=1.0)


def stats(running: int = 2, waiting: int = 1) -> EngineStats:
    return EngineStats(running=running, waiting=waiting, kv_blocks_used=30, kv_blocks_free=70, kv_blocks_total=100,
                       steps=500, preemptions=3, prefix_cache_hit_tokens=640, prefix_cache_query_tokens=1000,
                       last_batch_seqs=2, last_batch_tokens=9, continued=4)


def parse(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(families: dict[str, list], sample: str, **labels: str) -> float:
    """The sum over every sample of that name whose labels include `labels` (e.g. over all workers)."""
    return sum(s.value for samples in families.values() for s in samples
               if s.name == sample and labels.items() <= s.labels.items())


def buckets(families: dict[str, list], histogram: str, **labels: str) -> list[tuple[str, float]]:
    return [(s.labels["le"], s.value) for s in families[histogram]
            if s.name == histogram + "_bucket" and labels.items() <= s.labels.items()]


def assert_valid_histograms(families: dict[str, list], worker: str) -> None:
    for name in HISTOGRAMS:
        for cls in CLASSES:
            bs = buckets(families, name, worker=worker, **{"class": cls})
            bounds = [float(le) for le, _ in bs]
            counts = [c for _, c in bs]
            assert bs[-1][0] == "+Inf" and bounds == sorted(bounds), name
            assert all(a <= b for a, b in zip(counts, counts[1:])), f"{name} buckets must be cumulative"
            assert counts[-1] == value(families, name + "_count", worker=worker, **{"class": cls}), name


def assert_one_type_line_per_family(text: str) -> None:
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert names and len(names) == len(set(names)), Counter(names).most_common(3)


# ---- the worker's registry -----------------------------------------------------------------


STD = {"class": "standard"}   # a job that names no class (an older web process's) is standard


def test_observe_puts_each_timing_in_its_bucket():
    m = WorkerMetrics("w1", "tiny")
    job = {"enqueued_at": 100.0}
    m.observe(job, finished("a", admitted=100.3, first=100.8, end=101.85, tokens=11))
    m.observe(job, finished("b", admitted=None, first=None, end=100.05, tokens=0, reason="error"))
    fams = parse(m.exposition(stats()).decode())
    # Times count from the web app's enqueue (100.0), not from the engine's arrival (100.1).
    assert dict(buckets(fams, "supportbot_request_queue_time_seconds", **STD))["0.25"] == 0
    assert dict(buckets(fams, "supportbot_request_queue_time_seconds", **STD))["0.5"] == 1
    assert dict(buckets(fams, "supportbot_time_to_first_token_seconds", **STD))["0.75"] == 0
    assert dict(buckets(fams, "supportbot_time_to_first_token_seconds", **STD))["1.0"] == 1
    assert dict(buckets(fams, "supportbot_time_per_output_token_seconds", **STD))["0.1"] == 0
    assert dict(buckets(fams, "supportbot_time_per_output_token_seconds", **STD))["0.15"] == 1
    assert dict(buckets(fams, "supportbot_e2e_request_latency_seconds", **STD))["0.1"] == 1
    assert dict(buckets(fams, "supportbot_e2e_request_latency_seconds", **STD))["1.5"] == 1
    assert dict(buckets(fams, "supportbot_e2e_request_latency_seconds", **STD))["2.0"] == 2
    assert value(fams, "supportbot_e2e_request_latency_seconds_count") == 2
    assert value(fams, "supportbot_time_to_first_token_seconds_count") == 1
    assert value(fams, "supportbot_e2e_request_latency_seconds_sum") == pytest.approx(1.85 + 0.05)
    assert value(fams, "supportbot_request_success_total", finish_reason="stop") == 1
    assert value(fams, "supportbot_request_success_total", finish_reason="error") == 1
    assert value(fams, "supportbot_request_success_total", finish_reason="cancelled") == 0
    assert value(fams, "supportbot_generation_tokens_total") == 11
    assert value(fams, "supportbot_num_requests_running") == 2 and value(fams, "supportbot_num_requests_waiting") == 1
    assert value(fams, "supportbot_kv_cache_usage_ratio") == pytest.approx(0.3)
    assert value(fams, "supportbot_num_preemptions_total") == 3
    assert value(fams, "supportbot_prefix_cache_hit_tokens_total") == 640
    assert value(fams, "supportbot_prefix_cache_query_tokens_total") == 1000
    assert value(fams, "supportbot_continued_requests_total") == 4


def test_a_continued_answer_counts_only_the_tokens_this_worker_wrote():
    """An answer handed back mid-stream and continued (worker/continuation.py): 9 of its 11 tokens came from an
    earlier delivery, so this worker generated 2, one 0.25 s after its first. Its customer waited 0.1 s in the queue
    and saw the first token 0.4 s after the enqueue (the earlier delivery's), not 30.2 and 30.5 s, and the class's
    objective was met."""
    from dataclasses import replace

    m = WorkerMetrics("w1", "tiny")
    m.observe({"enqueued_at": 100.0}, replace(finished("c", admitted=130.2, first=130.5, end=130.75, tokens=11),
                                              continued_tokens=9), first_token_time=100.4, admitted_time=100.1)
    fams = parse(m.exposition(stats()).decode())
    assert dict(buckets(fams, "supportbot_request_queue_time_seconds", **STD))["0.1"] == 1, \
        "its queue wait is the earlier delivery's"
    assert value(fams, "supportbot_generation_tokens_total") == 2
    assert dict(buckets(fams, "supportbot_time_per_output_token_seconds", **STD))["0.2"] == 0
    assert dict(buckets(fams, "supportbot_time_per_output_token_seconds", **STD))["0.3"] == 1
    assert dict(buckets(fams, "supportbot_time_to_first_token_seconds", **STD))["0.25"] == 0
    assert dict(buckets(fams, "supportbot_time_to_first_token_seconds", **STD))["0.5"] == 1
    assert value(fams, "supportbot_ttft_objective_met_total", **STD) == 1


def test_latencies_are_labelled_by_class_with_each_class_objective_and_its_attainment(monkeypatch):
    monkeypatch.setenv("TTFT_OBJECTIVE_INTERACTIVE_S", "0.5")
    m = WorkerMetrics("w1", "tiny")
    for cls, first in (("interactive", 100.2), ("interactive", 100.9), ("bulk", 130.0)):
        m.observe({"enqueued_at": 100.0, "params": {"service_class": cls}}, finished("a", 100.1, first, 140.0, 5))
    fams = parse(m.exposition(stats()).decode())
    assert value(fams, "supportbot_time_to_first_token_seconds_count", **{"class": "interactive"}) == 2
    assert value(fams, "supportbot_time_to_first_token_seconds_count", **{"class": "bulk"}) == 1
    assert value(fams, "supportbot_time_to_first_token_seconds_count", **{"class": "standard"}) == 0
    assert value(fams, "supportbot_e2e_request_latency_seconds_count", **{"class": "bulk"}) == 1
    assert value(fams, "supportbot_ttft_objective_seconds", **{"class": "interactive"}) == 0.5
    assert value(fams, "supportbot_ttft_objective_seconds", **{"class": "bulk"}) == 60
    # 0.2 s met 0.5 s, 0.9 s did not; bulk's 30 s met its 60 s.
    assert value(fams, "supportbot_ttft_objective_met_total", **{"class": "interactive"}) == 1
    assert value(fams, "supportbot_ttft_objective_met_total", **{"class": "bulk"}) == 1


def test_snapshots_of_two_workers_merge_into_valid_text():
    one, two = WorkerMetrics("w1", "tiny"), WorkerMetrics("w2", "tiny")
    for i in range(3):
        one.observe({"enqueued_at": 100.0}, finished(f"a{i}", 100.1, 100.2, 101.0 + i, tokens=5))
    two.observe({"enqueued_at": 100.0}, finished("b", 100.5, 102.0, 130.0, tokens=50, reason="length"))
    snapshots = {"w1": one.exposition(stats(2, 0)).decode(), "w2": two.exposition(stats(1, 4)).decode(),
                 "broken": "this is { not exposition text"}

    class Merged:
        def collect(self):
            return merge_snapshots(snapshots)

    registry = CollectorRegistry()
    registry.register(Merged())
    text = generate_latest(registry).decode()
    assert_one_type_line_per_family(text)
    assert "_created" not in text
    fams = parse(text)
    for worker in ("w1", "w2"):
        assert_valid_histograms(fams, worker)
    assert value(fams, "supportbot_e2e_request_latency_seconds_count", worker="w1") == 3
    assert value(fams, "supportbot_e2e_request_latency_seconds_count", worker="w2") == 1
    assert value(fams, "supportbot_e2e_request_latency_seconds_count") == 4
    assert value(fams, "supportbot_request_success_total", finish_reason="length") == 1
    assert value(fams, "supportbot_num_requests_waiting", worker="w2") == 4
    assert value(fams, "supportbot_num_requests_running") == 3
    assert not any(s.labels.get("worker") == "broken" for samples in fams.values() for s in samples)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    proc, url = start_redis(tmp_path_factory.mktemp("metrics-redis"))
    yield url
    proc.terminate()
    proc.wait(10)


def test_any_web_app_serves_what_the_workers_published(tmp_path, redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    for name, n in (("w1", 2), ("w2", 5)):
        m = WorkerMetrics(name, "tiny")
        for i in range(n):
            m.observe({"enqueued_at": 100.0}, finished(f"{name}-{i}", 100.1, 100.2, 101.0, tokens=3))
        m.publish(r, stats())
        assert 0 < r.ttl(snapshot_key(name)) <= 10, "a dead worker's figures must expire"
    r.rpush("generate", "a", "b", "c")
    upgrade(f"sqlite:///{tmp_path / 'm.db'}")   # every /v1 request first looks up the API keys there
    apps = [create_app({"DATABASE_URL": f"sqlite:///{tmp_path / 'm.db'}", "REDIS_URL": redis_url,
                        "OPERATOR_PASSWORD": "an operator password", "METRICS_TOKEN": TOKEN}) for _ in range(2)]
    # Refused API calls are counted by outcome, in Redis, whichever process answered them.
    apps[0].test_client().post("/v1/chat/completions", data="not json", content_type="text/plain")
    apps[1].test_client().post("/v1/chat/completions", json={"messages": []})
    apps[1].test_client().post("/v1/responses", json={"input": []})   # the Responses API counts with them
    texts = [a.test_client().get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text for a in apps]
    assert texts[0] == texts[1]
    assert_one_type_line_per_family(texts[0])
    fams = parse(texts[0])
    assert value(fams, "supportbot_e2e_request_latency_seconds_count", worker="w1") == 2
    assert value(fams, "supportbot_e2e_request_latency_seconds_count", worker="w2") == 5
    assert value(fams, "supportbot_queue_depth") == 3
    assert value(fams, "supportbot_api_requests_total", outcome="invalid_json") == 1
    assert value(fams, "supportbot_api_requests_total", outcome="invalid_messages") == 1
    assert value(fams, "supportbot_api_requests_total", outcome="invalid_value") == 1
    assert value(fams, "supportbot_worker_info", worker="w2", model="tiny") == 1


# ---- the running stack ---------------------------------------------------------------------


def scrape(stack, url: str | None = None) -> dict[str, list]:
    response = requests.get((url or stack.web_urls[0]) + "/metrics", timeout=10,
                            headers={"Authorization": f"Bearer {stack.env['METRICS_TOKEN']}"})
    response.raise_for_status()
    assert_one_type_line_per_family(response.text)
    return parse(response.text)


def settled(stack, timeout: float = 90) -> dict[str, list]:
    """Metrics once nothing is in flight and a later publication (every 2 s) agrees."""
    deadline, previous = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        fams = scrape(stack)
        state = tuple(value(fams, f"{h}_count") for h in HISTOGRAMS) + (
            value(fams, "supportbot_num_requests_running"), value(fams, "supportbot_num_requests_waiting"),
            value(fams, "supportbot_queue_depth"))
        if state == previous and state[-3:] == (0, 0, 0):
            return fams
        previous = state
        time.sleep(2.5)
    raise TimeoutError("the stack's metrics did not settle")


def test_metrics_on_the_stack_need_a_login_or_the_token(stack):
    url = stack.web_urls[0] + "/metrics"
    assert requests.get(url).status_code == 401
    assert requests.get(url, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert requests.get(url, headers={"Authorization": f"Bearer {stack.env['METRICS_TOKEN']}"}).status_code == 200


def test_n_requests_through_the_stack_add_n_to_every_histogram(stack):
    n = 6
    before = settled(stack)
    workers = sorted({s.labels["worker"] for s in before["supportbot_e2e_request_latency_seconds"]})
    assert workers, "the worker publishes its metrics"

    def ask(i: int) -> dict:
        response = requests.post(stack.web_urls[i % 2] + "/v1/chat/completions", timeout=120,
                                 json={"messages": [{"role": "user", "content": f"Where is order {1000 + i}?"}],
                                       "max_tokens": 8})
        response.raise_for_status()
        return response.json()

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(ask, range(n)))

    deadline = time.monotonic() + 60
    while value(scrape(stack), "supportbot_e2e_request_latency_seconds_count") < \
            value(before, "supportbot_e2e_request_latency_seconds_count") + n and time.monotonic() < deadline:
        time.sleep(0.5)
    after = settled(stack)

    def diff(sample: str, **labels: str) -> float:
        return value(after, sample, **labels) - value(before, sample, **labels)

    completion = [a["usage"]["completion_tokens"] for a in answers]
    for name in ("supportbot_e2e_request_latency_seconds", "supportbot_time_to_first_token_seconds",
                 "supportbot_request_queue_time_seconds"):
        assert diff(name + "_count") == n, name
        assert diff(name + "_bucket", le="+Inf") == n, name
        assert diff(name + "_sum") > 0, name
    assert diff("supportbot_time_per_output_token_seconds_count") == sum(c >= 2 for c in completion)
    assert diff("supportbot_request_success_total") == n
    assert diff("supportbot_request_success_total", finish_reason="length") == \
        sum(a["choices"][0]["finish_reason"] == "length" for a in answers)
    assert diff("supportbot_generation_tokens_total") == sum(completion)
    assert diff("supportbot_prompt_tokens_total") == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert diff("supportbot_api_requests_total", outcome="ok") == n
    for worker in workers:
        assert_valid_histograms(after, worker)
    assert 0 <= value(after, "supportbot_kv_cache_usage_ratio") <= 1
    assert value(after, "supportbot_prefix_cache_query_tokens_total") >= value(
        after, "supportbot_prefix_cache_hit_tokens_total") > 0, "every request shares the system prompt"
    assert "supportbot_num_preemptions" in after and value(after, "supportbot_workers_live") >= 1

    # The other web process serves the same worker figures.
    other = scrape(stack, stack.web_urls[1])
    for name in HISTOGRAMS:
        assert other[name] == after[name], name


def test_chat_messages_and_connections_are_counted_by_outcome(stack):
    before = scrape(stack)
    client = ChatClient(stack.web_urls[1])   # counted in Redis: any web process serves the total
    try:
        client.ask("Do you ship to Canada?", max_new_tokens=4)
        client.sio.emit("chat_message", {"text": "   "})
        name, data = client.next()
        assert name == "error" and data["code"] == "empty_message"
    finally:
        client.close()
    after = scrape(stack)

    def diff(sample: str, **labels: str) -> float:
        return value(after, sample, **labels) - value(before, sample, **labels)

    assert diff("supportbot_chat_messages_total", outcome="accepted") == 1
    assert diff("supportbot_chat_messages_total", outcome="empty_message") == 1
    assert diff("supportbot_chat_messages_total") == 2
    assert diff("supportbot_chat_connections_total", outcome="accepted") == 1
