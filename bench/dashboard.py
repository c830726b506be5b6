"""`python -m bench.dashboard`: the dashboard's cost with many records, on a throwaway database.

Fills a new SQLite file (or, with --postgres, a new PostgreSQL database, dropped afterwards) with N raw
request records spread over the last 24 hours, written by SQL the way a restore or an import writes rows
(not through the worker); 60% of them carry one of --keys API key names (the rest stand for chat traffic), so
the summaries and the figures include usage per key. Then, in order:

1. catch-up: a housekeeping process (`python -m housekeeping`) summarises them; the 24 h figures are sampled
   while it works (they say they are catching up) and the time until nothing is left to summarise is taken;
2. the web process: a fresh process builds the web app, logs in and GETs /dashboard/data for every window
   (repeats, median and worst), its resident memory measured before and at its peak;
3. the baseline, in the same run: the previous way (every record of the window read into Python, percentiles
   by sorting) for the windows where that is still affordable, with the ratio, and the summary percentiles
   checked against those exact ones.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, func, select, text
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from models import DirtyMinute
from models.db import make_engine, upgrade

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "dashboard-bench-password"
WINDOWS = ("5m", "1h", "24h", "7d")
CHUNK = 250_000
PHASES = ("fill", "catch-up", "web")

# One row per i: finished evenly over [t0, t0 + span) in id order; latencies from skewed distributions.
# MATERIALIZED: each random() is drawn once per row, not again wherever a column is used.
SQLITE_FILL = """
WITH RECURSIVE n(i) AS (SELECT :start UNION ALL SELECT i + 1 FROM n WHERE i + 1 < :end),
g AS MATERIALIZED (SELECT i, :t0 + (i + 0.5) * :span / :total AS fin,
             -0.05 * ln((abs(random()) % 999999 + 1) / 1e6) AS queue,
             0.03 + 0.2 * power((abs(random()) % 1000000) / 1e6, 2) AS prefill,
             1 + abs(random()) % 300 AS tokens,
             0.015 + 0.03 * power((abs(random()) % 1000000) / 1e6, 3) AS tpot,
             abs(random()) % 100 AS r FROM n),
l AS (SELECT *, tpot * (tokens - 1) AS decode FROM g),
t AS (SELECT *, fin - decode - prefill - queue AS enq FROM l)
INSERT INTO request_records (request_id, source, model, worker, enqueued_at, admitted_at, first_token_at,
                             finished_at, prompt_tokens, completion_tokens, cached_tokens, finish_reason,
                             batch_size, error, api_key)
SELECT printf('bench-%012d', i), 'api', 'bench', 'bench-worker', {ts_enq}, {ts_adm}, {ts_first}, {ts_fin},
       50 + r * 3, tokens, r, CASE WHEN r < 2 THEN 'error' WHEN r < 10 THEN 'length'
                                   WHEN r < 13 THEN 'cancelled' ELSE 'stop' END,
       1 + r % 16, CASE WHEN r < 2 THEN 'bench: worker lost' END, {key}
FROM t
"""


# The API key a record came with: one of :keys names for 60% of the records, none for the others.
KEY = "CASE WHEN :keys > 0 AND r < 60 THEN 'bench-key-' || (r % :keys) END"


def sqlite_ts(expr: str) -> str:
    """'YYYY-MM-DD HH:MM:SS.ffffff' of epoch seconds `expr`, as SQLAlchemy stores a UTC datetime in SQLite."""
    return (f"printf('%s.%06d', strftime('%Y-%m-%d %H:%M:%S', CAST({expr} AS INTEGER), 'unixepoch'), "
            f"CAST(({expr} - CAST({expr} AS INTEGER)) * 1000000 AS INTEGER))")


PG_FILL = """
INSERT INTO request_records (request_id, source, model, worker, enqueued_at, admitted_at, first_token_at,
                             finished_at, prompt_tokens, completion_tokens, cached_tokens, finish_reason,
                             batch_size, error, api_key)
