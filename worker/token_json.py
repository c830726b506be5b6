"""Log-probabilities as the web tier sends them: each token's text, its UTF-8 bytes and the best alternatives."""

from __future__ import annotations

import math
from functools import lru_cache

from worker.engine import TokenLogprob

# JSON has no -infinity; OpenAI-compatible servers report a token the model rules out with this instead.
FLOOR = -9999.0


class TokenJson:
    """Turns the engine's TokenLogprob into OpenAI's {token, logprob, bytes, top_logprobs} (chat's shape; the web
    tier reshapes it for /v1/completions). A token's text is its own decoding: a token holding part of a character
    reads as U+FFFD, as other OpenAI-compatible servers report it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=1 << 17)(self._text)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def one(self, token_id: int, logprob: float) -> dict:
        text = self.text(token_id)
        return {"token": text, "logprob": logprob if math.isfinite(logprob) else FLOOR,
                "bytes": list(text.encode("utf-8"))}

    def __call__(self, entry: TokenLogprob) -> dict:
        return {**self.one(entry.token_id, entry.logprob),
                "top_logprobs": [self.one(token, logprob) for token, logprob in entry.top]}
