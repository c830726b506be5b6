"""`python -m bench.weights`: the engine at each weight precision in one run, with the quality each costs.

Each precision runs `python -m bench --weights W` in a process of its own (its memory is its own): engine
tokens/s at --slots; greedy agreement with per-prompt `generate` on the same precision, run on SDPA (transformers'
default) and on the engine's attention arithmetic (attention.KERNEL_REFERENCE), with SDPA against eager as
transformers' own agreement with itself; agreement with the same request alone in a one-slot engine (batch
invariance); the process's peak RSS
and the bytes its weights take. Then every precision's model scores the float32 model's greedy answers (mean
log-likelihood per answer token) and its own answers are compared with float32's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.engine import ENGINE_BLOCK_SIZE, cut, eos_ids_of, load_workload, resolve_workload
from worker.engine import attention, native
from worker.model_loader import load_model

CHOICES = ("float32", "int4", "int8", "bfloat16", "w8a8")


def run_precision(weights: str, args: argparse.Namespace, out: Path) -> dict:
    command = [sys.executable, "-m", "bench", "--weights", weights, "--slots", str(args.slots), "--skip",
               "static,transformers_cb,engine_best,reference", "--workload", args.workload, "--json", str(out)]
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


@torch.inference_mode()
def generate_alone(model, prompt: list[int], cap: int, tokenizer, attn: str = "sdpa") -> list[int]:
    """Per-prompt `generate` with the model's attention set to `attn` (an implementation transformers knows). On
    the engine's attention arithmetic (KERNEL_REFERENCE) its layers are fused as the engine's are, where they are."""
    from worker.engine import EngineConfig
    from worker.engine.fused import FusedLayers, unfit_reason
    from worker.engine.sizing import fused_for

    before = model.config._attn_implementation
    model.set_attn_implementation(attn)
    fused = (FusedLayers(model, reference=True) if attn == attention.KERNEL_REFERENCE and fused_for(EngineConfig())
             and unfit_reason(model) is None else None)
    try:
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=cap, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    finally:
        model.set_attn_implementation(before)
        if fused is not None:
            fused.release()
    return cut(out[0, len(prompt):].tolist(), cap, eos_ids_of(model, tokenizer))


@torch.inference_mode()
def engine_alone(model, tokenizer, prompt: list[int], cap: int) -> list[int]:
    """The engine's greedy answer with the request alone in a one-slot engine, configured as the bench's."""
    from worker.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=1, block_size=ENGINE_BLOCK_SIZE))
    try:
        engine.add_request("alone", prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_new_tokens=cap))
        answer: list[int] = []
        while engine.has_unfinished():
            answer = next((list(e.token_ids) for e in engine.step() if e.finished), answer)
    finally:
        engine.release_model()
    return cut(answer, cap, eos_ids_of(model, tokenizer))


@torch.inference_mode()
def interleaved_forward(wanted: list[str], model_name: str | None, rows: int, rounds: int) -> dict[str, float]:
    """Median ms of one forward pass of `rows` tokens (every linear, the lm_head included, at `rows` rows, as in a
    decode step of that many sequences), the precisions taking turns round after round in one process, so a
    machine whose load changes affects them alike. float32 runs on the engine's packed linears."""
    from worker.engine.weights.packed import pack_linears

    models = {}
    for weights in wanted:
        models[weights] = load_model(model_name, device="cpu", weights=weights)[0]
        pack_linears(models[weights])
    ids = torch.randint(0, 10000, (1, rows), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {w: [] for w in wanted}
    for _ in range(rounds):
        for weights, model in models.items():
            start = time.perf_counter()
            model(input_ids=ids, logits_to_keep=rows)
            times[weights].append((time.perf_counter() - start) * 1000)
    return {w: statistics.median(t[1:]) for w, t in times.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default=",".join(CHOICES), help="comma-separated precisions, float32 first")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--workload", default="workload.json")
    parser.add_argument("--model", default=None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--agree", type=int, default=3,
                        help="requests checked against per-prompt generate at each precision")
    parser.add_argument("--forward-rounds", type=int, default=0,
                        help="only time forward passes of --slots rows, the precisions taking turns this many rounds")
    parser.add_argument("--keep", type=Path, default=None, help="a folder for each precision's own bench JSON")
    args = parser.parse_args(argv)
    wanted = [w.strip() for w in args.weights.split(",") if w.strip()]
    if not wanted or wanted[0] != "float32" or any(w not in CHOICES for w in wanted):
        parser.error(f"--weights takes float32 first, then any of {', '.join(CHOICES[1:])}")
    if args.forward_rounds:
        medians = interleaved_forward(wanted, args.model, args.slots, args.forward_rounds)
        for weights, ms in medians.items():
            print(f"{weights:<9} forward of {args.slots} rows: median {ms:.1f} ms, "
                  f"{medians['float32'] / ms:.2f}x float32's speed")
        print(f"rounds={args.forward_rounds} torch={torch.__version__} threads={torch.get_num_threads()}")
        return medians
    runs = {}
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for weights in wanted:
            runs[weights] = run_precision(weights, args, Path(args.keep or tmp) / f"{weights}.json")
    _, tokenizer = load_model(args.model, device="cpu")
    prompts = {r.id: r.prompt_ids for r in load_workload(resolve_workload(args.workload), tokenizer, args.limit)}
    caps = {r.id: r.cap for r in load_workload(resolve_workload(args.workload), tokenizer, args.limit)}
    base = runs["float32"]["engine_outputs"]
    # Greedy agreement with per-prompt generate on the same precision, on the requests with the shortest caps
    # (generate alone costs a request's full decode: the whole workload's would dominate the run).
    sample = sorted(caps, key=caps.get)[:args.agree]
    attention.register()
    rows = {}
    for weights in wanted:
        model, _ = load_model(args.model, device="cpu", weights=weights)
        engine = runs[weights]["methods"]["engine"]
        own = runs[weights]["engine_outputs"]
        same = sum(1 for rid in base if own.get(rid) == base[rid])
        # generate as transformers runs it (SDPA), with eager attention (how far transformers' own two kernels
        # agree with each other), and on the engine's attention arithmetic (what is left is the engine's own work).
        kinds = ("sdpa", "eager") + ((attention.KERNEL_REFERENCE,) if native.load() is not None else ())
        answers = {attn: {rid: generate_alone(model, prompts[rid], caps[rid], tokenizer, attn) for rid in sample}
                   for attn in kinds}
        matches = sum(1 for rid in sample if answers["sdpa"][rid] == own[rid])
        on_kernel = sum(1 for rid in sample if answers.get(attention.KERNEL_REFERENCE, {}).get(rid) == own[rid])
        sdpa_eager = sum(1 for rid in sample if answers["sdpa"][rid] == answers["eager"][rid])
        # Batch invariance: the same request alone in the engine gives the answer it gave among --slots others.
        alone = sum(1 for rid in sample if engine_alone(model, tokenizer, prompts[rid], caps[rid]) == own[rid])
        rows[weights] = {
            "tokens_per_s": engine["tokens_per_s"],
            "vs_float32": engine["tokens_per_s"] / runs["float32"]["methods"]["engine"]["tokens_per_s"],
            "equal_to_generate": f"{matches}/{len(sample)}",
            # without a C compiler the engine runs the gather backend, and there is no kernel to compare with
            "equal_to_generate_on_kernel": f"{on_kernel}/{len(sample)}" if attention.KERNEL_REFERENCE in answers
            else "-",
            "generate_sdpa_as_eager": f"{sdpa_eager}/{len(sample)}",
            "equal_to_engine_alone": f"{alone}/{len(sample)}",
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
