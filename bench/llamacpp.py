"""llama.cpp's own server as a baseline: found, started on a GGUF, and sent a workload through /v1/chat/completions."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench.stats import percentile

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILT_SERVER = REPO_ROOT / ".llamacpp" / "bin" / "llama-server"
SERVER_ENV = "LLAMA_SERVER"
HOST = "127.0.0.1"
CHAT_PATH = "/v1/chat/completions"
HEALTH_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0
# Room per slot beyond our own count of the longest request: llama.cpp tokenizes the chat template itself.
CTX_MARGIN = 64
CTX_ROUND = 256
RSS_INTERVAL_S = 0.05


@dataclass
class ChatRequest:
    id: str
    messages: list[dict]
    max_tokens: int


@dataclass
class ChatResult:
    """One streamed answer: its text, llama.cpp's token count, and times since the shared start."""

    id: str
    text: str
    completion_tokens: int
    prompt_tokens: int
    finish_reason: str | None
    ttft_s: float | None
    e2e_s: float


@dataclass
class StreamReading:
    text: str = ""
    usage: dict | None = None
    finish_reason: str | None = None
    first_chunk_time: float | None = None


@dataclass
class BaselineRun:
    results: dict[str, ChatResult]
    wall_s: float
    peak_rss_mb: float
    command: list[str] = field(default_factory=list)
    version: str = ""
    pid: int | None = None


def find_server(env: dict | None = None, built: Path = BUILT_SERVER) -> Path:
    """The llama-server binary: $LLAMA_SERVER, the one `make llamacpp` builds, or one on PATH."""
    env = os.environ if env is None else env
    if env.get(SERVER_ENV):
        path = Path(env[SERVER_ENV])
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise SystemExit(f"{SERVER_ENV}={path}: not an executable file. Point it at a llama-server binary, "
                             "or unset it and run `make llamacpp`.")
        return path
    if built.is_file() and os.access(built, os.X_OK):
        return built
    on_path = shutil.which("llama-server", path=env.get("PATH"))
    if on_path:
        return Path(on_path)
    raise SystemExit(f"--baseline llamacpp: no llama-server binary (looked for ${SERVER_ENV}, {built} and "
                     "PATH). Run `make llamacpp` to build it (about 40 minutes on 2 busy cores), or set "
                     f"{SERVER_ENV} to a llama-server binary.")


def server_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    text = (out.stdout + out.stderr).strip()
    lines = [line for line in text.splitlines() if line.startswith("version")]
    return lines[0] if lines else text.splitlines()[-1] if text else ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def context_size(slots: int, longest_tokens: int) -> int:
    """-c for llama-server: it splits the context evenly among the slots, each one fitting the longest request."""
    per_slot = -(-(longest_tokens + CTX_MARGIN) // CTX_ROUND) * CTX_ROUND
    return slots * per_slot


def server_command(binary: Path, gguf: Path, port: int, slots: int, threads: int, ctx: int,
                   http_threads: int) -> list[str]:
    """Continuous batching over `slots` slots, `threads` threads for generation and prompts, on loopback."""
    return [str(binary), "-m", str(gguf), "--host", HOST, "--port", str(port),
            "-np", str(slots), "-c", str(ctx), "-t", str(threads), "-tb", str(threads), "-cb",
            "--jinja", "--no-webui", "--threads-http", str(http_threads)]


def chat_body(request: ChatRequest) -> dict:
    """Greedy (temperature 0), streamed so the first token's arrival is seen, with the token count at the end."""
    return {"messages": request.messages, "max_tokens": request.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}


def read_stream(lines: Iterable[bytes], clock=time.time) -> StreamReading:
    """Server-sent events of chat.completion.chunk: the text, the finish reason, usage, and when the first
    chunk with a choice came (llama.cpp sends it with the first generated token)."""
    reading = StreamReading()
    for raw in lines:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"llama-server streamed an error: {chunk['error']}")
        for choice in chunk.get("choices") or []:
            if reading.first_chunk_time is None:
                reading.first_chunk_time = clock()
            reading.text += (choice.get("delta") or {}).get("content") or ""
            if choice.get("finish_reason"):
                reading.finish_reason = choice["finish_reason"]
        if chunk.get("usage"):
            reading.usage = chunk["usage"]
    return reading


def stream_lines(response: http.client.HTTPResponse) -> Iterator[bytes]:
    while line := response.readline():
        yield line


