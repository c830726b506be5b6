"""Long prompts through the engine: prefill throughput, then the decode step at that context, per KV pool dtype.

    python -m bench.long_prompts [--prompt-tokens 1024] [--requests 16] [--decode-tokens 32]
                                 [--kv float32,float16] [--weights auto] [--model ID_OR_PATH] [--json PATH]

`--requests` prompts of `--prompt-tokens` random token ids arrive together (greedy, EOS ignored) into an engine of
as many slots and the CPU's step budget. "prefill" runs until every request has its first token (tokens a second
over that time); "decode" is the mean step after it, every row then at about the prompt's length. Attention over
long contexts is most of both on CPU, so this is where the C attention kernel's paths and the pool's dtype show.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.model_loader import load_model

BLOCK_SIZE = 16


def run(model, tokenizer, prompt_tokens: int, requests: int, decode_tokens: int, kv: str, budget: int) -> dict:
    gen = random.Random(0)
    blocks = requests * (-(-(prompt_tokens + decode_tokens) // BLOCK_SIZE) + 1) + 8
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=requests, max_num_batched_tokens=budget,
                                                      block_size=BLOCK_SIZE, num_blocks=blocks,
                                                      kv_cache_dtype=None if kv == "float32" else kv))
    try:
        for i in range(requests):
            engine.add_request(str(i), prompt_token_ids=[gen.randrange(100, model.config.vocab_size)
                                                         for _ in range(prompt_tokens)],
                               params=SamplingParams(temperature=0.0, max_new_tokens=decode_tokens + 1,
                                                     ignore_eos=True))
        start = time.perf_counter()
        started, first, decode_steps = set(), None, 0
        while engine.has_unfinished():
            started.update(event.request_id for event in engine.step())
            if first is None:
                if len(started) == requests:
                    first = time.perf_counter()
            else:
                decode_steps += 1
        end = time.perf_counter()
    finally:
        engine.release_model()
    return {"kv": kv, "steps": engine.runner.describe_steps(), "prefill_s": first - start,
            "prefill_tok_s": requests * prompt_tokens / (first - start),
            "decode_ms": (end - first) / max(decode_steps, 1) * 1e3, "decode_steps": decode_steps}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--kv", default="float32,float16", help="KV pool dtypes, in turn: float32, float16")
    parser.add_argument("--weights", default="auto", help="as WEIGHTS (default: auto, the worker's default)")
    parser.add_argument("--budget", type=int, default=512, help="tokens a step (the CPU's default)")
    parser.add_argument("--model", default=None, help="HF id or model dir (default: the bundled SmolLM2-135M)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    pools = args.kv.split(",")
    unknown = [p for p in pools if p not in ("float32", "float16")]
    if unknown:
        raise SystemExit(f"unknown KV pool dtype {unknown[0]!r}: choose float32 or float16")
    model, tokenizer = load_model(args.model, device="cpu", weights=args.weights)
    rows = []
    for kv in pools:
        row = run(model, tokenizer, args.prompt_tokens, args.requests, args.decode_tokens, kv, args.budget)
        rows.append(row)
        print(f"kv {kv:8} prefill {args.requests}x{args.prompt_tokens}: {row['prefill_s']:.2f} s "
              f"({row['prefill_tok_s']:.0f} tok/s); decode at ~{args.prompt_tokens} tokens, {args.requests} rows: "
              f"{row['decode_ms']:.1f} ms a step   [{row['steps']}]", flush=True)
    result = {"prompt_tokens": args.prompt_tokens, "requests": args.requests, "weights": args.weights, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
