"""Time the batched sampler against greedy, a full sort and the previous per-row sampler, alone and in the engine."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.engine import DEFAULT_WORKLOAD, load_workload
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.dry import BreakerTokens
from worker.engine.sampler import CPU_CANDIDATES, Bias, BiasCache, RowParams, Sampler
from worker.engine.transfer import upload
from worker.model_loader import load_model, load_tokenizer, pick_device

SAMPLED = dict(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1)
KINDS: dict[str, dict] = {
    "greedy": dict(temperature=0.0),
    "all_processors": SAMPLED,
    "top_p_no_top_k": dict(temperature=0.7, top_p=0.95, repetition_penalty=1.1),
    "temperature_only": dict(temperature=0.6),
    "chat": dict(temperature=0.7, top_p=0.9),
    # the chat page's DRY; the bench's histories are all answer, so every prompt token is in the window (the
    # engine's chat rows look at their answer only: less work than this)
    "chat_dry": dict(temperature=0.7, top_p=0.9, dry_multiplier=0.8),
}
NEW_ONLY = {"chat_dry"}   # kinds the previous sampler cannot do


class PreviousSampler:
    """The sampler this one replaced, kept as the baseline: per-row parameters read from Python lists every call,
    a full sort for top-k/top-p, and one torch.Generator and one torch.multinomial per sampled row."""

    def __init__(self) -> None:
        self.generators: dict[int, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[list[int]],
                 seeds: Sequence[int]) -> torch.Tensor:
        if all(p.greedy and p.repetition_penalty == 1.0 for p in params):
            return logits.argmax(dim=-1)
        batch, vocab = logits.shape
        device = logits.device
        scores = logits.to(torch.float32, copy=True)
        rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rows:
            row_ids = torch.tensor([i for i in rows for _ in histories[i]], device=device)
            token_ids = torch.tensor([t for i in rows for t in histories[i]], device=device).clamp(0, vocab)
            seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device)
            seen[row_ids, token_ids] = True
            seen = seen[:, :vocab]
            penalty = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
            scores = torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
        temps = [1.0 if p.greedy else float(p.temperature) for p in params]
        if any(t != 1.0 for t in temps):
            scores = scores / torch.tensor(temps, device=device).unsqueeze(1)
        top_k = [vocab if p.greedy or p.top_k <= 0 else min(p.top_k, vocab) for p in params]
        top_p_on = [not p.greedy and p.top_p < 1.0 for p in params]
        if any(k < vocab for k in top_k) or any(top_p_on):
            sorted_scores, sorted_idx = torch.sort(scores, dim=-1)
            kth = sorted_scores.gather(1, torch.tensor([vocab - k for k in top_k], device=device).unsqueeze(1))
            remove = scores < kth
            sorted_scores = sorted_scores.masked_fill(sorted_scores < kth, float("-inf"))
            cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
            threshold = torch.tensor([1.0 - float(p.top_p) for p in params], device=device).unsqueeze(1)
            sorted_remove = cum <= threshold
            sorted_remove[:, -1] = False
            sorted_remove &= torch.tensor(top_p_on, device=device).unsqueeze(1)
            remove |= sorted_remove.scatter(1, sorted_idx, sorted_remove)
            scores = scores.masked_fill(remove, float("-inf"))
        tokens = scores.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            index = torch.tensor(sampled, device=device)
            probs = scores.index_select(0, index).softmax(dim=-1)
            draws = [torch.multinomial(probs[j], 1, generator=self._generator(histories[i], seeds[i], device))
                     for j, i in enumerate(sampled)]
            tokens[index] = torch.cat(draws)
        return tokens

    def _generator(self, history: list[int], seed: int, device: torch.device) -> torch.Generator:
        key = id(history)
        if key not in self.generators:
            self.generators[key] = torch.Generator(device=device).manual_seed(seed)
        return self.generators[key]


def model_logits(model, tokenizer, rows: int, workload: Path) -> tuple[torch.Tensor, list[list[int]]]:
    """Next-token logits at the end of real support prompts (tiled to `rows`), and those prompts as histories."""
    prompts = [r.prompt_ids for r in load_workload(workload, tokenizer, None)][:48]
    out = []
    with torch.inference_mode():
        for ids in prompts:
            out.append(model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -1].float())
    logits = torch.stack(out)
    index = [i % len(prompts) for i in range(rows)]
    return logits[index].contiguous(), [list(prompts[i]) for i in index]


def peaked_logits(rows: int, vocab: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits shaped like a language model's without one: Zipf-like (score -1.3 ln rank) over a shuffled vocabulary,
    whose nucleus at temperature 0.7 and top-p 0.9 is 7-10 tokens (the default model's, over the workload's
    prompts: 2-24), and 300-token histories of random ids. For a GPU machine without the model's weights, and for
    vocabularies other than the model's."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    logits = torch.stack([(-1.3 * ranks.log())[torch.randperm(vocab, generator=g)] for _ in range(rows)])
    logits += torch.randn(rows, vocab, generator=g) * 0.1
    histories = torch.randint(0, vocab, (rows, 300), generator=g).tolist()
    return logits.to(device), histories


def time_calls(sample: Callable, logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
               repeats: int) -> float:
    """Median seconds per call in decode's steady state: every history grows by the token just drawn."""
    seeds = list(range(len(params)))
    histories = [list(h) for h in histories]
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        tokens = sample(logits, params, histories, seeds).tolist()
        elapsed = time.perf_counter() - start
        for history, token in zip(histories, tokens):
            history.append(token)
        if i >= 2:   # the first calls build per-row state
            times.append(elapsed)
    return statistics.median(times)


