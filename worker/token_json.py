"""Log-probabilities as the web tier sends them: each token's text, its UTF-8 bytes and the best alternatives."""

from __future__ import annotations

import math
from functools import lru_cache

from messaging.jobs import TOKENS_AS_IDS
from worker.engine import TokenLogprob
from worker.engine.detokenizer import token_bytes

# JSON has no -infinity; OpenAI-compatible servers report a token the model rules out with this instead.
FLOOR = -9999.0


class TokenJson:
    """Turns the engine's TokenLogprob into OpenAI's {token, logprob, bytes, top_logprobs} (chat's shape; the web
    tier reshapes it for /v1/completions). A token's text is its own decoding: a token holding part of a character
    reads as U+FFFD, as other OpenAI-compatible servers report it; its bytes are its own (detokenizer.token_bytes),
    so a client that joins the bytes of consecutive tokens gets the character back."""

    def __init__(self, tokenizer, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids   # each token named "token_id:N" rather than by its text; its bytes are still its own
        self.spelled = lru_cache(maxsize=1 << 17)(self._spelled)
        self._by_ids: TokenJson | None = None

    def for_job(self, job: dict) -> TokenJson:
        """This, or (when the request asked for vLLM's return_tokens_as_token_ids) one that names tokens by id."""
        if not job.get(TOKENS_AS_IDS) or self.as_ids:
            return self
        if self._by_ids is None:
            self._by_ids = TokenJson(self.tokenizer, as_ids=True)
            self._by_ids.spelled = self.spelled   # one cache of each token's text and bytes
        return self._by_ids

    def _spelled(self, token_id: int) -> tuple[str, list[int]]:
        return self.tokenizer.decode([token_id]), list(token_bytes(self.tokenizer, [token_id])[0])

    def one(self, token_id: int, logprob: float) -> dict:
        text, own = self.spelled(token_id)
        return {"token": f"token_id:{token_id}" if self.as_ids else text,
                "logprob": logprob if math.isfinite(logprob) else FLOOR, "bytes": own}

    def __call__(self, entry: TokenLogprob) -> dict:
        return {**self.one(entry.token_id, entry.logprob),
                "top_logprobs": [self.one(token, logprob) for token, logprob in entry.top]}
