"""Start the real system for tests: a private Redis, a Celery worker on a tiny model, web processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis
import requests
from sqlalchemy import Engine, text

from worker.local_redis import free_port, port_of, start_redis

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"   # screenshots and reports the tests leave behind


def wait_for(check, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:] if log else ''}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{what} not ready after {timeout}s:\n{log.read_text()[-3000:] if log else ''}")


@dataclass
class Stack:
    workdir: Path
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)
    web_urls: list[str] = field(default_factory=list)
    worker: subprocess.Popen | None = None
    webs: dict[str, subprocess.Popen] = field(default_factory=dict)   # url -> its process
    _webs_by_env: dict[tuple, str] = field(default_factory=dict)

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
        log = self.workdir / f"{name}.log"
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc, log

    def start_worker(self, **extra: str) -> subprocess.Popen:
        env = {**self.env, **extra}
        proc, log = self.spawn("worker", [sys.executable, "-m", "celery", "-A", "worker.tasks", "worker",
                                          "--pool", "threads",
                                          "--loglevel", "INFO", "--hostname",
                                          f"test{len(self.procs)}@%h", "--without-gossip", "--without-mingle"], env)
        r, started = redis.Redis.from_url(self.env["REDIS_URL"]), time.time()

        def beating() -> bool:   # a heartbeat written by this process, not one left by a killed worker
            return any(json.loads(r.get(key) or "{}").get("time", 0) > started
                       for key in r.scan_iter("supportbot:workers:*"))

        wait_for(beating, 120, "worker", proc, log)
        self.worker = proc
        return proc

    def start_housekeeping(self, **extra: str) -> subprocess.Popen:
        """The dashboard's summaries and retention, as `make run` and the deployment run them."""
        proc, _ = self.spawn("housekeeping", [sys.executable, "-m", "housekeeping"], {**self.env, **extra})
        return proc

    def kill_worker(self) -> None:
        """SIGKILL, as an out-of-memory kill or a power cut would: no shutdown handlers run."""
        self.worker.kill()
        self.worker.wait()

    def web_with(self, **extra: str) -> str:
        """A web process with these settings, started on first use and shared after."""
        key = tuple(sorted(extra.items()))
        if key not in self._webs_by_env:
            self._webs_by_env[key] = self.start_web(**extra)
        return self._webs_by_env[key]

    def start_web(self, port: int | None = None, **extra: str) -> str:
        port = port or free_port()
        proc, log = self.spawn(f"web{port}", [sys.executable, "-m", "webapp"], {**self.env, "PORT": str(port), **extra})
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: requests.get(url + "/healthz", timeout=1).ok, 60, "web app", proc, log)
        self.web_urls.append(url)
        self.webs[url] = proc
        return url

    def kill_web(self, url: str) -> None:
        """SIGKILL a web process: its sockets drop without a goodbye and it cancels nothing, as in a crash."""
        proc = self.webs.pop(url)
        proc.kill()
        proc.wait()
        self.web_urls.remove(url)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass
class RedisServer:
    """A private Redis that a test may stop and start again on the same port and data directory."""

    workdir: Path
    proc: subprocess.Popen | None = None
    url: str = ""

    def start(self) -> str:
        self.proc, self.url = start_redis(self.workdir, port=port_of(self.url) if self.url else None)
        return self.url

    def stop(self, sig: int = signal.SIGKILL) -> None:
        """SIGKILL by default: a crash, with no chance to save anything it had not written already."""
        self.proc.send_signal(sig)
        self.proc.wait(10)


@contextmanager
def throwaway_database(admin: Engine) -> Iterator[str]:
    """A fresh PostgreSQL database's URL, dropped afterwards, so whatever the server holds stays untouched."""
    name = f"supportbot_test_{uuid.uuid4().hex[:16]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin.url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def base_env(redis_url: str, database_url: str, model_dir: Path, workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "DATABASE_URL", "REDIS_URL")}
    env.update(REDIS_URL=redis_url, DATABASE_URL=database_url, MODEL=str(model_dir), MAX_NUM_SEQS="4",
               KV_CACHE_GIB="0.05", SECRET_KEY="test-secret", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               TEMPERATURE="0", MAX_NEW_TOKENS="24", VISIBILITY_TIMEOUT="6",
               LOST_AFTER_S="5", ROLLUP_INTERVAL_S="0.5")
    env.update(OPERATOR_PASSWORD="stack-operator-password", METRICS_TOKEN="stack-metrics-token-0123456789abcdef")
    env.update(RATE_LIMIT_PER_SESSION="9999/second", RATE_LIMIT_PER_IP="9999/second", MAX_CONNECTIONS_PER_IP="9999")
    return env


@contextmanager
def private_stack(workdir: Path, model_dir: Path, webs: int = 1, **env: str) -> Iterator[Stack]:
    """A stack of a test module's own: private Redis, migrated SQLite, one worker on `model_dir` and `webs` web
    processes, with `env` over the test settings; torn down by PID afterwards."""
    from models.db import upgrade

    redis_proc, redis_url = start_redis(workdir / "redis")
    database_url = f"sqlite:///{workdir / 'chat.db'}"
    upgrade(database_url)
    s = Stack(workdir, {**base_env(redis_url, database_url, model_dir, workdir), **env})
    try:
        s.start_worker()
        for _ in range(webs):
            s.start_web()
        yield s
    finally:
        s.stop()
        redis_proc.terminate()
        redis_proc.wait(10)