SELECT 'bench-' || lpad(i::text, 12, '0'), 'api', 'bench', 'bench-worker', to_timestamp(enq),
       to_timestamp(enq + queue), to_timestamp(fin - decode), to_timestamp(fin), 50 + r * 3, tokens, r,
       CASE WHEN r < 2 THEN 'error' WHEN r < 10 THEN 'length' WHEN r < 13 THEN 'cancelled' ELSE 'stop' END,
       1 + r % 16, CASE WHEN r < 2 THEN 'bench: worker lost' END, {key}
FROM (SELECT *, fin - decode - prefill - queue AS enq FROM (
      SELECT *, tpot * (tokens - 1) AS decode FROM (
        SELECT i, :t0 + (i + 0.5) * :span / :total AS fin, -0.05 * ln(1 - random()) AS queue,
               0.03 + 0.2 * power(random(), 2) AS prefill, 1 + floor(random() * 300)::int AS tokens,
               0.015 + 0.03 * power(random(), 3) AS tpot, floor(random() * 100)::int AS r
        FROM generate_series(CAST(:start AS bigint), CAST(:end AS bigint) - 1) AS i) AS a) AS b) AS c
"""


def fill(url: str, n: int, now: float, span: float = 86400.0, keys: int = 10) -> float:
    """N raw records finished over [now - span, now), 60% of them with one of `keys` API key names; returns the
    seconds it took."""
    engine = make_engine(url)
    t0, started = now - span, time.perf_counter()
    if engine.dialect.name == "sqlite":
        sql = SQLITE_FILL.format(ts_enq=sqlite_ts("enq"), ts_adm=sqlite_ts("enq + queue"),
                                 ts_first=sqlite_ts("fin - decode"), ts_fin=sqlite_ts("fin"), key=KEY)
    else:
        sql = PG_FILL.format(key=KEY)
    for start in range(0, n, CHUNK):
        with engine.begin() as conn:
            conn.execute(text(sql), {"start": start, "end": min(n, start + CHUNK), "t0": t0, "span": span,
                                     "total": n, "keys": keys})
        print(f"  filled {min(n, start + CHUNK):,} / {n:,} ({time.perf_counter() - started:.0f} s)", flush=True)
    with engine.begin() as conn:
        conn.execute(text("ANALYZE"))   # as one does after a restore
    engine.dispose()
    return time.perf_counter() - started


def dirty_minutes(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(DirtyMinute)).scalar()


def catch_up(url: str, sample_s: float) -> dict:
    """Run the housekeeping process until nothing is left to summarise; sample the 24 h figures meanwhile."""
    from webapp import aggregates

    engine = make_engine(url)
    env = {**os.environ, "DATABASE_URL": url, "ROLLUP_INTERVAL_S": "1", "RETENTION_INTERVAL_S": "86400"}
    pending_at_start = dirty_minutes(engine)
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "housekeeping"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples, next_sample = [], started
    try:
        while True:
            left = dirty_minutes(engine)
            if left == 0:
                break
            if proc.poll() is not None:
                raise RuntimeError(f"housekeeping exited with {proc.returncode}")
            if time.perf_counter() >= next_sample:
                t = time.perf_counter()
                with Session(engine) as db:
                    body = aggregates.figures(db, None, "24h")
                samples.append({"at_s": round(t - started, 1), "figures_s": round(time.perf_counter() - t, 4),
                                **{k: body["summaries"][k] for k in ("catching_up", "pending_minutes")},
                                "requests": body["totals"]["requests"], "e2e_p90": body["latency"]["e2e"]["p90"]})
                print(f"  {samples[-1]}", flush=True)
                next_sample = t + sample_s
            time.sleep(0.5)
        elapsed = time.perf_counter() - started
    finally:
        proc.terminate()
        proc.wait(60)
    with Session(engine) as db:
        body = aggregates.figures(db, None, "24h")
    samples.append({"at_s": round(elapsed, 1), **{k: body["summaries"][k] for k in ("catching_up", "pending_minutes")},
                    "requests": body["totals"]["requests"], "e2e_p90": body["latency"]["e2e"]["p90"]})
    engine.dispose()
    return {"minutes_to_summarise": pending_at_start, "seconds": round(elapsed, 1), "samples": samples}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def serve_figures(url: str, repeats: int) -> dict:
    """In a fresh process: the web app's own GET /dashboard/data for every window, timed, memory watched."""
    from webapp import create_app

    app = create_app({"DATABASE_URL": url, "REDIS_URL": os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:1/0"),
                      "OPERATOR_PASSWORD": PASSWORD, "SECRET_KEY": uuid.uuid4().hex, "LOGIN_RATE_LIMIT": "off"})
    client = app.test_client()
    import re
    token = re.search(r'name="csrf_token" value="([^"]+)"', client.get("/login").text).group(1)
    assert client.post("/login", data={"username": "operator", "password": PASSWORD,
                                       "csrf_token": token}).status_code == 302
    base_rss = rss_mb()
    base_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {"rss_before_mb": round(base_rss, 1), "windows": {}}
    for window in WINDOWS:
        times, body = [], None
        for _ in range(repeats):
            t = time.perf_counter()
            response = client.get(f"/dashboard/data?window={window}")
            times.append(time.perf_counter() - t)
            assert response.status_code == 200, response.text
            body = response.json
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out["windows"][window] = {
            "median_s": round(statistics.median(times), 4), "worst_s": round(max(times), 4),
            "extra_peak_mb": round(max(0.0, peak - max(base_peak, base_rss)), 1),
            "extra_rss_after_mb": round(rss_mb() - base_rss, 1),
            "requests": body["totals"]["requests"], "catching_up": body["summaries"]["catching_up"],
            "first": body["series"]["t"][0], "generated_at": body["generated_at"],
            "latency": body["latency"], "keys_listed": len(body["api_keys"] or []),
            "keyed_requests": sum(k["requests"] for k in body["api_keys"] or [])}
    return out


