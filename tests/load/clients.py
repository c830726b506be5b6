"""Simulated customers: one over Socket.IO (its own connection and conversation), one over the HTTP API."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import requests
import socketio

from bench.socketio_client import InOrderClient

SOCKET_EVENTS = ("accepted", "token", "done", "error")
# Chat refusals that every later message would get too: the run stops and says what to change.
FATAL_CODES = ("invalid_value", "bad_request")
# Client mistakes a retry cannot fix; the run stops at the first one and says what to change.
NOT_FATAL_STATUSES = (408, 429)


@dataclass
class Result:
    """One request as the client saw it; times in seconds, `sent_at` on the epoch clock."""

    protocol: str
    customer: int
    script: str
    turn: int
    sent_at: float = 0.0
    offset_s: float = 0.0
    request_id: str | None = None
    conversation_id: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tokens_exact: bool = True
    chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None
    message: str | None = None
    retryable: bool = False
    fatal: bool = False
    rate: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def fail(self, kind: str, message: str, retryable: bool = False, fatal: bool = False) -> Result:
        self.error, self.message, self.retryable, self.fatal = kind, message, retryable, fatal
        return self


class _Clock:
    """Client-side timings of one request, started when the message leaves."""

    def __init__(self, result: Result, run_start: float) -> None:
        self.start = time.perf_counter()
        result.sent_at, result.offset_s = time.time(), self.start - run_start
        self.result = result

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def token(self) -> None:
        if self.result.ttft_s is None:
            self.result.ttft_s = self.elapsed()
        self.result.chunks += 1

    def end(self) -> None:
        self.result.e2e_s = self.elapsed()
        if self.result.ttft_s is None:   # an empty answer: its first sign of life is the end
            self.result.ttft_s = self.result.e2e_s


class SocketCustomer:
    """A browser stand-in: loads the page for its session cookie, then one websocket and one conversation."""

    protocol = "socketio"

    def __init__(self, url: str, index: int, timeout: float, run_start: float, max_tokens: int | None = None) -> None:
        self.url, self.index, self.timeout, self.run_start = url, index, timeout, run_start
        self.extra = {} if max_tokens is None else {"max_new_tokens": max_tokens}
        self.http = requests.Session()
        self.events: queue.Queue = queue.Queue()
        self.sio: socketio.Client | None = None
        self.conversation_id: str | None = None
        self.aborted = False

    def _connect(self) -> None:
        self.http.get(self.url + "/", timeout=10)
        sio = InOrderClient(http_session=self.http, reconnection=False)
        for name in SOCKET_EVENTS:
            sio.on(name, lambda data, name=name: self.events.put((name, data if isinstance(data, dict) else {})))
        sio.on("disconnect", lambda *_: self.events.put(("disconnect", {})))
        sio.connect(self.url, transports=["websocket"], wait_timeout=10)
        self.sio = sio

    def ask(self, text: str, result: Result) -> Result:
        if self.sio is None:
            try:
                self._connect()
            except (requests.RequestException, socketio.exceptions.ConnectionError) as exc:
                return result.fail("connection", f"could not open a Socket.IO connection: {exc}", retryable=True)
        if self.aborted:
            return result.fail("aborted", "stopped before sending")
        payload = {"text": text, **self.extra}
        if self.conversation_id:
            payload["conversation_id"] = self.conversation_id
        clock = _Clock(result, self.run_start)
        try:
            self.sio.emit("chat_message", payload)
        except socketio.exceptions.SocketIOError as exc:
            return result.fail("connection", f"could not send: {exc}", retryable=True)
        return self._follow(result, clock)

    def _follow(self, result: Result, clock: _Clock) -> Result:
        while True:
            try:
                name, data = self.events.get(timeout=max(0.0, self.timeout - clock.elapsed()))
            except queue.Empty:
                self._give_up(result.request_id)
                return result.fail("timeout", f"no complete answer within {self.timeout:g}s", retryable=True)
            rid = data.get("request_id")
            if rid and result.request_id and rid != result.request_id:
                continue
            result.request_id = result.request_id or rid
            if name == "accepted":
                result.conversation_id = data.get("conversation_id")
            elif name == "token":
                clock.token()
            elif name == "done":
                clock.end()
                self.conversation_id = data.get("conversation_id") or result.conversation_id
                result.conversation_id = self.conversation_id
                result.prompt_tokens = data.get("prompt_tokens")
                result.completion_tokens = data.get("completion_tokens")
                result.finish_reason = data.get("finish_reason")
                return result
            elif name == "error":
                clock.end()
                code = str(data.get("code") or "error")
                return result.fail(code, str(data.get("message", "")), retryable=bool(data.get("retryable")),
                                   fatal=code in FATAL_CODES)
            else:
                return result.fail("aborted" if self.aborted else "connection", "the server closed the connection",
                                   retryable=True)

    def _give_up(self, request_id: str | None) -> None:
        """Stop the server's work on an answer nobody waits for, and drop this connection."""
        if request_id and self.sio is not None:
            try:
                self.sio.emit("cancel", {"request_id": request_id})
            except socketio.exceptions.SocketIOError:
                pass
        self.close()

    def abort(self) -> None:
        self.aborted = True
        self.close()

    def close(self) -> None:
        sio, self.sio = self.sio, None
        if sio is not None:
            self.events.put(("disconnect", {}))
            # websocket-client waits up to 3 s for the server's close frame; the customer need not.
            threading.Thread(target=_disconnect, args=(sio, self.http), daemon=True).start()
        else:
            self.http.close()


