"""What the engine reports: text deltas while a request runs, one final record when it ends, and stats."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """A token's log-probability under the model's own distribution (before penalties, temperature, filters
    and grammar masks), its rank there (1 = the most likely token) and the most likely tokens, best first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]   # (token id, log-probability); as many as the request asked for


@dataclass
class TokenDelta:
    request_id: str
    text: str                 # new text since the last delta (may be "" while a character is incomplete)
    token_ids: list[int]      # tokens sampled this step
    finished: bool = False
    index: int = 0            # the choice (0 .. n-1) these tokens belong to
    logprobs: list[TokenLogprob] | None = None   # one per token in token_ids, when the request asked
    # On choice 0's first delta, when the request asked for prompt log-probabilities: one per prompt token (the
    # first is None), so an echo can stream before the answer ends.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # On a choice's first delta: when the engine admitted its request, and how many of its tokens an earlier delivery
    # wrote (LLMEngine.submit's continued; their text comes with this delta, their log-probabilities do not).
    admitted_time: float | None = None
    continued: int = 0


@dataclass
class RequestFinished:
    request_id: str
    text: str                 # the whole answer: equals the concatenated deltas
    token_ids: list[int]      # the whole completion, EOS included when it was generated
    finish_reason: str        # stop | length | cancelled | error
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int        # prompt tokens served by the prefix cache
    arrival_time: float
    admitted_time: float | None
    first_token_time: float | None
    finished_time: float
    mean_batch_size: float    # sequences sharing this request's forward passes, on average
    preemptions: int = 0
    error: str | None = None
    # The request's last event: with n choices, only the last choice to end carries True.
    finished: bool = True
    index: int = 0            # the choice this ends
    logprobs: list[TokenLogprob] | None = None   # one per completion token, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None   # one per prompt token (the first is None)
    prompt_token_ids: list[int] = field(default_factory=list)
    # What ended a "stop": the stop string matched or the stop token drawn; None for EOS, a grammar's end or any
    # other reason (vLLM's stop_reason).
    stop_reason: str | int | None = None
    continued_tokens: int = 0   # of completion_tokens, those an earlier delivery wrote (LLMEngine.submit's continued)

    @property
    def queue_wait(self) -> float | None:
        return None if self.admitted_time is None else self.admitted_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        generated = self.completion_tokens - self.continued_tokens
        if self.first_token_time is None or generated < 2:
            return None
        return (self.finished_time - self.first_token_time) / (generated - 1)

    @property
    def e2e(self) -> float:
        return self.finished_time - self.arrival_time


Event = TokenDelta | RequestFinished


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    steps: int
    preemptions: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    last_batch_seqs: int
    last_batch_tokens: int
    class_preemptions: int = 0          # of the preemptions, those that started a waiting interactive request
    continued: int = 0                  # requests that went on from an earlier delivery's tokens

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total
