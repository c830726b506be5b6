"""One thread streams every answer's text: each window's deltas, for all requests, go to Redis in one message."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from messaging.contract import (STREAM_CHANNEL, STREAMED_TTL_S, admitted_at_key, shown_at_key, shown_key,
                                streamed_key)
from messaging.stream import encode_batch, event_for
from worker import continuation
from worker.engine import Event, RequestFinished, TokenDelta, TokenLogprob
from worker.token_json import TokenJson

log = logging.getLogger(__name__)

# Each window's stream positions and records of what was shown (worker/continuation.py), for every request in one
# command: KEYS are each choice's streamed_key and shown_key, ARGV the time they are kept, then each choice's
# position and record (empty: none).
RECORD = """
for i = 1, #KEYS, 2 do
    redis.call('SET', KEYS[i], ARGV[i + 1], 'EX', ARGV[1])
    if ARGV[i + 2] ~= '' then
        redis.call('RPUSH', KEYS[i + 1], ARGV[i + 2])
        redis.call('EXPIRE', KEYS[i + 1], ARGV[1])
    end
end
"""

# Text is sent at most this often (per worker, for all requests together), unless something cannot wait:
# a request's first text, or the end of an answer. Slower engine steps are sent as each one comes.
DEFAULT_WINDOW_S = 0.05


@dataclass
class Answer:
    """A request this worker is answering: how far each choice's text has got, and its end once it comes."""

    job: dict
    shown: dict[int, int]       # choice -> characters clients were already sent, by this delivery or an earlier one
    produced: dict[int, int] = field(default_factory=dict)   # choice -> characters this delivery has generated
    choices: dict[int, RequestFinished] = field(default_factory=dict)   # each choice's end, as it comes
    ends: queue.Queue[RequestFinished] = field(default_factory=queue.Queue)   # the request's last end
    # An echo (/v1/completions): its prompt for the client, from the prompt's log-probabilities when asked
    # (echo_waits: they come with choice 0's first delta), sent on that first delta, so the echo and the answer
    # stream at once. Without it, or when it is lost, the end carries the prompt.
    echo: Callable[[list[TokenLogprob | None] | None], dict] | None = None
    echo_waits: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None
    echoed: bool = False
    stamped: bool = False   # this delivery has sent text, and the time of the first is kept
    admitted: float | None = None   # when the engine first admitted it (its first delta says), kept once sent
    admission_kept: bool = False
    continued: set[int] = field(default_factory=set)   # choices going on from an earlier delivery's tokens

    def unseen(self, text: str, index: int = 0, carries: bool = False) -> tuple[str, int] | None:
        """The part of a choice's next `text` that no client was sent yet, with its offset in that choice's answer:
        each choice resumes after what an earlier delivery showed of it. `carries`: the delta holds more than its
        text (log-probabilities), so it goes out even with no new text: always for a choice that goes on from the
        earlier delivery's tokens, whose deltas carry only new tokens' (the first one's text may all have been
        shown: the continued text, then a token with none of its own); for one generated again only past what
        was shown, as what came before was sent then."""
        start = self.produced.get(index, 0)
        end = self.produced[index] = start + len(text)
        shown = self.shown.get(index, 0)
        if end <= shown and (start < shown and index not in self.continued or not carries) or not (text or carries):
            return None
        new = text[max(0, shown - start):]
        self.shown[index] = max(shown, end)
        return new, max(shown, end) - len(new)

    def unsent(self, index: int, parts: list[str], tokens: list[list[int] | None],
               logprobs: list[TokenLogprob]) -> list[TokenLogprob]:
        """The log-probabilities of a choice's next parts (each one's text and the tokens that wrote it, one entry a
        token) that no client was sent: a choice generated again sends none for the tokens of what an earlier
        delivery showed, as that delivery sent theirs (the same tokens where the numerics are the same)."""
        start, shown = self.produced.get(index, 0), self.shown.get(index, 0)
        if start >= shown or index in self.continued:
            return logprobs
        sent = 0
        for text, ids in zip(parts, tokens):
            start += len(text)
            if start > shown:
                break
            sent += len(ids or ())
        return logprobs[sent:]

    def wait(self, timeout: float | None = None) -> RequestFinished | None:
        """The request's last end (`choices` then holds every choice's), or None when `timeout` passes first."""
        try:
            return self.ends.get(timeout=timeout)
        except queue.Empty:
            return None

    def ordered(self) -> list[RequestFinished]:
        return [self.choices[i] for i in sorted(self.choices)]