def previous_way(url: str, since: float) -> dict:
    """The baseline: every record of the window read into Python, percentiles by sorting (exact)."""
    import numpy as np

    from models import RequestRecord

    engine = make_engine(url)
    t = time.perf_counter()
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    r = RequestRecord
    with Session(engine) as db:
        rows = db.execute(select(r.enqueued_at, r.admitted_at, r.first_token_at, r.finished_at, r.completion_tokens)
                          .where(r.finished_at >= _utc(since))).all()
    values: dict[str, list[float]] = {"queue_wait": [], "ttft": [], "tpot": [], "e2e": []}
    for enq, adm, first, fin, n in rows:
        if adm is not None:
            values["queue_wait"].append((adm - enq).total_seconds())
        if first is not None:
            values["ttft"].append((first - enq).total_seconds())
            if n is not None and n >= 2:
                values["tpot"].append((fin - first).total_seconds() / (n - 1))
        values["e2e"].append((fin - enq).total_seconds())
    latency = {name: {q: float(np.percentile(v, p)) for q, p in (("p50", 50), ("p90", 90), ("p99", 99))}
               for name, v in values.items() if v}
    elapsed = time.perf_counter() - t
    engine.dispose()
    return {"seconds": round(elapsed, 3), "records": len(rows), "latency": latency,
            "extra_peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - peak0, 1)}


def _utc(ts: float):
    from datetime import UTC, datetime
    return datetime.fromtimestamp(ts, tz=UTC)


def child(mode: str, url: str, *args: str, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.dashboard", "--child", mode, "--url", url, *args],
                         cwd=ROOT, capture_output=True, text=True, check=True, env={**os.environ, **(env or {})})
    return json.loads(out.stdout.splitlines()[-1])


def private_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    """A throwaway redis-server for the web app's live panel (the queue and the workers' heartbeats)."""
    import socket

    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            if redis.Redis.from_url(url).ping():
                return proc, url
        except redis.RedisError:
            time.sleep(0.05)
    proc.terminate()
    raise RuntimeError("redis-server did not start")


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    return f"{os.cpu_count()} CPUs ({cpu}), {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB, " \
           f"Python {platform.python_version()}"


def bench(url: str, args: argparse.Namespace) -> dict:
    result: dict = {"database": make_engine(url).dialect.name, "records": args.records, "machine": machine(),
                    "phases": args.phases}
    if "fill" in args.phases:
        upgrade(url)
        print(f"filling {args.records:,} records over 24 h ...", flush=True)
        result["fill_s"] = round(fill(url, args.records, time.time(), keys=args.keys), 1)
    with make_engine(url).connect() as conn:
        result["keyed_records"] = conn.execute(text("SELECT count(*) FROM request_records WHERE api_key IS NOT NULL")
                                               ).scalar()
    if "catch-up" in args.phases:
        print("catching up ...", flush=True)
        result["catch_up"] = catch_up(url, args.sample_s)
        print(f"  caught up in {result['catch_up']['seconds']} s", flush=True)
    if "web" in args.phases:
        print("web process ...", flush=True)
        with tempfile.TemporaryDirectory(prefix="dashboard-bench-redis-") as tmp:
            redis_proc, redis_url = private_redis(tmp)
            try:
                result["web"] = child("figures", url, "--repeats", str(args.repeats),
                                      env={"BENCH_REDIS_URL": redis_url})
            finally:
                redis_proc.terminate()
                redis_proc.wait(10)
        for window, f in result["web"]["windows"].items():
            print(f"  {window}: {f['median_s']} s median, {f['worst_s']} s worst, {f['requests']} requests, "
                  f"+{f['extra_peak_mb']} MB peak, +{f['extra_rss_after_mb']} MB resident after", flush=True)
        result["previous_way"] = {}
        for window in args.baseline_windows:
            print(f"previous way, {window} ...", flush=True)
            summary = result["web"]["windows"][window]
            # The same records as the web process's figures: from the start of that window's first bucket.
            base = result["previous_way"][window] = child("previous", url, "--since", str(summary["first"]))
            base["ratio_previous_over_summaries"] = round(base["seconds"] / max(summary["median_s"], 1e-9), 1)
            errors = [abs(summary["latency"][name][q] - exact) / exact
                      for name, qs in base["latency"].items() for q, exact in qs.items() if exact]
            base["max_relative_percentile_difference"] = round(max(errors), 4) if errors else None
            print(f"  {base['seconds']} s for {base['records']:,} records: {base['ratio_previous_over_summaries']}x "
                  f"the summaries; +{base['extra_peak_mb']} MB peak; percentiles within "
                  f"{base['max_relative_percentile_difference']}", flush=True)
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.dashboard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000, help="records over the last 24 h")
    parser.add_argument("--postgres", nargs="?", const="postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
                        help="a server's maintenance database URL: a new database is made there and dropped after")
    parser.add_argument("--dir", help="where the SQLite file goes (default: a temporary directory)")
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES),
                        help="run only these; with fewer than all, name the database with --database to keep it")
    parser.add_argument("--database", help="a SQLite file path (or with --postgres a database name) kept between "
                                           "phases")
    parser.add_argument("--drop", action="store_true", help="remove the --database at the end")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keys", type=int, default=10, help="API key names that 60%% of the records carry (0: none)")
    parser.add_argument("--sample-s", type=float, default=15.0, help="how often figures are taken while catching up")
    parser.add_argument("--baseline-windows", nargs="*", default=["5m", "1h"])
    parser.add_argument("--json", help="write the result here too")
    parser.add_argument("--child", choices=["figures", "previous"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--since", type=float, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child == "figures":
        print(json.dumps(serve_figures(args.url, args.repeats)))
        return 0
    if args.child == "previous":
        print(json.dumps(previous_way(args.url, args.since)))
        return 0
    keep = tuple(args.phases) != PHASES
    if args.postgres:
        admin = create_engine(args.postgres, isolation_level="AUTOCOMMIT", poolclass=NullPool)
        name = args.database or f"dashboard_bench_{uuid.uuid4().hex[:12]}"
        if "fill" in args.phases:
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            result = bench(admin.url.set(database=name).render_as_string(hide_password=False), args)
        finally:
            if not keep or args.drop:
                with admin.connect() as conn:
                    conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            else:
                print(f"kept PostgreSQL database {name} (--database {name}; --drop removes it)", flush=True)
            admin.dispose()
    elif args.database:
        path = Path(args.database)
        try:
            result = bench(f"sqlite:///{path}", args)
        finally:
            if not keep or args.drop:
                for suffix in ("", "-wal", "-shm", ".migrate-lock"):
                    Path(str(path) + suffix).unlink(missing_ok=True)
    else:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="dashboard-bench-") as tmp:
            result = bench(f"sqlite:///{Path(tmp) / 'bench.db'}", args)
    text_out = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text_out + "\n")
    print(text_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