class Client:
    """Streams chat completions from an OpenAI-compatible endpoint on one host and port."""

    def __init__(self, host: str, port: int, timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.host, self.port, self.timeout = host, port, timeout

    def connect(self) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        conn.connect()
        return conn

    def chat(self, conn: http.client.HTTPConnection, request: ChatRequest, start: float) -> ChatResult:
        conn.request("POST", CHAT_PATH, json.dumps(chat_body(request)), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"request {request.id}: {CHAT_PATH} answered {response.status}: "
                               f"{response.read()[:500].decode('utf-8', 'replace')}")
        reading = read_stream(stream_lines(response))
        end = time.time()
        if reading.usage is None:
            raise RuntimeError(f"request {request.id}: the stream ended without usage")
        ttft = reading.first_chunk_time - start if reading.first_chunk_time is not None else None
        return ChatResult(request.id, reading.text, int(reading.usage["completion_tokens"]),
                          int(reading.usage.get("prompt_tokens", -1)), reading.finish_reason, ttft, end - start)

    def chat_all(self, requests: Sequence[ChatRequest]) -> tuple[dict[str, ChatResult], float]:
        """Every request sent at once (a thread and connection each, opened beforehand); results and wall time."""
        conns = [self.connect() for _ in requests]
        go = threading.Event()
        clock = {"start": 0.0}
        results: dict[str, ChatResult] = {}
        errors: list[BaseException] = []

        def send(conn: http.client.HTTPConnection, request: ChatRequest) -> None:
            go.wait()
            try:
                results[request.id] = self.chat(conn, request, clock["start"])
            except BaseException as exc:  # reported after every thread is joined
                errors.append(exc)
            finally:
                conn.close()

        threads = [threading.Thread(target=send, args=pair, daemon=True) for pair in zip(conns, requests)]
        for thread in threads:
            thread.start()
        clock["start"] = time.time()
        go.set()
        for thread in threads:
            thread.join()
        wall = time.time() - clock["start"]
        if errors:
            raise RuntimeError(f"{len(errors)} of {len(requests)} llama.cpp requests failed; first: {errors[0]}")
        return results, wall


class ServerCrashed(RuntimeError):
    """llama-server exited before it answered /health."""

    def __init__(self, returncode: int, message: str) -> None:
        super().__init__(message)
        self.returncode = returncode


def wait_healthy(port: int, process: subprocess.Popen, log_path: Path, timeout: float = HEALTH_TIMEOUT_S) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise ServerCrashed(process.returncode, f"llama-server exited with {process.returncode} before it "
                                f"was ready:\n{tail(log_path)}")
        try:
            conn = http.client.HTTPConnection(HOST, port, timeout=2)
            conn.request("GET", "/health")
            status = conn.getresponse().status
            conn.close()
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"llama-server was not healthy after {timeout:.0f} s:\n{tail(log_path)}")


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop(process: subprocess.Popen) -> None:
    """Stop the server by its PID: SIGTERM, then SIGKILL if it does not exit."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def running_server(command: list[str], port: int) -> Iterator[tuple[subprocess.Popen, Path]]:
    """llama-server started and healthy; stopped when the block ends, also on error. Its log goes to a temp file."""
    with tempfile.TemporaryDirectory(prefix="llamacpp-") as tmp:
        log_path = Path(tmp) / "server.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            try:
                wait_healthy(port, process, log_path)
                yield process, log_path
            finally:
                stop(process)


@contextmanager
def peak_rss_of(pid: int) -> Iterator[list[float]]:
    """Sample another process's RSS in a thread; the yielded list holds the peak in MB afterwards."""
    process = psutil.Process(pid)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while True:
            try:
                peak[0] = max(peak[0], process.memory_info().rss)
            except psutil.Error:
                return
            if done.wait(RSS_INTERVAL_S):
                return

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    result = [0.0]
    try:
        yield result
    finally:
        done.set()
        thread.join()
        result[0] = peak[0] / 2**20


def warm_request() -> ChatRequest:
    """A short request of its own text, so no workload prompt is cached in a slot before the timed run."""
    return ChatRequest("warmup", [{"role": "user", "content": "Hello"}], 2)


