"""`python -m bench.publisher`: the worker's publisher at a GPU worker's rate, alone against a private Redis: what
its thread and Redis spend to stream every answer (and keep the record a redelivery goes on from).

A stand-in engine puts one step's deltas for every request in the outbox at a fixed rate (by default 256
requests at 100 steps a second, 25,600 tokens a second), each delta a token with its text, as the engine makes
them. Printed: the steps' tokens a second the publisher kept up with, the worker process's and Redis's CPU time
per second of the run, the messages sent, and whether every answer's stream position and record read back whole.
Run it on two checkouts to compare them.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import redis

from messaging.contract import shown_key, streamed_key
from worker.continuation import Shown
from worker.engine import RequestFinished, TokenDelta
from worker.local_redis import start_redis
from worker.publisher import Publisher


def redis_cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def run(r: redis.Redis, requests: int, rate: float, seconds: float) -> dict[str, float]:
    publisher = Publisher(r, on_redis_error=lambda: None)
    answers = {f"req{i}": publisher.track({"request_id": f"req{i}", "room": f"room{i}", "channel": None}, [0])
               for i in range(requests)}
    steps = int(rate * seconds)
    cpu0, redis0, wall0 = time.process_time(), redis_cpu(r), time.perf_counter()
    for step in range(steps):
        publisher.outbox.put([TokenDelta(rid, " word", [1000 + step % 5000]) for rid in answers])
        pause = wall0 + (step + 1) / rate - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
    now = time.time()
    publisher.outbox.put([RequestFinished(request_id=rid, text="", token_ids=[], finish_reason="stop",
                                          prompt_tokens=1, completion_tokens=steps, cached_tokens=0,
                                          arrival_time=now, admitted_time=now, first_token_time=now,
                                          finished_time=now, mean_batch_size=float(requests))
                          for rid in answers])
    for answer in answers.values():
        answer.ends.get(timeout=60)
    wall = time.perf_counter() - wall0
    # Every answer's position and record, read back: what a redelivery would go on from.
    chars, tokens = len(" word") * steps, [1000 + step % 5000 for step in range(steps)]
    complete = all(int(r.get(streamed_key(rid))) == chars
                   and (shown := Shown.read(r.lrange(shown_key(rid), 0, -1), chars)) is not None
                   and [t for _, ids in shown.pieces for t in ids] == tokens for rid in answers)
    return {"tok/s": requests * steps / wall, "cpu": (time.process_time() - cpu0) / wall,
            "redis": (redis_cpu(r) - redis0) / wall, "messages": publisher.batches, "wall": wall,
            "complete": complete}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.publisher", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rate", type=float, default=100.0, help="engine steps a second")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_redis(Path(tmp), persist=False)
        try:
            r = redis.Redis.from_url(url)
            print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}; redis on loopback; "
                  f"{args.requests} requests x {args.rate:g} steps/s for {args.seconds:g} s")
            for _ in range(args.repeats):
                got = run(r, args.requests, args.rate, args.seconds)
                print(f"  {got['tok/s']:9,.0f} tok/s over {got['wall']:.2f} s; worker process CPU "
                      f"{got['cpu']:.3f} s/s; redis CPU {got['redis']:.3f} s/s; {got['messages']} messages; "
                      f"records {'complete' if got['complete'] else 'INCOMPLETE'}")
                r.flushall()
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
