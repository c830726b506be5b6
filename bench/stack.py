"""The benchmark workload through the whole stack against the engine alone, in one run.

Through the stack, each request is a customer on its own Socket.IO connection (or, with
`--protocol http`, a streaming OpenAI-style HTTP request): web app -> Redis -> worker -> pub/sub.
Both sides stay up for the whole run and take turns, round after round, so a slow spell of a shared
machine falls on both; the figures are medians over rounds. In each round the engine alone gets the
requests in the order the web app received them from the customers sent at once. A last part sends requests one at a time:
there no request queues behind another, and the TTFT difference is the stack's own latency.
Each round also says when the engine first held a full batch, alone and through the stack: how long the
stack's intake (web app, queue, worker) keeps the engine from working at full width after a burst.
With `--engine-cpus`, the engine (the worker, and the engine alone) runs on those CPUs and the web
app, Redis and the customers on the others: what the stack then costs is its own, not a share of
the engine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.engine import DEFAULT_WORKLOAD
from bench.stack_parts import ROOT, Placement, Stack

# Error codes that mean "not taken": the customer was told to try again. Anything else is a failure.
REFUSALS = ("queue_full", "queue_unavailable", "storage_unavailable", "rate_limited", "too_many_connections",
            "http_429", "http_503")


def workload(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    return [{"id": str(r["id"]), "cap": r["max_new_tokens"],
             "messages": [{"role": "system", "content": data["system_prompt"]},
                          {"role": "user", "content": r["question"]}]} for r in data["requests"]]


class Direct:
    """The engine driven in this process, on the same model and slots as the worker: the baseline."""

    def __init__(self, slots: int, model_name: str | None = None, placement: Placement | None = None) -> None:
        import torch

        from worker.engine import EngineConfig, LLMEngine
        from worker.model_loader import load_model
        from worker.settings import weights_setting

        self.placement = placement or Placement()
        if self.placement.pinned:
            torch.set_num_threads(len(self.placement.engine))
        with self.placement.engine_thread():
            # The worker's WEIGHTS, read the worker's way: both sides run the same precision.
            loaded = load_model(model_name, weights=weights_setting())
            self.engine = LLMEngine(*loaded, EngineConfig(max_num_seqs=slots))

    def _add(self, q: dict, cap: int) -> None:
        from worker.engine import SamplingParams

        self.engine.add_request(q["id"], messages=q["messages"], params=SamplingParams(temperature=0, max_new_tokens=cap))

    def _drain(self) -> list:
        from worker.engine import RequestFinished

        done = []
        while self.engine.has_unfinished():
            done += [e for e in self.engine.step() if isinstance(e, RequestFinished)]
        return done

    def all_at_once(self, requests_: list[dict]) -> dict:
        start = time.time()
        for q in requests_:
            self._add(q, q["cap"])
        with self.placement.engine_thread():
            done = self._drain()
        return {"tokens": sum(d.completion_tokens for d in done), "wall_s": time.time() - start,
                "ttft": [d.first_token_time - start for d in done], "texts": {d.request_id: d.text for d in done},
                "admitted": [d.admitted_time - start for d in done]}

    def one_at_a_time(self, requests_: list[dict], cap: int) -> list[float]:
        ttft = []
        for q in requests_:
            start = time.time()
            self._add({**q, "id": f"alone-{q['id']}"}, cap)
            with self.placement.engine_thread():
                ttft.append(self._drain()[0].first_token_time - start)
        return ttft

    def close(self) -> None:
        self.engine.release_model()


def _cpu_list(text: str) -> set[int]:
    return {int(cpu) for cpu in text.split(",") if cpu.strip()}


def batch_full_s(admitted: list[float], slots: int) -> float:
    """Seconds from the burst until the engine held its first full batch: where the stack's intake shows."""
    ordered = sorted(admitted)
    return ordered[min(slots, len(ordered)) - 1] if ordered else float("nan")


