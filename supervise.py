"""`make run`: migrate, start Redis (unless REDIS_URL is set), the worker, the web app and housekeeping (dashboard
summaries, retention); restart what dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent
RUN_DIR = Path(os.environ.get("RUN_DIR", ROOT / "instance" / "run"))   # logs and the private Redis


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)

    def start(self) -> None:
        log = open(RUN_DIR / f"{self.name}.log", "ab")
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def stop(self, timeout: float = 30) -> None:   # the worker's shutdown grace (15 s) fits within it
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def restart_redis(dead: subprocess.Popen, port: int) -> subprocess.Popen:
    """Same port and directory: the web app and worker reconnect by themselves, and the queue is read back."""
    from worker.local_redis import start_redis

    print(f"supportbot: Redis exited with {dead.returncode}; restarting (see {RUN_DIR / 'redis' / 'redis.log'})",
          flush=True)
    try:
        return start_redis(RUN_DIR / "redis", port=port)[0]
    except RuntimeError as exc:
        print(f"supportbot: {exc}; trying again", flush=True)
        time.sleep(2)
        return dead


def api_line(database_url: str) -> str:
    """Whether /v1 is open or needs API keys, and the command that changes it."""
    from models.db import make_engine, make_session_factory
    from webapp.keys import api_base, api_status

    python = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT) + os.sep) else sys.executable
    production = os.environ.get("SUPPORTBOT_ENV", "").strip().lower() == "production"
    engine = make_engine(database_url)
    try:
        with make_session_factory(engine)() as db:
            return api_status(db, api_base(), production, python)
    finally:
        engine.dispose()


def main() -> int:
    from models import demo_orders, help_centre
    from models.db import default_database_url, upgrade
    from worker.local_redis import port_of, start_redis

    RUN_DIR.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    database_url_given = bool(env.get("DATABASE_URL"))
    env.setdefault("DATABASE_URL", default_database_url())
    upgrade(env["DATABASE_URL"])
    if demo_orders.wanted(database_url_given):   # the demo orders and help articles (DEMO_ORDERS)
        demo_orders.seed_url(env["DATABASE_URL"])
        help_centre.seed_url(env["DATABASE_URL"])
    redis_proc = None
    if "REDIS_URL" not in env:
        redis_proc, env["REDIS_URL"] = start_redis(RUN_DIR / "redis")
    children = [
        Child("worker", [sys.executable, "-m", "celery", "-A", "worker.tasks", "worker", "--pool", "threads",
                         "--loglevel", "INFO",
                         "--hostname", "worker@%h"], env),
        Child("web", [sys.executable, "-m", "webapp"], env),
        Child("housekeeping", [sys.executable, "-m", "housekeeping"], env),
    ]
    stopping = False

    def request_stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    for child in children:
        child.start()
    port = env.get("PORT", "5000")
    print(f"supportbot: http://127.0.0.1:{port}/  (Redis {env['REDIS_URL']}, database {env['DATABASE_URL']})")
    print(f"supportbot: {api_line(env['DATABASE_URL'])}")
    print(f"logs in {RUN_DIR}; Ctrl-C stops everything", flush=True)
    try:
        while not stopping:
            if redis_proc is not None and redis_proc.poll() is not None and not stopping:
                redis_proc = restart_redis(redis_proc, port_of(env["REDIS_URL"]))
            for child in children:
                if child.proc.poll() is not None and not stopping:
                    child.restarts = [t for t in child.restarts if t > time.time() - 60] + [time.time()]
                    print(f"supportbot: {child.name} exited with {child.proc.returncode}; restarting "
                          f"(see {RUN_DIR / (child.name + '.log')})", flush=True)
                    time.sleep(min(10, len(child.restarts)))   # back off if it keeps dying
                    child.start()
            time.sleep(0.5)
    finally:
        for child in reversed(children):
            child.stop()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
        print("supportbot: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
