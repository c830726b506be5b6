"""`python -m bench.keyspace`: finding the live workers in a Redis that holds the keys of recent requests, by
scanning the keyspace for heartbeat keys (as /readyz, the queue limit, the dashboard and /metrics once did) against
reading the set of worker names and their keys (messaging/workers.py), on the same private Redis in the same run.

Each answered request leaves its final event and its streamed count for an hour (messaging/contract.py): at 20
requests a second that is about 144,000 keys, plus rate-limit windows. Printed per keyspace size: milliseconds
per lookup each way and the ratio.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import redis

from messaging import workers
from messaging.contract import HEARTBEAT_PREFIX, final_key, streamed_key
from worker.local_redis import start_redis

WORKERS = 2


def by_scan(r: redis.Redis) -> int:
    """The former lookup: every key matched against the heartbeat prefix, then each one read."""
    keys = list(r.scan_iter(HEARTBEAT_PREFIX + "*"))
    return sum(1 for raw in (r.mget(keys) if keys else []) if raw is not None)


def by_names(r: redis.Redis) -> int:
    return len(workers.heartbeats(r))


def timed(lookup, r: redis.Redis, tries: int) -> float:
    """Milliseconds per lookup, the best of `tries` (the machine's noise only ever adds)."""
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        found = lookup(r)
        best = min(best, time.perf_counter() - start)
        assert found == WORKERS, f"{lookup.__name__} found {found} workers, not {WORKERS}"
    return best * 1e3


def fill(r: redis.Redis, start: int, end: int) -> None:
    """Keys as answered requests leave them, two a request."""
    pipe = r.pipeline(transaction=False)
    for i in range(start, end, 2):
        pipe.set(final_key(f"req{i}"), "{}", ex=3600)
        pipe.set(streamed_key(f"req{i}"), 10, ex=3600)
        if i % 20_000 == 0:
            pipe.execute()
    pipe.execute()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.keyspace", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,30000,300000", help="keyspace sizes, comma-separated")
    parser.add_argument("--tries", type=int, default=5, help="lookups timed per way and size (the best is kept)")
    args = parser.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_redis(Path(tmp), persist=False)
        try:
            r = redis.Redis.from_url(url)
            for n in range(WORKERS):
                workers.announce(r, f"worker{n}", {"slots": 256, "time": time.time()}, 600)
            print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}; redis on loopback; "
                  f"{WORKERS} live workers")
            have = 0
            for size in sizes:
                fill(r, have, size)
                have = size
                scan, names = timed(by_scan, r, args.tries), timed(by_names, r, args.tries)
                print(f"  {r.dbsize():>9,} keys: scan {scan:9.2f} ms  names {names:6.2f} ms  "
                      f"scan / names {scan / names:8.1f}x")
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
