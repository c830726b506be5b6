"""`python -m bench.weights`: the engine at each weight precision in one run, with the quality each costs.

Each precision runs `python -m bench --weights W` in a process of its own (its memory is its own): engine
tokens/s at --slots, greedy agreement with per-prompt `generate` on the same precision, the process's peak RSS
and the bytes its weights take. Then every precision's model scores the float32 model's greedy answers (mean
log-likelihood per answer token) and its own answers are compared with float32's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.engine import load_workload, resolve_workload
from worker.model_loader import load_model

CHOICES = ("float32", "int4", "int8", "bfloat16")


def run_precision(weights: str, args: argparse.Namespace, out: Path) -> dict:
    command = [sys.executable, "-m", "bench", "--weights", weights, "--slots", str(args.slots), "--skip",
               "static,transformers_cb,engine_best", "--workload", args.workload, "--json", str(out)]
    if args.model:
        command += ["--model", args.model]
    if args.limit:
        command += ["--limit", str(args.limit)]
    print(f"== {weights}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


@torch.inference_mode()
def score(model, prompts: dict[str, list[int]], answers: dict[str, list[int]]) -> float:
    """Mean log-probability per token of `answers` after their prompts, teacher-forced."""
    total, count = 0.0, 0
    for rid, answer in answers.items():
        if not answer:
            continue
        ids = torch.tensor([prompts[rid] + answer])
        logits = model(input_ids=ids).logits[0, len(prompts[rid]) - 1:-1].float()
        picked = torch.log_softmax(logits, -1).gather(1, torch.tensor(answer)[:, None])
        total += picked.sum().item()
        count += len(answer)
    return total / max(count, 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default=",".join(CHOICES), help="comma-separated precisions, float32 first")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--workload", default="workload.json")
    parser.add_argument("--model", default=None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    wanted = [w.strip() for w in args.weights.split(",") if w.strip()]
    if not wanted or wanted[0] != "float32" or any(w not in CHOICES for w in wanted):
        parser.error(f"--weights takes float32 first, then any of {', '.join(CHOICES[1:])}")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for weights in wanted:
            runs[weights] = run_precision(weights, args, Path(tmp) / f"{weights}.json")
    _, tokenizer = load_model(args.model, device="cpu")
    prompts = {r.id: r.prompt_ids for r in load_workload(resolve_workload(args.workload), tokenizer, args.limit)}
    base = runs["float32"]["reference"]
    rows = {}
    for weights in wanted:
        model, _ = load_model(args.model, device="cpu", weights=weights)
        engine = runs[weights]["methods"]["engine"]
        own = runs[weights]["reference"]
        same = sum(1 for rid in base if own.get(rid) == base[rid])
        rows[weights] = {
            "tokens_per_s": engine["tokens_per_s"],
            "vs_float32": engine["tokens_per_s"] / runs["float32"]["methods"]["engine"]["tokens_per_s"],
            "greedy_matches": f"{engine['greedy_matches']}/{engine['requests']}",
            "peak_rss_mb": engine["peak_rss_mb"],
            "weights_mb": runs[weights].get("weights_mb"),
            "loglik_of_float32_answers": score(model, prompts, base),
            "answers_as_float32": f"{same}/{len(base)}",
        }
        del model
    print()
    keys = list(next(iter(rows.values())))
    print("weights   " + "  ".join(f"{k:>26}" for k in keys))
    for weights, row in rows.items():
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()]
        print(f"{weights:<9} " + "  ".join(f"{c:>26}" for c in cells))
    print(f"slots={args.slots} workload={args.workload} torch={torch.__version__} threads={torch.get_num_threads()}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
