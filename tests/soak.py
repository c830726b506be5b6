"""A soak run: the whole stack under steady open-loop load for a long time, with memory and SQL accounted for.

    python -m tests.soak --duration 600 --rate 0.5

It starts its own private Redis, SQLite database, worker and web app (the default model unless
`--model`), drives them with the load generator, samples each process's resident memory, and at
the end checks that every request the clients saw accepted has exactly one finished record.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import redis

from models import RequestRecord
from models.db import make_engine, make_session_factory, upgrade
from tests.load.report import summarize
from tests.load.runner import LoadConfig, Run, open_loop
from tests.stack import ROOT, Stack
from messaging.contract import HEARTBEAT_PREFIX
from messaging.queue import queue_depths
from worker.local_redis import start_redis


@dataclass
class Sample:
    t_s: float
    worker_rss_mb: float
    web_rss_mb: float
    sent: int
    errors: int


@dataclass
class SoakReport:
    duration_s: float
    rate: float
    protocol: str
    model: str
    sent: int
    completed: int
    errors: dict[str, int]
    errors_first_half: int
    errors_second_half: int
    ttft_s: dict
    e2e_s: dict
    tokens_per_s: float
    worker_rss_mb: tuple[float, float]
    web_rss_mb: tuple[float, float]
    accepted: int
    records_finished: int
    records_missing: list[str]
    records_unfinished: list[str]
    records_by_finish_reason: dict[str, int]
    samples: list[Sample] = field(default_factory=list)


def rss_mb(proc: psutil.Process) -> float:
    """The process and its children: the Celery worker's engine lives in its main process, but be sure."""
    try:
        procs = [proc, *proc.children(recursive=True)]
        return sum(p.memory_info().rss for p in procs if p.is_running()) / 2**20
    except psutil.NoSuchProcess:
        return float("nan")


def start(workdir: Path, model: str | None, slots: int) -> tuple[Stack, object]:
    redis_proc, redis_url = start_redis(workdir / "redis")
    database_url = f"sqlite:///{workdir / 'soak.db'}"
    upgrade(database_url)
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "DATABASE_URL", "REDIS_URL")}
    env.update(REDIS_URL=redis_url, DATABASE_URL=database_url, MAX_NUM_SEQS=str(slots), PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", QUEUE_LIMIT="1000", SECRET_KEY="soak-secret-" + os.urandom(8).hex(),
               # Every customer comes from this one address: the abuse limits would refuse the load itself.
               RATE_LIMIT_PER_SESSION="off", RATE_LIMIT_PER_IP="off", MAX_CONNECTIONS_PER_IP="0")
    if model:
        env["MODEL"] = model
    stack = Stack(workdir, env)
    stack.start_worker()
    stack.start_web()
    return stack, redis_proc


