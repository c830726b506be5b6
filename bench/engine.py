"""Benchmark static batching, transformers continuous batching and the worker engine on a workload."""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

from bench import llamacpp
from bench.stats import percentile
from worker.model_loader import load_model

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_WORKLOAD = REPO_ROOT.parent / "shared" / "bench" / "workload.json"
# The same workload ships in the repo for checkouts without the shared folder beside them.
DATA_DIR = REPO_ROOT / "bench" / "data"
DEFAULT_WORKLOAD = SHARED_WORKLOAD if SHARED_WORKLOAD.is_file() else DATA_DIR / "workload.json"
# nano-vllm's benchmark shape: random token ids, lengths uniform in 100..1024, ignore_eos, temperature 0.6.
NANO = "nano"
NANO_REQUESTS = 256
NANO_LENGTHS = (100, 1024)
NANO_MAX_TOKEN_ID = 10000
NANO_TEMPERATURE = 0.6
METHODS = ("static", "transformers_cb", "engine", "engine_best")
SKIPPABLE = (*METHODS, "reference")
BEST_BUDGET = 1024
BEST_SLOTS_CAP = 64
ENGINE_BLOCK_SIZE = 16
CB_ATTN_CHOICES = ("sdpa", "paged|eager")
# On 2 CPU cores with SmolLM2-135M in float32, sdpa gave 3-15 % more tokens/s than paged|eager (4 and 16 slots).
# On CUDA transformers itself switches sdpa to flash attention when a flash kernel is installed.
DEFAULT_CB_ATTN = "sdpa"
STEP_SAMPLINGS = ("greedy", "sampled", "chat")
RSS_INTERVAL_S = 0.02
COLORS = {"static": "#888888", "transformers_cb": "#4c72b0", "engine": "#dd8452", "engine_best": "#55a868",
          "engine_dense": "#c44e52", "llamacpp": "#8172b3"}
METRIC_KEYS = ("tokens_per_s", "wall_s", "e2e_p50_s", "e2e_p95_s", "ttft_p50_s", "ttft_p95_s",
               "peak_rss_mb", "peak_device_mb", "greedy_matches", "requests")


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    cap: int


@dataclass
class Completion:
    ids: list[int]
    e2e_s: float
    ttft_s: float | None


@dataclass
class Run:
    """What one method produced: completions by request id, timings and the engine's batch occupancy."""

    completions: dict[str, Completion]
    wall_s: float
    peak_rss_mb: float = 0.0
    peak_device_mb: float | None = None   # CUDA: the most memory torch held at once during the run
    occupancy: list[tuple[float, int]] = field(default_factory=list)


@dataclass
class Setup:
    model: object
    tokenizer: object
    requests: list[Request]
    eos_ids: set[int]
    pad_id: int
    temperature: float = 0.0      # 0: greedy, checked against sequential generate
    ignore_eos: bool = False      # every request runs to its cap
    engine_options: dict = field(default_factory=dict)   # EngineConfig fields from --decode
    budget: int = 512             # tokens per step for the engine and transformers CB (--budget)
    auto_pool: bool = False       # --pool auto: the engine sizes its KV pool itself, as the worker does

    @property
    def stop_ids(self) -> set[int]:
        """The tokens that end a completion when outputs are cut for comparison."""
        return set() if self.ignore_eos else self.eos_ids


# ---------------------------------------------------------------- workload


