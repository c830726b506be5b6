"""Per-request sampling parameters and the engine's checks of them: each value's type and the range in which the
engine can compute with it. A product's limits (longest answer, most stop strings, hottest temperature) belong to
whoever serves the engine: the web app and worker share theirs in messaging/generation.py."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from structured import Structure

from worker.engine.dry import DEFAULT_BREAKERS

MAX_SEED = 2**63 - 1       # the generators' seed range


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
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the answer as EOS does (kept in it, as EOS is)
    include_stop_str_in_output: bool = False  # the matched stop string stays at the end of the text
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop tokens cannot be drawn, stop strings are not looked for, until this many
    skip_special_tokens: bool = True  # special tokens (EOS under ignore_eos, say) are left out of the text
    presence_penalty: float = 0.0  # subtracted once from each token generated so far (OpenAI's semantics)
    frequency_penalty: float = 0.0  # subtracted once per time each token was generated so far
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, before anything else
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the best one (after temperature); 0 = off
    logprobs: int | None = None  # each sampled token's log-probability plus this many alternatives; None = off
    prompt_logprobs: int | None = None  # the same for each prompt token after the first; None = off
    n: int = 1  # choices: copies of the request that share its prompt's KV blocks
    structure: Structure | None = None  # the answer must match this (grammar-constrained decoding)
    # DRY, as llama.cpp's server: a token that would extend a run of n >= dry_allowed_length tokens already seen
    # in the last dry_penalty_last_n tokens (-1: the whole context, prompt included; 0: off) loses
    # dry_multiplier * dry_base ** (n - dry_allowed_length); runs are not counted across a sequence breaker.
    dry_multiplier: float = 0.0  # 0 = off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_BREAKERS
    dry_include_prompt: bool = True  # False: runs are looked for in the answer only, so quoting the prompt is free

    def __post_init__(self) -> None:
        # Clients send JSON, so a single stop string or a list is the common shape.
        if self.stop is None:
            self.stop = ()
        elif isinstance(self.stop, str):
            self.stop = (self.stop,)
        elif isinstance(self.stop, list):
            self.stop = tuple(self.stop)
        if isinstance(self.stop_token_ids, list):
            self.stop_token_ids = tuple(self.stop_token_ids)
        if isinstance(self.dry_sequence_breakers, list):
            self.dry_sequence_breakers = tuple(self.dry_sequence_breakers)
        # JSON object keys are strings: OpenAI's logit_bias is {"50256": -100}.
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {int(k) if isinstance(k, str) and k.strip().isdigit() else k: v
                               for k, v in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        _check_real("temperature", self.temperature, lambda v: v >= 0, "must be a number >= 0 (0 = greedy)")
        _check_int("top_k", self.top_k, lambda v: v >= 0 or v == -1,
                   "must be an integer >= 1, or 0 / -1 to disable top-k")
        _check_real("top_p", self.top_p, lambda v: 0 < v <= 1, "must be greater than 0 and at most 1 (1 = disabled)")
        _check_real("repetition_penalty", self.repetition_penalty, lambda v: v > 0,
                    "must be greater than 0 (1 = disabled)")
        if self.seed is not None:
            _check_int("seed", self.seed, lambda v: 0 <= v <= MAX_SEED,
                       "must be an integer between 0 and 2**63-1, or null for a random seed")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), lambda v: v >= 0, "must be an integer >= 0, or null for none")
        if self.prompt_logprobs is None:
            _check_int("max_new_tokens", self.max_new_tokens, lambda v: v >= 1, "must be an integer >= 1")
        else:   # scoring a prompt: prefill, report, no answer
            _check_int("max_new_tokens", self.max_new_tokens, lambda v: v >= 0,
                       "must be an integer >= 0 (0 only scores the prompt, with prompt_logprobs)")
        self._validate_stop()
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParamsError(f"{name} must be true or false; got {getattr(self, name)!r}")
        _check_int("min_tokens", self.min_tokens, lambda v: 0 <= v <= max(self.max_new_tokens, 0),
                   "must be an integer from 0 to max_new_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(name, getattr(self, name), lambda v: True, "must be a finite number (0 = disabled)")
        _check_real("min_p", self.min_p, lambda v: 0 <= v <= 1, "must be between 0 and 1 (0 = disabled)")
        _check_int("n", self.n, lambda v: v >= 1, "must be an integer >= 1")
        self._validate_logit_bias()
        self._validate_dry()
        if self.structure is not None and not isinstance(self.structure, Structure):
            raise InvalidParamsError(
                f"structure must be a structured.Structure or null; got {type(self.structure).__name__}")

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise InvalidParamsError(
                f"logit_bias must be an object mapping token ids to biases; got {type(bias).__name__}")
        for token, value in bias.items():
            if not _is_int(token) or token < 0:
                raise InvalidParamsError(f"logit_bias keys must be token ids (integers >= 0); got {token!r}")
            _check_real(f"logit_bias[{token}]", value, lambda v: True, "must be a finite number")

    @property
    def dry(self) -> bool:
        return self.dry_multiplier > 0 and self.dry_penalty_last_n != 0

    def _validate_dry(self) -> None:
        _check_real("dry_multiplier", self.dry_multiplier, lambda v: v >= 0, "must be a number >= 0 (0 = DRY off)")
        _check_real("dry_base", self.dry_base, lambda v: v >= 1, "must be a number >= 1")
        _check_int("dry_allowed_length", self.dry_allowed_length, lambda v: v >= 1,
                   "must be an integer >= 1 (the longest run repeated without a penalty)")
        _check_int("dry_penalty_last_n", self.dry_penalty_last_n, lambda v: v >= -1,
                   "must be an integer >= -1 (-1 = the whole context, 0 = DRY off)")
        if not isinstance(self.dry_include_prompt, bool):
            raise InvalidParamsError(f"dry_include_prompt must be true or false; got {self.dry_include_prompt!r}")
        breakers = self.dry_sequence_breakers
        if not isinstance(breakers, tuple) or not all(isinstance(b, str) and b for b in breakers):
            raise InvalidParamsError(
                f"dry_sequence_breakers must be a list of non-empty strings; got {str(breakers)[:80]}")

    def _validate_stop(self) -> None:
        if not isinstance(self.stop, tuple):
            raise InvalidParamsError(
                f"stop must be a string or a list of strings; got {type(self.stop).__name__}"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParamsError(f"stop entries must be non-empty strings; got {s!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidParamsError(f"stop_token_ids must be a list of token ids (integers >= 0); "
                                     f"got {self.stop_token_ids!r}")


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