def wait_idle(stack: Stack, timeout: float = 300) -> None:
    """Until the queue is empty and the worker runs nothing: what was accepted has had its chance."""
    r = redis.Redis.from_url(stack.env["REDIS_URL"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        beats = [json.loads(r.get(k) or "{}") for k in r.scan_iter(HEARTBEAT_PREFIX + "*")]
        if sum(queue_depths(r).values()) == 0 and not any(b.get("running") or b.get("waiting") for b in beats):
            return
        time.sleep(1)


def account(database_url: str, request_ids: list[str]) -> tuple[list[str], list[str], dict[str, int], int]:
    with make_session_factory(make_engine(database_url))() as db:
        records = {rid: db.get(RequestRecord, rid) for rid in request_ids}
        every = db.query(RequestRecord).all()
    missing = [rid for rid, rec in records.items() if rec is None]
    unfinished = [rid for rid, rec in records.items() if rec is not None and rec.finished_at is None]
    reasons: dict[str, int] = {}
    for rec in every:
        reasons[rec.finish_reason or "unfinished"] = reasons.get(rec.finish_reason or "unfinished", 0) + 1
    return missing, unfinished, reasons, sum(1 for rec in every if rec.finished_at is not None)


def soak(args: argparse.Namespace) -> SoakReport:
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        workdir = Path(tmp)
        stack, redis_proc = start(workdir, args.model, args.slots)
        try:
            return drive(stack, args)
        finally:
            stack.stop()
            redis_proc.terminate()
            redis_proc.wait(10)


def drive(stack: Stack, args: argparse.Namespace) -> SoakReport:
    worker, web = psutil.Process(stack.worker.pid), psutil.Process(stack.procs[-1].pid)
    cfg = LoadConfig(url=stack.web_urls[0], protocol=args.protocol, rate=args.rate, duration=args.duration,
                     max_tokens=args.max_tokens, timeout=args.timeout, progress=not args.no_progress)
    samples: list[Sample] = []
    started, started_epoch, done = time.monotonic(), time.time(), threading.Event()
    run_holder: dict = {}

    def sample() -> None:
        while True:
            run = run_holder.get("run")
            results = run.results if run else []
            samples.append(Sample(round(time.monotonic() - started, 1), rss_mb(worker), rss_mb(web), len(results),
                                  sum(1 for r in results if not r.ok)))
            if done.wait(args.sample_every):
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    run = run_holder["run"] = Run(cfg, "soak")
    try:
        open_loop(run)
        run.wait()
    finally:
        run.finish()
    wait_idle(stack)
    done.set()
    sampler.join()
    summary = summarize(run.results, duration_s=args.duration, offered_rate=args.rate)
    accepted = [r.request_id for r in run.results if r.request_id]
    missing, unfinished, reasons, finished = account(stack.env["DATABASE_URL"], accepted)
    first = sum(1 for r in run.results if not r.ok and r.sent_at < started_epoch + args.duration / 2)
    return SoakReport(
        duration_s=args.duration, rate=args.rate, protocol=args.protocol, model=args.model or "default",
        sent=summary.sent, completed=summary.completed, errors=summary.errors, errors_first_half=first,
        errors_second_half=sum(summary.errors.values()) - first, ttft_s=summary.ttft_s, e2e_s=summary.e2e_s,
        tokens_per_s=summary.tokens_per_s, worker_rss_mb=(samples[0].worker_rss_mb, samples[-1].worker_rss_mb),
        web_rss_mb=(samples[0].web_rss_mb, samples[-1].web_rss_mb), accepted=len(accepted),
        records_finished=finished, records_missing=missing, records_unfinished=unfinished,
        records_by_finish_reason=reasons, samples=samples)


def print_report(rep: SoakReport) -> None:
    def pct(d: dict) -> str:
        return " / ".join("-" if d.get(k) is None else f"{d[k]:.2f}" for k in ("p50", "p90", "p99"))

    steady = [s for s in rep.samples if s.t_s >= rep.duration_s / 2] or rep.samples
    print(f"\nsoak: {rep.duration_s:.0f} s at {rep.rate:g} req/s over {rep.protocol}, model {rep.model}")
    print(f"requests sent {rep.sent}, completed {rep.completed}, errors {sum(rep.errors.values())} {rep.errors or ''}")
    print(f"errors in the first half {rep.errors_first_half}, in the second half {rep.errors_second_half}")
    print(f"TTFT p50/p90/p99 s: {pct(rep.ttft_s)}   end-to-end p50/p90/p99 s: {pct(rep.e2e_s)}")
    print(f"tokens/s {rep.tokens_per_s:.1f}")
    print(f"worker RSS MB start {rep.worker_rss_mb[0]:.0f}, end {rep.worker_rss_mb[1]:.0f} "
          f"(second-half median {statistics.median(s.worker_rss_mb for s in steady):.0f})")
    print(f"web RSS MB start {rep.web_rss_mb[0]:.0f}, end {rep.web_rss_mb[1]:.0f} "
          f"(second-half median {statistics.median(s.web_rss_mb for s in steady):.0f})")
    # Growth that slows to nothing is caches warming; growth at a steady pace is a leak.
    quarters = [min(rep.samples, key=lambda s, q=q: abs(s.t_s - q * rep.duration_s / 4)) for q in range(5)]
    print("worker RSS MB by quarter: " + ", ".join(f"{s.t_s:.0f} s {s.worker_rss_mb:.0f}" for s in quarters))
    print(f"SQL: {rep.accepted} accepted by the clients, {rep.records_finished} finished records "
          f"{rep.records_by_finish_reason}; missing {len(rep.records_missing)}, "
          f"unfinished {len(rep.records_unfinished)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    parser.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals per second (default 0.5)")
    parser.add_argument("--protocol", choices=("socketio", "http", "mixed"), default="mixed")
    parser.add_argument("--max-tokens", type=int, default=None, help="answer cap per request")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a client waits for an answer")
    parser.add_argument("--model", default=None, help="model id or path (default: the default model)")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--sample-every", type=float, default=10, help="seconds between memory samples")
    parser.add_argument("--out", type=Path, default=ROOT / "test-artifacts" / "soak", help="folder for soak.json")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    rep = soak(args)
    print_report(rep)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(asdict(rep), indent=2))
    print(f"written {args.out / 'soak.json'}")
    ok = not rep.records_missing and not rep.records_unfinished and rep.completed > 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
