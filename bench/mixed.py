"""Mixed traffic through the whole stack: chat customers arriving over time beside bulk API streams, with service
classes on and off in one run (`python -m bench.stack --mixed`).

One worker serves the whole run. Each half has a web process of its own on it: one as deployed (classes on: the
chats are interactive, the bulk streams send service_tier "flex"), one with SERVICE_CLASSES=off (every request
standard: one FIFO, as before classes existed). In each half the bulk streams (each a client that sends its next
request as soon as one ends; the end-of-text tokens are biased away, so no answer ends before its max_tokens) run
`--bulk-warmup` seconds, then `--bulk-window` seconds measure their tokens/s alone, then the chats arrive
`--chat-interval` seconds apart, each a customer on its own Socket.IO connection asking once; their TTFT (send to first text) and the
bulk tokens/s while they are answered are measured. Bulk tokens/s counts the tokens streamed to the bulk clients
in a window (their text re-tokenized; the count is checked against the engine's usage figures of the answers that
ended, and the streams run on after the chats until as many answers have ended as there are streams), divided by its
length. Before both halves the chats are sent one at a time to the idle stack: their TTFT alone.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass

import redis
import requests

from bench.stack_parts import Stack, _close_all, _Customer, _socketio
from messaging.queue import queue_depths

BULK_TASK = ("Summarise this support ticket for the back office in detail, step by step, with every fact and "
             "the next action: ")


def eos_bias(tok) -> dict[str, float]:
    """logit_bias that keeps the model from ending an answer early: -100 on its end-of-text tokens."""
    ids = {tok.eos_token_id} | {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>", "</s>")
                                if t in tok.get_vocab()}
    return {str(i): -100 for i in ids if i is not None}


class BulkStreams:
    """`n` API clients, each sending a bulk request after the other until closed."""

    def __init__(self, base: str, n: int, cap: int, questions: list[str], bias: dict[str, float], tok) -> None:
        self.base, self.cap, self.bias, self.tok = base, cap, bias, tok
        self.done: list[tuple[float, int, str, int]] = []   # (ended at, completion tokens, finish reason, counted)
        # Tokens as they stream: (time, tokens in the chunk's text, re-tokenized); checked against `usage` at the end.
        self.streamed: list[tuple[float, int]] = []
        self.errors: Counter = Counter()
        self.stop = threading.Event()
        self._responses: dict[int, requests.Response] = {}
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i, questions[i % len(questions)]), daemon=True)
                         for i in range(n)]
        for t in self._threads:
            t.start()

    def _run(self, i: int, question: str) -> None:
        session = requests.Session()
        body = {"messages": [{"role": "user", "content": BULK_TASK + question}], "max_tokens": self.cap,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                "logit_bias": self.bias, "service_tier": "flex"}
        while not self.stop.is_set():
            try:
                with session.post(self.base + "/v1/chat/completions", json=body, stream=True, timeout=900) as resp:
                    self._responses[i] = resp
                    if resp.status_code != 200:
                        self.errors[f"http_{resp.status_code}"] += 1
                        time.sleep(1)
                        continue
                    usage, reason, counted = None, None, 0
                    for line in resp.iter_lines():
                        if not line.startswith(b"data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        text = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
                        if text:
                            n = len(self.tok.encode(text, add_special_tokens=False))
                            counted += n
                            with self._lock:
                                self.streamed.append((time.time(), n))
                        if "error" in chunk:
                            self.errors[chunk["error"].get("code") or "error"] += 1
                        if chunk.get("usage"):
                            usage = chunk["usage"]["completion_tokens"]
                        if chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                            reason = chunk["choices"][0]["finish_reason"]
                    if usage is not None:
                        with self._lock:
                            self.done.append((time.time(), usage, reason or "?", counted))
            except (requests.RequestException, OSError, ValueError, AttributeError):
                if not self.stop.is_set():
                    self.errors["connection"] += 1

    def tokens_per_s(self, start: float, end: float) -> float:
        """Bulk tokens streamed in [start, end) per second, counted by re-tokenizing the streamed text."""
        with self._lock:
            return sum(n for t, n in self.streamed if start <= t < end) / max(1e-9, end - start)

    def count_error(self) -> float | None:
        """Tokens counted from the streamed text over the engine's own count, for the answers that ended."""
        with self._lock:
            usage = sum(u for _, u, _, _ in self.done)
            return sum(c for _, _, _, c in self.done) / usage - 1 if usage else None

    def wait_ended(self, n: int, timeout: float) -> None:
        """Until `n` answers have ended (or `timeout` s): the finish reasons and the token-count check need them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.done) >= n:
                    return
            time.sleep(0.1)

    def reasons(self) -> dict[str, int]:
        with self._lock:
            return dict(Counter(r for _, _, r, _ in self.done))

    def close(self) -> None:
        """Stop sending and drop the answers under way; wait_idle then waits until the worker holds none."""
        self.stop.set()
        for resp in list(self._responses.values()):
            try:
                resp.close()
            except Exception:
                pass
        for t in self._threads:
            t.join(10)


@dataclass
class Half:
    label: str
    chat_ttft: list[float | None]
    chat_tokens: int
    bulk_alone_tok_s: float
    bulk_with_chats_tok_s: float
    chats_window_s: float
    bulk_reasons: dict[str, int]
    count_error: float | None
    errors: dict[str, int]

    def figures(self) -> dict:
        ttfts = sorted(t for t in self.chat_ttft if t is not None)
        chat_tok_s = self.chat_tokens / self.chats_window_s
        return {"label": self.label, "chats": len(self.chat_ttft), "answered": len(ttfts),
                "chat_ttft_p50_s": statistics.median(ttfts) if ttfts else None,
                "chat_ttft_p99_s": pick(ttfts, 0.99), "chat_ttft_max_s": ttfts[-1] if ttfts else None,
                "bulk_alone_tok_s": self.bulk_alone_tok_s, "bulk_with_chats_tok_s": self.bulk_with_chats_tok_s,
                "bulk_drop": 1 - self.bulk_with_chats_tok_s / self.bulk_alone_tok_s if self.bulk_alone_tok_s else None,
                "chat_share_of_tokens": chat_tok_s / (chat_tok_s + self.bulk_with_chats_tok_s)
                if chat_tok_s + self.bulk_with_chats_tok_s else None,
                "chats_window_s": self.chats_window_s, "bulk_finish_reasons": self.bulk_reasons,
                "bulk_token_count_error": self.count_error,
                "errors": self.errors}


def pick(ordered: list[float], q: float) -> float | None:
    """The q-quantile by nearest rank: with few values, p99 is the slowest."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def chat_messages(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def run_chats(base: str, n: int, interval: float, messages: list[dict], cap: int) -> tuple[list, int, float, float]:
    """n customers connect, then ask `interval` s apart; (TTFTs, their answer tokens, first send, last end)."""
    customers = [_Customer(base, {"id": f"chat{i}", "cap": cap, "messages": messages}) for i in range(n)]
    start = time.time()
    for i, c in enumerate(customers):
        time.sleep(max(0.0, start + i * interval - time.time()))
        c.send(time.time())
    results = [c.wait() for c in customers]
    end = max(r["finished_at"] for r in results)
    _close_all(customers)
    return ([r["ttft"] for r in results], sum(r.get("completion_tokens") or 0 for r in results), start, end)