def sampler_table(make_logits: Callable[[int], tuple[torch.Tensor, list[list[int]]]], tokenizer,
                  rows_list: list[int], repeats: int) -> list[dict]:
    """new: the best-tokens search (the CPU's default); full sort: the device path (a device's default)."""
    results = []
    for rows in rows_list:
        logits, histories = make_logits(rows)
        breakers = BreakerTokens(tokenizer)
        for kind, config in KINDS.items():
            params = [SamplingParams(**config)] * rows
            new = time_calls(Sampler(candidates=CPU_CANDIDATES, breakers=breakers), logits, params, histories,
                             repeats)
            sort = time_calls(Sampler(candidates=0, breakers=breakers), logits, params, histories, repeats)
            old = time_calls(PreviousSampler(), logits, params, histories, repeats) if kind not in NEW_ONLY \
                else math.nan
            results.append({"rows": rows, "vocab": logits.shape[1], "kind": kind, "new_ms": new * 1e3,
                            "full_sort_ms": sort * 1e3, "previous_ms": old * 1e3})
        greedy = next(r["new_ms"] for r in results if r["rows"] == rows and r["kind"] == "greedy")
        for r in results:
            if r["rows"] == rows:
                r["new_vs_greedy"] = r["new_ms"] / greedy
                r["speedup_vs_previous"] = r["previous_ms"] / r["new_ms"]
    return results


def start_engine(model_source, tokenizer, requests, slots: int, config: dict, sampler) -> LLMEngine:
    model, _ = load_model(model_source)
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=slots, num_blocks=2048))
    if sampler is not None:
        engine.sampler = sampler
    for i, (ids, cap) in enumerate(requests):
        engine.add_request(str(i), prompt_token_ids=ids,
                           params=SamplingParams(**config, seed=i, max_new_tokens=cap, ignore_eos=True))
    return engine


