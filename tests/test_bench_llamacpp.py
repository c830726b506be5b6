"""`python -m bench --baseline llamacpp`: its arguments, the missing-binary error, and its client against a real
HTTP server speaking llama.cpp's stream; llama-server itself when `make llamacpp` has built it."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest

from bench import engine as bench
from bench import llamacpp

WORKLOAD = bench.REPO_ROOT / "bench" / "data" / "workload.json"


# ---------------------------------------------------------------- arguments and the binary


def test_baseline_flag_parses_and_refuses_what_llamacpp_cannot_run(capsys):
    assert bench.parse_args(["--baseline", "llamacpp"]).baseline == "llamacpp"
    assert bench.parse_args([]).baseline is None
    for extra in (["--workload", "nano"], ["--random-weights", "smollm2-135m"], ["--sweep-slots", "1,2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--baseline", "llamacpp", *extra])
        assert "--baseline llamacpp runs a chat workload file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--baseline", "vllm"])
    assert "invalid choice" in capsys.readouterr().err


def test_missing_binary_says_to_run_make_llamacpp(tmp_path):
    with pytest.raises(SystemExit, match=r"Run `make llamacpp`"):
        llamacpp.find_server({"PATH": str(tmp_path)}, built=tmp_path / "llama-server")
    with pytest.raises(SystemExit, match=r"LLAMA_SERVER=.*not an executable file.*make llamacpp"):
        llamacpp.find_server({llamacpp.SERVER_ENV: str(tmp_path / "nowhere")}, built=tmp_path / "llama-server")
    on_path = tmp_path / "llama-server"
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    assert llamacpp.find_server({"PATH": str(tmp_path)}, built=tmp_path / "absent") == on_path


def test_bench_fails_before_loading_the_model_without_the_binary(monkeypatch, tmp_path):
    monkeypatch.setenv(llamacpp.SERVER_ENV, str(tmp_path / "llama-server"))
    with pytest.raises(SystemExit, match="make llamacpp"):
        bench.main(["--baseline", "llamacpp", "--model", str(tmp_path / "not-loaded"), "--limit", "1"])


def test_non_gguf_model_is_refused():
    with pytest.raises(SystemExit, match=r"\.gguf"):
        llamacpp.baseline_gguf("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_server_command_and_context_fit_every_slot():
    ctx = llamacpp.context_size(16, 400)
    assert ctx % 16 == 0 and ctx // 16 >= 400 + llamacpp.CTX_MARGIN
    command = llamacpp.server_command(Path("/bin/llama-server"), Path("m.gguf"), 8081, 16, 2, ctx, 28)
    flags = dict(zip(command[1::2], command[2::2]))
    assert flags["-np"] == "16" and flags["-c"] == str(ctx) and flags["-t"] == flags["-tb"] == "2"
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "8081" and "-cb" in command


def test_chat_requests_follow_the_bench_workload():
    workload = json.loads(WORKLOAD.read_text())
    requests = llamacpp.chat_requests(workload, 3)
    assert [r.id for r in requests] == [str(item["id"]) for item in workload["requests"][:3]]
    assert requests[0].messages == [{"role": "system", "content": workload["system_prompt"]},
                                    {"role": "user", "content": workload["requests"][0]["question"]}]
    assert requests[0].max_tokens == workload["requests"][0]["max_new_tokens"]


# ---------------------------------------------------------------- the client against a real HTTP server


class ChatStreamHandler(BaseHTTPRequestHandler):
    """Answers /v1/chat/completions as llama-server streams it: a role chunk with the first token, content
    chunks, a finish chunk, a usage chunk, [DONE]. The answer is the user's message reversed, one chunk per
    word; a max_tokens of 0 gets a 400 with llama.cpp's error shape."""

    bodies: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        if body["max_tokens"] == 0:
            payload = json.dumps({"error": {"code": 400, "message": "max_tokens must be positive"}}).encode()
            self.send_response(400)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        words = body["messages"][-1]["content"][::-1].split(" ")[:body["max_tokens"]]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        deltas = [{"role": "assistant", "content": None}] + [
            {"content": word if i == 0 else " " + word} for i, word in enumerate(words)]
        events = [{"choices": [{"index": 0, "finish_reason": None, "delta": d}]} for d in deltas]
        events.append({"choices": [{"index": 0, "finish_reason": "length", "delta": {}}]})
        events.append({"choices": [], "usage": {"completion_tokens": len(words), "prompt_tokens": 5}})
        for event in events:
            self.send_chunk(f"data: {json.dumps(event)}\n\n".encode())
        self.send_chunk(b"data: [DONE]\n\n")
        self.send_chunk(b"")

    def send_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