def median(values: list[float | None]) -> float:
    """The median of the values there are: a refused or failed request has no TTFT; nan when none has one."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else float("nan")


def error_codes(results: list[dict]) -> dict[str, int]:
    codes: dict[str, int] = {}
    for r in results:
        if r.get("error"):
            code = r["error"].get("code", "unknown") if isinstance(r["error"], dict) else str(r["error"])
            codes[code] = codes.get(code, 0) + 1
    return codes


def summarize(direct: dict, stack: dict, slots: int) -> dict:
    codes = error_codes(stack["results"])
    return {"engine_batch_full_s": batch_full_s(direct["admitted"], slots),
            "stack_batch_full_s": batch_full_s(stack["admitted"], slots),
            "engine_tok_s": direct["tokens"] / direct["wall_s"], "stack_tok_s": stack["tokens"] / stack["wall_s"],
            "engine_ttft_p50_s": median(direct["ttft"]), "stack_ttft_p50_s": median(stack["ttft"]),
            "engine_wall_s": direct["wall_s"], "stack_wall_s": stack["wall_s"],
            "keep_ratio": (stack["tokens"] / stack["wall_s"]) / (direct["tokens"] / direct["wall_s"]),
            "added_ttft_p50_s": median(stack["ttft"]) - median(direct["ttft"]),
            "identical": sum(stack["texts"].get(k) == v for k, v in direct["texts"].items()),
            "errors": sum(codes.values()), "error_codes": codes,
            "refused": sum(n for code, n in codes.items() if code in REFUSALS)}


# ---- crowds: a burst of customers, idle connections, the delivery ceiling (bench/crowd.py) -------------------

def web_server_pids(master_pid: int) -> list[int]:
    """The web process: gunicorn's master and the worker that holds the connections."""
    import psutil

    master = psutil.Process(master_pid)
    return [master_pid, *(c.pid for c in master.children())]


def rss_mb(pids: list[int]) -> float:
    import psutil

    return sum(psutil.Process(pid).memory_info().rss for pid in pids) / 2**20


