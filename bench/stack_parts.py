"""The stack a benchmark runs through: its own Redis, SQLite, worker and web processes (`Stack`), where they run
(`Placement`), and its customers, over Socket.IO (`_Customer`, `_socketio`) or streaming HTTP (`_post`)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis
import requests
import socketio

from bench.socketio_client import InOrderClient
from models import RequestRecord
from models.db import make_engine, make_session_factory, upgrade
from worker.local_redis import free_port, start_redis

ROOT = Path(__file__).resolve().parent.parent

class Placement:
    """Which CPUs the engine runs on and which the rest does; no CPU set means the scheduler decides."""

    def __init__(self, engine_cpus: set[int] | None = None) -> None:
        everything = os.sched_getaffinity(0)
        self.engine, self.rest = (engine_cpus, everything - engine_cpus) if engine_cpus else (everything, everything)
        if not self.engine <= everything:
            raise SystemExit(f"--engine-cpus: this process may run on CPUs {sorted(everything)} only")
        if not self.rest:
            raise SystemExit(f"--engine-cpus must leave at least one of CPUs {sorted(everything)} for the rest")
        self.pinned = engine_cpus is not None

    def pin(self, pid: int, cpus: set[int]) -> None:
        """Every thread of a running process: threads it starts later inherit the set."""
        if self.pinned:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), cpus)

    def launcher(self, cpus: set[int]):
        return (lambda: os.sched_setaffinity(0, cpus)) if self.pinned else None

    @contextlib.contextmanager
    def engine_thread(self):
        """Run the calling thread, and the torch threads it starts, on the engine's CPUs for a while."""
        if not self.pinned:
            yield
            return
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.engine)
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)


class Stack:
    """Redis, a Celery worker and a web app of its own, started once and kept up for every round."""

    def __init__(self, slots: int, workdir: Path, system_prompt: str, max_new_tokens: int,
                 model_name: str | None = None, placement: Placement | None = None, queue_limit: int = 1000,
                 worker_env: dict[str, str] | None = None) -> None:
        placement = placement or Placement()
        self.redis_proc, redis_url = start_redis(workdir / "redis")
        placement.pin(self.redis_proc.pid, placement.rest)
        self.db_url = f"sqlite:///{workdir / 'bench.db'}"
        upgrade(self.db_url)
        port = free_port()
        env = {**os.environ, "REDIS_URL": redis_url, "DATABASE_URL": self.db_url, "MAX_NUM_SEQS": str(slots),
               "PORT": str(port), "QUEUE_LIMIT": str(queue_limit), "SYSTEM_PROMPT": system_prompt, "TEMPERATURE": "0",
               "MAX_NEW_TOKENS": str(max_new_tokens),
               # The engine side answers the same messages greedily: no DRY and no grounded lookups on the chat
               # side either, so each answer can be compared token for token and the difference is the plumbing.
               "DRY_MULTIPLIER": "0", "CHAT_GROUNDING": "off",
               # Every customer here comes from one address: the abuse limits would measure themselves.
               "RATE_LIMIT_PER_SESSION": "off", "RATE_LIMIT_PER_IP": "off", "MAX_CONNECTIONS_PER_IP": "0"}
        env.pop("MODEL", None)
        if model_name:
            env["MODEL"] = model_name
        worker_env = {**env, **(worker_env or {})}
        if placement.pinned:
            worker_env["OMP_NUM_THREADS"] = str(len(placement.engine))
        self.env, self.workdir, self.placement = env, workdir, placement
        logs = [open(workdir / f"{n}.log", "wb") for n in ("worker", "web")]
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "celery", "-A", "worker.tasks", "worker", "--pool", "threads",
                              "--loglevel", "WARNING"],
                             cwd=ROOT, env=worker_env, stdout=logs[0], stderr=subprocess.STDOUT,
                             preexec_fn=placement.launcher(placement.engine)),
            subprocess.Popen([sys.executable, "-m", "webapp"], cwd=ROOT, env=env, stdout=logs[1],
                             stderr=subprocess.STDOUT, preexec_fn=placement.launcher(placement.rest))]
        try:
            r = redis.Redis.from_url(redis_url)
            deadline = time.monotonic() + 180
            while not (any(r.scan_iter("supportbot:workers:*")) and _up(port)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"stack did not start; see {workdir}")
                time.sleep(0.2)
        except BaseException:
            self.close()
            raise
        self.base = f"http://127.0.0.1:{port}"

    def add_web(self, **extra: str) -> str:
        """Another web process on the same Redis, database and worker, with these settings; its base URL."""
        port = free_port()
        log = open(self.workdir / f"web{port}.log", "wb")
        self.procs.append(subprocess.Popen([sys.executable, "-m", "webapp"], cwd=ROOT,
                                           env={**self.env, "PORT": str(port), **extra}, stdout=log,
                                           stderr=subprocess.STDOUT,
                                           preexec_fn=self.placement.launcher(self.placement.rest)))
        deadline = time.monotonic() + 60
        while not _up(port):
            if time.monotonic() > deadline:
                raise RuntimeError(f"web process did not start; see {self.workdir}")
            time.sleep(0.2)
        return f"http://127.0.0.1:{port}"

    def all_at_once(self, requests_: list[dict], protocol: str) -> dict:
        clients = [_Customer(self.base, q) for q in requests_] if protocol == "socketio" else []
        results, start = {}, time.time()
        if clients:
            for c in clients:
                if c.refused is None:
                    c.send(start)
            for c in clients:
                results[c.q["id"]] = c.wait() if c.refused is None else {
                    "ttft": None, "text": "", "request_id": None, "finished_at": start, "error": c.refused}
            _close_all(clients)
        else:
            threads = [threading.Thread(target=lambda q=q: results.__setitem__(
                q["id"], _post(self.base, q, q["cap"], start))) for q in requests_]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        wall = max(res["finished_at"] for res in results.values()) - start
        with make_session_factory(make_engine(self.db_url))() as db:
            records = {qid: db.get(RequestRecord, res["request_id"]) for qid, res in results.items()
                       if res.get("request_id")}
        # Sent at once, the messages reach the web app in no set order; the engine gets them in the same one.
        received = sorted(records, key=lambda qid: records[qid].enqueued_at)
        return {"tokens": sum(r.completion_tokens or 0 for r in records.values()), "wall_s": wall,
                "ttft": [res["ttft"] for res in results.values()], "results": list(results.values()),
                "texts": {rid: res["text"] for rid, res in results.items()}, "received": received,
                "admitted": [r.admitted_at.timestamp() - start for r in records.values() if r.admitted_at]}

    def one_at_a_time(self, requests_: list[dict], cap: int, protocol: str) -> list[float]:
        ask = _post if protocol == "http" else _socketio
        return [ask(self.base, q, cap)["ttft"] for q in requests_]

    def close(self) -> None:
        for p in getattr(self, "procs", []):
            p.terminate()
        for p in getattr(self, "procs", []):
            p.wait(20)
        self.redis_proc.terminate()
        self.redis_proc.wait(10)