def engine_table(model_source, tokenizer, slots: int, count: int, new_tokens: int, workload: Path) -> dict:
    """Greedy, sampled and sampled with the previous sampler, each engine on its own copy of the model, stepped in
    turn (one step of each, then the next), so load from elsewhere on the machine falls on all of them alike."""
    requests = [(r.prompt_ids, new_tokens) for r in load_workload(workload, tokenizer, count)]
    methods = {"greedy": (KINDS["greedy"], None), "sampled": (SAMPLED, None),
               "sampled_previous": (SAMPLED, PreviousSampler)}
    engines = {name: start_engine(model_source, tokenizer, requests, slots, config, make() if make else None)
               for name, (config, make) in methods.items()}
    runs = {name: {"tokens": 0, "step_s": 0.0, "decode_tokens": 0, "decode_s": 0.0} for name in engines}
    while any(e.has_unfinished() for e in engines.values()):
        for name, engine in engines.items():
            if not engine.has_unfinished():
                continue
            run, start = runs[name], time.perf_counter()
            made = sum(len(e.token_ids) for e in engine.step() if not e.finished)
            elapsed = time.perf_counter() - start
            run["tokens"] += made
            run["step_s"] += elapsed
            seqs, batched = engine.last_batch
            if seqs == batched:   # a decode-only step
                run["decode_tokens"] += made
                run["decode_s"] += elapsed
    for run in runs.values():
        run["tokens_per_s"] = run["tokens"] / run["step_s"]
        run["decode_tokens_per_s"] = run["decode_tokens"] / run["decode_s"]
    greedy = runs["greedy"]
    for run in runs.values():
        run["vs_greedy"] = run["tokens_per_s"] / greedy["tokens_per_s"]
        run["decode_vs_greedy"] = run["decode_tokens_per_s"] / greedy["decode_tokens_per_s"]
    return {"slots": slots, "requests": len(requests), "new_tokens": new_tokens, "methods": runs}


def previous_bias(params: Sequence[SamplingParams], vocab: int, device: torch.device) -> Bias | None:
    """The batch's logit_bias as the sampler built it before each request's tensors were kept: one (row, id, value)
    tuple per entry of every row, at every build."""
    entries = [(row, token, float(value)) for row, p in enumerate(params) if p.logit_bias
               for token, value in p.logit_bias.items() if 0 <= token < vocab]
    if not entries:
        return None
    rows, ids, values = zip(*entries)
    return Bias(upload(list(rows), torch.int64, device), upload(list(ids), torch.int64, device),
                upload(list(values), torch.float32, device))