class Publisher:
    """Reads the engine's output for every tracked request and sends it on, one Redis transaction per window.

    The engine hands each step's events, for all requests, to this one thread. Their text is held back for up
    to `window_s` since the last send, so a fast engine's steps are sent together: one pub/sub message and one
    round trip carry every request's new text, however many requests and steps it covers. A request's first
    text and every answer's end go out at once.
    """

    def __init__(self, client: redis.Redis, on_redis_error: Callable[[], None],
                 window_s: float = DEFAULT_WINDOW_S, describe: TokenJson | None = None) -> None:
        self.redis, self.on_redis_error, self.window_s = client, on_redis_error, window_s
        self.describe = describe   # a token's log-probabilities as JSON for clients (worker/token_json.py)
        self.outbox: queue.Queue[list[Event]] = queue.Queue()   # the engine puts each step's events here
        self.answers: dict[str, Answer] = {}
        self.lock = threading.Lock()
        self.blind = False   # text deltas are failing to reach Redis
        # (request id, choice) -> text not sent yet, in order, the log-probabilities of its tokens and the tokens
        # behind each part of the text (its record: worker/continuation.py)
        self.pending: dict[tuple[str, int], tuple[list[str], list[TokenLogprob], list[list[int] | None]]] = {}
        self.unwritten: dict[tuple[str, int], list[int]] = {}   # (request id, choice) -> tokens whose text has not come
        self.sent_at = 0.0   # monotonic time of the last send
        self.batches = 0     # messages published, for tests and benchmarks
        threading.Thread(target=self._run, name="publisher", daemon=True).start()

    def track(self, job: dict, shown: list[int]) -> Answer | None:
        """Start following a request before it is submitted, so none of its events go unclaimed; `shown`: the
        characters of each choice an earlier delivery sent. None when this worker is answering it already (a
        second delivery of a request under way)."""
        with self.lock:
            if job["request_id"] in self.answers:
                return None
            answer = self.answers[job["request_id"]] = Answer(job, dict(enumerate(shown)))
        return answer

    def forget(self, request_id: str) -> None:
        with self.lock:
            self.answers.pop(request_id, None)

    def _run(self) -> None:
        while True:
            wait = None if not self.pending else max(0.0, self.sent_at + self.window_s - time.monotonic())
            try:
                events = self.outbox.get(timeout=wait)
                while not self.outbox.empty():   # fell behind the engine: take the steps that piled up together
                    events += self.outbox.get_nowait()
            except queue.Empty:
                events = []
            try:
                self.publish(events)
            except Exception:   # never leave a request waiting for an end that this thread dropped
                log.exception("publishing answers failed")
                self.pending.clear()
                self._hand_over_ends(events)

    def publish(self, events: list[Event]) -> None:
        """Take in a step's events; send what is due (everything, once the window has passed)."""
        urgent = False
        for event in events:
            if isinstance(event, TokenDelta) and (event.prompt_logprobs is not None or event.admitted_time is not None
                                                  or event.continued):   # a choice's first delta
                with self.lock:
                    answer = self.answers.get(event.request_id)
                if answer is not None and event.prompt_logprobs is not None:   # for an echo, with choice 0's text
                    answer.prompt_logprobs = event.prompt_logprobs
                if answer is not None and event.admitted_time is not None and answer.admitted is None:
                    answer.admitted = event.admitted_time
                if answer is not None and event.continued:
                    answer.continued.add(event.index)
            if isinstance(event, TokenDelta) and (event.text or event.logprobs):
                key = (event.request_id, event.index)
                held = self.pending.get(key)
                if held is None:
                    held = self.pending[key] = ([], [], [])
                    with self.lock:
                        answer = self.answers.get(event.request_id)
                    urgent |= answer is not None and not answer.produced.get(event.index)   # its first text
                held[0].append(event.text)
                held[1].extend(event.logprobs or ())
                # the tokens behind the text (none for the worker's own), those carried too
                carried = self.unwritten.pop(key, None) if self.unwritten else None
                tokens = continuation.tokens_of(event)
                held[2].append(carried + tokens if carried and tokens is not None else tokens)
            elif isinstance(event, TokenDelta) and event.token_ids:
                # A character's first bytes: its text comes with a later token, which carries these too.
                self.unwritten.setdefault((event.request_id, event.index), []).extend(event.token_ids)
            elif isinstance(event, RequestFinished):
                urgent = True   # its last text goes out before its end can
                if self.unwritten:
                    self.unwritten.pop((event.request_id, event.index), None)
        if self.pending and (urgent or time.monotonic() - self.sent_at >= self.window_s):
            self.flush()
        self._hand_over_ends(events)   # after the text: a request's end is never sent before its last delta

    def flush(self) -> None:
        pending, self.pending = self.pending, {}
        self.sent_at = time.monotonic()
        with self.lock:
            answers = {rid: self.answers.get(rid) for rid, _ in pending}
        deltas = []
        for (rid, index), (parts, logprobs, tokens) in pending.items():
            answer, joined = answers[rid], "".join(parts)
            if answer is None:
                continue
            if logprobs:
                logprobs = answer.unsent(index, parts, tokens, logprobs)
            unseen = answer.unseen(joined, index, carries=bool(logprobs))
            if unseen is not None:   # the text is recorded, less what an earlier delivery showed
                shown = continuation.record(list(zip(parts, tokens)), len(joined) - len(unseen[0])) \
                    if unseen[0] else ""
                deltas.append((answer, index, unseen, logprobs, shown))
        if deltas:
            self.send(deltas)

    def send(self, deltas: list[tuple[Answer, int, tuple[str, int], list[TokenLogprob], str]]) -> None:
        """Every request's text delta in one message, and the stream positions after them, in one transaction:
        a worker killed here has either shown a text and recorded its position, or neither, so a redelivery
        never shows text twice, even to a client that ignores offsets. Each choice's text is recorded too, with the
        tokens that wrote it, so that a redelivery goes on from them (worker/continuation.py), and the times text was
        first sent and the request first admitted, which a redelivery keeps as its time to first token and queue
        wait. While Redis is down the deltas are lost (the final event carries the whole text, and clients see the
        gap in the offsets)."""
        events, pipe, keys, positions = [], self.redis.pipeline(transaction=True), [], []
        first, admitted, now = [], [], time.time()
        for answer, index, (text, offset), logprobs, shown in deltas:
            rid = answer.job["request_id"]
            data = {"request_id": rid, "text": text, "offset": offset}
            if index:
                data["index"] = index
            if logprobs and self.describe is not None:
                describe = self.describe.for_job(answer.job)
                data["logprobs"] = [describe(entry) for entry in logprobs]
            if (index == 0 and answer.echo is not None and not answer.echoed
                    and (answer.prompt_logprobs is not None or not answer.echo_waits)):
                data["prompt"] = answer.echo(answer.prompt_logprobs)
                answer.echoed = True
            events.append(event_for(answer.job, "token", data))
            keys += (streamed_key(rid, index), shown_key(rid, index))
            positions += (offset + len(text), shown)
            if text and not answer.stamped:   # an earlier delivery's first text keeps its time
                pipe.set(shown_at_key(rid), repr(now), ex=STREAMED_TTL_S, nx=True)
                answer.stamped = True
                first.append(answer)
            if answer.admitted is not None and not answer.admission_kept:   # an earlier delivery's is kept
                pipe.set(admitted_at_key(rid), repr(answer.admitted), ex=STREAMED_TTL_S, nx=True)
                answer.admission_kept = True
                admitted.append(answer)
        if keys:
            pipe.eval(RECORD, len(keys), *keys, STREAMED_TTL_S, *positions)
        pipe.publish(STREAM_CHANNEL, encode_batch(events))
        try:
            pipe.execute()
        except redis.RedisError as exc:
            self.on_redis_error()
            for answer in first:   # its first text's time was not kept: the next text's is
                answer.stamped = False
            for answer in admitted:
                answer.admission_kept = False
            if not self.blind:
                log.warning("cannot stream answers while Redis is unreachable (%s); their ends are sent later", exc)
            self.blind = True
            return
        self.batches += 1
        if self.blind:
            self.blind = False
            log.info("streaming answers again")

    def _hand_over_ends(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, RequestFinished):
                with self.lock:   # with n choices, each ends on its own; the request ends with the last
                    answer = self.answers.get(event.request_id)
                    if answer is not None and event.finished:
                        del self.answers[event.request_id]
                if answer is not None:
                    answer.choices[event.index] = event
                    if event.finished:
                        answer.ends.put(event)


def publish_event(client: redis.Redis | redis.client.Pipeline, job: dict, name: str, data: dict) -> None:
    """One event (an answer's end) on the stream, on its own."""
    client.publish(STREAM_CHANNEL, encode_batch([event_for(job, name, data)]))

