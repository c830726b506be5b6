"""Per-request sampling parameters and their validation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_TEMPERATURE = 2.0
MAX_REPETITION_PENALTY = 10.0
MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 64


class InvalidParamsError(ValueError):
    """Raised when a request carries sampling parameters the engine cannot honour."""


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 (or -1) = disabled
    top_p: float = 1.0  # 1.0 = disabled
    repetition_penalty: float = 1.0  # 1.0 = disabled; HF semantics
    seed: int | None = None
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Clients send JSON, so a single stop string or a list is the common shape.
        if self.stop is None:
            self.stop = ()
        elif isinstance(self.stop, str):
            self.stop = (self.stop,)
        elif isinstance(self.stop, list):
            self.stop = tuple(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        _check_real(
            "temperature",
            self.temperature,
            lambda v: 0 <= v <= MAX_TEMPERATURE,
            f"must be between 0 and {MAX_TEMPERATURE:g} (0 = greedy)",
        )
        _check_int(
            "top_k",
            self.top_k,
            lambda v: v >= 0 or v == -1,
            "must be an integer >= 1, or 0 / -1 to disable top-k",
        )
        _check_real(
            "top_p",
            self.top_p,
            lambda v: 0 < v <= 1,
            "must be greater than 0 and at most 1 (1 = disabled)",
        )
        _check_real(
            "repetition_penalty",
            self.repetition_penalty,
            lambda v: 0 < v <= MAX_REPETITION_PENALTY,
            f"must be greater than 0 and at most {MAX_REPETITION_PENALTY:g} (1 = disabled)",
        )
        if self.seed is not None:
            _check_int(
                "seed",
                self.seed,
                lambda v: 0 <= v <= MAX_SEED,
                "must be an integer between 0 and 2**63-1, or null for a random seed",
            )
        _check_int(
            "max_new_tokens",
            self.max_new_tokens,
            lambda v: v >= 1,
            "must be an integer >= 1",
        )
        self._validate_stop()
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParamsError(f"ignore_eos must be true or false; got {self.ignore_eos!r}")

    def _validate_stop(self) -> None:
        if not isinstance(self.stop, tuple):
            raise InvalidParamsError(
                f"stop must be a string or a list of strings; got {type(self.stop).__name__}"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParamsError(
                f"stop accepts at most {MAX_STOP_STRINGS} strings; got {len(self.stop)}. "
                "Remove some stop strings."
            )
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_LENGTH:
                raise InvalidParamsError(
                    f"stop entries must be non-empty strings of at most {MAX_STOP_LENGTH} "
                    f"characters; got {s!r}"
                )


def _is_int(value: Any) -> bool:
    # bool is a subclass of int, but `top_k=True` is a client bug, not a value.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, ok: Any, rule: str) -> None:
    if not _is_int(value) or not ok(value):
        raise InvalidParamsError(f"{name} {rule}; got {value!r}")


def _check_real(name: str, value: Any, ok: Any, rule: str) -> None:
    is_real = isinstance(value, (int, float)) and not isinstance(value, bool)
    # NaN compares false with everything, so it must be rejected explicitly.
    if not is_real or not math.isfinite(value) or not ok(value):
        raise InvalidParamsError(f"{name} {rule}; got {value!r}")
