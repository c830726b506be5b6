"""Operator login and the dashboard's JSON: access rules, CSRF, production secrets, figures recomputed from SQL rows."""

from __future__ import annotations

import math
import os
import random
import re
import time
import uuid
from collections import Counter
from datetime import UTC, datetime

import numpy as np
import pytest
import redis
from sqlalchemy import create_engine, select, text
from sqlalchemy.pool import NullPool
from werkzeug.security import generate_password_hash

from housekeeping import histogram, rollup
from messaging import workers
from messaging.classes import DEFAULT_TTFT_OBJECTIVE_S
from models import RequestRecord
from models.db import make_engine, make_session_factory, upgrade
from webapp import config, create_app
from webapp.config import ConfigError
from worker.local_redis import start_redis

PASSWORD = "correct horse battery staple"
TOKEN = "metrics-token-for-the-dashboard-tests"
QS = {"p50": 50, "p90": 90, "p99": 99}


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    proc, url = start_redis(tmp_path_factory.mktemp("dash-redis"))
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture()
def database_url(tmp_path):
    url = f"sqlite:///{tmp_path / 'dashboard.db'}"
    upgrade(url)
    return url


@pytest.fixture()
def app(database_url, redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    return create_app({"DATABASE_URL": database_url, "REDIS_URL": redis_url, "OPERATOR_PASSWORD": PASSWORD,
                       "METRICS_TOKEN": TOKEN})


@pytest.fixture(params=["sqlite", "postgresql"])
def any_database_url(request, tmp_path):
    """SQLite, and a throwaway PostgreSQL database when a server answers (TEST_POSTGRES_URL)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'figures.db'}"
        upgrade(url)
        yield url
        return
    admin = create_engine(os.environ.get("TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"),
                          isolation_level="AUTOCOMMIT", poolclass=NullPool, connect_args={"connect_timeout": 3})
    name = f"test_dashboard_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:   # no server here: the SQLite run still covers the figures
        pytest.skip(f"PostgreSQL not reachable: {str(exc).splitlines()[0]}")
    url = admin.url.set(database=name).render_as_string(hide_password=False)
    upgrade(url)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def csrf_from(html: str) -> str:
    return re.search(r'name="csrf_token" value="([^"]+)"', html).group(1)


def login(client, password: str = PASSWORD, **extra):
    token = csrf_from(client.get("/login").text)
    return client.post("/login", data={"username": "operator", "password": password, "csrf_token": token, **extra})


@pytest.fixture()
def operator(app):
    client = app.test_client()
    assert login(client).status_code == 302
    return client


# ---- access ----------------------------------------------------------------------------------


def test_logged_out_visitors_get_nothing(app):
    client = app.test_client()
    page = client.get("/dashboard")
    assert page.status_code == 302 and page.headers["Location"].startswith("/login?next=/dashboard")
    assert client.get("/dashboard/data?window=5m").status_code == 401
    metrics = client.get("/metrics")
    assert metrics.status_code == 401 and "supportbot" not in metrics.text
    assert client.get("/metrics", headers={"Authorization": "Bearer wrong-token"}).status_code == 401
    assert client.get("/metrics", headers={"Authorization": TOKEN}).status_code == 401


def test_metrics_accept_the_bearer_token(app):
    response = app.test_client().get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200 and response.mimetype == "text/plain"
    assert "supportbot_queue_depth" in response.text


def test_metrics_without_a_configured_token_take_no_bearer(database_url, redis_url):
    app = create_app({"DATABASE_URL": database_url, "REDIS_URL": redis_url, "OPERATOR_PASSWORD": PASSWORD})
    assert app.test_client().get("/metrics", headers={"Authorization": "Bearer "}).status_code == 401


def test_a_wrong_password_or_username_is_refused(app):
    client = app.test_client()
    response = login(client, password="not the password")
    assert response.status_code == 401 and "Wrong username or password" in response.text
    token = csrf_from(client.get("/login").text)
    response = client.post("/login", data={"username": "root", "password": PASSWORD, "csrf_token": token})
    assert response.status_code == 401
    assert client.get("/dashboard/data").status_code == 401


def test_a_login_without_the_csrf_token_is_refused(app):
    client = app.test_client()
    client.get("/login")
    assert client.post("/login", data={"username": "operator", "password": PASSWORD}).status_code == 400
    assert client.post("/login", data={"username": "operator", "password": PASSWORD,
                                       "csrf_token": "forged"}).status_code == 400
    # A token from another browser's session is no good either.
    other = csrf_from(app.test_client().get("/login").text)
    assert client.post("/login", data={"username": "operator", "password": PASSWORD,
                                       "csrf_token": other}).status_code == 400
    assert client.get("/dashboard/data").status_code == 401


def test_login_then_everything_then_logout(app):
    client = app.test_client()
    response = login(client, next="/dashboard?window=1h")
    assert response.status_code == 302 and response.headers["Location"] == "/dashboard?window=1h"
    page = client.get("/dashboard")
    assert page.status_code == 200
    scripts = re.findall(r"<script\b[^>]*>", page.text)
    assert scripts and all("src=" in s for s in scripts), "no inline scripts"
    assert "script-src 'self';" in page.headers["Content-Security-Policy"]
    assert "vendor/uplot.iife.min.js" in page.text
    assert client.get("/static/vendor/uplot.iife.min.js").status_code == 200
    assert client.get("/dashboard/data?window=1h").status_code == 200
    assert client.get("/metrics").status_code == 200
    # Logging out needs the form's token too.
    assert client.post("/logout").status_code == 400
    assert client.get("/dashboard/data").status_code == 200
    assert client.post("/logout", data={"csrf_token": csrf_from(page.text)}).status_code == 302
    assert client.get("/dashboard/data").status_code == 401
    assert client.get("/metrics").status_code == 401


@pytest.mark.parametrize("target", ["//evil.example/x", "https://evil.example/", "/\\evil.example"])
def test_login_never_redirects_off_site(app, target):
    response = login(app.test_client(), next=target)
    assert response.status_code == 302 and response.headers["Location"] == "/dashboard"


def test_a_password_hash_from_the_environment_works(database_url, redis_url):
    app = create_app({"DATABASE_URL": database_url, "REDIS_URL": redis_url,
                      "OPERATOR_PASSWORD_HASH": generate_password_hash("hashed secret 42")})
    client = app.test_client()
    assert login(client, password=PASSWORD).status_code == 401
    assert login(client, password="hashed secret 42").status_code == 302


def test_an_unknown_window_is_a_clear_error(operator):
    response = operator.get("/dashboard/data?window=30d")
    assert response.status_code == 400 and "5m" in response.json["error"]["message"]


# ---- configuration ---------------------------------------------------------------------------

SETTINGS = ("SECRET_KEY", "OPERATOR_PASSWORD", "OPERATOR_PASSWORD_HASH", "OPERATOR_USERNAME", "METRICS_TOKEN")


@pytest.fixture()
def clean_env(monkeypatch, tmp_path, redis_url):
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(config, "INSTANCE_DIR", tmp_path / "instance")
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path / 'prod.db'}")
    return monkeypatch


def test_development_generates_an_operator_password_once(clean_env, tmp_path, caplog):
    clean_env.setenv("SUPPORTBOT_ENV", "development")
    with caplog.at_level("WARNING"):
        first = create_app()
    stored = (tmp_path / "instance" / "operator_password").read_text().strip()
    assert len(stored) >= 12 and stored in caplog.text
    client = first.test_client()
    assert login(client, password=stored).status_code == 302
    second = create_app()   # a second web process shares the password
    assert login(second.test_client(), password=stored).status_code == 302


@pytest.mark.parametrize("env, missing", [
    ({}, "SECRET_KEY"),
    ({"SECRET_KEY": "test-secret", "OPERATOR_PASSWORD": "a-strong-operator-password"}, "SECRET_KEY"),
    ({"SECRET_KEY": "changeme", "OPERATOR_PASSWORD": "a-strong-operator-password"}, "SECRET_KEY"),
    ({"SECRET_KEY": "f" * 64}, "OPERATOR_PASSWORD"),
    ({"SECRET_KEY": "f" * 64, "OPERATOR_PASSWORD": "changeme"}, "OPERATOR_PASSWORD"),
    ({"SECRET_KEY": "f" * 64, "OPERATOR_PASSWORD": "operator"}, "OPERATOR_PASSWORD"),
    ({"SECRET_KEY": "f" * 64, "OPERATOR_PASSWORD_HASH": "plain text"}, "OPERATOR_PASSWORD_HASH"),
    ({"SECRET_KEY": "f" * 64, "OPERATOR_PASSWORD": "a-strong-operator-password", "METRICS_TOKEN": "secret"},
     "METRICS_TOKEN"),
])
def test_production_refuses_missing_or_default_secrets(clean_env, tmp_path, env, missing):
    clean_env.setenv("SUPPORTBOT_ENV", "production")
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(ConfigError, match=missing):
        create_app()
    assert not (tmp_path / "instance" / "operator_password").exists()
    assert not (tmp_path / "instance" / "secret_key").exists()


def test_production_starts_with_real_secrets(clean_env, tmp_path):
    clean_env.setenv("SUPPORTBOT_ENV", "production")
    clean_env.setenv("SECRET_KEY", "9" * 64)
    clean_env.setenv("OPERATOR_USERNAME", "lead")
    clean_env.setenv("OPERATOR_PASSWORD_HASH", generate_password_hash("the lead's own password"))
    upgrade(f"sqlite:///{tmp_path / 'prod.db'}")
    app = create_app()
    assert not (tmp_path / "instance" / "operator_password").exists()
    client = app.test_client()
    token = csrf_from(client.get("/login").text)
    assert client.post("/login", data={"username": "lead", "password": "the lead's own password",
                                       "csrf_token": token}).status_code == 302
    assert client.get("/dashboard/data").status_code == 200


# ---- figures ---------------------------------------------------------------------------------


def make_records(now: float) -> list[RequestRecord]:
    """A known mix: finished at different ages, some never admitted, some with 0 or 1 output tokens."""
    rng = random.Random(1234)

    def at(ts: float) -> datetime:
        return datetime.fromtimestamp(ts, tz=UTC)

    records = []
    ages = [rng.uniform(3, 240) for _ in range(70)] + [rng.uniform(400, 3000) for _ in range(15)] \
        + [rng.uniform(4000, 80000) for _ in range(10)] + [rng.uniform(90000, 200000) for _ in range(5)]
    for i, age in enumerate(ages):
        finished = now - age
        reason = rng.choice(["stop"] * 6 + ["length"] * 2 + ["cancelled", "error"])
        tokens = rng.choice([0, 1, 2, 5, 17, 64, 200]) if reason != "error" else 0
        queue, prefill = rng.expovariate(2.0), rng.uniform(0.02, 0.6)
        decode = tokens * rng.uniform(0.01, 0.08)
        enqueued = finished - queue - prefill - decode
        admitted = enqueued + queue if reason != "error" or i % 2 else None
        first = admitted + prefill if admitted is not None and tokens else None
        records.append(RequestRecord(
            request_id=f"req-{i:03d}", source=rng.choice(["chat", "api"]), model="tiny", worker="w1",
            enqueued_at=at(enqueued), admitted_at=at(admitted) if admitted else None,
            first_token_at=at(first) if first else None, finished_at=at(finished),
            prompt_tokens=rng.randint(20, 300), completion_tokens=tokens, cached_tokens=rng.randint(0, 20),
            finish_reason=reason, batch_size=rng.uniform(1, 4), continued_tokens=tokens // 2 if i % 7 == 0 else 0,
            error="<img src=x onerror=alert(1)> worker lost" if reason == "error" else None,
            service_class=rng.choice(["interactive", "standard", "bulk", None])))   # None: written before classes
    # Still queued: not finished, so in no window.
    records.append(RequestRecord(request_id="req-queued", source="chat", enqueued_at=at(now - 5)))
    return records


@pytest.fixture()
def seeded(any_database_url, redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    now = time.time()
    sessions = make_session_factory(make_engine(any_database_url))
    with sessions() as db:
        db.add_all(make_records(now))
        db.commit()
    rollup.summarise(sessions.kw["bind"])
    r = redis.Redis.from_url(redis_url)
    workers.announce(r, "w1", {"model": "tiny", "running": 3, "waiting": 2, "kv_usage": 0.5, "time": now}, 3600)
    workers.announce(r, "w2", {"model": "tiny", "running": 1, "waiting": 0, "kv_usage": 0.25, "time": now}, 3600)
    r.rpush("generate", *["job"] * 4)
    yield sessions
    sessions.kw["bind"].dispose()


@pytest.fixture()
def figures_client(any_database_url, redis_url, seeded, monkeypatch):
    monkeypatch.setenv("TTFT_OBJECTIVE_INTERACTIVE_S", "0.25")   # inside the seeded records' spread
    app = create_app({"DATABASE_URL": any_database_url, "REDIS_URL": redis_url, "OPERATOR_PASSWORD": PASSWORD})
    client = app.test_client()
    assert login(client).status_code == 302
    yield client
    app.extensions["db"].kw["bind"].dispose()


def expected_figures(sessions, now: float, seconds: int, bucket: int) -> dict:
    """The same figures, computed here from the stored rows with RequestRecord's own definitions and numpy.

    A window starts at the start of its first bucket."""
    first = math.floor((now - seconds) / bucket) * bucket
    with sessions() as db:
        rows = [r for r in db.scalars(select(RequestRecord)) if r.finished_at and r.finished_at.timestamp() >= first]

    def pct(values, q):
        return float(np.percentile(values, q)) if values else None

    latency = {}
    for name in ("queue_wait", "ttft", "tpot", "e2e"):
        values = [getattr(r, name) for r in rows if getattr(r, name) is not None]
        latency[name] = {q: pct(values, p) for q, p in QS.items()} | {"count": len(values)}

    buckets: dict[int, list[RequestRecord]] = {}
    for r in rows:
        buckets.setdefault(int((r.finished_at.timestamp() - first) // bucket), []).append(r)
    reasons = Counter(r.finish_reason for r in rows)
    prompt = sum(r.prompt_tokens for r in rows)
    errors = sorted((r for r in rows if r.finish_reason == "error"), key=lambda r: r.finished_at, reverse=True)
    return {
        "rows": rows, "latency": latency, "first": first, "buckets": buckets,
        "totals": {
            "requests": len(rows), "errors": reasons["error"], "error_rate": reasons["error"] / len(rows),
            "prompt_tokens": prompt, "completion_tokens": sum(r.completion_tokens for r in rows),
            "prefix_cache_hit_rate": sum(r.cached_tokens for r in rows) / prompt,
            "mean_batch_size": sum(r.batch_size for r in rows) / len(rows),
            "tokens_per_second": sum(r.completion_tokens for r in rows) / (now - first),
            "requests_per_minute": len(rows) / ((now - first) / 60),
            "finish_reasons": {k: reasons.get(k, 0) for k in ("stop", "length", "cancelled", "error")},
        },
        "slowest": [r.request_id for r in sorted(rows, key=lambda r: r.e2e, reverse=True)[:10]],
        "errors": [r.request_id for r in errors[:10]],
    }


def within_bound(got: float | None, want: float | None) -> bool:
    """A percentile read from a histogram against the exact one: the bound housekeeping/histogram.py states."""
    if got is None or want is None:
        return got is None and want is None
    return abs(got - want) <= histogram.RELATIVE_ERROR * abs(want) + histogram.ABSOLUTE_ERROR_S + 1e-12


@pytest.mark.parametrize("window, seconds, bucket", [("5m", 300, 10), ("1h", 3600, 60), ("24h", 86400, 900),
                                                     ("7d", 7 * 86400, 3600)])
def test_the_json_figures_equal_figures_computed_from_the_rows(figures_client, seeded, window, seconds, bucket):
    body = figures_client.get(f"/dashboard/data?window={window}").json
    now = body["generated_at"]
    want = expected_figures(seeded, now, seconds, bucket)
    assert body["window"] == {"key": window, "label": body["window"]["label"], "seconds": seconds,
                              "bucket_seconds": bucket}
    assert len(want["rows"]) == {"5m": 70, "1h": 85, "24h": 95, "7d": 100}[window]
    assert body["summaries"]["catching_up"] is False and body["summaries"]["pending_minutes"] == 0

    totals, want_totals = dict(body["totals"]), dict(want["totals"])
    assert totals.pop("finish_reasons") == want_totals.pop("finish_reasons")
    assert totals == pytest.approx(want_totals)
    for name, figures in want["latency"].items():
        assert body["latency"][name]["count"] == figures["count"], name
        for q in QS:
            assert within_bound(body["latency"][name][q], figures[q]), (name, q, body["latency"][name][q], figures[q])

    series = body["series"]
    assert series["t"][0] == want["first"] and all(b - a == bucket for a, b in zip(series["t"], series["t"][1:]))
    assert series["t"][-1] <= now < series["t"][-1] + bucket
    for i, start in enumerate(series["t"]):
        rows = want["buckets"].get(i, [])
        covered = min(start + bucket, now) - start
        assert series["requests_per_minute"][i] == pytest.approx(len(rows) * 60 / covered)
        assert series["errors_per_minute"][i] == pytest.approx(
            sum(r.finish_reason == "error" for r in rows) * 60 / covered)
        assert series["tokens_per_second"][i] == pytest.approx(sum(r.completion_tokens for r in rows) / covered)
        for name in ("queue_wait", "ttft", "tpot", "e2e"):
            values = [getattr(r, name) for r in rows if getattr(r, name) is not None]
            for q, p in QS.items():
                got = series[name][q][i]
                assert within_bound(got, float(np.percentile(values, p)) if values else None), (name, q, i)
    assert sum(len(v) for v in want["buckets"].values()) == len(want["rows"])

    for cls, got in body["classes"].items():
        ttfts = [r.ttft for r in want["rows"] if r.service_class == cls and r.ttft is not None]
        objective = DEFAULT_TTFT_OBJECTIVE_S[cls] if cls != "interactive" else 0.25
        assert got["objective_s"] == objective and got["count"] == len(ttfts), cls
        for q, p in (("p50", 50), ("p99", 99)):
            assert within_bound(got["ttft"][q], float(np.percentile(ttfts, p)) if ttfts else None), (cls, q)
        # Read from the histogram: a request within 1% of the objective may count either way.
        low = sum(t <= objective * (1 - histogram.RELATIVE_ERROR) for t in ttfts) / len(ttfts)
        high = sum(t <= objective * (1 + histogram.RELATIVE_ERROR) for t in ttfts) / len(ttfts)
        assert low <= got["attainment"] <= high, (cls, got)
    assert sum(c["count"] for c in body["classes"].values()) < body["latency"]["ttft"]["count"], \
        "records without a class count in no class"

    assert [s["request_id"] for s in body["slowest"]] == want["slowest"]
    by_id = {r.request_id: r for r in want["rows"]}
    for s in body["slowest"]:
        r = by_id[s["request_id"]]
        assert (s["queue_wait"], s["ttft"], s["tpot"], s["e2e"]) == pytest.approx((r.queue_wait, r.ttft, r.tpot, r.e2e))
        assert s["continued_tokens"] == r.continued_tokens
    assert [e["request_id"] for e in body["recent_errors"]] == want["errors"]
    assert all(e["error"] == "<img src=x onerror=alert(1)> worker lost" for e in body["recent_errors"])


def test_the_json_shows_the_engines_now(figures_client):
    live = figures_client.get("/dashboard/data?window=5m").json["live"]
    assert live["queue_depths"] == {"interactive": 0, "standard": 4, "bulk": 0}
    assert live["queue_depth"] == 4 and live["running"] == 4 and live["waiting"] == 2
    assert live["kv_cache_usage"] == pytest.approx(0.375)
    assert [w["name"] for w in live["workers"]] == ["w1", "w2"] and live["error"] is None


def test_an_empty_window_has_no_percentiles(operator):
    body = operator.get("/dashboard/data?window=5m").json
    assert body["totals"]["requests"] == 0 and body["totals"]["error_rate"] is None
    assert body["latency"]["ttft"] == {"p50": None, "p90": None, "p99": None, "count": 0}
    assert body["slowest"] == [] and body["recent_errors"] == []
    assert len(body["series"]["t"]) == 31 and set(body["series"]["ttft"]["p99"]) == {None}


def test_redis_down_still_serves_the_sql_figures(database_url):
    app = create_app({"DATABASE_URL": database_url, "REDIS_URL": "redis://127.0.0.1:1/0",
                      "OPERATOR_PASSWORD": PASSWORD})
    client = app.test_client()
    login(client)
    body = client.get("/dashboard/data").json
    assert body["live"]["error"].startswith("Redis unreachable") and body["totals"]["requests"] == 0