def _up(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).ok
    except requests.RequestException:   # not listening yet, or too busy starting to answer within the second
        return False


class _Customer:
    """One customer: a page visit for the session cookie, then a Socket.IO connection, then one question."""

    def __init__(self, base: str, q: dict) -> None:
        self.q, self.http = q, requests.Session()
        self.http.get(base + "/").raise_for_status()
        self.parts: list[str] = []
        self.ttft: float | None = None
        self.result: dict = {}
        self.finished = threading.Event()
        self.sio = InOrderClient(http_session=self.http, reconnection=False)
        self.sio.on("token", self._token)
        self.sio.on("done", self._done)
        self.sio.on("error", self._error)
        self.refused: dict | None = None
        try:
            self.sio.connect(base, transports=["websocket"], wait_timeout=30)
        except socketio.exceptions.ConnectionError as exc:   # reported as a refusal, not raised
            self.refused = {"code": "too_many_connections" if "Too many" in str(exc) else "connection",
                            "message": str(exc)[:200]}

    def send(self, start: float) -> None:
        self.start = start
        self.sio.emit("chat_message", {"text": self.q["messages"][-1]["content"], "max_new_tokens": self.q["cap"]})

    def wait(self) -> dict:
        if not self.finished.wait(600):
            raise TimeoutError(f"request {self.q['id']} got no answer")
        return self.result

    def _token(self, data: dict) -> None:
        self.ttft = self.ttft or time.time() - self.start
        self.parts.append(data["text"])

    def _done(self, data: dict) -> None:
        self.result = {"ttft": self.ttft, "text": "".join(self.parts), "request_id": data["request_id"],
                       "finished_at": time.time(), "completion_tokens": data.get("completion_tokens")}
        self.finished.set()

    def _error(self, data: dict) -> None:
        self.result = {"ttft": self.ttft, "text": "", "request_id": data.get("request_id"), "error": data,
                       "finished_at": time.time()}
        self.finished.set()


def _close_all(clients: list[_Customer]) -> None:
    """After the clock stops: a client's disconnect waits for its reader thread, so close them side by side."""
    threads = [threading.Thread(target=c.sio.disconnect) for c in clients if c.refused is None]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def _socketio(base: str, q: dict, cap: int) -> dict:
    customer = _Customer(base, {**q, "cap": cap})
    if customer.refused is not None:
        return {"ttft": None, "text": "", "request_id": None, "finished_at": time.time(), "error": customer.refused}
    customer.send(time.time())
    try:
        return customer.wait()
    finally:
        customer.sio.disconnect()


def _post(base: str, q: dict, cap: int, start: float | None = None) -> dict:
    body = {"messages": q["messages"], "max_tokens": cap, "temperature": 0, "stream": True}
    start = start or time.time()
    ttft, parts, request_id = None, [], None
    with requests.post(base + "/v1/chat/completions", json=body, stream=True, timeout=600) as response:
        if response.status_code != 200:   # refused: reported, not raised
            error = (response.json().get("error") or {}) if response.headers.get("content-type", "").startswith(
                "application/json") else {}
            return {"ttft": None, "text": "", "request_id": None, "finished_at": time.time(),
                    "error": {"code": error.get("code") or f"http_{response.status_code}"}}
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"ttft": ttft, "text": "".join(parts), "request_id": request_id, "finished_at": time.time(),
                        "error": {"code": chunk["error"].get("code")}}
            request_id = chunk["id"].removeprefix("chatcmpl-")
            text = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if text:
                ttft = ttft or time.time() - start
                parts.append(text)
    return {"ttft": ttft, "text": "".join(parts), "request_id": request_id, "finished_at": time.time()}
