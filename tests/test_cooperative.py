"""The web server's gevent worker: what blocks in a request (PostgreSQL, SQLite's lock) lets the others run."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
import time

from tests.stack import ROOT

# Runs in a fresh interpreter patched the way gunicorn's gevent worker patches itself, before any import.
PRELUDE = """
from gevent import monkey
monkey.patch_all()
import json, sys, time
import gevent

ticks = 0
def ticker():
    global ticks
    while True:
        gevent.sleep(0.01)
        ticks += 1
"""


def patched(body: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(body), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result_of(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def run_patched(body: str, *args: str) -> dict:
    return result_of(patched(body, *args))


def test_psycopg_waits_for_postgresql_without_stopping_other_greenlets(pg_url):
    result = run_patched("""
        import psycopg.waiting
        from sqlalchemy import text
        from models.db import make_engine
        engine = make_engine(sys.argv[1], pool_size=4)
        def query():
            with engine.connect() as conn:
                conn.execute(text("SELECT pg_sleep(0.5)"))
        gevent.spawn(ticker)
        start = time.monotonic()
        gevent.joinall([gevent.spawn(query) for _ in range(3)], raise_error=True)
        print(json.dumps({"wait": psycopg.waiting.wait.__name__, "ticks": ticks,
                          "elapsed": time.monotonic() - start}))
    """, pg_url)
    # psycopg's C wait function would block the whole process; it picks a gevent-patched poll instead.
    assert result["wait"] != "wait_c", result
    # The ticker kept ticking while the three half-second queries waited (blocked, it would not tick at all).
    assert result["ticks"] >= 20, result


def test_sqlite_waits_for_another_writer_without_stopping_other_greenlets(tmp_path):
    from models.db import upgrade

    path = tmp_path / "coop.db"
    upgrade(f"sqlite:///{path}")
    other = sqlite3.connect(path, isolation_level=None)   # another process's writer, as the worker is
    other.execute("BEGIN IMMEDIATE")
    proc = patched("""
        from sqlalchemy import text
        from models.db import make_engine
        from webapp.sockets import async_mode
        engine = make_engine(sys.argv[1])
        gevent.spawn(ticker)
        print("ready", flush=True)
        start = time.monotonic()
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO conversations (id, owner, created_at) VALUES ('c1', 'o', CURRENT_TIMESTAMP)"))
        print(json.dumps({"elapsed": time.monotonic() - start, "ticks": ticks, "mode": async_mode(),
                          "busy": engine.connect().exec_driver_sql("PRAGMA busy_timeout").scalar()}))
    """, f"sqlite:///{path}")
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(1)   # the child meets the lock and waits
    other.execute("COMMIT")
    result = result_of(proc)
    other.close()
    assert result["mode"] == "gevent" and result["busy"] == 0, result
    # The write waited for the other writer's commit, and the process's other greenlets ran meanwhile.
    assert result["elapsed"] >= 0.5 and result["ticks"] >= 20, result
    assert sqlite3.connect(path).execute("SELECT count(*) FROM conversations").fetchone() == (1,)
