"""`python -m bench.ratelimit`: the rate limiter's one-step Lua check of every rule (webapp/limits.py) against the
`limits` package (Flask-Limiter's core) on the same private Redis, in the same run.

What a chat message or API completion costs: three rules (per address, per session, per API key) checked, and
recorded only when all have room. `limits` checks one rule per call, so the same decision takes either a `test`
of each rule and then a `hit` of each (six round trips, and two processes may both pass the tests for the last
slot), or a `hit` of each (three round trips, but a request refused by one rule still spends the others'
budget). Printed: microseconds per check for each way and the ratio to the Lua script, then how many requests
each way admits when 8 threads race for the last slots, and how much of a shared address's budget one session
over its own limit uses up.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import threading
import time
import uuid
from pathlib import Path

import redis

from webapp.limits import Rule, hit
from worker.local_redis import start_redis


def lua_check(r: redis.Redis, rules: list[tuple[str, Rule]]) -> bool:
    return hit(r, rules).wait == 0


class LimitsChecks:
    """The same decision with the `limits` package's moving window (the Lua script's sliding window)."""

    def __init__(self, url: str, strategy: str) -> None:
        from limits import RateLimitItemPerSecond, storage, strategies
        self.item = RateLimitItemPerSecond
        self.limiter = {"moving": strategies.MovingWindowRateLimiter,
                        "counter": strategies.SlidingWindowCounterRateLimiter}[strategy](storage.RedisStorage(url))

    def items(self, rules: list[tuple[str, Rule]]):
        return [(self.item(rule.limit, int(rule.period)), key) for key, rule in rules]

    def test_then_hit(self, rules: list[tuple[str, Rule]]) -> bool:
        items = self.items(rules)
        if not all(self.limiter.test(item, key) for item, key in items):
            return False
        return all([self.limiter.hit(item, key) for item, key in items])

    def hit_each(self, rules: list[tuple[str, Rule]]) -> bool:
        return all([self.limiter.hit(item, key) for item, key in self.items(rules)])


def timed(check, rules_for, n: int) -> float:
    """Microseconds per check over `n` checks, every one allowed (fresh keys, generous limits)."""
    start = time.perf_counter()
    for i in range(n):
        check(rules_for(i))
    return (time.perf_counter() - start) / n * 1e6


def race(check, rules: list[tuple[str, Rule]], threads: int, tries: int) -> int:
    """Requests admitted when `threads` threads each try `tries` times at once."""
    admitted = []
    barrier = threading.Barrier(threads)

    def run() -> None:
        barrier.wait()
        admitted.append(sum(bool(check(rules)) for _ in range(tries)))

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(admitted)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ratelimit", description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=int, default=3000, help="checks timed per way")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_redis(Path(tmp), persist=False)
        try:
            run(url, args.checks)
        finally:
            proc.terminate()
            proc.wait(10)


def run(url: str, n: int) -> None:
    r = redis.Redis.from_url(url)
    moving, counter = LimitsChecks(url, "moving"), LimitsChecks(url, "counter")
    roomy = Rule(10**6, 60)

    def fresh(i: int, tag: str = "") -> list[tuple[str, Rule]]:
        run_id = uuid.uuid4().hex[:6]
        return [(f"{tag}{run_id}:ip:{i % 50}", roomy), (f"{tag}{run_id}:session:{i}", roomy),
                (f"{tag}{run_id}:key:{i % 5}", roomy)]

    ways = {"lua (one EVAL, all rules)": lambda rules: lua_check(r, rules),
            "limits moving window, test all then hit all": moving.test_then_hit,
            "limits moving window, hit each": moving.hit_each,
            "limits sliding counter, test all then hit all": counter.test_then_hit,
            "limits sliding counter, hit each": counter.hit_each}
    for check in ways.values():   # warm: scripts loaded, connections open
        timed(check, fresh, 50)
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}; redis on loopback; {n} checks of 3 rules "
          "per way")
    base = None
    for name, check in ways.items():
        us = timed(check, fresh, n)
        base = base or us
        print(f"  {name:48s} {us:8.1f} us per check  {us / base:5.2f}x the Lua script's time")
    print("8 threads x 20 tries racing for a limit of 10 (address) with session limits of 1000:")
    for name, check in ways.items():
        tag = uuid.uuid4().hex[:6]
        rules = [(f"race{tag}:ip", Rule(10, 60)), (f"race{tag}:session", Rule(1000, 60))]
        print(f"  {name:48s} admitted {race(check, rules, 8, 20)}")
    print("one session sending 100 requests past its limit of 5, beside an address limit of 50:")
    for name, check in ways.items():
        tag = uuid.uuid4().hex[:6]
        rules = [(f"spend{tag}:ip", Rule(50, 60)), (f"spend{tag}:session", Rule(5, 60))]
        admitted = sum(bool(check(rules)) for _ in range(100))
        left = sum(bool(check([(f"spend{tag}:ip", Rule(50, 60))])) for _ in range(50))
        print(f"  {name:48s} admitted {admitted}, address slots left for everyone else {left} of {50 - admitted}")


if __name__ == "__main__":
    main()
