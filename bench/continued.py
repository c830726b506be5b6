"""`python -m bench.continued`: an answer under way when its worker changes (a deploy to other weights), generated
again against continued from what the customer was shown.

The same chat request, with the chat's sampling and a fixed seed, runs on the first worker's weights and on the
next one's, through the engine alone. Printed: the token at which the two answers part, what a customer shown the
first `--shown` tokens would read if the next worker generated the answer again (the stream resuming at the shown
character count), and what they read when it goes on from those tokens (worker/continuation.py).
"""

from __future__ import annotations

import argparse

from worker.engine import EngineConfig, LLMEngine, RequestFinished, SamplingParams
from worker.model_loader import load_model

QUESTION = "My parcel arrived damaged, the mug is broken. What can I do?"


def answer(model: str | None, weights: str, question: str, seed: int, cap: int,
           continued: list[int] | None = None) -> tuple[RequestFinished, object]:
    lm, tok = load_model(model, weights=weights)
    engine = LLMEngine(lm, tok, EngineConfig(max_num_seqs=2))
    params = SamplingParams(temperature=0.7, top_p=0.9, dry_multiplier=0.8, dry_include_prompt=False, seed=seed,
                            max_new_tokens=cap)
    engine.add_request("q", messages=[{"role": "user", "content": question}], params=params,
                       continued=[continued] if continued else None)
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, RequestFinished):
                return event, tok
    raise RuntimeError("the engine ended without an answer")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.continued", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="the first worker's model (default: the default model)")
    parser.add_argument("--next-model", default=None, help="the next worker's (default: --model)")
    parser.add_argument("--weights", default="w8a8")
    parser.add_argument("--next-weights", default="float32")
    parser.add_argument("--shown", type=int, default=25, help="tokens of the first answer the customer saw")
    parser.add_argument("--max-new-tokens", type=int, default=70)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--question", default=QUESTION)
    args = parser.parse_args(argv)
    next_model = args.next_model or args.model
    first, tok = answer(args.model, args.weights, args.question, args.seed, args.max_new_tokens)
    again, _ = answer(next_model, args.next_weights, args.question, args.seed, args.max_new_tokens)
    shown_ids = first.token_ids[:args.shown]
    continued, _ = answer(next_model, args.next_weights, args.question, args.seed, args.max_new_tokens, shown_ids)
    shown = tok.decode(shown_ids, skip_special_tokens=True)
    parted = next((i for i, (a, b) in enumerate(zip(first.token_ids, again.token_ids)) if a != b),
                  min(len(first.token_ids), len(again.token_ids)))
    regenerated = shown + again.text[len(shown):]
    print(f"{args.weights} -> {args.next_weights}: the answers part at token {parted + 1}; "
          f"the customer saw {len(shown_ids)} tokens")
    print(f"  shown:                {shown!r}")
    print(f"  generated again:      {regenerated!r}")
    print(f"  continued:            {continued.text!r}")
    print(f"  continued starts with what was shown: {continued.text.startswith(shown)}")
    return {"parted": parted, "shown": shown, "regenerated": regenerated, "continued": continued.text}


if __name__ == "__main__":
    main()