def run_baseline(binary: Path, gguf: Path, requests: Sequence[ChatRequest], slots: int, threads: int,
                 longest_tokens: int) -> BaselineRun:
    """Start llama-server on the GGUF, warm it with one short request, then time the workload sent at once."""
    port = free_port()
    ctx = context_size(slots, longest_tokens)
    command = server_command(binary, gguf, port, slots, threads, ctx, http_threads=len(requests) + 4)
    version = server_version(binary)
    client = Client(HOST, port)
    try:
        return timed_run(client, command, port, requests, version)
    except ServerCrashed as crash:
        if crash.returncode != -signal.SIGILL:
            raise
    # Some VMs list AMX in /proc/cpuinfo and grant the tile permission, yet fault on the first tile instruction;
    # a -march=native build then dies in ggml's AMX kernels. Repacking is the only way weights reach them (Q4_1
    # has no other repacked form), so without it the server runs its AVX-512 kernels.
    print("llamacpp: llama-server died of SIGILL before it was ready (AMX listed but not usable here); "
          "running it again with --no-repack", file=sys.stderr, flush=True)
    return timed_run(client, [*command, "--no-repack"], port, requests, version)


def timed_run(client: Client, command: list[str], port: int, requests: Sequence[ChatRequest],
              version: str) -> BaselineRun:
    with running_server(command, port) as (process, _log), peak_rss_of(process.pid) as peak:
        conn = client.connect()
        try:
            client.chat(conn, warm_request(), time.time())
        finally:
            conn.close()
        results, wall = client.chat_all(requests)
    return BaselineRun(results, wall, peak[0], command, version, process.pid)


def chat_requests(workload: dict, limit: int | None) -> list[ChatRequest]:
    """The workload's requests as chat messages, as bench.engine.load_workload builds them."""
    items = workload["requests"][:limit] if limit else workload["requests"]
    return [ChatRequest(str(item["id"]),
                        [{"role": "system", "content": workload["system_prompt"]},
                         {"role": "user", "content": item["question"]}],
                        int(item["max_new_tokens"]))
            for item in items]


def summarize(run: BaselineRun, reference_texts: dict[str, str] | None) -> dict:
    """The bench's metrics for the baseline; tokens are llama.cpp's own completion counts (EOS included, as the
    bench counts the engine's). `text_matches`: answers whose text equals the reference answer's."""

    results = list(run.results.values())
    tokens = sum(r.completion_tokens for r in results)
    e2e = [r.e2e_s for r in results]
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    has_ttft = len(ttft) == len(results)
    matches = None
    if reference_texts is not None:
        matches = sum(1 for r in results if r.text.strip() == reference_texts.get(r.id, "").strip())
    return {
        "tokens_per_s": tokens / run.wall_s if run.wall_s > 0 else 0.0,
        "wall_s": run.wall_s,
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p95_s": percentile(e2e, 95),
        "ttft_p50_s": percentile(ttft, 50) if has_ttft else None,
        "ttft_p95_s": percentile(ttft, 95) if has_ttft else None,
        **p90s(e2e, [r.ttft_s for r in results]),
        "peak_rss_mb": run.peak_rss_mb,
        "peak_device_mb": None,
        "greedy_matches": None,
        "text_matches": matches,
        "completion_tokens": tokens,
        "requests": len(results),
    }


def p90s(e2e: Sequence[float], ttft: Sequence[float | None]) -> dict:
    """The 90th percentiles the baseline comparison adds; TTFT only when every request has one."""

    return {"e2e_p90_s": percentile(e2e, 90),
            "ttft_p90_s": None if None in ttft else percentile(list(ttft), 90)}


def baseline_gguf(model: str | None) -> Path:
    """The GGUF both the engine and llama.cpp run: --model when it is a .gguf file, else the default model's."""
    from worker.model_loader import default_gguf

    if not model:
        return default_gguf()
    if model.endswith(".gguf") and Path(model).expanduser().is_file():
        return Path(model).expanduser()
    raise SystemExit(f"--baseline llamacpp runs llama.cpp on a .gguf file; --model {model!r} is not one. "
                     "Give --model PATH.gguf, or leave --model out for the default GGUF.")


def comparison_lines(methods: dict[str, dict], ours: Sequence[str] = ("engine", "engine_best")) -> list[str]:
    """Latency ratios against llama.cpp (below 1: ours is quicker), beside the tokens/s ratio in ratio_lines."""
    base = methods.get("llamacpp")
    lines = []
    for name in ours:
        if base is None or name not in methods:
            continue
        parts = []
        for key in ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "e2e_p90_s"):
            if methods[name].get(key) is not None and base.get(key):
                parts.append(f"{key.removesuffix('_s').replace('_', ' ')} {methods[name][key] / base[key]:.2f}x")
        if parts:
            lines.append(f"{name} / llamacpp latency: " + ", ".join(parts))
    return lines
