"""Driving customers: closed loop (N customers, each turn after the last answer) or open loop (Poisson arrivals)."""

from __future__ import annotations

import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from tqdm import tqdm

from .clients import HttpCustomer, Result, SocketCustomer
from .scripts import Script, pick

PROTOCOLS = ("socketio", "http", "mixed")
# After a retryable refusal a customer waits this long, so a full queue is not hammered.
RETRY_PAUSE_S = 1.0


class Customer(Protocol):
    protocol: str
    index: int

    def ask(self, text: str, result: Result) -> Result: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...


@dataclass
class LoadConfig:
    url: str
    protocol: str = "socketio"
    customers: int = 4
    rate: float | None = None
    requests: int | None = None
    duration: float | None = None
    think_time: float = 0.0
    timeout: float = 120.0
    max_tokens: int | None = None
    temperature: float | None = None
    model: str | None = None
    api_key: str | None = None
    seed: int = 0
    progress: bool = True

    @property
    def mode(self) -> str:
        return "open" if self.rate else "closed"

    def http_body(self) -> dict:
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature}
        return {k: v for k, v in body.items() if v is not None}

    def describe(self) -> str:
        load = f"open loop at {self.rate:g} req/s" if self.rate else f"closed loop, {self.customers} customers"
        if self.think_time and not self.rate:
            load += f" (think {self.think_time:g}s)"
        until = f"{self.requests} requests" if self.requests is not None else f"{self.duration:g}s"
        return f"{load} over {self.protocol} -> {self.url}, {until}"


@dataclass
class Conversation:
    customer: Customer
    script: Script
    turns: list[str]
    turn: int = 0


class Run:
    """One load run: the request budget, the live customers, the results and the progress bar."""

    def __init__(self, cfg: LoadConfig, label: str = "") -> None:
        self.cfg = cfg
        self.results: list[Result] = []
        self.stop = threading.Event()
        self.interrupted = False
        self.fatal: Result | None = None
        self.started_at = time.time()
        self.start = time.perf_counter()
        self.elapsed = 0.0
        self._last_end: float | None = None
        self._lock = threading.Lock()
        self._issued = 0
        self._customers = 0
        self._live: set = set()
        self._parked: list[Conversation] = []
        self._threads: list[threading.Thread] = []
        total = cfg.requests if cfg.requests is not None else (
            round(cfg.rate * cfg.duration) if cfg.rate and cfg.duration else None)
        self.bar = tqdm(total=total, desc=label or "requests", unit="req", file=sys.stderr,
                        disable=not cfg.progress, dynamic_ncols=True)

    def take(self) -> bool:
        """Permission to send one more request within --requests / --duration."""
        with self._lock:
            if self.stop.is_set():
                return False
            if self.cfg.requests is not None and self._issued >= self.cfg.requests:
                return False
            if self.cfg.duration is not None and time.perf_counter() - self.start >= self.cfg.duration:
                return False
            self._issued += 1
            return True

    def record(self, result: Result) -> None:
        result.rate = self.cfg.rate
        with self._lock:
            self._last_end = time.perf_counter()
            self.results.append(result)
            errors = sum(not r.ok for r in self.results)
            self.bar.set_postfix(ok=len(self.results) - errors, err=errors, refresh=False)
            self.bar.update()
            first_fatal = result.fatal and self.fatal is None
            if first_fatal:
                self.fatal = result
        if first_fatal:
            self.abort()

    def customer(self) -> tuple[Customer, random.Random]:
        with self._lock:
            index = self._customers
            self._customers += 1
        protocol = self.cfg.protocol if self.cfg.protocol != "mixed" else ("socketio", "http")[index % 2]
        if protocol == "socketio":
            c: Customer = SocketCustomer(self.cfg.url, index, self.cfg.timeout, self.start, self.cfg.max_tokens)
        else:
            c = HttpCustomer(self.cfg.url, index, self.cfg.timeout, self.start, self.cfg.http_body(), self.cfg.api_key)
        with self._lock:
            self._live.add(c)
        return c, random.Random(f"{self.cfg.seed}:{index}")

    def new_conversation(self) -> Conversation:
        customer, rng = self.customer()
        script, turns = pick(rng)
        return Conversation(customer, script, turns)

    def release(self, customer: Customer) -> None:
        with self._lock:
            self._live.discard(customer)
        customer.close()

    def park(self, conv: Conversation) -> None:
        with self._lock:
            self._parked.append(conv)

    def unpark(self) -> Conversation | None:
        """The conversation idle the longest, if any: ongoing conversations continue before new ones start."""
        with self._lock:
            return self._parked.pop(0) if self._parked else None

    def spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=(self, *args), daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def wait(self, limit: float | None = None) -> None:
        deadline = None if limit is None else time.perf_counter() + limit
        while True:
            with self._lock:
                alive = [t for t in self._threads if t.is_alive()]
            if not alive or (deadline is not None and time.perf_counter() >= deadline):
                return
            alive[0].join(0.2)

    def abort(self) -> None:
        """Stop sending and cut every answer in flight (the server cancels what it was generating)."""
        self.stop.set()
        with self._lock:
            live = list(self._live)
        for c in live:
            c.abort()

    def finish(self) -> None:
        """Close the run; its duration ends with the last answer, not with closing connections."""
        self.elapsed = (self._last_end or time.perf_counter()) - self.start
        self.bar.close()
        with self._lock:
            parked, self._parked = self._parked, []
        for conv in parked:
            self.release(conv.customer)


def execute(cfg: LoadConfig, label: str = "") -> Run:
    """Run the load until the budget is spent, a fatal refusal, or Ctrl-C (then the results so far)."""
    run = Run(cfg, label)
    try:
        (open_loop if cfg.rate else closed_loop)(run)
        run.wait()
    except KeyboardInterrupt:
        run.interrupted = True
        run.abort()
        try:
            run.wait(limit=10)
        except KeyboardInterrupt:
            pass
    finally:
        run.finish()
    return run


def closed_loop(run: Run) -> None:
    for _ in range(run.cfg.customers):
        run.spawn(customer_loop)


def customer_loop(run: Run) -> None:
    while not run.stop.is_set():
        conv = run.new_conversation()
        try:
            if not converse(run, conv):
                return
        finally:
            run.release(conv.customer)


def converse(run: Run, conv: Conversation) -> bool:
    """Every turn of one script; False once the run's budget is spent."""
    rng = random.Random(f"{run.cfg.seed}:think:{conv.customer.index}")
    for turn, text in enumerate(conv.turns):
        if not run.take():
            return False
        result = conv.customer.ask(text, Result(conv.customer.protocol, conv.customer.index, conv.script.name, turn))
        run.record(result)
        if not result.ok:
            if result.retryable:
                run.stop.wait(RETRY_PAUSE_S)
            return True
        if run.cfg.think_time > 0:
            run.stop.wait(rng.expovariate(1 / run.cfg.think_time))
    return True


def open_loop(run: Run) -> None:
    rng = random.Random(f"{run.cfg.seed}:arrivals")
    due = time.perf_counter()
    while True:
        due += rng.expovariate(run.cfg.rate)
        if run.stop.wait(max(0.0, due - time.perf_counter())) or not run.take():
            return
        run.spawn(open_turn, run.unpark() or run.new_conversation())


def open_turn(run: Run, conv: Conversation) -> None:
    c = conv.customer
    result = c.ask(conv.turns[conv.turn], Result(c.protocol, c.index, conv.script.name, conv.turn))
    run.record(result)
    conv.turn += 1
    if result.ok and conv.turn < len(conv.turns) and not run.stop.is_set():
        run.park(conv)
    else:
        run.release(c)
