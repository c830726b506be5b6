"""Every step of one engine run timed by kind (decode-only or mixed), and the slowest kinds profiled.

    python -m bench.step_trace --random-weights qwen3-0.6b [--requests 256] [--profile 2] [--json PATH]

Each step is synchronised before its clock stops (steps are not overlapped here), so a step's wall time is
its own. The table groups steps by kind, decode rows and prefill tokens; the profiles show, for the first
mixed steps past warm-up, the operators that took the most host time and the most device time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.engine import ENGINE_BLOCK_SIZE, NANO_LENGTHS, NANO_TEMPERATURE, nano_workload
from bench.random_model import load_random_model


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work, so a clock read after it counts that work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profile_table(prof, device: torch.device, rows: int = 12) -> str:
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    dev = prof.key_averages().table(sort_by=key, row_limit=rows) if device.type == "cuda" else ""
    return f"-- by host time\n{host}\n-- by device time\n{dev}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-weights", default="qwen3-0.6b")
    parser.add_argument("--model", default=None, help="tokenizer (default: the default model's)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--lengths", default=None, help="LOW,HIGH prompt and output lengths (nano's: 100,1024)")
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--budget", type=int, default=None)
    parser.add_argument("--profile", type=int, default=2, help="mixed steps profiled")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="stop the run after this long")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from worker.engine import EngineConfig, LLMEngine, SamplingParams

    model, tokenizer = load_random_model(args.random_weights, device=args.device, dtype=args.dtype,
                                         tokenizer_model=args.model)
    device = model.device
    lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else NANO_LENGTHS
    requests = nano_workload(args.requests, lengths)
    config = EngineConfig(max_num_seqs=args.slots, max_num_batched_tokens=args.budget, block_size=ENGINE_BLOCK_SIZE,
                          overlap_steps=False)
    built = time.perf_counter()
    engine = LLMEngine(model, tokenizer, config)
    print(f"engine built in {time.perf_counter() - built:.1f} s: {engine.runner.describe_steps()}", flush=True)
    for r in requests:
        engine.add_request(r.id, prompt_token_ids=r.prompt_ids,
                           params=SamplingParams(temperature=NANO_TEMPERATURE, max_new_tokens=r.cap, ignore_eos=True))
    steps, profiles = [], []
    runner_run = engine.runner.run
    shape: dict = {}

    def traced_run(batch, pending=None):
        shape.update(decodes=len(batch.decodes), prefill=sum(n for _, n in batch.prefills))
        return runner_run(batch, pending)

    engine.runner.run = traced_run
    start = time.perf_counter()
    while engine.has_unfinished() and time.perf_counter() - start < args.max_seconds:
        mixed_seen = sum(1 for s in steps if s["prefill"])
        profiling = shape.get("prefill") and 2 <= mixed_seen < 2 + args.profile
        sync_device(device)
        t0 = time.perf_counter()
        if profiling:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                engine.step()
                sync_device(device)
        else:
            engine.step()
            sync_device(device)
        wall = (time.perf_counter() - t0) * 1e3
        steps.append({"decodes": shape.get("decodes", 0), "prefill": shape.get("prefill", 0), "wall_ms": wall,
                      "profiled": bool(profiling)})
        if profiling:
            profiles.append(f"step {len(steps)}: {steps[-1]}\n{_profile_table(prof, device)}")
    total = time.perf_counter() - start

    groups: dict[str, list[float]] = {}
    for s in steps:
        if s["profiled"]:
            continue
        kind = "mixed" if s["prefill"] and s["decodes"] else ("prefill" if s["prefill"] else "decode")
        groups.setdefault(kind, []).append(s["wall_ms"])
    for text in profiles:
        print(text)
    print(f"\n{len(steps)} steps in {total:.1f} s ({'finished' if not engine.has_unfinished() else 'stopped'})")
    print(f"{'kind':8} {'steps':>6} {'total_s':>8} {'p50_ms':>8} {'max_ms':>8}")
    for kind, walls in groups.items():
        print(f"{kind:8} {len(walls):6d} {sum(walls) / 1e3:8.2f} {statistics.median(walls):8.1f} {max(walls):8.1f}")
    print("first 30 steps (decodes, prefill tokens, ms):",
          [(s["decodes"], s["prefill"], round(s["wall_ms"], 1)) for s in steps[:30]])
    result = {"steps": steps, "total_s": total, "device": str(device), "model": model.name_or_source}
    if args.json:
        args.json.write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
