"""Which workers are live: each heartbeat also adds the worker's name to one set, so a reader fetches the few keys
of the named workers instead of scanning Redis's keyspace, which holds a few keys for every recent request."""

from __future__ import annotations

import json

import redis

from messaging.contract import HEARTBEAT_PREFIX, WORKER_NAMES_KEY, snapshot_key


def announce(r: redis.Redis, name: str, beat: dict, ttl_s: int) -> None:
    """The worker's heartbeat (gone once ttl_s pass without another) and its name in the set."""
    pipe = r.pipeline(transaction=False)
    pipe.set(HEARTBEAT_PREFIX + name, json.dumps(beat), ex=ttl_s)
    pipe.sadd(WORKER_NAMES_KEY, name)
    pipe.execute()


def publish_snapshot(r: redis.Redis, name: str, exposition: bytes, ttl_s: int) -> None:
    """The worker's latest metrics (gone once ttl_s pass without another), and its name in the set."""
    pipe = r.pipeline(transaction=False)
    pipe.set(snapshot_key(name), exposition, ex=ttl_s)
    pipe.sadd(WORKER_NAMES_KEY, name)
    pipe.execute()


def names(r: redis.Redis) -> list[str]:
    """Every worker that has announced itself and not yet been forgotten, live or not."""
    return sorted(n.decode() if isinstance(n, bytes) else n for n in r.smembers(WORKER_NAMES_KEY))


def heartbeats(r: redis.Redis) -> dict[str, dict]:
    """The live workers' latest heartbeats, by name (a worker whose heartbeat expired is left out)."""
    known = names(r)
    raws = r.mget([HEARTBEAT_PREFIX + n for n in known]) if known else []
    return {n: json.loads(raw) for n, raw in zip(known, raws) if raw is not None}


def snapshots(r: redis.Redis) -> dict[str, str]:
    """Each worker's latest metrics exposition, while it lasts (a dead worker's expires after a while)."""
    known = names(r)
    raws = r.mget([snapshot_key(n) for n in known]) if known else []
    return {n: raw.decode() for n, raw in zip(known, raws) if raw is not None}


def forget_gone(r: redis.Redis) -> None:
    """Drop from the set the workers whose heartbeat and metrics have both expired; a worker that comes back adds
    itself again with its next heartbeat."""
    known = names(r)
    if not known:
        return
    pipe = r.pipeline(transaction=False)
    for n in known:
        pipe.exists(HEARTBEAT_PREFIX + n, snapshot_key(n))
    gone = [n for n, alive in zip(known, pipe.execute()) if not alive]
    if gone:
        r.srem(WORKER_NAMES_KEY, *gone)
