"""One request's state as it moves through the engine: tokens, KV blocks, timings."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from .detokenizer import IncrementalDetokenizer
from .outputs import TokenLogprob
from .sampling_params import SamplingParams


PENDING = -1   # the id in token_ids of a token sampled on the device and not yet read back
# Service classes, most urgent first: a person waiting in the chat, the API's default, work that only needs
# throughput. The scheduler admits by class, then arrival (scheduler.py).
SERVICE_CLASSES = ("interactive", "standard", "bulk")


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seed: int                                            # of the request's draws; random when it gave none
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)   # prompt + completion
    num_computed_tokens: int = 0                         # tokens whose K/V are in the cache
    num_cached_tokens: int = 0                           # of the prompt, served by the prefix cache
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None
    admitted_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    batch_size_sum: int = 0                              # for the mean batch size this request shared
    steps: int = 0
    # With overlapped steps, a sampled token still on the device: the last token id is then PENDING and
    # this is its row among the step's sampled tokens.
    pending: int | None = None
    index: int = 0                                       # the choice, of the request's n
    group: list[Sequence] = field(default_factory=list, repr=False)   # every choice of the request, this one too
    matcher: Any = None                                  # llguidance matcher of a constrained answer
    prefilled: bool = False                              # its whole prompt has been computed once
    logprobs: list[TokenLogprob] = field(default_factory=list)   # per completion token, when asked
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)   # per prompt token, when asked
    service_class: str = "standard"                      # one of SERVICE_CLASSES
    early_params: SamplingParams | None = None           # drawn with until min_tokens: params with EOS masked out
    replay: str = ""                                     # text of continued tokens, sent with the first new one
    continued: int = 0                                   # completion tokens an earlier delivery wrote

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if not self.group:
            self.group = [self]

    @property
    def rank(self) -> int:
        """The class's place in SERVICE_CLASSES: lower is served first."""
        return SERVICE_CLASSES.index(self.service_class)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def draw_params(self) -> SamplingParams:
        """What the next token is drawn with: EOS masked out while the answer is shorter than min_tokens."""
        if self.early_params is not None and self.num_completion_tokens < self.params.min_tokens:
            return self.early_params
        return self.params

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def leader(self) -> Sequence:
        """The request's first choice: it prefills the prompt the others then share."""
        return self.group[0]

    @property
    def waits_for_leader(self) -> bool:
        """A later choice waits until the first has computed the prompt: then it finds the prompt's blocks in the
        prefix cache and computes only the partial last one (or until the first ended without)."""
        return self.index > 0 and not (self.leader.prefilled or self.leader.finished)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """The prompt's log-probabilities are still to be computed: every prompt row's logits are kept, and the
        prefix cache is not used. A later choice uses the first choice's once they are complete."""
        if self.params.prompt_logprobs is None:
            return False
        return all(len(s.prompt_logprobs) < self.num_prompt_tokens for s in (self, self.leader))

    @property
    def scored_from(self) -> int | None:
        """The first position whose logits row a prefill keeps, to score the token after it: 0 while the prompt's
        log-probabilities are to be computed, the prompt's last while a continued answer's tokens (written by an
        earlier delivery, without them here) still need theirs; None when only the last row samples. A prefill
        that scores computes every row it scores: no prefix-cache hits."""
        if self.wants_prompt_logprobs:
            return 0
        if self.params.logprobs is not None and len(self.logprobs) < self.continued:
            return self.num_prompt_tokens - 1
        return None

    def prompt_logprobs_result(self) -> list[TokenLogprob | None] | None:
        """What the request reports: its own (or the first choice's) complete list, else what it has."""
        if self.params.prompt_logprobs is None:
            return None
        for seq in (self, self.leader):
            if len(seq.prompt_logprobs) >= self.num_prompt_tokens:
                return list(seq.prompt_logprobs)
        return list(self.prompt_logprobs)