@pytest.fixture()
def chat_server():
    ChatStreamHandler.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), ChatStreamHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_client_sends_every_request_greedy_and_streamed_and_reads_the_answers(chat_server):
    requests = [llamacpp.ChatRequest(str(i), [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": f"one two three {i}"}], 3)
                for i in range(5)]
    client = llamacpp.Client("127.0.0.1", chat_server.server_address[1])
    results, wall = client.chat_all(requests)

    assert sorted(results) == [r.id for r in requests]
    assert len(ChatStreamHandler.bodies) == 5
    for body in ChatStreamHandler.bodies:
        assert body["temperature"] == 0 and body["max_tokens"] == 3
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["messages"][0] == {"role": "system", "content": "be brief"}
    for i, request in enumerate(requests):
        result = results[request.id]
        assert result.text == f"{i} eerht owt"
        assert result.completion_tokens == 3 and result.prompt_tokens == 5 and result.finish_reason == "length"
        assert 0 <= result.ttft_s <= result.e2e_s <= wall

    metrics = llamacpp.summarize(llamacpp.BaselineRun(results, wall, 0.0), {"0": "0 eerht owt", "1": "other"})
    assert metrics["requests"] == 5 and metrics["completion_tokens"] == 15
    assert metrics["tokens_per_s"] == pytest.approx(15 / wall)
    assert metrics["text_matches"] == 1
    assert metrics["ttft_p50_s"] <= metrics["ttft_p90_s"] <= metrics["ttft_p95_s"]
    assert metrics["e2e_p50_s"] <= metrics["e2e_p90_s"] <= metrics["e2e_p95_s"] <= wall


def test_client_reports_a_refused_request(chat_server):
    client = llamacpp.Client("127.0.0.1", chat_server.server_address[1])
    bad = llamacpp.ChatRequest("bad", [{"role": "user", "content": "hi"}], 0)
    good = llamacpp.ChatRequest("good", [{"role": "user", "content": "hi"}], 2)
    with pytest.raises(RuntimeError, match=r"1 of 2 llama.cpp requests failed.*request bad.*answered 400"):
        client.chat_all([good, bad])


def test_stream_error_event_is_raised():
    lines = [b'data: {"error": {"code": 500, "message": "slot failed"}}\n']
    with pytest.raises(RuntimeError, match="slot failed"):
        llamacpp.read_stream(lines)


def test_latency_ratios_read_below_one_when_ours_is_quicker():
    methods = {"engine": {"ttft_p50_s": 1.0, "ttft_p90_s": 2.0, "e2e_p50_s": 3.0, "e2e_p90_s": 4.0},
               "llamacpp": {"ttft_p50_s": 2.0, "ttft_p90_s": 2.0, "e2e_p50_s": 6.0, "e2e_p90_s": 2.0}}
    assert llamacpp.comparison_lines(methods) == [
        "engine / llamacpp latency: ttft p50 0.50x, ttft p90 1.00x, e2e p50 0.50x, e2e p90 2.00x"]


# ---------------------------------------------------------------- llama-server itself, when built


def built_server() -> Path | None:
    try:
        return llamacpp.find_server()
    except SystemExit:
        return None


@pytest.mark.skipif(built_server() is None, reason="llama-server is not built (`make llamacpp`)")
def test_llama_server_answers_two_requests_on_the_default_gguf():
    requests = [llamacpp.ChatRequest(str(i), [{"role": "user", "content": question}], 8)
                for i, question in enumerate(("What is 2 + 2?", "Name a colour."))]
    run = llamacpp.run_baseline(built_server(), llamacpp.baseline_gguf(None), requests, slots=2, threads=2,
                                longest_tokens=64)

    assert sorted(run.results) == ["0", "1"]
    for result in run.results.values():
        assert 1 <= result.completion_tokens <= 8
        assert result.text.strip()
        assert 0 < result.ttft_s <= result.e2e_s <= run.wall_s
    assert run.version.startswith("version") and run.peak_rss_mb > 0
    assert not psutil.pid_exists(run.pid) or psutil.Process(run.pid).status() == psutil.STATUS_ZOMBIE


STAND_IN = '''#!{python}
"""A stand-in llama-server: dies of SIGILL unless --no-repack is given (as a -march=native build does on a VM
that lists AMX it cannot run), and otherwise answers as ChatStreamHandler does."""
import importlib.util, os, signal, sys
from http.server import ThreadingHTTPServer
if "--version" in sys.argv:
    print("version: 0 (stand-in)")
    sys.exit(0)
with open({log!r}, "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
if "--no-repack" not in sys.argv:
    os.kill(os.getpid(), signal.SIGILL)
sys.path.insert(0, {root!r})
spec = importlib.util.spec_from_file_location("llamacpp_tests", {tests!r})
tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tests)
port = int(sys.argv[sys.argv.index("--port") + 1])
ThreadingHTTPServer(("127.0.0.1", port), tests.ChatStreamHandler).serve_forever()
'''


def test_a_server_that_dies_of_sigill_runs_again_without_repacking(tmp_path):
    import sys

    log = tmp_path / "starts.log"
    binary = tmp_path / "llama-server"
    binary.write_text(STAND_IN.format(python=sys.executable, log=str(log), tests=__file__,
                                      root=str(bench.REPO_ROOT)))
    binary.chmod(0o755)
    requests = [llamacpp.ChatRequest("a", [{"role": "user", "content": "one two"}], 2)]
    run = llamacpp.run_baseline(binary, tmp_path / "model.gguf", requests, slots=2, threads=1, longest_tokens=64)
    starts = log.read_text().splitlines()
    assert len(starts) == 2 and "--no-repack" not in starts[0] and starts[1].endswith("--no-repack")
    assert run.command[-1] == "--no-repack" and run.results["a"].text == "owt eno"
