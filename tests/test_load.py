"""The load generator: its report maths, its rate search, and short real runs checked against the SQL records."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import pytest

from models import Message, RequestRecord
from tests.load.__main__ import main
from tests.load.clients import Result
from tests.load.report import percentiles, summarize, write_results_csv
from tests.load.runner import LoadConfig, execute
from tests.load.sweep import Criterion, Step, highest_sustained, search
from tests.stack import ROOT
from worker.local_redis import free_port

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# SQLite keeps microseconds; client and server clocks are the same machine's.
CLOCK_SLACK_S = 1e-3


def synthetic(n: int = 100) -> list[Result]:
    results = [Result("socketio", i, "script", 0, request_id=f"r{i}", ttft_s=(i + 1) / 100, e2e_s=(i + 1) / 100 + 1.0,
                      completion_tokens=10) for i in range(n)]
    results.append(Result("socketio", n, "script", 0).fail("queue_full", "busy", retryable=True))
    results.append(Result("http", n + 1, "script", 0).fail("http_429", "busy", retryable=True))
    results.append(Result("http", n + 2, "script", 0).fail("http_429", "busy", retryable=True))
    return results


def test_percentiles_interpolate_between_ranks():
    assert percentiles([0.01 * i for i in range(1, 101)]) == pytest.approx({"p50": 0.505, "p90": 0.901, "p99": 0.9901})
    assert percentiles([3.0]) == {"p50": 3.0, "p90": 3.0, "p99": 3.0}
    assert percentiles([None, 1.0, None, 2.0], points=(50,)) == {"p50": 1.5}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


def test_summary_counts_tokens_errors_and_latency_of_completed_requests_only(tmp_path):
    s = summarize(synthetic(), duration_s=10.0, offered_rate=2.0)
    assert (s.sent, s.completed) == (103, 100)
    assert s.errors == {"http_429": 2, "queue_full": 1}
    assert list(s.errors) == ["http_429", "queue_full"], "most frequent first"
    assert "QUEUE_LIMIT" in s.hints["queue_full"] and "--rate" in s.hints["http_429"]
    assert s.completion_tokens == 1000 and s.tokens_per_s == pytest.approx(100.0)
    assert s.request_rate == pytest.approx(10.0) and s.error_rate == pytest.approx(3 / 103)
    assert s.ttft_s["p50"] == pytest.approx(0.505) and s.e2e_s["p99"] == pytest.approx(1.9901)
    assert s.tpot_s["p50"] == pytest.approx(1.0 / 9)   # one second for the nine tokens after the first
    write_results_csv(tmp_path / "r.csv", synthetic())
    rows = (tmp_path / "r.csv").read_text().splitlines()
    assert len(rows) == 104 and rows[0].startswith("protocol,customer,script,turn")


def test_the_sweep_criterion_needs_the_bound_and_no_errors():
    fine = summarize(synthetic(10)[:10], 1.0)   # TTFT p99 0.0991 s, no errors
    assert Criterion(0.1).holds(fine) and not Criterion(0.05).holds(fine)
    assert not Criterion(10.0).holds(summarize(synthetic(10), 1.0)), "errors break the criterion"
    assert Criterion(10.0, max_error_rate=0.5).holds(summarize(synthetic(10), 1.0))
    assert not Criterion(10.0).holds(summarize([], 1.0))


def fake_measure(limit: float, tried: list[float]):
    def measure(rate: float) -> Step:
        tried.append(rate)
        return Step(rate, summarize([], 1.0, rate), sustained=rate <= limit)
    return measure


def test_the_rate_search_doubles_then_bisects():
    tried: list[float] = []
    steps = search(fake_measure(3.2, tried), start=0.5, bisect=2)
    assert tried == [0.5, 1.0, 2.0, 4.0, 3.0, 3.5]
    assert highest_sustained(steps) == 3.0


def test_the_rate_search_halves_when_the_start_rate_fails_and_uses_given_rates_as_they_are():
    tried: list[float] = []
    assert highest_sustained(search(fake_measure(0.2, tried), start=1.0, bisect=1)) == 0.1875
    assert tried == [1.0, 0.5, 0.25, 0.125, 0.1875]
    tried.clear()
    steps = search(fake_measure(2.0, tried), rates=[4.0, 1.0, 2.0, 8.0])
    assert tried == [4.0, 1.0, 2.0, 8.0] and highest_sustained(steps) == 2.0


def test_a_pass_above_a_failure_does_not_count():
    steps = [Step(r, summarize([], 1.0, r), ok) for r, ok in ((1, True), (2, False), (4, True))]
    assert highest_sustained(steps) == 1


def load_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.load", *args]


def check_against_sql(db, results: list[dict], source: str) -> None:
    """Every reported request is a finished SQL record whose counts and server-side times agree."""
    with db() as s:
        for r in results:
            record = s.get(RequestRecord, r["request_id"])
            assert record is not None, r
            assert record.source == source and record.finish_reason == r["finish_reason"]
            if r["tokens_exact"]:
                assert record.completion_tokens == r["completion_tokens"]
                assert record.prompt_tokens == r["prompt_tokens"]
            else:   # a streamed HTTP answer without usage: one delta holds one or more tokens
                assert 0 < r["completion_tokens"] <= record.completion_tokens
            # The client's clock starts before the server's enqueue and stops after its first token / finish. A
            # grounded answer's lookups (tool rows) can open it with facts the worker writes before the model's first
            # token, which is what the record times.
            answer = s.query(Message).filter_by(request_id=r["request_id"]).first()   # none for the API's
            before = answer and s.query(Message).filter(Message.conversation_id == answer.conversation_id,
                                                         Message.id < answer.id).order_by(Message.id.desc()).first()
            if before is None or before.role != "tool":
                assert r["ttft_s"] >= record.ttft - CLOCK_SLACK_S
            assert r["e2e_s"] >= record.e2e - CLOCK_SLACK_S
            assert r["offset_s"] >= 0 and r["sent_at"] <= epoch(record.enqueued_at) + CLOCK_SLACK_S


def epoch(when: datetime) -> float:
    """Stored timestamps are UTC; SQLite gives them back without a zone."""
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def by_customer(results: list[dict]) -> dict[int, list[dict]]:
    groups: dict[int, list[dict]] = defaultdict(list)
    for r in sorted(results, key=lambda r: (r["customer"], r["turn"])):
        groups[r["customer"]].append(r)
    return groups


def test_cli_closed_loop_over_socketio_matches_the_sql_records(stack, db, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(load_cli("--url", stack.web_urls[0], "--protocol", "socketio", "--customers", "3",
                                   "--requests", "6", "--seed", "1", "--out", str(out)),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "TTFT" in proc.stdout and "errors by kind: none" in proc.stdout
    assert "6/6" in proc.stderr, "the progress bar reaches the total"
    report = json.loads((out / "report.json").read_text())
    results = report["results"]
    assert report["summary"]["completed"] == len(results) == 6 and report["summary"]["errors"] == {}
    assert len({r["request_id"] for r in results}) == 6
    assert report["summary"]["completion_tokens"] == sum(r["completion_tokens"] for r in results)
    check_against_sql(db, results, "chat")
    groups = by_customer(results)
    assert len(groups) < 6, "with seed 1 every first script has follow-ups, so some customer sent a second turn"
    with db() as s:
        for turns in groups.values():
            assert [r["turn"] for r in turns] == list(range(len(turns)))
            assert len({r["conversation_id"] for r in turns}) == 1, "follow-ups stay in the conversation"
            roles = [m.role for m in s.query(Message)
                     .filter_by(conversation_id=turns[0]["conversation_id"]).order_by(Message.id)]
            # a question and its answer a turn (a grounded answer's lookups sit between them as tool rows)
            assert [r for r in roles if r in ("user", "assistant")] == ["user", "assistant"] * len(turns), roles
    assert (out / "latency.png").read_bytes().startswith(PNG_MAGIC)
    assert len((out / "results.csv").read_text().splitlines()) == 7


def test_open_loop_over_http_matches_the_sql_records(stack, db):
    run = execute(LoadConfig(url=stack.web_urls[1], protocol="http", rate=4.0, requests=4, progress=False))
    assert [r.error for r in run.results] == [None] * 4 and not run.interrupted
    results = [vars(r) for r in run.results]
    check_against_sql(db, results, "api")
    with db() as s:
        for turns in by_customer(results).values():
            for earlier, later in zip(turns, turns[1:]):
                # A follow-up carries the earlier question and answer as history.
                before, after = s.get(RequestRecord, earlier["request_id"]), s.get(RequestRecord, later["request_id"])
                assert after.prompt_tokens > before.prompt_tokens + before.completion_tokens


def test_a_short_sweep_writes_the_plot_and_names_the_sustained_rate(stack, tmp_path, capsys):
    out = tmp_path / "sweep"
    code = main(["--url", stack.web_urls[0], "--sweep", "--rates", "2,4", "--requests", "3", "--ttft-p99", "60",
                 "--protocol", "mixed", "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "highest sustained rate: 4 req/s" in printed
    report = json.loads((out / "report.json").read_text())
    assert [s["rate"] for s in report["steps"]] == [2.0, 4.0] and report["sustained_rate"] == 4.0
    assert report["sustained_rate_is_lower_bound"] and "raise --max-rate" in printed
    assert all(s["summary"]["completed"] == 3 for s in report["steps"])
    assert sorted({r["rate"] for r in report["results"]}) == [2.0, 4.0]
    assert {r["protocol"] for r in report["results"]} <= {"socketio", "http"}
    assert (out / "sweep.png").read_bytes().startswith(PNG_MAGIC)
    assert len((out / "sweep.csv").read_text().splitlines()) == 3


def test_a_sweep_interrupted_between_steps_reports_the_steps_it_finished(stack, tmp_path, capsys, monkeypatch):
    import tests.load.__main__ as cli

    real_execute, calls = cli.execute, []

    def ctrl_c_on_the_second_step(cfg, label=""):
        calls.append(label)
        if len(calls) == 2:   # as when Ctrl-C lands while the first step closes its connections
            raise KeyboardInterrupt
        return real_execute(cfg, label)

    monkeypatch.setattr(cli, "execute", ctrl_c_on_the_second_step)
    out = tmp_path / "sweep"
    code = main(["--url", stack.web_urls[0], "--sweep", "--rates", "2,4", "--requests", "2", "--ttft-p99", "60",
                 "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == cli.EXIT_INTERRUPTED
    assert "reporting the rates measured so far" in captured.err
    report = json.loads((out / "report.json").read_text())
    assert [s["rate"] for s in report["steps"]] == [2.0] and report["sustained_rate"] == 2.0
    assert report["steps"][0]["summary"]["completed"] == 2
    assert (out / "sweep.png").read_bytes().startswith(PNG_MAGIC)


def test_an_unreachable_url_is_a_clear_error(tmp_path, capsys):
    code = main(["--url", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "cannot reach" in err and "--url" in err
    assert main(["--url", "localhost:5000", "--out", str(tmp_path)]) == 2
    assert "http://" in capsys.readouterr().err


def refused_run(url: str, out: Path, *extra: str) -> int:
    return main(["--url", url, "--protocol", "http", "--requests", "2", "--customers", "1", "--out", str(out),
                 "--no-progress", *extra])


def test_an_api_address_instead_of_the_root_says_to_drop_v1(stack, tmp_path, capsys):
    assert refused_run(stack.web_urls[0] + "/v1", tmp_path) == 2
    assert "without /v1" in capsys.readouterr().err


def test_a_refused_parameter_stops_the_run_and_says_which_option_to_change(stack, tmp_path, capsys):
    assert refused_run(stack.web_urls[0], tmp_path, "--max-tokens", "99999") == 2
    err = capsys.readouterr().err
    assert "'max_tokens' must be" in err, "the server's own message is shown"
    assert "change --max-tokens" in err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["stopped"] and report["summary"]["errors"] == {"http_400": 1}


def read_until(stream, marker: str) -> str:
    """What the process writes to `stream` up to `marker` (or to its end, if it exits first)."""
    seen = ""
    while marker not in seen:
        char = stream.read(1)
        if not char:
            break
        seen += char
    return seen


def test_ctrl_c_prints_a_partial_report(stack, tmp_path):
    out = tmp_path / "partial"
    # -X faulthandler: a run that does not end after Ctrl-C is sent SIGABRT, which prints every thread's stack
    cli = load_cli("--url", stack.web_urls[1], "--duration", "120", "--customers", "2", "--timeout", "20",
                   "--out", str(out))
    # Ctrl-C's SIGINT at its default, as at a terminal: a suite started in the background of a shell without job
    # control (`make test &` in a script) runs with SIGINT ignored, and its children inherit that.
    proc = subprocess.Popen([cli[0], "-X", "faulthandler", *cli[1:]], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert "ok=1" in read_until(proc.stderr, "ok=1"), "a first answer completes"
        proc.send_signal(signal.SIGINT)
        try:
            stdout, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            stdout, stderr = proc.communicate(timeout=30)
            pytest.fail(f"the run did not end within 60 s of Ctrl-C; its stdout:\n{stdout}\nits threads:\n{stderr}")
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "interrupted" in stdout and "TTFT" in stdout
    report = json.loads((out / "report.json").read_text())
    assert report["interrupted"] is True and report["summary"]["completed"] >= 1
    assert set(report["summary"]["errors"]) <= {"aborted"}
