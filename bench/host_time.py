"""The host's share of a decode step, by part: scheduling, the runner (inputs and forward), drawing, appending tokens.

    python -m bench.host_time [--rows 256] [--layers 1] [--steps 40] [--stop STR] [--temperature T] [--top-p P]
                              [--dry-multiplier M] [--static] [--device cuda] [--model TOKENIZER]

A model of the default model's shape cut to `--layers` layers (random weights), so the forward pass is small and
what is left is the engine's own work per step: `--rows` requests decode side by side (EOS ignored), and after
warm-up each part of `--steps` steps is timed with the device synchronised at its end. "append" is the per-row
Python of a step (detokenising, events, finish checks); "draw" is the sampler; "runner" builds the step's inputs
and runs the model. Prints milliseconds a step and microseconds a row, and the append part alone on warm caches
("append_warm").
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.random_model import CONFIG_DIR, load_random_model
from bench.step_trace import sync_device
from worker.engine import EngineConfig, LLMEngine, SamplingParams

PARTS = ("schedule", "runner", "draw", "append")
APPEND_REPEATS = 100   # calls of the append part alone, on warm caches, after the steps


class PartClock:
    """Wraps an object's method so each call's time, device synchronised, adds to `spent[name]`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.spent = {name: 0.0 for name in PARTS}
        self.on = False

    def wrap(self, owner, method: str, name: str) -> None:
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            if not self.on:
                return inner(*args, **kwargs)
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            sync_device(self.device)
            self.spent[name] += time.perf_counter() - start
            return out

        setattr(owner, method, timed)


def append_alone(engine: LLMEngine, words: list[int]) -> float:
    """Median ms of the append part alone over every running row, called back to back: on a GPU the host does
    little else, so its caches stay warm; on a CPU the forward pass between steps evicts them."""
    seqs = [seq for seq in engine.seqs.values() if not seq.finished]
    times = []
    for rep in range(APPEND_REPEATS):
        tokens = [words[(rep + i) % len(words)] for i in range(len(seqs))]
        start = time.perf_counter()
        engine._append_tokens(seqs, tokens)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def cut_config(layers: int, base: str = "smollm2-135m") -> Path:
    """The built-in shape with `layers` decoder layers, written to a temporary config.json."""
    settings = json.loads((CONFIG_DIR / f"{base}.json").read_text())
    settings["num_hidden_layers"] = layers
    path = Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(json.dumps(settings))
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--prompt", type=int, default=24, help="prompt tokens a request")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--dry-multiplier", type=float, default=0.0, help="DRY (the chat's: 0.8)")
    parser.add_argument("--stop", action="append", default=[], help="a stop string every request has (repeatable)")
    parser.add_argument("--static", action="store_true", help="static decode buffers on CPU (enforce_eager=False)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--model", default=None, help="tokenizer (default: the default model's)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    model, tok = load_random_model(str(cut_config(args.layers)), device=args.device, tokenizer_model=args.model)
    device = next(model.parameters()).device
    total_tokens = args.prompt + args.warmup + args.steps + APPEND_REPEATS + 8
    config = EngineConfig(max_num_seqs=args.rows, max_num_batched_tokens=max(args.rows * args.prompt, 512),
                          max_model_len=max(256, total_tokens), enforce_eager=False if args.static else None,
                          num_blocks=args.rows * (-(-total_tokens // 16) + 1) + 8)
    engine = LLMEngine(model, tok, config)
    clock = PartClock(device)
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine.runner, "run", "runner")
    clock.wrap(engine, "_draw", "draw")
    clock.wrap(engine, "_append_tokens", "append")
    words = tok.encode(" the order has shipped and the parcel is on its way to you", add_special_tokens=False)
    params = SamplingParams(max_new_tokens=args.warmup + args.steps + APPEND_REPEATS + 4, temperature=args.temperature,
                            top_p=args.top_p, dry_multiplier=args.dry_multiplier,
                            ignore_eos=True, stop=args.stop)
    for i in range(args.rows):
        prompt = [(words[(i + j) % len(words)]) for j in range(args.prompt)]
        engine.add_request(f"r{i}", prompt, params=params)
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.seqs.values()):
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    walls = []
    clock.on = True
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        sync_device(device)
        walls.append(time.perf_counter() - start)
    clock.on = False
    assert engine.last_batch[0] == args.rows, f"the measured steps decoded {engine.last_batch[0]} rows"
    ms = {name: 1e3 * spent / args.steps for name, spent in clock.spent.items()}
    ms["step"] = 1e3 * statistics.fmean(walls)
    ms["other"] = ms["step"] - sum(ms[name] for name in PARTS)
    ms["append_warm"] = append_alone(engine, words)
    figures = {"rows": args.rows, "layers": args.layers, "device": str(device), "steps": args.steps, "stop": args.stop,
               "describe": engine.runner.describe_steps(), "ms_per_step": ms,
               "us_per_row": {k: 1e3 * v / args.rows for k, v in ms.items()}}
    stops = f", stop strings {args.stop}" if args.stop else ""
    print(f"{args.rows} rows, {args.layers} layer(s), {device}{stops}: {figures['describe']}")
    for name in (*PARTS, "other", "step", "append_warm"):
        print(f"  {name:9s} {ms[name]:8.3f} ms a step  {figures['us_per_row'][name]:7.2f} us a row")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main()