def load_workload(path: Path, tokenizer, limit: int | None) -> list[Request]:
    data = json.loads(path.read_text())
    items = data["requests"][:limit] if limit else data["requests"]
    requests = []
    for item in items:
        messages = [{"role": "system", "content": data["system_prompt"]},
                    {"role": "user", "content": item["question"]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        requests.append(Request(str(item["id"]), list(ids), int(item["max_new_tokens"])))
    return requests


def nano_workload(n: int = NANO_REQUESTS, lengths: tuple[int, int] = NANO_LENGTHS, seed: int = 0) -> list[Request]:
    """nano-vllm's bench.py drawn the same way: all prompts first, then all output lengths, from one seeded RNG."""
    low, high = lengths
    rng = random.Random(seed)
    prompts = [[rng.randint(0, NANO_MAX_TOKEN_ID) for _ in range(rng.randint(low, high))] for _ in range(n)]
    caps = [rng.randint(low, high) for _ in range(n)]
    return [Request(str(i), ids, cap) for i, (ids, cap) in enumerate(zip(prompts, caps))]


def resolve_workload(value: str) -> Path:
    """A workload file: a path, or a name shipped in bench/data (e.g. `workload-256`)."""
    for path in (Path(value), DATA_DIR / value, DATA_DIR / f"{value}.json"):
        if path.is_file():
            return path
    shipped = ", ".join(sorted(p.stem for p in DATA_DIR.glob("workload*.json")))
    raise SystemExit(f"--workload {value!r}: no such file; give a path, {NANO!r} or one of: {shipped}")


def eos_ids_of(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids) if isinstance(ids, (list, tuple)) else ({ids} if ids is not None else set())
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def cut(ids: Sequence[int], cap: int, eos_ids: set[int]) -> list[int]:
    """Completion ids up to the cap and the first EOS, EOS included, so every method is compared the same way."""
    out = []
    for token in list(ids)[:cap]:
        out.append(int(token))
        if token in eos_ids:
            break
    return out


def chunks(items: list[Request], size: int) -> Iterator[list[Request]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


# ---------------------------------------------------------------- measuring


@contextmanager
def peak_rss() -> Iterator[list[float]]:
    """Sample this process's RSS in a background thread; the yielded list holds the peak in MB afterwards."""
    process = psutil.Process()
    peak = [process.memory_info().rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(RSS_INTERVAL_S):
            peak[0] = max(peak[0], process.memory_info().rss)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    result = [0.0]
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        result[0] = max(peak[0], process.memory_info().rss) / 2**20


class FirstTokenClock(BaseStreamer):
    """A generate() streamer that notes when the first new tokens exist (the first put is the prompt)."""

    def __init__(self) -> None:
        super().__init__()
        self.puts = 0
        self.first_token_time: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_time = time.time()

    def end(self) -> None:
        pass


def summarize(run: Run, requests: list[Request], eos_ids: set[int],
              reference: dict[str, list[int]] | None) -> dict:
    caps = {r.id: r.cap for r in requests}
    outputs = {rid: cut(c.ids, caps[rid], eos_ids) for rid, c in run.completions.items()}
    tokens = sum(len(ids) for ids in outputs.values())
    e2e = [c.e2e_s for c in run.completions.values()]
    ttft = [c.ttft_s for c in run.completions.values() if c.ttft_s is not None]
    # TTFT is reported only when every request has one: a partial sample would flatter the method.
    has_ttft = len(ttft) == len(run.completions)
    matches = None
    if reference is not None:
        matches = sum(1 for rid, ids in outputs.items() if ids == reference.get(rid))
    return {
        "tokens_per_s": tokens / run.wall_s if run.wall_s > 0 else 0.0,
        "wall_s": run.wall_s,
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p95_s": percentile(e2e, 95),
        "ttft_p50_s": percentile(ttft, 50) if has_ttft else None,
        "ttft_p95_s": percentile(ttft, 95) if has_ttft else None,
        "peak_rss_mb": run.peak_rss_mb,
        "peak_device_mb": run.peak_device_mb,
        "greedy_matches": matches,
        "requests": len(run.completions),
    }


def measured(method: Callable[..., Run]) -> Callable[..., Run]:
    """Wrap a method so its whole run (setup included) is RSS-sampled."""

    def wrapper(*args, **kwargs) -> Run:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with peak_rss() as peak:
            run = method(*args, **kwargs)
        run.peak_rss_mb = peak[0]
        if cuda:
            run.peak_device_mb = torch.cuda.max_memory_allocated() / 2**20
        return run

    return wrapper


def progress(name: str, total: int) -> tqdm:
    return tqdm(total=total, desc=f"{name:<15}", unit="req", file=sys.stderr, dynamic_ncols=True)


# ---------------------------------------------------------------- methods


def greedy_config(model, max_new_tokens: int, pad_id: int):
    config = copy.deepcopy(model.generation_config)
    config.do_sample = False
    config.max_new_tokens = max_new_tokens
    config.pad_token_id = pad_id
    # Sampling knobs from the checkpoint would only trigger warnings once do_sample is off.
    config.temperature = config.top_p = config.top_k = None
    return config


def workload_config(setup: Setup, max_new_tokens: int):
    """Greedy, or plain temperature sampling (no top-k/top-p) as the workload asks; no EOS when it is ignored."""
    config = greedy_config(setup.model, max_new_tokens, setup.pad_id)
    if setup.temperature > 0:
        config.do_sample, config.temperature, config.top_k = True, setup.temperature, 0
    if setup.ignore_eos:
        config.eos_token_id = None
    return config


@torch.inference_mode()
def generate_batch(setup: Setup, batch: list[Request], streamer=None) -> list[list[int]]:
    """One left-padded model.generate call over the batch, greedy up to the batch's largest cap."""
    tokenizer, model = setup.tokenizer, setup.model
    encoded = tokenizer.pad({"input_ids": [r.prompt_ids for r in batch]}, padding_side="left", return_tensors="pt")
    input_ids = encoded["input_ids"].to(model.device)
    attention_mask = encoded["attention_mask"].to(model.device)
    config = workload_config(setup, max(r.cap for r in batch))
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                         streamer=streamer)
    return out[:, input_ids.shape[1]:].tolist()


def warm_up(setup: Setup) -> None:
    generate_batch(setup, [Request("warmup", setup.requests[0].prompt_ids, 2)])


def run_reference(setup: Setup) -> dict[str, list[int]]:
    """Each request alone through model.generate: the greedy answer every method is checked against."""
    reference = {}
    with progress("reference", len(setup.requests)) as bar:
        for request in setup.requests:
            ids = generate_batch(setup, [request])[0]
            reference[request.id] = cut(ids, request.cap, setup.eos_ids)
            bar.update(1)
    return reference


@measured
def run_static(setup: Setup, slots: int) -> Run:
    completions = {}
    start = time.time()
    with progress("static", len(setup.requests)) as bar:
        for wave in chunks(setup.requests, slots):
            clock = FirstTokenClock()
            outputs = generate_batch(setup, wave, streamer=clock)
            end = time.time()
            ttft = clock.first_token_time - start if clock.first_token_time else None
            for request, ids in zip(wave, outputs):
                completions[request.id] = Completion(cut(ids, request.cap, setup.stop_ids), end - start, ttft)
            bar.update(len(wave))
    return Run(completions, time.time() - start)


def cb_num_blocks(requests: list[Request], slots: int, page_size: int) -> int:
    """Enough cache pages for `slots` of the longest requests, above the FIFO scheduler's 15 % free-page reserve."""
    longest = max(len(r.prompt_ids) + r.cap for r in requests)
    pages = slots * math.ceil(longest / page_size)
    return math.ceil(pages / 0.8) + 1


@measured
def run_transformers_cb(setup: Setup, slots: int, attn: str, ran: dict | None = None) -> Run:
    """transformers' continuous batching in its best configuration for the device; `ran` gets what it used."""
    from transformers import ContinuousBatchingConfig

    model = setup.model
    on_cuda = model.device.type == "cuda"
    original_attn = model.config._attn_implementation
    model.set_attn_implementation(attn)
    cb_config = ContinuousBatchingConfig(
        max_requests_per_batch=slots,
        max_batch_tokens=setup.budget,
        # Left unset, the cache takes 60 % of free RAM on CPU.
        num_blocks=cb_num_blocks(setup.requests, slots, ContinuousBatchingConfig.page_size),
        # On CUDA: graphs for its steps, and flash attention instead of sdpa where a flash kernel is installed.
        auto_switch_to_flash=on_cuda,
        use_cuda_graph=True if on_cuda else None,
    )
    gen_config = workload_config(setup, max(r.cap for r in setup.requests))
    gen_config.eos_token_id = -1 if setup.ignore_eos else sorted(setup.eos_ids)
    manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    try:
        manager.warmup()  # builds the paged cache now, as the engine does in its constructor
        if ran is not None:
            graphs = cb_config.use_cuda_graph   # transformers resolves it to (varlen, decode) booleans
            ran.update(attn=model.config._attn_implementation,
                       use_cuda_graph=list(graphs) if isinstance(graphs, tuple) else bool(graphs),
                       max_requests_per_batch=slots, max_batch_tokens=setup.budget)
        manager.start()
        run = collect_cb(manager, setup.requests, -1 if setup.ignore_eos else None)
    finally:
        manager.stop(block=True)
        model.destroy_cached_continuous_batching_manager()
        model.set_attn_implementation(original_attn)
    return run


def collect_cb(manager, requests: list[Request], eos_token_id: int | None = None) -> Run:
    start, start_perf = time.time(), time.perf_counter()
    for request in requests:
        manager.add_request(request.prompt_ids, request_id=request.id, max_new_tokens=request.cap,
                            record_timestamps=True, eos_token_id=eos_token_id)
    completions = {}
    with progress("transformers_cb", len(requests)) as bar:
        while len(completions) < len(requests):
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching stopped before all requests finished")
                continue
            if not out.is_finished():
                continue
            if out.error:
                raise RuntimeError(f"transformers continuous batching failed request {out.request_id}: {out.error}")
            # Its clocks are perf_counter readings taken in the generation thread.
            ttft = out.timestamps[0] - start_perf if out.timestamps else None
            completions[out.request_id] = Completion(list(out.generated_tokens), out.lifespan[1] - start_perf, ttft)
            bar.update(1)
    return Run(completions, time.time() - start)


@measured
def run_engine(setup: Setup, slots: int, budget: int, name: str = "engine", pack: bool = True) -> Run:
    from worker.engine import EngineConfig, LLMEngine

    # The pool is sized by the same rule as transformers_cb's, so peak memory compares like for like; or, with
    # --pool auto, by the engine's own rule (a share of the free GPU memory less its reserve for a step).
    blocks = None if setup.auto_pool else cb_num_blocks(setup.requests, slots, ENGINE_BLOCK_SIZE)
    config = EngineConfig(max_num_seqs=slots, max_num_batched_tokens=budget, block_size=ENGINE_BLOCK_SIZE,
                          num_blocks=blocks, pack_cpu_linears=pack, **setup.engine_options)
    engine = LLMEngine(setup.model, setup.tokenizer, config)
    try:
        return drive_engine(setup, engine, name)
    finally:
        engine.release_model()   # later methods get the model exactly as loaded


def drive_engine(setup: Setup, engine, name: str) -> Run:
    from worker.engine import SamplingParams

    print(f"{name}: {engine.runner.describe_steps()}; KV pool {engine.runner.num_blocks} blocks sized by "
          f"{engine.runner.sizing.describe(engine.config)}", file=sys.stderr, flush=True)
    start = time.time()
    for request in setup.requests:
        engine.add_request(request.id, prompt_token_ids=request.prompt_ids,
                           params=SamplingParams(temperature=setup.temperature, max_new_tokens=request.cap,
                                                 ignore_eos=setup.ignore_eos))
    completions, occupancy = {}, []
    with progress(name, len(setup.requests)) as bar:
        while engine.has_unfinished():
            events = engine.step()
            occupancy.append((time.time() - start, engine.stats().running))
            for event in events:
                if event.finished:
                    if event.finish_reason == "error":
                        raise RuntimeError(f"{name} failed request {event.request_id}: {event.error}")
                    ttft = event.first_token_time - start if event.first_token_time else None
                    completions[event.request_id] = Completion(list(event.token_ids),
                                                               event.finished_time - start, ttft)
                    bar.update(1)
    return Run(completions, time.time() - start, occupancy=occupancy)


# ---------------------------------------------------------------- reporting


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def format_table(rows: dict[str, dict], first_column: str = "method") -> str:
    header = [first_column, *METRIC_KEYS]
    body = [[str(name), *(fmt(metrics[k]) for k in METRIC_KEYS)] for name, metrics in rows.items()]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ratio_lines(methods: dict[str, dict]) -> list[str]:
    lines = []
    for ours in ("engine", "engine_best", "engine_dense"):
        for base in ("static", "transformers_cb", "llamacpp"):
            if ours in methods and base in methods and methods[base]["tokens_per_s"] > 0:
                ratio = methods[ours]["tokens_per_s"] / methods[base]["tokens_per_s"]
                lines.append(f"{ours} / {base}: {ratio:.2f}x")
    return lines


def describe(info: dict) -> str:
    import transformers

    return (f"device={info['device']} dtype={info['dtype']} slots={info['slots']} model={info['model']} "
            f"torch={torch.__version__} transformers={transformers.__version__} "
            f"threads={torch.get_num_threads()} python={platform.python_version()} budget={info.get('budget')}"
            + (f" decode={info['decode']}" if info.get("decode") else "")
            + (f" sampler_candidates={info['sampler_candidates']}" if "sampler_candidates" in info else "")
            + (f" overlap={info['overlap']}" if "overlap" in info else "")
            + (f" weights={info['weights']}" if "weights" in info else ""))


def plot_methods(path: Path, methods: dict[str, dict], runs: dict[str, Run]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, occupancy) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(methods)
    values = [methods[n]["tokens_per_s"] for n in names]
    bars.bar(names, values, color=[COLORS[n] for n in names])
    for x, v in enumerate(values):
        bars.text(x, v, f"{v:.1f}", ha="center", va="bottom")
    bars.set_ylabel("completion tokens / s")
    bars.set_title("Throughput")
    engine_runs = {n: r for n, r in runs.items() if r.occupancy}
    for name, run in engine_runs.items():
        times, running = zip(*run.occupancy)
        occupancy.step(times, running, where="post", label=name, color=COLORS[name])
    if engine_runs:
        occupancy.legend()
    else:
        occupancy.text(0.5, 0.5, "no engine run", ha="center", va="center", transform=occupancy.transAxes)
    occupancy.set_xlabel("time since start (s)")
    occupancy.set_ylabel("running sequences")
    occupancy.set_title("Batch occupancy per step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(path: Path, sweep: dict[int, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slots = list(sweep)
    throughput = [sweep[s]["tokens_per_s"] for s in slots]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(slots, throughput, marker="o")
    left.set_xscale("log", base=2)
    left.set_xticks(slots, [str(s) for s in slots])
    left.set_xlabel("max_num_seqs (slots)")
    left.set_ylabel("completion tokens / s")
    left.set_title("Engine throughput vs slots")
    for key, label in (("e2e_p50_s", "e2e p50"), ("e2e_p95_s", "e2e p95")):
        right.plot(throughput, [sweep[s][key] for s in slots], marker="o", label=label)
    for s, x, y in zip(slots, throughput, [sweep[s]["e2e_p95_s"] for s in slots]):
        right.annotate(str(s), (x, y), textcoords="offset points", xytext=(4, 4))
    right.set_xlabel("completion tokens / s")
    right.set_ylabel("latency (s)")
    right.set_title("Latency vs throughput (labels: slots)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- driver


DECODE_CHOICES = {"eager": {"enforce_eager": True},
                  "triton": {"enforce_eager": False, "decode_attention": "triton"},
                  "flex": {"enforce_eager": False, "decode_attention": "flex"},
                  "gather": {"enforce_eager": False, "decode_attention": "gather"}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--model", default=os.environ.get("MODEL") or None,
                        help="HF id, model dir or .gguf (default: env MODEL, else the bundled SmolLM2-135M)")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: per device)")
    parser.add_argument("--weights", default=None,
                        help="weight precision, as WEIGHTS: float32, int4, int8, bfloat16, w8a8, or auto (the worker's "
                             "default); default: env WEIGHTS, else float32 (the weights as stored); "
                             "`python -m bench.weights` compares several")
    parser.add_argument("--slots", type=int, default=16, help="batch slots N for static, transformers_cb and engine")
    parser.add_argument("--best-slots", type=int, default=None,
                        help=f"engine_best max_num_seqs (default: number of requests, at most {BEST_SLOTS_CAP})")
    parser.add_argument("--budget", type=int, default=None,
                        help="tokens per step for the engine and transformers CB alike (default: the engine's "
                             "device default, 512 on CPU and 8192 on CUDA)")
    parser.add_argument("--best-budget", type=int, default=BEST_BUDGET, help="engine_best max_num_batched_tokens")
    parser.add_argument("--cb-attn", choices=CB_ATTN_CHOICES, default=DEFAULT_CB_ATTN,
                        help="attention for transformers_cb (sdpa was faster than paged|eager on CPU)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first K requests")
    parser.add_argument("--workload", default=str(DEFAULT_WORKLOAD),
                        help=f"a workload JSON, a name shipped in bench/data (e.g. workload-256), or {NANO!r}: "
                             "nano-vllm's shape (random token ids, ignore_eos, temperature 0.6)")
    parser.add_argument("--requests", type=int, default=None,
                        help=f"--workload {NANO}: number of requests (default {NANO_REQUESTS})")
    parser.add_argument("--nano-lengths", default=None,
                        help=f"--workload {NANO}: prompt and output lengths LOW,HIGH "
                             f"(default {NANO_LENGTHS[0]},{NANO_LENGTHS[1]}; smaller for quick checks)")
    parser.add_argument("--random-weights", default=None, metavar="CONFIG",
                        help="a config.json, a directory holding one, or a built-in shape (qwen3-0.6b, "
                             "smollm2-135m): that model with random weights and the default model's tokenizer "
                             "(or --model's)")
    parser.add_argument("--step-profile", default=None, metavar="N,N,...",
                        help="e.g. 16,64,256: time the engine's decode step at each number of running sequences, "
                             "wall time against device busy time from the profiler: greedy, every knob sampled, "
                             "and the chat's sampling (top-p without top-k, DRY)")
    parser.add_argument("--profile-steps", type=int, default=8, help="--step-profile: decode steps measured")
    parser.add_argument("--mixed-profile", type=int, default=None, metavar="TOKENS",
                        help="e.g. 20000: time the steps that prefill one prompt of TOKENS random ids beside --slots "
                             "decodes (chunks of --budget tokens), with the most device memory they held")
    parser.add_argument("--pool", choices=("fit", "auto"), default="fit",
                        help="the engine's KV pool: sized to fit the workload like transformers CB's (fit), or by "
                             "the engine's own rule, a share of the free GPU memory less its reserve (auto)")
    parser.add_argument("--skip", default="", help=f"comma-separated, from: {','.join(SKIPPABLE)}")
    parser.add_argument("--sweep-slots", default=None,
                        help="e.g. 1,2,4,8,16,32: measure only the engine at each slot count (no reference run)")
    parser.add_argument("--decode", choices=sorted(DECODE_CHOICES), default=None,
                        help="the engine's decode steps: eager, or through static buffers (CUDA graphs on CUDA) "
                             "with triton or flex (in place) or gather attention (default: the device's default)")
    parser.add_argument("--compile", choices=("on", "off"), default=None,
                        help="the engine's decoder layers compiled for steps with Triton attention or the CPU "
                             "kernel (EngineConfig.compile_layers; default: the device's, on for CUDA)")
    parser.add_argument("--sampler-candidates", type=int, default=None, metavar="N",
                        help="the engine's top-k/top-p cut-off searched among the N best tokens first, 0 for a full "
                             "sort (default: 256 on CPU, a full sort elsewhere)")
    parser.add_argument("--overlap", choices=("on", "off"), default=None,
                        help="the engine's overlapped steps (EngineConfig.overlap_steps): the next step runs "
                             "while this one's tokens are read back (default: the device's, off)")
    parser.add_argument("--ablate", action="store_true",
                        help="also run engine_dense: the engine with N slots on dense (unpacked) CPU matmuls")
    parser.add_argument("--baseline", choices=("llamacpp",), default=None,
                        help="also run llama.cpp's llama-server (`make llamacpp`) on the same GGUF, slots and "
                             "threads, every request at once through its OpenAI endpoint, after the other methods")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG here")
    args = parser.parse_args(argv)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = args.skip - set(SKIPPABLE)
    if unknown:
        parser.error(f"--skip: unknown {sorted(unknown)}; choose from {','.join(SKIPPABLE)}")
    for name in ("sweep_slots", "step_profile", "nano_lengths"):
        value = getattr(args, name)
        if value:
            try:
                setattr(args, name, [int(s) for s in value.split(",") if s.strip()])
            except ValueError:
                parser.error(f"--{name.replace('_', '-')} takes comma-separated integers, e.g. 1,2,4,8")
            if min(getattr(args, name)) < 1:
                parser.error(f"--{name.replace('_', '-')}: every value must be >= 1")
    if args.nano_lengths and (len(args.nano_lengths) != 2 or args.nano_lengths[0] > args.nano_lengths[1]):
        parser.error("--nano-lengths takes LOW,HIGH with LOW <= HIGH, e.g. 100,1024")
    if args.workload != NANO and (args.requests or args.nano_lengths):
        parser.error(f"--requests and --nano-lengths apply to --workload {NANO}; use --limit for a workload file")
    if args.baseline and (args.workload == NANO or args.random_weights or args.sweep_slots or args.step_profile
                          or args.mixed_profile):
        parser.error("--baseline llamacpp runs a chat workload file on the model's GGUF: it does not take "
                     f"--workload {NANO}, --random-weights, --sweep-slots, --step-profile or --mixed-profile")
    if sum(1 for mode in (args.sweep_slots, args.step_profile, args.mixed_profile) if mode) > 1:
        parser.error("--sweep-slots, --step-profile and --mixed-profile are separate runs; give one")
    for name in ("slots", "budget", "best_slots", "best_budget", "limit", "requests", "profile_steps", "mixed_profile"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def engine_wanted(args: argparse.Namespace) -> bool:
    profiles = args.sweep_slots or args.step_profile or args.mixed_profile
    return bool(profiles) or bool({"engine", "engine_best"} - args.skip)


def check_engine_importable() -> None:
    try:
        from worker.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"worker.engine is not importable ({exc}); add --skip engine,engine_best") from exc


def device_budget(device_type: str) -> int:
    """The engine's default tokens per step on this device (512 when the engine cannot be imported)."""
    try:
        from worker.engine.sizing import default_budget
    except ImportError:
        return 512
    return default_budget(device_type)


def prepare(args: argparse.Namespace) -> tuple[Setup, dict]:
    torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    if args.random_weights:
        from bench.random_model import load_random_model

        model, tokenizer = load_random_model(args.random_weights, device=args.device, dtype=args.dtype,
                                             tokenizer_model=args.model)
    else:
        model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype,
                                      weights=args.weights or os.environ.get("WEIGHTS"))
    nano = args.workload == NANO
    if nano:
        requests = nano_workload(args.requests or NANO_REQUESTS, tuple(args.nano_lengths or NANO_LENGTHS))
        requests = requests[:args.limit] if args.limit else requests
    else:
        requests = load_workload(resolve_workload(args.workload), tokenizer, args.limit)
    eos_ids = eos_ids_of(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    info = {"slots": args.slots, "device": str(model.device), "dtype": str(model.dtype).removeprefix("torch."),
            "model": getattr(model, "name_or_source", args.model), "workload": Path(args.workload).name}
    if getattr(model, "weights_report", None) is not None:
        info["weights"] = model.weights_report.weights
        info["weights_mb"] = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) / 2**20
    options = dict(DECODE_CHOICES[args.decode]) if args.decode else {}
    if args.sampler_candidates is not None:
        options["sampler_candidates"] = info["sampler_candidates"] = args.sampler_candidates
    if args.overlap is not None:
        options["overlap_steps"] = args.overlap == "on"
        info["overlap"] = args.overlap
    if args.compile is not None:
        options["compile_layers"] = args.compile == "on"
        info["compile"] = args.compile
    budget = args.budget or device_budget(model.device.type)
    info["budget"] = budget
    setup = Setup(model, tokenizer, requests, eos_ids, pad_id, temperature=NANO_TEMPERATURE if nano else 0.0,
                  ignore_eos=nano, engine_options=options, budget=budget, auto_pool=args.pool == "auto")
    if args.pool == "auto":
        info["pool"] = "auto"
    if args.decode:
        info["decode"] = args.decode
    return setup, info


def compare(args: argparse.Namespace, setup: Setup, info: dict) -> dict:
    # Sampled outputs have no single right answer: greedy matches are counted only for greedy workloads.
    reference = None if "reference" in args.skip or setup.temperature > 0 else run_reference(setup)
    best_slots = args.best_slots or min(len(setup.requests), BEST_SLOTS_CAP)
    cb_ran: dict = {}
    plans = {
        "static": lambda: run_static(setup, args.slots),
        "transformers_cb": lambda: run_transformers_cb(setup, args.slots, args.cb_attn, cb_ran),
        "engine": lambda: run_engine(setup, args.slots, setup.budget),
        "engine_best": lambda: run_engine(setup, best_slots, args.best_budget, name="engine_best"),
    }
    if args.ablate:
        # The engine's scheduling alone, on the same dense matmuls the baselines use.
        plans["engine_dense"] = lambda: run_engine(setup, args.slots, setup.budget, name="engine_dense", pack=False)
    runs = {name: plan() for name, plan in plans.items() if name not in args.skip}
    methods = {name: summarize(run, setup.requests, setup.stop_ids, reference) for name, run in runs.items()}
    baseline = run_llamacpp(args, setup, reference) if args.baseline else None
    if baseline is not None:
        methods["llamacpp"] = baseline.pop("metrics")
        for name, run in runs.items():   # the p90s of llama.cpp's row, for the latency ratios
            methods[name].update(llamacpp.p90s([c.e2e_s for c in run.completions.values()],
                                               [c.ttft_s for c in run.completions.values()]))
    print()
    print(format_table(methods))
    print()
    for line in ratio_lines(methods) + llamacpp.comparison_lines(methods):
        print(line)
    print(describe(info))
    if baseline is not None:
        print(f"llamacpp: {baseline['version']}; answers with the reference's text: "
              f"{fmt(methods['llamacpp']['text_matches'])} of {methods['llamacpp']['requests']}; prompts of the "
              f"engine's token count: {baseline['prompts_of_our_length']}; "
              f"ran: {' '.join(baseline['command'])}")
    if setup.temperature > 0:
        print(f"sampled at temperature {setup.temperature}: greedy matches not counted")
    if "transformers_cb" in runs:
        print("transformers_cb ran with: " + " ".join(f"{k}={v}" for k, v in cb_ran.items()))
    if "engine_best" in runs:
        print(f"engine_best: max_num_seqs={best_slots} max_num_batched_tokens={args.best_budget}")
    if args.plot:
        plot_methods(args.plot, methods, runs)
    result = {**info, "methods": methods}
    if reference is not None:
        result["reference"] = reference
    if "engine" in runs:
        result["engine_outputs"] = {rid: cut(c.ids, c_cap, setup.stop_ids) for rid, c, c_cap in
                                    ((r.id, runs["engine"].completions[r.id], r.cap) for r in setup.requests)}
    if cb_ran:
        result["transformers_cb"] = cb_ran
    if baseline is not None:
        result["llamacpp"] = baseline
    return result


def run_llamacpp(args: argparse.Namespace, setup: Setup, reference: dict[str, list[int]] | None) -> dict:
    """llama.cpp's server on the same GGUF, slots, threads and requests; its metrics and how it ran."""
    binary, gguf = llamacpp.find_server(), llamacpp.baseline_gguf(args.model)
    workload = json.loads(resolve_workload(args.workload).read_text())
    requests = llamacpp.chat_requests(workload, args.limit)
    longest = max(len(r.prompt_ids) + r.cap for r in setup.requests)
    print(f"llamacpp: {binary} on {gguf.name}, {args.slots} slots, {torch.get_num_threads()} threads",
          file=sys.stderr, flush=True)
    run = llamacpp.run_baseline(binary, gguf, requests, args.slots, torch.get_num_threads(), longest)
    texts = None if reference is None else {
        rid: setup.tokenizer.decode(ids, skip_special_tokens=True) for rid, ids in reference.items()}
    # llama.cpp applies the GGUF's chat template itself: count the prompts it saw at our length.
    same_prompts = sum(1 for r in setup.requests if run.results[r.id].prompt_tokens == len(r.prompt_ids))
    return {"metrics": llamacpp.summarize(run, texts), "version": run.version, "command": run.command,
            "gguf": str(gguf), "threads": torch.get_num_threads(), "prompts_of_our_length": same_prompts}


def sweep(args: argparse.Namespace, setup: Setup, info: dict) -> dict:
    results = {}
    for slots in args.sweep_slots:
        run = run_engine(setup, slots, max(setup.budget, slots), name=f"engine@{slots}")
        results[slots] = summarize(run, setup.requests, setup.stop_ids, None)
    print()
    print(format_table(results, first_column="slots"))
    print(describe({**info, "slots": ",".join(map(str, args.sweep_slots))}))
    if args.plot:
        plot_sweep(args.plot, results)
    return {**info, "slots": args.sweep_slots, "sweep": {str(s): m for s, m in results.items()}}


def step_params(sampling: str, seed: int, cap: int):
    from worker.engine import SamplingParams

    if sampling == "greedy":
        return SamplingParams(temperature=0.0, max_new_tokens=cap, ignore_eos=True)
    if sampling == "chat":   # the chat's defaults (webapp/config.py): top-p without a top-k, and DRY on the answer
        return SamplingParams(temperature=0.7, top_p=0.9, dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2,
                              dry_include_prompt=False, seed=seed, max_new_tokens=cap, ignore_eos=True)
    # Every sampling knob at once, each request with a seed of its own.
    return SamplingParams(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1, seed=seed,
                          max_new_tokens=cap, ignore_eos=True)


@contextmanager
def c_kernels_profiled(device: torch.device) -> Iterator[None]:
    """On a CPU, each call into the engine's C kernels (attention, w8a8, layer ops, whole layers, the sampler's)
    shows in the profiler as a range named "c::<function>", so that their time counts as busy: ctypes calls are no
    operators of torch's. Nothing is changed on other devices, nor outside the block."""
    from worker.engine import native

    wrapped = []
    if device.type == "cpu":
        for lib, names in ((native.load(), ("paged_attention_f32",)),
                           (native.load_int8_rows(), tuple(native.INT8_ARGTYPES)),
                           (native.load_layer_ops(), tuple(native.LAYER_ARGTYPES)),
                           (native.load_layer_step(), ("layer_step",)),
                           (native.load_top_k(), ("top_k_f32", "exp_sums_f32", "first_largest_f32"))):
            for name in names if lib is not None else ():
                call = getattr(lib, name)

                def recorded(*args, _call=call, _label=f"c::{name}"):
                    with torch.profiler.record_function(_label):
                        return _call(*args)

                setattr(lib, name, recorded)
                wrapped.append((lib, name, call))
    try:
        yield
    finally:
        for lib, name, call in wrapped:
            setattr(lib, name, call)


def device_busy_ms(prof, device: torch.device) -> tuple[str, float]:
    """What the profiler saw doing work: kernel time on a GPU; on a CPU time inside operators and the C kernels
    (self time, c_kernels_profiled)."""
    if device.type == "cuda":
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return "gpu_kernels", sum(e.time_range.elapsed_us() for e in kernels) / 1000
    return "cpu_ops", sum(e.self_cpu_time_total for e in prof.key_averages()) / 1000


def device_activity(prof, steps: int, layers: int) -> dict:
    """On a GPU, per step: host-to-device copies by source memory (a pageable one is staged and waited for;
    the step buffers are meant to be pinned), kernels launched (and per layer), the time between one kernel's
    end and the next one's start, and the five kernels that took the most time."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies: dict[str, int] = {}
    kernels: dict[str, float] = {}
    launched = [e for e in events if not e.name.startswith("Memcpy") and not e.name.startswith("Memset")]
    for e in events:
        if e.name.startswith("Memcpy HtoD"):
            copies[e.name] = copies.get(e.name, 0) + 1
        kernels[e.name] = kernels.get(e.name, 0.0) + e.time_range.elapsed_us() / 1000
    top = sorted(kernels.items(), key=lambda item: -item[1])[:5]
    spans = sorted((e.time_range.start, e.time_range.end) for e in launched)
    gaps = [max(0, b[0] - a[1]) for a, b in zip(spans, spans[1:])]
    return {"h2d_copies_per_step": {k: v / steps for k, v in sorted(copies.items())},
            "kernels_per_step": len(launched) / steps, "kernels_per_layer": len(launched) / steps / layers,
            "median_gap_us": percentile(gaps, 50) if gaps else None,
            "top_kernels_ms_per_step": {k[:80]: v / steps for k, v in top}}


def num_layers(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 1))


def table_writers(engine) -> list:
    """The engine's block tables that persist on the device (block_tables.SlotTables)."""
    runner = engine.runner
    found = []
    for paged in (getattr(runner.decode_graphs, "paged", None), runner.paged):
        if paged is not None and paged.slots not in found:
            found.append(paged.slots)
    tables = getattr(runner.decode_graphs, "tables", None)
    return found + ([tables] if tables is not None else [])


def decode_path(engine, seqs: int) -> dict:
    """Which static bucket and compiled decode row count a step of `seqs` sequences takes (None: eager)."""
    graphs = engine.runner.decode_graphs
    if graphs is None or not graphs.fits(seqs, 1):
        return {"bucket": None, "kernel_rows": None}
    bucket = graphs.bucket(seqs)
    return {"bucket": bucket, "kernel_rows": graphs.paged.rows_for(bucket) if graphs.paged is not None else None}


def profile_decode(setup: Setup, seqs: int, slots: int, sampling: str, steps: int) -> dict:
    """Fill `seqs` of `slots` slots, prefill them all, then time decode-only steps: wall clock, then under the
    profiler. With fewer sequences than slots the steps run in a smaller bucket, as they do in service."""
    from worker.engine import EngineConfig, LLMEngine

    prompts = [setup.requests[i % len(setup.requests)].prompt_ids for i in range(seqs)]
    budget = max(BEST_BUDGET, 2 * slots)
    # Sequences that finish prefill early decode while the rest prefill: their caps cover that, then the
    # measured steps, so no sequence ends (and no slot empties) before the measurement does.
    cap = -(-sum(map(len, prompts)) // (budget - seqs)) + 2 * steps + 8
    blocks = None if setup.auto_pool else sum(-(-(len(p) + cap) // ENGINE_BLOCK_SIZE) for p in prompts) + 1
    config = EngineConfig(max_num_seqs=slots, max_num_batched_tokens=budget, block_size=ENGINE_BLOCK_SIZE,
                          num_blocks=blocks, **setup.engine_options)
    cuda = setup.model.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    engine = LLMEngine(setup.model, setup.tokenizer, config)
    print(f"{seqs} of {slots} slots: {engine.runner.describe_steps()}; KV pool {engine.runner.num_blocks} blocks "
          f"sized by {engine.runner.sizing.describe(engine.config)}", file=sys.stderr, flush=True)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        for i, ids in enumerate(prompts):
            engine.add_request(f"p{i}", prompt_token_ids=ids, params=step_params(sampling, i, cap))

        def decoding() -> bool:
            stats = engine.stats()
            return stats.last_batch_seqs == stats.last_batch_tokens == seqs

        while not decoding():
            engine.step()
        for _ in range(2):   # warm: allocator, first-use kernels
            engine.step()
        writers = table_writers(engine)
        written = sum(t.entries_written for t in writers)
        walls = []
        for _ in range(steps):
            sync()
            start = time.perf_counter()
            engine.step()
            sync()
            walls.append(time.perf_counter() - start)
            if not decoding():
                raise RuntimeError(f"the step at {seqs} sequences stopped being decode-only")
        written = sum(t.entries_written for t in writers) - written
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with c_kernels_profiled(engine.device), torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
            sync()
        busy_kind, busy = device_busy_ms(prof, engine.device)
        extra = device_activity(prof, steps, num_layers(setup.model)) if cuda else {}
        if cuda:   # the pool, the graphs and every step so far, against what the device holds
            extra["peak_device_mb"] = torch.cuda.max_memory_allocated() / 2**20
            extra["device_total_mb"] = torch.cuda.mem_get_info()[1] / 2**20
        path = decode_path(engine, seqs)
    finally:
        engine.release_model()
    wall_ms = 1000 * sum(walls) / len(walls)
    return {"seqs": seqs, "slots": slots, "sampling": sampling, **path, "wall_ms": wall_ms,
            "wall_p50_ms": 1000 * percentile(walls, 50), "busy_kind": busy_kind, "busy_ms": busy / steps,
            "wall_over_busy": wall_ms / (busy / steps), "table_ids_per_step": written / steps if writers else None,
            "steps": steps, **extra}


def step_profile(args: argparse.Namespace, setup: Setup, info: dict) -> dict:
    slots = max(args.step_profile)   # one engine size for every row: smaller counts run in smaller buckets
    rows = [profile_decode(setup, n, slots, sampling, args.profile_steps)
            for n in args.step_profile for sampling in STEP_SAMPLINGS]
    print()
    header = ("seqs", "sampling", "bucket", "kernel_rows", "wall_ms", "wall_p50_ms", "busy_kind", "busy_ms",
              "wall_over_busy", "table_ids_per_step")
    print("  ".join(f"{h:>14}" for h in header))
    for row in rows:
        print("  ".join(f"{fmt(row[h]):>14}" for h in header))
    print()
    for n in args.step_profile:
        greedy, *others = (next(r for r in rows if r["seqs"] == n and r["sampling"] == s) for s in STEP_SAMPLINGS)
        print(f"{n} seqs: " + ", ".join(f"{r['sampling']} / greedy step wall {r['wall_ms'] / greedy['wall_ms']:.2f}x"
                                         for r in others))
    for row in rows:
        if "h2d_copies_per_step" in row:
            print(f"{row['seqs']} seqs {row['sampling']}: host-to-device copies per step "
                  f"{row['h2d_copies_per_step']}; kernels per step {fmt(row['kernels_per_step'])} "
                  f"({fmt(row['kernels_per_layer'])} a layer), median gap between kernels "
                  f"{fmt(row['median_gap_us'])} us; top kernels (ms per step) {row['top_kernels_ms_per_step']}; "
                  f"peak memory {fmt(row['peak_device_mb'])} of {fmt(row['device_total_mb'])} MB")
    if rows and rows[0]["busy_kind"] == "cpu_ops":
        print("busy = time inside operators and the C kernels (profiler self CPU time); the rest of the wall is "
              "Python and dispatch. No GPU kernel time on this device.")
    print("transformers_cb: not step-profiled (its steps run inside its own loop thread)")
    print(describe({**info, "slots": slots}))
    return {**info, "slots": slots, "step_profile": rows}


def profile_mixed(args: argparse.Namespace, setup: Setup, info: dict) -> dict:
    """Steps that prefill one long prompt (--mixed-profile tokens, in chunks of the step budget) beside --slots
    decodes: wall time, device busy time and the most memory held, against the same number of decode-only
    steps before it."""
    from worker.engine import EngineConfig, LLMEngine

    decodes, long_tokens, budget = args.slots, args.mixed_profile, setup.budget
    chunk = budget - decodes
    if chunk < 1:
        raise SystemExit(f"--mixed-profile: a budget of {budget} leaves no room for a prompt beside {decodes} decodes")
    prefill_steps = -(-long_tokens // chunk)
    prompts = [setup.requests[i % len(setup.requests)].prompt_ids for i in range(decodes)]
    cap = -(-sum(map(len, prompts)) // chunk) + 2 * prefill_steps + 16
    rng = random.Random(1)
    long_ids = [rng.randint(0, NANO_MAX_TOKEN_ID) for _ in range(long_tokens)]
    blocks = (sum(-(-(len(p) + cap) // ENGINE_BLOCK_SIZE) for p in prompts)
              + -(-(long_tokens + 8) // ENGINE_BLOCK_SIZE) + 1)
    config = EngineConfig(max_num_seqs=decodes + 1, max_num_batched_tokens=budget, block_size=ENGINE_BLOCK_SIZE,
                          num_blocks=blocks, max_model_len=long_tokens + 8, **setup.engine_options)
    engine = LLMEngine(setup.model, setup.tokenizer, config)
    print(f"{decodes} decodes beside {long_tokens} prompt tokens: {engine.runner.describe_steps()}",
          file=sys.stderr, flush=True)
    cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    result = {"decodes": decodes, "long_tokens": long_tokens, "budget": budget}
    try:
        for i, ids in enumerate(prompts):
            engine.add_request(f"d{i}", prompt_token_ids=ids, params=step_params("greedy", i, cap))
        while not (engine.stats().last_batch_seqs == engine.stats().last_batch_tokens == decodes):
            engine.step()
        # Warm: a shorter prompt of other ids (nothing for the long one to find cached) compiles the mixed step.
        engine.add_request("warm", prompt_token_ids=[rng.randint(0, NANO_MAX_TOKEN_ID) for _ in range(2 * chunk)],
                           params=step_params("greedy", 0, 1))
        while "warm" in engine.seqs:
            engine.step()
        for name, work in (("decode_only", None), ("mixed", long_ids)):
            if work is not None:
                engine.add_request("long", prompt_token_ids=work, params=step_params("greedy", 0, 2))
            sync()
            before = torch.cuda.memory_allocated() if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            walls = []
            with c_kernels_profiled(engine.device), torch.profiler.profile(activities=activities) as prof:
                for _ in range(prefill_steps):
                    start = time.perf_counter()
                    engine.step()
                    sync()
                    walls.append(time.perf_counter() - start)
            busy_kind, busy = device_busy_ms(prof, engine.device)
            result[name] = {"steps": prefill_steps, "wall_ms": 1000 * sum(walls) / len(walls),
                            "busy_kind": busy_kind, "busy_ms": busy / prefill_steps,
                            "peak_extra_mb": (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else None}
        long_seq = engine.seqs.get("long")
        result["long_prefilled"] = long_seq is None or long_seq.num_computed_tokens >= long_tokens
    finally:
        engine.release_model()
    print()
    for name in ("decode_only", "mixed"):
        r = result[name]
        print(f"{name:>12}: {r['steps']} steps, wall {fmt(r['wall_ms'])} ms, {r['busy_kind']} {fmt(r['busy_ms'])} ms, "
              f"peak beyond the pool and model {fmt(r['peak_extra_mb'])} MB")
    print(f"the long prompt prefilled within the mixed steps: {result['long_prefilled']} (profiled steps, "
          "so walls include the profiler's overhead)")
    print(describe({**info, "slots": decodes}))
    return {**info, "mixed_profile": result}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if engine_wanted(args):
        check_engine_importable()
    if args.baseline:   # before the model loads: a missing binary or GGUF fails at once
        llamacpp.find_server(), llamacpp.baseline_gguf(args.model)
    setup, info = prepare(args)
    if not setup.requests:
        raise SystemExit(f"no requests in {args.workload}")
    warm_up(setup)
    if args.step_profile:
        result = step_profile(args, setup, info)
    elif args.mixed_profile:
        result = profile_mixed(args, setup, info)
    elif args.sweep_slots:
        result = sweep(args, setup, info)
    else:
        result = compare(args, setup, info)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
