"""Chat with the support assistant in the terminal, answers streamed by the engine."""

from __future__ import annotations

import argparse
import itertools
import os

from worker.engine import EngineConfig, InvalidParamsError, InvalidRequestError, LLMEngine, SamplingParams, TokenDelta
from worker.model_loader import load_model
from worker.settings import weights_setting

DEFAULT_SYSTEM_PROMPT = ("You are a friendly customer-support assistant for an online shop. Answer briefly and "
                         "politely; if you do not know an order's details, ask for the order number.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=os.environ.get("MODEL"), help="HF id, directory or .gguf file")
    parser.add_argument("--device", default=os.environ.get("DEVICE"))
    parser.add_argument("--dtype", default=os.environ.get("DTYPE"))
    parser.add_argument("--weights", default=weights_setting(),
                        help="float32, int4, int8, bfloat16, w8a8, or auto (the device's measured best)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--dry-multiplier", type=float, default=float(os.environ.get("DRY_MULTIPLIER", "0.8")),
                        help="the DRY repetition guard over each answer, as the chat page's (0: off)")
    args = parser.parse_args(argv)

    print("Loading the model...", flush=True)
    engine = LLMEngine.launch(lambda: LLMEngine(*load_model(args.model, args.device, args.dtype, weights=args.weights),
                                                EngineConfig(max_num_seqs=4)))
    history = [{"role": "system", "content": os.environ.get("SYSTEM_PROMPT", DEFAULT_SYSTEM_PROMPT)}]
    print("Ask the shop's assistant anything (Ctrl-D to quit).")
    try:
        for n in itertools.count():
            try:
                text = input("\nyou> ").strip()
            except EOFError:
                break
            if not text:
                continue
            history.append({"role": "user", "content": text})
            params = SamplingParams(temperature=args.temperature, top_p=0.9, max_new_tokens=args.max_new_tokens,
                                    dry_multiplier=args.dry_multiplier, dry_include_prompt=False)
            try:
                stream = engine.submit(f"chat-{n}", messages=history, params=params)
            except (InvalidRequestError, InvalidParamsError) as exc:
                history.pop()
                print(f"error: {exc}")
                continue
            print("assistant> ", end="", flush=True)
            for event in stream:
                if isinstance(event, TokenDelta):
                    print(event.text, end="", flush=True)
                else:
                    history.append({"role": "assistant", "content": event.text})
            print()
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
