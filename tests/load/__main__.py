"""`python -m tests.load`: fire support conversations at a running deployment and report latency percentiles."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

from .clients import Result, hint
from .report import (format_summary, format_sweep, plot_run, plot_sweep, summarize, write_json,
                     write_results_csv, write_sweep_csv)
from .runner import PROTOCOLS, LoadConfig, Run, execute
from .sweep import Criterion, Step, highest_sustained, search

EXIT_OK, EXIT_NOTHING_DONE, EXIT_SETUP, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_REQUESTS = 20
DEFAULT_SWEEP_DURATION_S = 15.0


class SetupError(Exception):
    """The run cannot start or cannot go on; the message says what to change."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.load", description=__doc__,
                                epilog="Closed loop by default (--customers); --rate R for open loop; --sweep for "
                                       "the highest sustained rate. Exit status: 0 done, 1 nothing completed or no "
                                       "rate sustained, 2 setup error or refused requests, 130 interrupted.")
    default_url = os.environ.get("SUPPORTBOT_URL", f"http://127.0.0.1:{os.environ.get('PORT', '5000')}")
    p.add_argument("--url", metavar="URL", default=default_url, help="the web app's root (default %(default)s)")
    p.add_argument("--protocol", choices=PROTOCOLS, default="socketio",
                   help="Socket.IO chat, the OpenAI-compatible HTTP API (streaming), or half of the customers each")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--customers", type=int, metavar="N", default=4,
                      help="closed loop: concurrent customers (default 4)")
    load.add_argument("--rate", type=float, metavar="R", help="open loop: Poisson arrivals at R requests/s")
    until = p.add_mutually_exclusive_group()
    until.add_argument("--requests", type=int, metavar="N",
                       help=f"stop after N requests (default {DEFAULT_REQUESTS}; per rate in a sweep)")
    until.add_argument("--duration", type=float, metavar="S",
                       help=f"send for S seconds, then wait for the answers (per rate in a sweep, default "
                            f"{DEFAULT_SWEEP_DURATION_S:g})")
    p.add_argument("--think-time", type=float, metavar="S", default=0.0,
                   help="closed loop: mean pause after each answer (exponential)")
    p.add_argument("--timeout", type=float, metavar="S", default=120.0, help="give up on an answer after S seconds")
    p.add_argument("--max-tokens", type=int, metavar="N",
                   help="answer cap: max_tokens over HTTP, max_new_tokens in chat_message (default: the server's)")
    p.add_argument("--temperature", type=float, metavar="T", help="HTTP only: temperature")
    p.add_argument("--model", metavar="NAME", help="HTTP only: model name")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get("OPENAI_API_KEY"),
                   help="HTTP only: bearer token")
    p.add_argument("--seed", type=int, metavar="N", default=0, help="picks scripts, order numbers and arrival times")
    p.add_argument("--out", type=Path, metavar="DIR", help="output folder (default test-artifacts/load/<timestamp>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    sweep = p.add_argument_group("sweep (open loop at increasing rates)")
    sweep.add_argument("--sweep", action="store_true", help="find the highest rate with TTFT p99 under the bound")
    sweep.add_argument("--rates", type=_rates, metavar="LIST",
                       help="rates to try, e.g. 0.5,1,2,4 (default: double from --start-rate, then bisect)")
    sweep.add_argument("--ttft-p99", type=float, metavar="S", default=2.0, help="TTFT p99 bound (default 2.0 s)")
    sweep.add_argument("--max-error-rate", type=float, metavar="SHARE", default=0.0,
                       help="share of failed requests a sustained rate may have (default 0)")
    sweep.add_argument("--start-rate", type=float, metavar="R", default=0.5,
                       help="first rate of the automatic search (default 0.5)")
    sweep.add_argument("--max-rate", type=float, metavar="R", default=64.0, help="highest rate it tries (default 64)")
    sweep.add_argument("--bisect", type=int, metavar="N", default=2,
                       help="bisection steps after the first failing rate (default 2)")
    args = p.parse_args(argv)
    for name in ("customers", "rate", "requests", "duration", "timeout", "ttft_p99", "start_rate", "max_rate"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.sweep and args.rate:
        p.error("--sweep chooses the rates itself: use --rates instead of --rate")
    return args


def _rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be positive numbers")
    return rates


def config_from(args: argparse.Namespace) -> LoadConfig:
    requests_, duration = args.requests, args.duration
    if requests_ is None and duration is None:
        requests_, duration = (None, DEFAULT_SWEEP_DURATION_S) if args.sweep else (DEFAULT_REQUESTS, None)
    return LoadConfig(url=args.url.rstrip("/"), protocol=args.protocol, customers=args.customers, rate=args.rate,
                      requests=requests_, duration=duration, think_time=args.think_time, timeout=args.timeout,
                      max_tokens=args.max_tokens, temperature=args.temperature, model=args.model,
                      api_key=args.api_key, seed=args.seed, progress=not args.no_progress)


def preflight(url: str, timeout: float = 5.0) -> str | None:
    """Fail fast on an address nothing answers at; a warning when the stack is up but not ready."""
    if not url.startswith(("http://", "https://")):
        raise SetupError(f"--url {url!r} must start with http:// or https:// (like http://127.0.0.1:5000)")
    try:
        health = requests.get(url + "/healthz", timeout=timeout)
    except requests.Timeout:
        raise SetupError(f"{url} did not answer within {timeout:g}s: is the server overloaded or the address "
                         f"wrong? Check --url.") from None
    except requests.RequestException as exc:
        raise SetupError(f"cannot reach {url} ({type(exc).__name__}): start the stack (make run) or pass "
                         f"--url with the right host and port.") from None
    if health.status_code == 404:
        raise SetupError(f"{url}/healthz answered 404: --url must be the web app's root "
                         f"(like http://127.0.0.1:5000), without /v1 or a page path.")
    if 400 <= health.status_code < 500:
        raise SetupError(f"{url}/healthz answered {health.status_code}: check --url (and --api-key).")
    try:
        ready = requests.get(url + "/readyz", timeout=timeout)
    except requests.RequestException:
        return None
    if ready.status_code != 200:
        return f"{url} is up but not ready ({ready.text.strip()[:200]}); requests will wait for a worker"
    return None


def out_dir(args: argparse.Namespace) -> Path:
    path = args.out or Path("test-artifacts") / "load" / time.strftime("%Y%m%d-%H%M%S")
    path.mkdir(parents=True, exist_ok=True)
    return path


def header(cfg: LoadConfig, run_started: float) -> dict:
    return {"tool": "python -m tests.load", "url": cfg.url,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(run_started)),
            "config": {k: v for k, v in asdict(cfg).items() if k != "api_key"}}


def stop_reason(run: Run) -> str | None:
    if run.interrupted:
        return "interrupted (Ctrl-C): partial report"
    if run.fatal is not None:
        return f"stopped: {run.fatal.message}"
    return None


def single(cfg: LoadConfig, out: Path) -> int:
    run = execute(cfg)
    summary = summarize(run.results, run.elapsed, cfg.rate)
    reason = stop_reason(run)
    print(f"\n{cfg.describe()}")
    if reason:
        print(reason)
    print(format_summary(summary))
    write_json(out / "report.json", {**header(cfg, run.started_at), "interrupted": run.interrupted,
                                     "stopped": reason, "summary": summary}, run.results)
    write_results_csv(out / "results.csv", run.results)
    plot_run(out / "latency.png", run.results, cfg.describe())
    print(f"\nwrote {out / 'report.json'}, {out / 'results.csv'}, {out / 'latency.png'}")
    return exit_code(run, summary.completed > 0)


def exit_code(run: Run, success: bool) -> int:
    if run.interrupted:
        return EXIT_INTERRUPTED
    if run.fatal is not None:
        advice = hint(run.fatal.error or "")
        print(f"error: {run.fatal.message}" + (f"\n  {advice}" if advice else ""), file=sys.stderr)
        return EXIT_SETUP
    return EXIT_OK if success else EXIT_NOTHING_DONE


@dataclass
class SweepRecord:
    """Everything the sweep's steps produced, for the report."""

    criterion: Criterion
    started: float = field(default_factory=time.time)
    results: list[Result] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    last: Run | None = None


def sweep(cfg: LoadConfig, args: argparse.Namespace, out: Path) -> int:
    record = SweepRecord(Criterion(args.ttft_p99, args.max_error_rate))

    def measure(rate: float) -> Step:
        cfg.rate = rate
        run = record.last = execute(cfg, label=f"{rate:g} req/s")
        record.results.extend(run.results)
        summary = summarize(run.results, run.elapsed, rate)
        step = Step(rate, summary, record.criterion.holds(summary), stopped=run.interrupted or run.fatal is not None)
        print(f"{rate:g} req/s: TTFT p99 {_fmt(summary.ttft_s['p99'])}s, {summary.completed}/{summary.sent} "
              f"completed -> {'sustained' if step.sustained else 'not sustained'}", file=sys.stderr)
        record.steps.append(step)
        return step

    try:
        steps = search(measure, args.rates, start=args.start_rate, max_rate=args.max_rate, bisect=args.bisect)
    except KeyboardInterrupt:   # outside a step's own handling (e.g. while it closed its connections)
        print("interrupted; reporting the rates measured so far", file=sys.stderr)
        steps = record.steps
        if not steps:
            raise
        cfg.rate = None
        report_sweep(cfg, record, steps, out)
        return EXIT_INTERRUPTED
    cfg.rate = None
    best = report_sweep(cfg, record, steps, out)
    return exit_code(record.last, best is not None) if record.last else EXIT_NOTHING_DONE


def report_sweep(cfg: LoadConfig, record: SweepRecord, steps: list[Step], out: Path) -> float | None:
    bound, best = record.criterion.ttft_p99_s, highest_sustained(steps)
    open_ended = best is not None and all(s.sustained for s in steps)
    rows = [(s.summary, s.sustained) for s in sorted(steps, key=lambda s: s.rate)]
    reason = stop_reason(record.last) if record.last else None
    print(f"\nsweep: open loop over {cfg.protocol} -> {cfg.url}, TTFT p99 bound {bound:g}s")
    if reason:
        print(reason)
    print(format_sweep(rows))
    print(f"\nhighest sustained rate: {best:g} req/s" if best is not None else
          "\nhighest sustained rate: none of the tested rates; try lower --rates or --start-rate")
    if open_ended:
        print("every rate tried was sustained, so the limit is higher: raise --max-rate or add higher --rates")
    write_json(out / "report.json", {
        **header(cfg, record.started), "sweep": True, "ttft_p99_bound_s": bound,
        "max_error_rate": record.criterion.max_error_rate, "sustained_rate": best,
        "sustained_rate_is_lower_bound": open_ended, "interrupted": bool(record.last and record.last.interrupted),
        "stopped": reason, "steps": [{"rate": s.rate, "sustained": s.sustained, "summary": s.summary} for s in steps],
    }, record.results)
    write_results_csv(out / "results.csv", record.results)
    write_sweep_csv(out / "sweep.csv", rows)
    plot_sweep(out / "sweep.png", rows, bound, best, f"{cfg.protocol} -> {cfg.url}; TTFT p99 bound {bound:g}s")
    print(f"wrote {out / 'report.json'}, {out / 'results.csv'}, {out / 'sweep.csv'}, {out / 'sweep.png'}")
    return best


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = config_from(args)
    try:
        warning = preflight(cfg.url)
    except SetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_SETUP
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    out = out_dir(args)
    try:
        if args.sweep:
            print(f"load: sweep over {cfg.protocol} -> {cfg.url}, bound TTFT p99 {args.ttft_p99:g}s",
                  file=sys.stderr)
            return sweep(cfg, args, out)
        print(f"load: {cfg.describe()}", file=sys.stderr)
        return single(cfg, out)
    except KeyboardInterrupt:   # a second Ctrl-C, while the report is being written
        print(f"interrupted; what was written is in {out}", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
