"""Log-probabilities as the web tier sends them: each token's text, its UTF-8 bytes and the best alternatives."""

from __future__ import annotations

import math
from functools import lru_cache

from worker.engine import TokenLogprob
from worker.engine.detokenizer import token_bytes

# JSON has no -infinity; OpenAI-compatible servers report a token the model rules out with this instead.
FLOOR = -9999.0


class TokenJson:
    """Turns the engine's TokenLogprob into OpenAI's {token, logprob, bytes, top_logprobs} (chat's shape; the web
    tier reshapes it for /v1/completions). A token's text is its own decoding: a token holding part of a character
    reads as U+FFFD, as other OpenAI-compatible servers report it; its bytes are its own (detokenizer.token_bytes),
    so a client that joins the bytes of consecutive tokens gets the character back."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.spelled = lru_cache(maxsize=1 << 17)(self._spelled)

    def _spelled(self, token_id: int) -> tuple[str, list[int]]:
        return self.tokenizer.decode([token_id]), list(token_bytes(self.tokenizer, [token_id])[0])

    def one(self, token_id: int, logprob: float) -> dict:
        text, own = self.spelled(token_id)
        return {"token": text, "logprob": logprob if math.isfinite(logprob) else FLOOR, "bytes": own}

    def __call__(self, entry: TokenLogprob) -> dict:
        return {**self.one(entry.token_id, entry.logprob),
                "top_logprobs": [self.one(token, logprob) for token, logprob in entry.top]}
