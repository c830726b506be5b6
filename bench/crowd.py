"""Many customers from one process, for `bench.stack`: each a greenlet on its own connection.

Socket.IO customers load the chat page (for the session cookie, as a browser does), then speak Engine.IO
and Socket.IO over a websocket directly: open, connect to the default namespace, answer pings, emit
`chat_message` and read `accepted`, `token`, `done` and `error`. HTTP customers send streaming
`POST /v1/chat/completions`. A thin client keeps the benchmark's own CPU small beside the server's on a
shared machine. Run by bench.stack as a process of its own (gevent patches the standard library first):

    python -m bench.crowd --url URL --customers N --mode burst|idle|stream [--protocol socketio|http]

It connects everyone, prints `connected N`, waits for a line on stdin, then acts (all at once) and prints
one JSON line of results.
"""

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import gevent  # noqa: E402
import requests  # noqa: E402
import websocket  # noqa: E402
from gevent.pool import Pool  # noqa: E402

QUESTION = "Where is my parcel? It was due on Monday."


class Customer:
    """One chat customer on a raw Engine.IO websocket."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.ws: websocket.WebSocket | None = None
        self.refused: str | None = None
        self.sent_at = self.accepted_at = self.first_at = self.ended_at = None
        self.error: dict | None = None
        self.chars = 0
        self.marks: list[tuple[float, int]] = []   # (time, characters received so far), for rates
        self.request_id = None

    def connect(self) -> None:
        try:
            http = requests.Session()
            http.get(self.base + "/", timeout=120).raise_for_status()
            cookie = "; ".join(f"{k}={v}" for k, v in http.cookies.items())
            url = self.base.replace("http", "ws", 1) + "/socket.io/?EIO=4&transport=websocket"
            self.ws = websocket.create_connection(url, header=[f"Cookie: {cookie}"], timeout=600)
            opened = self.ws.recv()
            assert opened.startswith("0"), opened
            self.ws.send("40")
            reply = self.ws.recv()
            if not reply.startswith("40"):
                self.refused = reply[:200]
                self.ws.close()
                self.ws = None
                return
        except Exception as exc:   # reported, not raised: a refused connection is a result
            self.refused = f"{type(exc).__name__}: {exc}"[:200]
            self.ws = None
            return
        gevent.spawn(self._read)

    def _read(self) -> None:
        ws = self.ws
        while True:
            try:
                message = ws.recv()
            except Exception:
                return
            if message == "2":
                ws.send("3")
            elif message.startswith("42"):
                name, data = json.loads(message[2:])
                self._on(name, data)
            elif message.startswith("41") or message == "1":
                return

    def _on(self, name: str, data: dict) -> None:
        now = time.time()
        if name == "accepted":
            self.accepted_at, self.request_id = now, data["request_id"]
        elif name == "token":
            self.first_at = self.first_at or now
            self.chars += len(data["text"])
            self.marks.append((now, self.chars))
        elif name == "done":
            self.ended_at = now
        elif name == "error":
            self.ended_at, self.error = now, data

    def ask(self, text: str, max_new_tokens: int) -> None:
        self.sent_at = time.time()
        self.ws.send("42" + json.dumps(["chat_message", {"text": text, "max_new_tokens": max_new_tokens}]))

    def result(self) -> dict:
        return {"refused": self.refused, "sent_at": self.sent_at, "accepted_at": self.accepted_at,
                "first_at": self.first_at, "ended_at": self.ended_at, "error": self.error, "chars": self.chars,
                "request_id": self.request_id}


class HttpCustomer:
    """One streaming OpenAI-style request."""

    def __init__(self, base: str) -> None:
        self.base, self.refused, self.error = base, None, None
        self.sent_at = self.accepted_at = self.first_at = self.ended_at = None
        self.chars, self.marks, self.request_id = 0, [], None
        self.http = requests.Session()

    def connect(self) -> None:
        self.http.get(self.base + "/healthz", timeout=120)   # a kept-alive connection, like a client's pool

    def ask(self, text: str, max_new_tokens: int) -> None:
        gevent.spawn(self._post, text, max_new_tokens)

    def _post(self, text: str, max_new_tokens: int) -> None:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_new_tokens, "stream": True}
        self.sent_at = time.time()
        try:
            with self.http.post(self.base + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
                if r.status_code != 200:
                    error = r.json().get("error", {})
                    self.error = {"code": error.get("code") or f"http_{r.status_code}"}
                    return
                self.accepted_at = time.time()
                for line in r.iter_lines():
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error = {"code": chunk["error"].get("code")}
                        return
                    self.request_id = chunk["id"].removeprefix("chatcmpl-")
                    text = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                    if text:
                        now = time.time()
                        self.first_at = self.first_at or now
                        self.chars += len(text)
                        self.marks.append((now, self.chars))
        except Exception as exc:
            self.error = {"code": "connection", "message": f"{type(exc).__name__}: {exc}"[:200]}
        finally:
            self.ended_at = time.time()

    result = Customer.result


class HealthProbe:
    """GET /healthz every `interval` seconds: how long the web process takes to answer while under load."""

    def __init__(self, base: str, interval: float = 0.25) -> None:
        self.base, self.interval, self.latencies, self.failures = base, interval, [], 0
        self.http = requests.Session()
        self.greenlet = gevent.spawn(self._run)

    def _run(self) -> None:
        while True:
            start = time.perf_counter()
            try:
                self.http.get(self.base + "/healthz", timeout=10).raise_for_status()
                self.latencies.append(time.perf_counter() - start)
            except Exception:
                self.failures += 1
            gevent.sleep(self.interval)

    def stop(self) -> dict:
        self.greenlet.kill()
        lat = sorted(self.latencies)
        return {"probes": len(lat), "failures": self.failures, "max_s": lat[-1] if lat else None,
                "p99_s": lat[int(0.99 * (len(lat) - 1))] if lat else None, "over_1s": sum(x > 1 for x in lat)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.crowd", description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--customers", type=int, required=True)
    parser.add_argument("--mode", choices=("burst", "idle", "stream"), default="burst")
    parser.add_argument("--protocol", choices=("socketio", "http"), default="socketio")
    parser.add_argument("--askers", type=int, default=None, help="stream mode: how many of the customers ask")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--duration", type=float, default=20.0, help="stream: seconds measured; idle: seconds held")
    parser.add_argument("--warmup", type=float, default=5.0, help="stream: seconds before measuring")
    parser.add_argument("--timeout", type=float, default=600.0, help="burst: seconds to wait for every answer")
    parser.add_argument("--connect-concurrency", type=int, default=200)
    args = parser.parse_args(argv)

    kind = HttpCustomer if args.protocol == "http" else Customer
    customers = [kind(args.url) for _ in range(args.customers)]
    started = time.time()
    Pool(args.connect_concurrency).map(lambda c: c.connect(), customers)
    connected = [c for c in customers if c.refused is None]
    print(f"connected {len(connected)} in {time.time() - started:.1f} s", flush=True)
    sys.stdin.readline()   # the go signal: every client process acts at the same moment

    probe = HealthProbe(args.url)
    go = time.time()
    askers = connected if args.mode == "burst" else connected[:args.askers or 0]
    for c in askers:
        c.ask(QUESTION, args.max_new_tokens)
    out = {"customers": args.customers, "connected": len(connected), "asked": len(askers), "go": go,
           "refused_connections": [c.refused for c in customers if c.refused][:5],
           "refused_connection_count": sum(1 for c in customers if c.refused)}
    if args.mode == "burst":
        deadline = go + args.timeout
        while time.time() < deadline and any(c.ended_at is None for c in askers):
            gevent.sleep(0.1)
        out["results"] = [c.result() for c in askers]
    elif args.mode == "stream":
        gevent.sleep(args.warmup)
        begin = time.time()
        at_begin = sum(c.chars for c in askers)
        gevent.sleep(args.duration)
        end = time.time()
        out["window_s"] = end - begin
        out["chars"] = sum(c.chars for c in askers) - at_begin
        out["streaming_at_end"] = sum(1 for c in askers if c.first_at and c.ended_at is None)
        out["errors"] = [c.error for c in askers if c.error][:5]
    else:
        gevent.sleep(args.duration)
        out["still_open"] = sum(1 for c in connected if c.ws is not None and c.ws.connected)
    out["health"] = probe.stop()
    print(json.dumps(out), flush=True)
    for c in connected:
        ws = getattr(c, "ws", None)
        if ws is not None:
            try:
                ws.close(timeout=0.5)
            except Exception:
                pass


if __name__ == "__main__":
    main()