def wait_idle(stack: Stack, timeout: float = 300) -> None:
    """Until nothing is queued or in the engine: the next half starts from the same state."""
    r = redis.Redis.from_url(stack.env["REDIS_URL"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        beats = [json.loads(b) for k in r.scan_iter("supportbot:workers:*") if (b := r.get(k))]
        if sum(queue_depths(r).values()) == 0 and not any(b.get("running") or b.get("waiting") for b in beats):
            return
        time.sleep(0.5)
    raise TimeoutError("the stack did not go idle between the halves")


def run_half(stack: Stack, base: str, label: str, args, questions: list[str], system: str, tok) -> Half:
    messages = chat_messages(system, args.chat_question)
    streams = BulkStreams(base, args.bulk_streams, args.bulk_tokens, questions, eos_bias(tok), tok)
    try:
        time.sleep(args.bulk_warmup)
        alone_start = time.time()
        time.sleep(args.bulk_window)
        alone_end = time.time()
        ttft, chat_tokens, first, last = run_chats(base, args.chats, args.chat_interval, messages, args.chat_tokens)
        # On a loaded machine no bulk answer may have ended yet; the windows above are measured already.
        streams.wait_ended(args.bulk_streams, timeout=300)
    finally:
        streams.close()
    half = Half(label, ttft, chat_tokens, streams.tokens_per_s(alone_start, alone_end),
                streams.tokens_per_s(first, last), last - first, streams.reasons(), streams.count_error(),
                dict(streams.errors))
    wait_idle(stack)
    return half


def run(args, reqs: list[dict]) -> dict:
    """Both halves on one stack; prints and returns the figures."""
    import tempfile
    from pathlib import Path

    system = reqs[0]["messages"][0]["content"]
    questions = [q["messages"][-1]["content"] for q in reqs]
    from worker.model_loader import load_tokenizer

    tok = load_tokenizer(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        stack = Stack(args.slots, workdir, system, max(args.chat_tokens, args.bulk_tokens), args.model,
                      queue_limit=max(1000, 4 * args.bulk_streams))
        try:
            off = stack.add_web(SERVICE_CLASSES="off")
            messages = chat_messages(system, args.chat_question)
            _socketio(stack.base, {"id": "warm", "messages": messages}, 4)   # first use: compile, cache the prefix
            alone = [_socketio(stack.base, {"id": f"alone{i}", "messages": messages}, args.chat_tokens)["ttft"]
                     for i in range(args.chats_alone)]
            halves = [run_half(stack, stack.base, "classes on", args, questions, system, tok),
                      run_half(stack, off, "classes off (one FIFO)", args, questions, system, tok)]
        finally:
            stack.close()
    alone_sorted = sorted(t for t in alone if t is not None)
    figures = {"mode": "mixed", "slots": args.slots, "bulk_streams": args.bulk_streams,
               "bulk_tokens": args.bulk_tokens, "chats": args.chats, "chat_interval_s": args.chat_interval,
               "chat_tokens": args.chat_tokens, "chats_alone": len(alone_sorted),
               "alone_chat_ttft_p50_s": statistics.median(alone_sorted),
               "alone_chat_ttft_max_s": alone_sorted[-1], "halves": [h.figures() for h in halves]}
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    report(figures)
    return figures


def share(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def report(f: dict) -> None:
    alone = f["alone_chat_ttft_p50_s"]
    print(f"chat TTFT alone (idle stack, the chats' question {f['chats_alone']} times, one at a time): "
          f"p50 {alone:.2f} s, max {f['alone_chat_ttft_max_s']:.2f} s")
    target = max(2 * alone, alone + 1)
    for h in f["halves"]:
        p50, p99 = h["chat_ttft_p50_s"], h["chat_ttft_p99_s"]
        print(f"{h['label']}: {h['answered']}/{h['chats']} chats beside {f['bulk_streams']} bulk streams: TTFT p50 "
              f"{p50:.2f} s ({p50 / alone:.1f}x alone), p99 {p99:.2f} s ({p99 / alone:.1f}x); bulk "
              f"{h['bulk_alone_tok_s']:.1f} tok/s alone, {h['bulk_with_chats_tok_s']:.1f} tok/s with the chats "
              f"(drop {share(h['bulk_drop'])}; the chats' share of tokens {share(h['chat_share_of_tokens'])}); bulk "
              f"answers ended {h['bulk_finish_reasons']} (streamed-token count off by "
              f"{share(h['bulk_token_count_error'])}){'; errors ' + str(h['errors']) if h['errors'] else ''}")
        print(f"  target max(2x, +1 s) of alone = {target:.2f} s: p50 {'within' if p50 <= target else 'OVER'}, "
              f"p99 {'within' if p99 <= target else 'OVER'}")
