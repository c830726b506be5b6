"""Limits that follow the workers' capacity: what a heartbeat announces, and the queue and connection limits."""

from __future__ import annotations

import json
import time

import pytest
import redis

from messaging import workers
from messaging.contract import HEARTBEAT_PREFIX
from webapp import capacity
from webapp.capacity import Capacity
from worker.local_redis import start_redis


@pytest.fixture()
def r(tmp_path):
    proc, url = start_redis(tmp_path / "redis", persist=False)
    try:
        yield redis.Redis.from_url(url)
    finally:
        proc.terminate()
        proc.wait(10)


def beat(r: redis.Redis, name: str, slots: int, device: str = "cuda:0") -> None:
    workers.announce(r, name, {"model": "m", "slots": slots, "device": device}, 10)


def test_limits_follow_the_live_workers_slots_unless_set(r, monkeypatch):
    monkeypatch.setattr(capacity, "REFRESH_S", 0)
    cap = Capacity(r)
    # No worker, or a CPU worker's 16 slots: the defaults a CPU deployment was sized for.
    assert (cap.queue_limit(None), cap.connections_per_ip(None)) == (200, 50)
    beat(r, "cpu", 16, "cpu")
    assert (cap.queue_limit(None), cap.connections_per_ip(None)) == (200, 50)
    # Two GPU workers of 256 slots each: room for eight answers' worth of waiting per slot.
    r.delete(HEARTBEAT_PREFIX + "cpu")
    beat(r, "gpu0", 256)
    beat(r, "gpu1", 256)
    assert (cap.queue_limit(None), cap.connections_per_ip(None)) == (4096, 512)
    # An explicit setting wins, 0 included (every queue full; no connection limit).
    assert (cap.queue_limit(300), cap.connections_per_ip(20)) == (300, 20)
    assert (cap.queue_limit(0), cap.connections_per_ip(0)) == (0, 0)


def test_the_figure_is_read_at_most_every_few_seconds(r):
    cap = Capacity(r)
    beat(r, "gpu0", 256)
    assert cap.slots() == 256
    beat(r, "gpu1", 256)
    assert cap.slots() == 256, "read again within REFRESH_S"
    cap._read_at = time.monotonic() - capacity.REFRESH_S
    assert cap.slots() == 512


def test_live_workers_are_read_without_scanning_the_keyspace(r, monkeypatch):
    """A keyspace holds a few keys for every recent request: finding the workers by scanning it took 4.4 s at 300,000
    keys here. Readers look up the named workers' keys instead, and forget a worker whose keys are gone."""
    from messaging.contract import snapshot_key

    r.flushdb()
    r.mset({f"supportbot:final:{i}": "x" for i in range(2000)})
    workers.announce(r, "live", {"slots": 4}, 10)
    workers.announce(r, "dead", {"slots": 8}, 10)
    r.delete(HEARTBEAT_PREFIX + "dead")             # its heartbeat expired ...
    r.set(snapshot_key("dead"), "# metrics", ex=10)  # ... its last metrics not yet
    r.set(snapshot_key("live"), "# live metrics", ex=10)

    def no_scan(*args, **kwargs):
        raise AssertionError("the keyspace was scanned")

    for method in ("scan", "scan_iter", "keys"):
        monkeypatch.setattr(r, method, no_scan)
    assert workers.heartbeats(r) == {"live": {"slots": 4}}
    assert workers.snapshots(r) == {"dead": "# metrics", "live": "# live metrics"}
    workers.forget_gone(r)
    assert workers.names(r) == ["dead", "live"], "a worker whose metrics last is still named"
    r.delete(snapshot_key("dead"))
    workers.forget_gone(r)
    assert workers.names(r) == ["live"]
    assert Capacity(r).slots() == 4


def test_a_worker_announces_its_slots_kv_pool_and_device(stack):
    r = redis.Redis.from_url(stack.env["REDIS_URL"])
    beats = [json.loads(r.get(key)) for key in r.scan_iter(HEARTBEAT_PREFIX + "*")]
    assert beats
    for beat_ in beats:
        assert beat_["slots"] == int(stack.env["MAX_NUM_SEQS"]) and beat_["device"] == "cpu"
        assert beat_["kv_blocks"] > 0 and beat_["kv_tokens"] == beat_["kv_blocks"] * beat_["kv_block_size"]
        assert beat_["kv_bytes"] > 0 and beat_["step_tokens"] >= beat_["slots"]
        assert beat_["kv_sizing"] == f"{float(stack.env['KV_CACHE_GIB']):g} GiB"   # how the pool got its size
    # The same in the worker's start line, where an operator reads it, with the attention that runs.
    log = stack.workdir / "worker.log"
    deadline = time.monotonic() + 30
    while "ready with" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    line = next(text for text in log.read_text().splitlines() if "ready with" in text)
    slots, sizing = stack.env["MAX_NUM_SEQS"], f"{float(stack.env['KV_CACHE_GIB']):g} GiB"
    assert f"{slots} slots" in line and f"sized by {sizing}" in line and "; attention " in line, line
    assert f"{beats[0]['step_tokens']} tokens per step" in line, line