def rebuild_table(rows: int, bias_sizes: list[int], vocab: int, repeats: int) -> list[dict]:
    """The batch's logit_bias tensors rebuilt as one request leaves and another joins, every row with a bias of
    each size: each request's tensors kept from the last build (the sampler's way), made again from every row's
    dict, and the previous build's way; and the whole rebuild of the per-row tensors, the bias kept."""
    device = torch.device("cpu")
    out = []
    for size in bias_sizes:
        bias = {token: -100.0 for token in range(vocab - size, vocab)}
        params = [SamplingParams(temperature=0.7, top_p=0.9, logit_bias=dict(bias) if bias else None)
                  for _ in range(rows + 1)]
        seeds = list(range(rows))
        kept = BiasCache()
        ways = {"kept_ms": kept.build, "from_dicts_ms": lambda b, v, d: BiasCache().build(b, v, d),
                "previous_ms": previous_bias,
                "whole_rebuild_ms": lambda b, v, d: RowParams.build(b, seeds, v, d, biases=kept)}
        figures = {"rows": rows, "bias_entries": size}
        for name, build in ways.items():
            build(params[:rows], vocab, device)
            times = []
            for k in range(repeats):
                batch = params[1:] if k % 2 == 0 else params[:rows]
                start = time.perf_counter()
                built = build(batch, vocab, device)
                times.append(time.perf_counter() - start)
            if name != "whole_rebuild_ms":
                assert (built is None) == (size == 0) and (built is None or len(built.ids) == rows * size)
            figures[name] = 1e3 * statistics.median(times)
        out.append(figures)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.sampler", description=__doc__)
    parser.add_argument("--model", default=os.environ.get("MODEL") or None)
    parser.add_argument("--rows", default="16,64,256", help="batch sizes for the sampler alone ('' skips)")
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per case (median)")
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--engine-slots", type=int, default=16, help="0 skips the engine runs")
    parser.add_argument("--engine-requests", type=int, default=16)
    parser.add_argument("--engine-new-tokens", type=int, default=48)
    parser.add_argument("--rebuild-rows", type=int, default=256,
                        help="rows for the per-row tensors' rebuild as requests change (0 skips)")
    parser.add_argument("--rebuild-biases", default="0,10,1110",
                        help="logit_bias entries a row (1,110: the digit tokens of a vocabulary of 1-3 digit groups)")
    parser.add_argument("--rebuild-vocab", type=int, default=128256)
    parser.add_argument("--logits", choices=("model", "peaked"), default="model",
                        help="the sampler alone over the model's logits at the workload's prompts, or over "
                             "Zipf-like ones (no weights needed; --vocab, --device)")
    parser.add_argument("--vocab", type=int, default=151936, help="--logits peaked: vocabulary size")
    parser.add_argument("--device", default=None, help="--logits peaked: cpu, cuda (default: cuda if available)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.logits == "peaked" and args.engine_slots:
        parser.error("--logits peaked times the sampler alone; add --engine-slots 0")
    result: dict = {}
    if args.rebuild_rows:
        result["rebuild"] = rebuild_table(args.rebuild_rows, [int(b) for b in args.rebuild_biases.split(",") if b],
                                          args.rebuild_vocab, args.repeats)
        print(f"the batch's logit_bias rebuilt as one request of {args.rebuild_rows} changes (vocab {args.rebuild_vocab}), "
              "ms: each request's tensors kept / made from the dicts / the previous build; the whole per-row rebuild")
        for r in result["rebuild"]:
            ratio = f" ({r['previous_ms'] / r['kept_ms']:.0f}x kept)" if r["bias_entries"] else ""
            print(f"  {r['bias_entries']:>5} entries a row: {r['kept_ms']:8.2f} / {r['from_dicts_ms']:8.2f} / "
                  f"{r['previous_ms']:8.2f}{ratio}; whole rebuild {r['whole_rebuild_ms']:.2f}")
    if not args.rows and not args.engine_slots:
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return result

    torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    if args.logits == "peaked":
        model, tokenizer, device = None, load_tokenizer(args.model), pick_device(args.device)
        make_logits = lambda rows: peaked_logits(rows, args.vocab, device)   # noqa: E731
        info = {"device": str(device), "dtype": "float32", "logits": f"peaked, vocab {args.vocab}"}
    else:
        model, tokenizer = load_model(args.model)
        make_logits = lambda rows: model_logits(model, tokenizer, rows, args.workload)   # noqa: E731
        info = {"device": str(model.device), "dtype": str(model.dtype).removeprefix("torch."), "logits": "model"}
    info.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                torch=torch.__version__)
    print(json.dumps(info))
    rows = sampler_table(make_logits, tokenizer, [int(r) for r in args.rows.split(",") if r], args.repeats)
    print(f"{'rows':>5} {'kind':<18} {'new ms':>9} {'full sort ms':>13} {'previous ms':>12} {'vs greedy':>10} "
          f"{'speed-up':>9}")
    for r in rows:
        print(f"{r['rows']:>5} {r['kind']:<18} {r['new_ms']:>9.2f} {r['full_sort_ms']:>13.2f} {r['previous_ms']:>12.2f} "
              f"{r['new_vs_greedy']:>9.2f}x {r['speedup_vs_previous']:>8.2f}x")
    for r in rows:
        if r["kind"] == "chat_dry":
            chat = next(c["new_ms"] for c in rows if c["rows"] == r["rows"] and c["kind"] == "chat")
            print(f"DRY at {r['rows']} rows: {r['new_ms'] / chat:.2f}x the chat's sampling without it")
    result.update(info=info, sampler=rows)
    if args.engine_slots:
        engine = engine_table(args.model, tokenizer, args.engine_slots, args.engine_requests,
                              args.engine_new_tokens, args.workload)
        print(f"engine, {engine['requests']} requests x {engine['new_tokens']} tokens, {engine['slots']} slots:")
        for name, run in engine["methods"].items():
            print(f"  {name:<18} {run['tokens_per_s']:8.1f} tok/s  {run['vs_greedy']:.3f}x greedy   decode-only steps "
                  f"{run['decode_tokens_per_s']:8.1f} tok/s  {run['decode_vs_greedy']:.3f}x greedy")
        result["engine"] = engine
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