def _disconnect(sio: socketio.Client, http: requests.Session) -> None:
    try:
        sio.disconnect()
    finally:
        http.close()


class HttpCustomer:
    """A client of the OpenAI-compatible API: streams each answer and sends the whole history every turn."""

    protocol = "http"

    def __init__(self, url: str, index: int, timeout: float, run_start: float, body: dict,
                 api_key: str | None = None) -> None:
        self.endpoint = url + "/v1/chat/completions"
        self.index, self.timeout, self.run_start, self.body = index, timeout, run_start, body
        self.http = requests.Session()
        if api_key:
            self.http.headers["Authorization"] = f"Bearer {api_key}"
        self.messages: list[dict] = []
        self.aborted = False
        self._response: requests.Response | None = None
        self._lock = threading.Lock()

    def ask(self, text: str, result: Result) -> Result:
        messages = [*self.messages, {"role": "user", "content": text}]
        body = {**self.body, "messages": messages, "stream": True, "stream_options": {"include_usage": True}}
        clock = _Clock(result, self.run_start)
        parts: list[str] = []
        try:
            with self.http.post(self.endpoint, json=body, stream=True, timeout=(10, self.timeout)) as response:
                with self._lock:
                    self._response = response
                if response.status_code != 200:
                    return refused(result, response, self.endpoint)
                if self.aborted:
                    return result.fail("aborted", "stopped while sending")
                self._read(response, result, clock, parts)
        except requests.Timeout:
            return result.fail("timeout", f"no complete answer within {self.timeout:g}s", retryable=True)
        except (requests.RequestException, OSError) as exc:
            if self.aborted:
                return result.fail("aborted", "stopped mid-answer")
            return result.fail("connection", f"{type(exc).__name__}: {exc}", retryable=True)
        except ValueError as exc:
            return result.fail("bad_response", f"the event stream is not valid JSON: {exc}")
        finally:
            with self._lock:
                self._response = None
        if result.ok:
            self.messages = [*messages, {"role": "assistant", "content": "".join(parts)}]
        return result

    def _read(self, response: requests.Response, result: Result, clock: _Clock, parts: list[str]) -> None:
        usage = None
        for chunk in sse_events(response):
            if clock.elapsed() > self.timeout:
                raise requests.Timeout()
            if "error" in chunk:
                clock.end()
                error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                result.fail(str(error.get("code") or "stream_error"), str(error.get("message", "")), retryable=True)
                return
            result.request_id = result.request_id or str(chunk.get("id", "")).removeprefix("chatcmpl-") or None
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    clock.token()
                    parts.append(content)
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
        clock.end()
        if result.finish_reason is None:
            result.fail("incomplete", "the event stream ended without a finish_reason", retryable=True)
        elif usage:
            result.prompt_tokens, result.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        else:   # the server sent no usage: each content delta carries at least one token
            result.completion_tokens, result.tokens_exact = result.chunks, False

    def abort(self) -> None:
        self.aborted = True
        with self._lock:
            if self._response is not None:
                self._response.close()

    def close(self) -> None:
        self.http.close()


def sse_events(response: requests.Response) -> Iterator[dict]:
    """The JSON payloads of a server-sent event stream, read as bytes arrive (no fixed-size buffering)."""
    buffer = b""
    for data in response.iter_content(chunk_size=None):
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            yield json.loads(payload)


def refused(result: Result, response: requests.Response, endpoint: str) -> Result:
    status = response.status_code
    try:
        error = response.json().get("error") or {}
    except ValueError:
        error = {}
    code = error.get("code") if isinstance(error, dict) else None
    message = error.get("message") if isinstance(error, dict) else str(error)
    detail = f"{code}: {message}" if code else (message or response.text[:200] or response.reason)
    return result.fail(f"http_{status}", f"POST {endpoint} answered {status} ({detail})",
                       retryable=status >= 500 or status in NOT_FATAL_STATUSES,
                       fatal=400 <= status < 500 and status not in NOT_FATAL_STATUSES)


def hint(kind: str) -> str:
    """What to change when requests fail this way."""
    if kind == "http_404":
        return ("the API is not at that address: --url must be the web app's root (like http://127.0.0.1:5000), "
                "without /v1")
    if kind in ("http_401", "http_403"):
        return "the server wants credentials: pass --api-key"
    if kind == "invalid_value":
        return "the chat refused a parameter: change --max-tokens (at most the server's MAX_NEW_TOKENS)"
    if kind in ("http_400", "http_422"):
        return "the server refused the request parameters: change --max-tokens, --temperature or --model"
    if kind in ("http_429", "queue_full"):
        return "the server's queue is full: lower --rate or --customers, or raise the server's QUEUE_LIMIT"
    if kind == "timeout":
        return "answers took longer than --timeout: lower the load or raise --timeout"
    if kind == "connection":
        return "connections failed or dropped: check the server's logs and that --url is reachable"
    if kind == "aborted":
        return "requests still running when the run was stopped"
    if kind.startswith("http_4"):
        return "the server refused the request: check --url and the options"
    return ""
