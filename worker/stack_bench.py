"""The benchmark workload through the whole stack (HTTP API -> Redis -> worker -> pub/sub) against the engine alone."""

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


def engine_direct(requests_: list[dict], slots: int) -> dict:
    from worker.engine import EngineConfig, LLMEngine, RequestFinished, SamplingParams
    from worker.model_loader import load_model

    model, tokenizer = load_model()
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


def through_stack(requests_: list[dict], slots: int, workdir: Path) -> dict:
    redis_proc, redis_url = start_redis(workdir / "redis")
    db_url = f"sqlite:///{workdir / 'bench.db'}"
    upgrade(db_url)
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_url, "DATABASE_URL": db_url, "MAX_NUM_SEQS": str(slots),
           "PORT": str(port), "QUEUE_LIMIT": "1000"}
    env.pop("MODEL", None)
    logs = [open(workdir / f"{n}.log", "wb") for n in ("worker", "web")]
    procs = [subprocess.Popen([sys.executable, "-m", "celery", "-A", "worker.tasks", "worker", "--pool", "threads",
                               "--concurrency", str(slots), "--queues", "generate", "--loglevel", "WARNING"],
                              cwd=ROOT, env=env, stdout=logs[0], stderr=subprocess.STDOUT),
             subprocess.Popen([sys.executable, "-m", "webapp"], cwd=ROOT, env=env, stdout=logs[1],
                              stderr=subprocess.STDOUT)]
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        r = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + 180
        while not (any(r.scan_iter("supportbot:workers:*")) and _up(port)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"stack did not start; see {workdir}")
            time.sleep(0.2)
        _post(url, requests_[0], 4)   # warm-up
        results, start = {}, time.time()
        threads = [threading.Thread(target=lambda q=q: results.__setitem__(q["id"], _post(url, q, q["cap"], start)))
                   for q in requests_]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.time() - start
        with make_session_factory(make_engine(db_url))() as db:
            tokens = sum(db.get(RequestRecord, res["request_id"]).completion_tokens for res in results.values())
        return {"tokens": tokens, "wall_s": wall, "ttft": [res["ttft"] for res in results.values()],
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


def _post(url: str, q: dict, cap: int, start: float | None = None) -> dict:
    body = {"messages": q["messages"], "max_tokens": cap, "temperature": 0, "stream": True}
    start = start or time.time()
    ttft, parts, request_id = None, [], None
    with requests.post(url, json=body, stream=True, timeout=600) as response:
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
    return {"ttft": ttft, "text": "".join(parts), "request_id": request_id}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m worker.stack_bench", description=__doc__)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args(argv)
    reqs = workload(args.workload)[:args.limit]
    direct = engine_direct(reqs, args.slots)
    with tempfile.TemporaryDirectory() as tmp:
        stack = through_stack(reqs, args.slots, Path(tmp))
    rows = {"engine direct": direct, "whole stack": stack}
    print(f"{'':14} {'tokens/s':>9} {'wall s':>7} {'TTFT p50 s':>10}")
    for name, m in rows.items():
        print(f"{name:14} {m['tokens'] / m['wall_s']:9.1f} {m['wall_s']:7.2f} {statistics.median(m['ttft']):10.3f}")
    keep = (stack["tokens"] / stack["wall_s"]) / (direct["tokens"] / direct["wall_s"])
    added = statistics.median(stack["ttft"]) - statistics.median(direct["ttft"])
    same = sum(stack["texts"].get(k) == v for k, v in direct["texts"].items())
    print(f"stack keeps {keep:.0%} of the engine's tokens/s; adds {added * 1000:+.0f} ms to TTFT p50; "
          f"{same}/{len(reqs)} answers identical")


if __name__ == "__main__":
    main()
