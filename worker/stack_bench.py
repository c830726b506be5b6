"""The benchmark workload through the whole stack against the engine alone, in one run.

Through the stack, each request is a customer on its own Socket.IO connection (or, with
`--protocol http`, a streaming OpenAI-style HTTP request): web app -> Redis -> worker -> pub/sub.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis
import requests
import socketio

from models import RequestRecord
from models.db import make_engine, make_session_factory, upgrade
from worker.bench import DEFAULT_WORKLOAD
from worker.local_redis import free_port, start_redis

ROOT = Path(__file__).resolve().parent.parent


def workload(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    return [{"id": str(r["id"]), "cap": r["max_new_tokens"],
             "messages": [{"role": "system", "content": data["system_prompt"]},
                          {"role": "user", "content": r["question"]}]} for r in data["requests"]]


def engine_direct(requests_: list[dict], slots: int, model_name: str | None = None) -> dict:
    from worker.engine import EngineConfig, LLMEngine, RequestFinished, SamplingParams
    from worker.model_loader import load_model

    model, tokenizer = load_model(model_name)
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=slots))
    engine.add_request("warm", messages=requests_[0]["messages"], params=SamplingParams(temperature=0, max_new_tokens=4))
    while engine.has_unfinished():
        engine.step()
    start, done = time.time(), []
    for r in requests_:
        engine.add_request(r["id"], messages=r["messages"], params=SamplingParams(temperature=0, max_new_tokens=r["cap"]))
    while engine.has_unfinished():
        done += [e for e in engine.step() if isinstance(e, RequestFinished)]
    wall = time.time() - start
    engine.release_model()
    return {"tokens": sum(d.completion_tokens for d in done), "wall_s": wall,
            "ttft": [d.first_token_time - start for d in done], "texts": {d.request_id: d.text for d in done}}


def through_stack(requests_: list[dict], slots: int, workdir: Path, protocol: str, system_prompt: str,
                  model_name: str | None = None) -> dict:
    redis_proc, redis_url = start_redis(workdir / "redis")
    db_url = f"sqlite:///{workdir / 'bench.db'}"
    upgrade(db_url)
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_url, "DATABASE_URL": db_url, "MAX_NUM_SEQS": str(slots),
           "PORT": str(port), "QUEUE_LIMIT": "1000", "SYSTEM_PROMPT": system_prompt, "TEMPERATURE": "0",
           "MAX_NEW_TOKENS": str(max(q["cap"] for q in requests_)),
           # Every customer here comes from one address: the abuse limits would measure themselves.
           "RATE_LIMIT_PER_SESSION": "off", "RATE_LIMIT_PER_IP": "off", "MAX_CONNECTIONS_PER_IP": "0"}
    env.pop("MODEL", None)
    if model_name:
        env["MODEL"] = model_name
    logs = [open(workdir / f"{n}.log", "wb") for n in ("worker", "web")]
    procs = [subprocess.Popen([sys.executable, "-m", "celery", "-A", "worker.tasks", "worker", "--pool", "threads",
                               "--queues", "generate", "--loglevel", "WARNING"],
                              cwd=ROOT, env=env, stdout=logs[0], stderr=subprocess.STDOUT),
             subprocess.Popen([sys.executable, "-m", "webapp"], cwd=ROOT, env=env, stdout=logs[1],
                              stderr=subprocess.STDOUT)]
    try:
        r = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + 180
        while not (any(r.scan_iter("supportbot:workers:*")) and _up(port)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"stack did not start; see {workdir}")
            time.sleep(0.2)
        base = f"http://127.0.0.1:{port}"
        ask = _post if protocol == "http" else _socketio
        ask(base, requests_[0], 4)   # warm-up
        clients = [_Customer(base, q) for q in requests_] if protocol == "socketio" else []
        results, start = {}, time.time()
        if clients:
            for c in clients:
                c.send(start)
            for c in clients:
                results[c.q["id"]] = c.wait()
            _close_all(clients)
        else:
            threads = [threading.Thread(target=lambda q=q: results.__setitem__(q["id"], _post(base, q, q["cap"], start)))
                       for q in requests_]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        wall = max(res["finished_at"] for res in results.values()) - start
        with make_session_factory(make_engine(db_url))() as db:
            tokens = sum(db.get(RequestRecord, res["request_id"]).completion_tokens or 0 for res in results.values())
        return {"tokens": tokens, "wall_s": wall, "ttft": [res["ttft"] for res in results.values()],
                "results": list(results.values()),
                "texts": {rid: res["text"] for rid, res in results.items()}}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)
        redis_proc.terminate()
        redis_proc.wait(10)


def _up(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).ok
    except requests.ConnectionError:
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
        self.sio = socketio.Client(http_session=self.http, reconnection=False)
        self.sio.on("token", self._token)
        self.sio.on("done", self._done)
        self.sio.on("error", self._error)
        self.sio.connect(base, transports=["websocket"], wait_timeout=30)

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
                       "finished_at": time.time()}
        self.finished.set()

    def _error(self, data: dict) -> None:
        self.result = {"ttft": self.ttft, "text": "", "request_id": data.get("request_id"), "error": data,
                       "finished_at": time.time()}
        self.finished.set()


def _close_all(clients: list[_Customer]) -> None:
    """After the clock stops: a client's disconnect waits for its reader thread, so close them side by side."""
    threads = [threading.Thread(target=c.sio.disconnect) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def _socketio(base: str, q: dict, cap: int) -> dict:
    customer = _Customer(base, {**q, "cap": cap})
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
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            request_id = chunk["id"].removeprefix("chatcmpl-")
            text = chunk["choices"][0]["delta"].get("content")
            if text:
                ttft = ttft or time.time() - start
                parts.append(text)
    return {"ttft": ttft, "text": "".join(parts), "request_id": request_id, "finished_at": time.time()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m worker.stack_bench", description=__doc__)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--protocol", choices=("socketio", "http"), default="socketio")
    parser.add_argument("--model", default=None, help="a model id or path (default: the default model)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the stack's logs, database and Redis files here (default: a temporary folder)")
    args = parser.parse_args(argv)
    reqs = workload(args.workload)[:args.limit]
    direct = engine_direct(reqs, args.slots, args.model)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        stack = through_stack(reqs, args.slots, workdir, args.protocol, reqs[0]["messages"][0]["content"],
                              args.model)
    errors = [r for r in stack["results"] if r.get("error")]
    if errors:
        print(f"{len(errors)} requests failed through the stack, e.g. {errors[0]['error']}")
    rows = {"engine direct": direct, "whole stack": stack}
    print(f"{'':14} {'tokens/s':>9} {'wall s':>7} {'TTFT p50 s':>10}")
    for name, m in rows.items():
        print(f"{name:14} {m['tokens'] / m['wall_s']:9.1f} {m['wall_s']:7.2f} {statistics.median(m['ttft']):10.3f}")
    keep = (stack["tokens"] / stack["wall_s"]) / (direct["tokens"] / direct["wall_s"])
    added = statistics.median(stack["ttft"]) - statistics.median(direct["ttft"])
    same = sum(stack["texts"].get(k) == v for k, v in direct["texts"].items())
    print(f"stack keeps {keep:.0%} of the engine's tokens/s; adds {added * 1000:+.0f} ms to TTFT p50; "
          f"{same}/{len(reqs)} answers identical")
    figures = {"protocol": args.protocol, "slots": args.slots, "requests": len(reqs), "errors": len(errors),
               "identical": same, "keep_ratio": keep, "added_ttft_p50_s": added,
               **{f"{key}_{name}": value for key, m in (("engine", direct), ("stack", stack))
                  for name, value in (("tok_s", m["tokens"] / m["wall_s"]), ("wall_s", m["wall_s"]),
                                      ("ttft_p50_s", statistics.median(m["ttft"])))}}
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main()
