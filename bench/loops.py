"""Count looping chat answers on the default model with and without DRY, at the chat page's sampling."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time

import torch

from webapp.config import DEFAULT_SYSTEM_PROMPT
from worker.engine import EngineConfig, LLMEngine, RequestFinished, SamplingParams
from worker.model_loader import load_model

# The twelve kinds of question a new customer asks first: the six demo orders, two unknown numbers, four policies.
QUESTIONS = [
    "Hi, where is my order NW-10042? My email is grace@example.com",
    "Where is my order NW-10041?",
    "Has order NW-10043 left the warehouse yet?",
    "What is the status of NW-10044 please",
    "I want to know what happened to my order NW-10045.",
    "order NW-10046, did you get it back?",
    "where is my order NW-1002?",
    "Can you check order NW-99999 for me?",
    "Can I return a mug I bought last week?",
    "How long does a refund take?",
    "How long does shipping take?",
    "Can I change the delivery address of my order?",
    "What is your return policy?",
    "When will my order ship?",
]

# Questions the system prompt answers with a figure, and the figure an answer should quote.
FACTS = {8: r"30 days", 10: r"3\s*(-|to|–)\s*7|2 business days", 12: r"30 days", 13: r"2 business days"}

# name -> (dry_multiplier, dry_base, dry_allowed_length, dry_include_prompt); off first, as the baseline.
SETTINGS = {
    "off": (0.0, 1.75, 2, True),
    "0.8/1.75/2 context": (0.8, 1.75, 2, True),
    "0.8/1.75/2 answer": (0.8, 1.75, 2, False),
    "0.8/1.75/3 answer": (0.8, 1.75, 3, False),
    "1.5/1.75/2 answer": (1.5, 1.75, 2, False),
}


def loops(text: str, run: int = 5, times: int = 3) -> bool:
    """Whether some run of `run` words occurs `times` times or more (issue 31's measure of a looping answer)."""
    words = re.findall(r"\w+", text.lower())
    counts: dict[tuple[str, ...], int] = {}
    for i in range(len(words) - run + 1):
        key = tuple(words[i:i + run])
        counts[key] = counts.get(key, 0) + 1
    return max(counts.values(), default=0) >= times


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.loops", description=__doc__)
    parser.add_argument("--seeds", type=int, default=2, help="answers per question and setting")
    parser.add_argument("--first-seed", type=int, default=0, help="the seeds are first-seed .. first-seed + seeds - 1")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="the chat's cap (MAX_NEW_TOKENS)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--model", default=os.environ.get("MODEL"), help="the default model unless given")
    parser.add_argument("--show", action="store_true", help="print every looping answer")
    parser.add_argument("--out", help="write every answer and the summary here as JSON")
    args = parser.parse_args(argv)

    model, tokenizer = load_model(args.model)
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=16))
    system = DEFAULT_SYSTEM_PROMPT.replace("{shop}", "Northwind Goods")
    requests = {}
    for name in args.settings:
        multiplier, base, allowed, whole = SETTINGS[name]
        for q, question in enumerate(QUESTIONS):
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=seed,
                                        max_new_tokens=args.max_new_tokens, dry_multiplier=multiplier,
                                        dry_base=base, dry_allowed_length=allowed,
                                        dry_include_prompt=whole)
                rid = f"{name}|{q}|{seed}"
                requests[rid] = engine.add_request(
                    rid, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                    params=params)
    started = time.perf_counter()
    texts: dict[str, str] = {}
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, RequestFinished):
                texts[event.request_id] = tokenizer.decode(event.token_ids, skip_special_tokens=True)
                if len(texts) % 10 == 0:
                    print(f"{len(texts)}/{len(requests)} answers, {time.perf_counter() - started:.0f} s", flush=True)
    elapsed = time.perf_counter() - started

    info = {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "seconds": round(elapsed, 1),
            "questions": len(QUESTIONS), "seeds": args.seeds, "first_seed": args.first_seed, "temperature": args.temperature,
            "top_p": args.top_p, "max_new_tokens": args.max_new_tokens}
    print(json.dumps(info))
    print(f"{'setting (mult/base/allowed window)':<36} {'looping':>8} {'of':>4} {'vs off':>7} {'capped':>7} "
          f"{'words':>6} {'figures quoted':>15}")
    summary = {}
    base_loops = None
    for name in args.settings:
        mine = {rid: text for rid, text in texts.items() if rid.split("|")[0] == name}
        looping = [rid for rid, text in mine.items() if loops(text)]
        capped = sum(len(tokenizer.encode(t, add_special_tokens=False)) >= args.max_new_tokens - 1
                     for t in mine.values())
        words = sum(len(t.split()) for t in mine.values()) / max(1, len(mine))
        base_loops = len(looping) if name == "off" else base_loops
        ratio = f"{len(looping) / base_loops:.2f}" if base_loops else "-"
        facts = [bool(re.search(FACTS[int(rid.split("|")[1])], text)) for rid, text in mine.items()
                 if int(rid.split("|")[1]) in FACTS]
        quoted = f"{sum(facts)}/{len(facts)}"
        print(f"{name:<36} {len(looping):>8} {len(mine):>4} {ratio:>7} {capped:>7} {words:>6.0f} {quoted:>15}")
        summary[name] = {"looping": len(looping), "answers": len(mine), "capped": capped, "mean_words": words,
                         "figures_quoted": sum(facts), "figure_questions": len(facts)}
        if args.show:
            for rid in looping:
                print(f"  [{rid}] {mine[rid][:300]!r}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"info": info, "summary": summary, "answers": texts}, f, indent=1)
    return {"info": info, "summary": summary}


if __name__ == "__main__":
    main()
