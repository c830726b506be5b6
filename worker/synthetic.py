"""A benchmark-only stand-in for the engine: text at a set rate, to measure how fast the stack delivers it.

`python -m bench.stack --ceiling` starts its worker with SYNTHETIC_TOKEN_RATE set, so the web
tier's delivery can be measured at GPU-like rates on a machine without a GPU. Every running request gets
SYNTHETIC_TOKEN ("tok ") once per step, steps come SYNTHETIC_TOKEN_RATE times a second, and a request
ends at its max_new_tokens. It has no model: it must never serve customers, and no test of the product's
answers uses it. Unset (the default), the worker runs the real engine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

from worker.engine import EngineConfig, EngineStats, RequestFinished, SamplingParams, TokenDelta

log = logging.getLogger(__name__)

SYNTHETIC_TOKEN = "tok "


@dataclass
class _Request:
    request_id: str
    prompt_tokens: int
    max_new_tokens: int
    arrival_time: float
    outbox: queue.Queue
    admitted_time: float
    first_token_time: float | None = None
    produced: int = 0


class SyntheticEngine:
    """The parts of LLMEngine the worker uses, producing SYNTHETIC_TOKEN per request per step."""

    def __init__(self, tokens_per_s: float, max_num_seqs: int, max_model_len: int = 1 << 20) -> None:
        if tokens_per_s <= 0:
            raise ValueError("SYNTHETIC_TOKEN_RATE must be positive")
        self.interval = 1.0 / tokens_per_s
        self.config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(512, max_num_seqs),
                                   num_blocks=1)
        self.device = "synthetic"
        self.runner = SimpleNamespace(model=SimpleNamespace(name_or_source="synthetic"), num_blocks=1)
        self.max_model_len = max_model_len
        self.steps = 0
        self._running: dict[str, _Request] = {}
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="synthetic-engine", daemon=True)
        self._thread.start()
        log.warning("SYNTHETIC_TOKEN_RATE is set: this worker answers with %r at %.0f tokens/s per request, for "
                    "benchmarks only", SYNTHETIC_TOKEN, tokens_per_s)

    def render_chat(self, messages: list[dict]) -> list[int]:
        return [0] * (1 + sum(len(str(m.get("content", "")).split()) for m in messages))

    def submit(self, request_id: str, prompt_token_ids: list[int] | None = None, params: SamplingParams | None = None,
               arrival_time: float | None = None, outbox: queue.Queue | None = None, **_) -> None:
        now = time.time()
        request = _Request(request_id, len(prompt_token_ids or []), (params or SamplingParams()).max_new_tokens,
                           arrival_time or now, outbox, admitted_time=now)
        with self._lock:
            self._running[request_id] = request

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def stats(self) -> EngineStats:
        with self._lock:
            running = len(self._running)
        return EngineStats(running=running, waiting=0, kv_blocks_used=0, kv_blocks_free=1, kv_blocks_total=1,
                           steps=self.steps, preemptions=0, prefix_cache_hit_tokens=0, prefix_cache_query_tokens=0,
                           last_batch_seqs=running, last_batch_tokens=running)

    def shutdown(self) -> None:
        self._stopping.set()
        self._thread.join()
        with self._lock:
            left, self._running = list(self._running.values()), {}
        for request in left:
            request.outbox.put([self._end(request, "error", "The engine shut down before the answer finished.")])

    def _end(self, request: _Request, reason: str, error: str | None = None) -> RequestFinished:
        return RequestFinished(request_id=request.request_id, text=SYNTHETIC_TOKEN * request.produced,
                               token_ids=[0] * request.produced, finish_reason=reason,
                               prompt_tokens=request.prompt_tokens, completion_tokens=request.produced,
                               cached_tokens=0, arrival_time=request.arrival_time,
                               admitted_time=request.admitted_time, first_token_time=request.first_token_time,
                               finished_time=time.time(), mean_batch_size=1.0, error=error)

    def _loop(self) -> None:
        next_step = time.monotonic()
        while not self._stopping.is_set():
            next_step += self.interval
            time.sleep(max(0.0, next_step - time.monotonic()))
            now = time.time()
            outboxes: dict[int, tuple[queue.Queue, list]] = {}
            with self._lock:
                aborts, self._aborts = self._aborts, set()
                for request in list(self._running.values()):
                    events = outboxes.setdefault(id(request.outbox), (request.outbox, []))[1]
                    if request.request_id in aborts:
                        events.append(self._end(request, "cancelled"))
                        del self._running[request.request_id]
                        continue
                    request.produced += 1
                    request.first_token_time = request.first_token_time or now
                    events.append(TokenDelta(request.request_id, SYNTHETIC_TOKEN, [0]))
                    if request.produced >= request.max_new_tokens:
                        events.append(self._end(request, "length"))
                        del self._running[request.request_id]
                self.steps += 1
            for outbox, events in outboxes.values():
                if events:
                    outbox.put(events)
            if time.monotonic() - next_step > 1.0:   # fell far behind: do not try to catch up in a rush
                next_step = time.monotonic()
