"""One request's state as it moves through the engine: tokens, KV blocks, timings."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from .detokenizer import IncrementalDetokenizer
from .sampling_params import SamplingParams


PENDING = -1   # the id in token_ids of a token sampled on the device and not yet read back


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

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

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
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