def run_crowd(url: str, customers: int, mode: str, procs: int = 1, protocol: str = "socketio",
              extra: list[str] | None = None, when_connected=None) -> list[dict]:
    """`customers` split over `procs` client processes; once all are connected they act at the same moment."""
    sizes = [customers // procs + (i < customers % procs) for i in range(procs)]
    children = [subprocess.Popen([sys.executable, "-m", "bench.crowd", "--url", url, "--customers", str(n),
                                  "--mode", mode, "--protocol", protocol, *(extra or [])],
                                 cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for n in sizes if n]
    try:
        for child in children:
            line = child.stdout.readline()
            if not line.startswith("connected"):
                raise RuntimeError(f"a client process failed before connecting: {line!r}")
            print(f"client process {child.pid}: {line.strip()}", flush=True)
        if when_connected is not None:
            when_connected()
        for child in children:
            child.stdin.write("go\n")
            child.stdin.flush()
        return [json.loads(child.stdout.readline()) for child in children]
    finally:
        for child in children:
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()


def percentiles(values: list[float]) -> dict:
    ordered = sorted(values)
    if not ordered:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]   # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": ordered[-1]}


def merge_health(outs: list[dict]) -> dict:
    h = [o["health"] for o in outs]
    return {"probes": sum(x["probes"] for x in h), "failures": sum(x["failures"] for x in h),
            "max_s": max((x["max_s"] or 0) for x in h), "over_1s": sum(x["over_1s"] for x in h)}


def burst_figures(outs: list[dict]) -> dict:
    """Every customer asked once at the same moment: who was answered, refused (retryable), failed or lost."""
    results = [r | {"go": o["go"]} for o in outs for r in o["results"]]
    codes = error_codes(results)
    answered = [r for r in results if r["ended_at"] and not r["error"]]
    return {"customers": sum(o["customers"] for o in outs), "connected": sum(o["connected"] for o in outs),
            "refused_connections": sum(o["refused_connection_count"] for o in outs),
            "asked": len(results), "accepted": sum(1 for r in results if r["accepted_at"]),
            "answered": len(answered), "refused": sum(n for c, n in codes.items() if c in REFUSALS),
            "failed": sum(n for c, n in codes.items() if c not in REFUSALS), "error_codes": codes,
            "lost": sum(1 for r in results if r["ended_at"] is None),
            "ttft_s": percentiles([r["first_at"] - r["go"] for r in answered if r["first_at"]]),
            "e2e_s": percentiles([r["ended_at"] - r["go"] for r in answered]),
            "accepted_s": percentiles([r["accepted_at"] - r["go"] for r in results if r["accepted_at"]]),
            "healthz": merge_health(outs)}


def print_burst(fig: dict, protocol: str) -> None:
    t, e, a, h = fig["ttft_s"], fig["e2e_s"], fig["accepted_s"], fig["healthz"]
    print(f"burst of {fig['customers']} {protocol} customers: {fig['connected']} connected, {fig['asked']} asked at "
          f"once; {fig['accepted']} accepted, {fig['answered']} answered, {fig['refused']} refused, "
          f"{fig['failed']} failed, {fig['lost']} without an answer {fig['error_codes'] or ''}")
    if t["p50"] is not None:
        print(f"  accepted p50/p99 {a['p50']:.2f}/{a['p99']:.2f} s; first text p50/p90/p99 {t['p50']:.2f}/{t['p90']:.2f}/"
              f"{t['p99']:.2f} s; last answer {e['max']:.1f} s after the burst")
    print(f"  /healthz: {h['probes']} probes, slowest {h['max_s']:.3f} s, {h['over_1s']} over 1 s, "
          f"{h['failures']} failed")


def crowd_main(args) -> dict:
    """--customers, --idle and --ceiling: against --url, or a stack of its own."""
    from worker.synthetic import SYNTHETIC_TOKEN

    if args.ceiling:   # every streaming chat keeps streaming past the measured window
        args.max_new_tokens = int(args.token_rate * (args.warmup + args.duration + 15))
    with tempfile.TemporaryDirectory() as tmp:
        stack = None
        url, web_pid = args.url, args.web_pid
        if url is None:
            workdir = args.workdir or Path(tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            wanted = args.customers or args.idle or args.open
            worker_env = {"SYNTHETIC_TOKEN_RATE": str(args.token_rate), "MAX_NUM_SEQS": str(max(args.streaming, 16))} \
                if args.ceiling else None
            stack = Stack(max(args.streaming, args.slots) if args.ceiling else args.slots, workdir,
                          "You are a helpful shop assistant.", max(args.max_new_tokens, 64), args.model,
                          queue_limit=max(1000, 2 * wanted), worker_env=worker_env)
            url, web_pid = stack.base, stack.procs[1].pid
        try:
            pids = web_server_pids(web_pid) if web_pid else []
            if args.customers:
                outs = run_crowd(url, args.customers, "burst", args.client_procs, args.protocol,
                                 ["--max-new-tokens", str(args.max_new_tokens), "--timeout", str(args.timeout)])
                figures = {"mode": "burst", "protocol": args.protocol, **burst_figures(outs)}
                print_burst(figures, args.protocol)
            elif args.idle:
                before = rss_mb(pids) if pids else None
                held: dict = {}

                def measure() -> None:
                    time.sleep(2)
                    held["rss_mb"] = rss_mb(pids) if pids else None

                outs = run_crowd(url, args.idle, "idle", args.client_procs,
                                 extra=["--duration", "5"], when_connected=measure)
                connected = sum(o["connected"] for o in outs)
                figures = {"mode": "idle", "connections": connected, "still_open": sum(o["still_open"] for o in outs),
                           "web_rss_mb_before": before, "web_rss_mb_held": held.get("rss_mb")}
                if before is not None:
                    figures["kb_per_connection"] = (held["rss_mb"] - before) * 1024 / max(1, connected)
                    print(f"one web process holds {connected} idle chat connections "
                          f"({figures['still_open']} still open after 5 s): RSS {before:.0f} MB before, "
                          f"{held['rss_mb']:.0f} MB with them, {figures['kb_per_connection']:.0f} KB per connection")
                else:
                    print(f"{connected} idle chat connections held; pass --web-pid to measure the server's memory")
            else:
                cpu_before = _cpu_times(pids)
                outs = run_crowd(url, args.open, "stream", args.client_procs,
                                 extra=["--askers", str(args.streaming // args.client_procs), "--max-new-tokens",
                                        str(args.max_new_tokens), "--duration", str(args.duration),
                                        "--warmup", str(args.warmup)])
                cpu = _cpu_times(pids) - cpu_before if pids else None
                chars = sum(o["chars"] for o in outs)
                window = max(o["window_s"] for o in outs)
                tokens_s = chars / len(SYNTHETIC_TOKEN) / window
                figures = {"mode": "ceiling", "open": sum(o["connected"] for o in outs),
                           "streaming": sum(o["asked"] for o in outs), "offered_tokens_per_s_per_chat": args.token_rate,
                           "offered_tokens_per_s": args.token_rate * sum(o["asked"] for o in outs),
                           "delivered_tokens_per_s": tokens_s, "window_s": window,
                           "streaming_at_end": sum(o["streaming_at_end"] for o in outs),
                           "errors": [e for o in outs for e in o["errors"]], "healthz": merge_health(outs),
                           "web_cpu_s": cpu}
                print(f"delivery ceiling: {figures['open']} chats open, {figures['streaming']} streaming at "
                      f"{args.token_rate:.0f} tokens/s each (offered {figures['offered_tokens_per_s']:.0f} tokens/s): "
                      f"delivered {tokens_s:.0f} tokens/s over {window:.0f} s; web process CPU "
                      f"{(cpu or 0) / (args.duration + args.warmup) * 100:.0f}% of a core; /healthz slowest "
                      f"{figures['healthz']['max_s']:.3f} s")
        finally:
            if stack is not None:
                stack.close()
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return figures


def _cpu_times(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.stack", description=__doc__)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--protocol", choices=("socketio", "http"), default="socketio")
    parser.add_argument("--model", default=None, help="a model id or path (default: the default model)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="engine-direct and stack runs, alternated; the figures are the medians over rounds")
    parser.add_argument("--alone", type=int, default=8,
                        help="also send this many requests one at a time, to see the stack's own added latency")
    parser.add_argument("--engine-cpus", type=_cpu_list, default=None, metavar="0,1",
                        help="run the engine on these CPUs and the web app, Redis and the customers on the others")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the stack's logs, database and Redis files here (default: a temporary folder)")
    crowd = parser.add_argument_group("crowds", "instead of the workload: many customers from bench/crowd.py")
    crowd.add_argument("--customers", type=int, default=0,
                       help="burst: this many customers connect, then each asks once, all at the same moment")
    crowd.add_argument("--max-new-tokens", type=int, default=8, help="the answers' length in --customers and "
                                                                        "--ceiling")
    crowd.add_argument("--idle", type=int, default=0,
                       help="hold this many idle chat connections on one web process and report its memory")
    crowd.add_argument("--ceiling", action="store_true",
                       help="the delivery ceiling: --open chats, --streaming of them answered by a synthetic token "
                            "source at --token-rate tokens/s each (its own stack only; never the real engine)")
    crowd.add_argument("--open", type=int, default=1000)
    crowd.add_argument("--streaming", type=int, default=256)
    crowd.add_argument("--token-rate", type=float, default=100.0, help="tokens/s per streaming chat")
    crowd.add_argument("--duration", type=float, default=20.0, help="--ceiling: seconds measured")
    crowd.add_argument("--warmup", type=float, default=5.0)
    crowd.add_argument("--client-procs", type=int, default=1, help="client processes the customers are spread over")
    crowd.add_argument("--timeout", type=float, default=1800,
                       help="--customers: seconds to wait for every answer (a slow engine works through the queue)")
    crowd.add_argument("--url", default=None, help="a running deployment (e.g. `make run`) instead of a stack of its "
                                                   "own; --web-pid PID of its web server to report memory and CPU")
    crowd.add_argument("--web-pid", type=int, default=None)
    mixed = parser.add_argument_group("mixed", "instead of the workload: chats arriving beside bulk API streams, "
                                               "service classes on and off (bench/mixed.py)")
    mixed.add_argument("--mixed", action="store_true")
    mixed.add_argument("--bulk-streams", type=int, default=40, help="bulk API clients, each always waiting for one "
                                                                    "answer")
    mixed.add_argument("--bulk-tokens", type=int, default=64, help="tokens of each bulk answer (it cannot end early)")
    mixed.add_argument("--chats", type=int, default=8, help="chat customers, arriving one after another")
    mixed.add_argument("--chat-interval", type=float, default=2.0, help="seconds between two chats' arrivals")
    mixed.add_argument("--chat-tokens", type=int, default=32, help="the chats' answer cap")
    mixed.add_argument("--chat-question", default="Where is my parcel? It was due on Monday.")
    mixed.add_argument("--chats-alone", type=int, default=4, help="chats sent one at a time to the idle stack first")
    mixed.add_argument("--bulk-warmup", type=float, default=10.0, help="seconds of bulk before anything is measured")
    mixed.add_argument("--bulk-window", type=float, default=20.0, help="seconds of bulk alone measured")
    args = parser.parse_args(argv)
    if args.mixed:
        from bench import mixed as mixed_traffic
        return mixed_traffic.run(args, workload(args.workload))
    if args.customers or args.idle or args.ceiling:
        if args.ceiling and args.url:
            parser.error("--ceiling starts its own stack with a synthetic worker; it does not take --url")
        return crowd_main(args)
    reqs = workload(args.workload)[:args.limit]
    alone_cap = 8   # TTFT is what is measured one at a time; short answers keep that part quick
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        placement = Placement(args.engine_cpus)
        placement.pin(os.getpid(), placement.rest)
        direct = Direct(args.slots, args.model, placement)
        stack = Stack(args.slots, workdir, reqs[0]["messages"][0]["content"], max(q["cap"] for q in reqs), args.model,
                      placement)
        try:
            # Warm both paths; then take turns, so a slow spell of a shared machine hits both sides alike.
            direct.one_at_a_time(reqs[:1], 4)
            stack.one_at_a_time(reqs[:1], 4, args.protocol)
            rounds = []
            by_id = {q["id"]: q for q in reqs}
            for n in range(args.rounds):
                through = stack.all_at_once(reqs, args.protocol)
                # The baseline gets the same requests in the order the web app received them: simultaneous
                # messages arrive shuffled, and which answers share the first batch moves TTFT and the tail.
                order = through["received"] + [q["id"] for q in reqs if q["id"] not in through["received"]]
                rounds.append(summarize(direct.all_at_once([by_id[qid] for qid in order]), through, args.slots))
                r = rounds[-1]
                print(f"round {n + 1}: engine {r['engine_tok_s']:.1f} tok/s, TTFT p50 {r['engine_ttft_p50_s']:.3f} s; "
                      f"stack {r['stack_tok_s']:.1f} tok/s, TTFT p50 {r['stack_ttft_p50_s']:.3f} s; "
                      f"keeps {r['keep_ratio']:.0%}, adds {r['added_ttft_p50_s'] * 1000:+.0f} ms; "
                      f"first batch full at {r['engine_batch_full_s']:.2f} s alone, {r['stack_batch_full_s']:.2f} s "
                      "through the stack", flush=True)
            alone_direct = direct.one_at_a_time(reqs[:args.alone], alone_cap) if args.alone else []
            alone_stack = stack.one_at_a_time(reqs[:args.alone], alone_cap, args.protocol) if args.alone else []
        finally:
            stack.close()
            direct.close()
    figures = {"protocol": args.protocol, "slots": args.slots, "requests": len(reqs), "rounds": rounds,
               "engine_cpus": sorted(placement.engine) if placement.pinned else None,
               "errors": sum(r["errors"] for r in rounds), "identical": min(r["identical"] for r in rounds),
               **{key: statistics.median(r[key] for r in rounds)
                  for key in ("keep_ratio", "added_ttft_p50_s", "engine_tok_s", "stack_tok_s", "engine_ttft_p50_s",
                              "stack_ttft_p50_s", "engine_wall_s", "stack_wall_s", "engine_batch_full_s",
                              "stack_batch_full_s")}}
    if args.alone:
        figures.update(alone_requests=args.alone, alone_engine_ttft_p50_s=median(alone_direct),
                       alone_stack_ttft_p50_s=median(alone_stack),
                       alone_added_ttft_p50_s=median(alone_stack) - median(alone_direct))
    if figures["errors"]:
        codes: dict[str, int] = {}
        for r in rounds:
            for code, n in r["error_codes"].items():
                codes[code] = codes.get(code, 0) + n
        print(f"{figures['errors']} requests got an error through the stack: "
              + ", ".join(f"{n} {code}" for code, n in sorted(codes.items())))
    print(f"median of {args.rounds} rounds: the stack keeps {figures['keep_ratio']:.0%} of the engine's tokens/s and "
          f"adds {figures['added_ttft_p50_s'] * 1000:+.0f} ms to TTFT p50; "
          f"{figures['identical']}/{len(reqs)} answers identical in every round")
    print(f"first batch of {args.slots} full {figures['engine_batch_full_s']:.2f} s after the burst alone, "
          f"{figures['stack_batch_full_s']:.2f} s through the stack (medians)")
    if args.alone:
        print(f"one request at a time ({args.alone}): engine TTFT p50 {figures['alone_engine_ttft_p50_s'] * 1000:.0f} ms, "
              f"stack {figures['alone_stack_ttft_p50_s'] * 1000:.0f} ms: the stack adds "
              f"{figures['alone_added_ttft_p50_s'] * 1000:+.0f} ms")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main()
