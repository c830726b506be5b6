"""A generation request as both tiers know it: its fields, limits, defaults, checks and versioned wire form."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from messaging.contract import CLASS_QUEUES, DEFAULT_CLASS

# The wire form's version: `params` in a queued job is {"v": VERSION, field: value, ...}. A job without "v" came
# from a web process older than the version (the same names, none of the fields added since).
VERSION = 1

# The limits, here only: the web app refuses a request past one before it is queued, and the worker reads the
# queued request with the same checks, so nothing accepted can fail later on a limit.
MAX_TOKENS = 4096              # answer tokens per choice
DEFAULT_MAX_TOKENS = 256
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 100_000
MAX_REPETITION_PENALTY = 10.0
MAX_PENALTY = 2.0              # presence and frequency penalties, as OpenAI's
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 200
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = 2**31 - 1       # larger than any vocabulary; the worker names ids its model lacks
MAX_CHOICES = 8
MAX_LOGPROBS = 20              # alternatives per token (chat's top_logprobs)
MAX_LEGACY_LOGPROBS = 5        # /v1/completions' logprobs, as OpenAI's
MAX_DRY_MULTIPLIER = 100.0
MAX_DRY_BASE = 10.0
MAX_DRY_LENGTH = 1_000_000     # dry_allowed_length and dry_penalty_last_n, in tokens
MAX_DRY_BREAKERS = 16
MAX_DRY_BREAKER_CHARS = 40     # llama.cpp's cut-off too
# DRY's sequence breakers when none are sent: llama.cpp's (worker/engine/dry.py holds the same tuple; a test checks).
DRY_BREAKERS = ("\n", ":", "\"", "*")

# Most urgent first, each with its queue; the engine serves them in this order (worker/engine/sequence.py holds the
# same tuple, and a test checks that they agree: the engine imports nothing from here).
SERVICE_CLASSES = tuple(CLASS_QUEUES)


class GenerationError(ValueError):
    """A field out of its limits; `field` is the name the client used."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


@dataclass
class Generation:
    """How to generate one answer. The names are the engine's SamplingParams' where they share a meaning."""

    max_new_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0             # 0: greedy
    top_p: float = 1.0                   # 1: off
    top_k: int = 0                       # 0 or -1: off
    min_p: float = 0.0                   # 0: off
    repetition_penalty: float = 1.0      # 1: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit
    seed: int | None = None              # None: drawn when the request is accepted (webapp/queue.py)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()   # tokens that end the answer as EOS does (vLLM's)
    include_stop_str_in_output: bool = False   # the matched stop string stays in the text (vLLM's)
    min_tokens: int = 0                  # EOS, stop tokens and stop strings wait until the answer has this many (vLLM's)
    ignore_eos: bool = False             # EOS does not end the answer (vLLM's)
    skip_special_tokens: bool = True     # special tokens are left out of the text (vLLM's)
    n: int = 1
    logprobs: int | None = None          # alternatives per answer token; None: no log-probabilities
    prompt_logprobs: int | None = None   # the same for the prompt's tokens (scoring, /v1/completions' echo)
    service_class: str = DEFAULT_CLASS    # picks the request's queue and its place in the engine's order
    # DRY, llama.cpp's repetition guard (worker/engine/dry.py): a token that would extend a run of n >=
    # dry_allowed_length tokens seen in the window loses dry_multiplier * dry_base ** (n - dry_allowed_length).
    dry_multiplier: float = 0.0          # 0: off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1         # the window: -1 the whole context, 0 off
    dry_sequence_breakers: tuple[str, ...] = DRY_BREAKERS   # runs are not counted across these
    dry_include_prompt: bool = True      # False: the window starts at the answer

    def check(self, max_tokens: int = MAX_TOKENS, names: dict[str, str] | None = None,
              min_max_tokens: int = 1) -> None:
        """Raise GenerationError for the first field out of its limits. `max_tokens`: a lower ceiling than
        MAX_TOKENS (the chat's); `names`: the client's names for fields (the API's `max_tokens`);
        `min_max_tokens`: 0 where an answer of no tokens only scores the prompt."""
        names = names or {}

        def name(f: str) -> str:
            return names.get(f, f)

        def integer(f: str, low: int, high: int, note: str = "") -> None:
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise GenerationError(name(f), f"'{name(f)}' must be an integer from {low} to {high}{note}; got "
                                               f"{shown(value)}.")

        def real(f: str, low: float, high: float, note: str = "") -> None:
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    (isinstance(value, float) and not math.isfinite(value)) or not low <= value <= high:
                raise GenerationError(name(f), f"'{name(f)}' must be a number from {low:g} to {high:g}{note}; got "
                                               f"{shown(value)}.")

        integer("max_new_tokens", min_max_tokens, min(max_tokens, MAX_TOKENS))
        real("temperature", 0, MAX_TEMPERATURE, " (0: greedy)")
        real("top_p", 0, 1)
        if self.top_p == 0:
            raise GenerationError(name("top_p"), f"'{name('top_p')}' must be greater than 0 (1: off).")
        integer("top_k", -1, MAX_TOP_K, " (0 or -1: off)")
        real("min_p", 0, 1, " (0: off)")
        real("repetition_penalty", 0, MAX_REPETITION_PENALTY, " (1: off)")
        if self.repetition_penalty == 0:
            raise GenerationError(name("repetition_penalty"),
                                  f"'{name('repetition_penalty')}' must be greater than 0 (1: off).")
        real("presence_penalty", -MAX_PENALTY, MAX_PENALTY)
        real("frequency_penalty", -MAX_PENALTY, MAX_PENALTY)
        self._check_logit_bias(name("logit_bias"))
        if self.seed is not None:
            integer("seed", 0, MAX_SEED)
        self._check_stop(name("stop"))
        self._check_stop_tokens(name("stop_token_ids"))
        integer("n", 1, MAX_CHOICES, " (send several requests for more)")
        integer("min_tokens", 0, MAX_TOKENS)
        if self.min_tokens > self.max_new_tokens:
            raise GenerationError(name("min_tokens"), f"'{name('min_tokens')}' ({self.min_tokens}) must not be more than "
                                                      f"'{name('max_new_tokens')}' ({self.max_new_tokens}).")
        for f in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, f), bool):
                raise GenerationError(name(f), f"'{name(f)}' must be true or false; got {shown(getattr(self, f))}.")
        for f in ("logprobs", "prompt_logprobs"):
            if getattr(self, f) is not None:
                integer(f, 0, MAX_LOGPROBS)
        if self.max_new_tokens == 0 and self.prompt_logprobs is None:
            raise GenerationError(name("max_new_tokens"), f"'{name('max_new_tokens')}' 0 only scores the prompt; "
                                                          "ask for its log-probabilities or for at least 1 token.")
        real("dry_multiplier", 0, MAX_DRY_MULTIPLIER, " (0: off)")
        real("dry_base", 1, MAX_DRY_BASE)
        integer("dry_allowed_length", 1, MAX_DRY_LENGTH)
        integer("dry_penalty_last_n", -1, MAX_DRY_LENGTH, " (-1: the whole context, 0: off)")
        breakers = self.dry_sequence_breakers
        if not isinstance(breakers, tuple) or len(breakers) > MAX_DRY_BREAKERS or \
                not all(isinstance(b, str) and 0 < len(b) <= MAX_DRY_BREAKER_CHARS for b in breakers):
            label = name("dry_sequence_breakers")
            raise GenerationError(label, f"'{label}' must be a list of at most {MAX_DRY_BREAKERS} non-empty strings "
                                         f"of at most {MAX_DRY_BREAKER_CHARS} characters, like [\"\\n\", \":\"].")
        if not isinstance(self.dry_include_prompt, bool):
            label = name("dry_include_prompt")
            raise GenerationError(label, f"'{label}' must be true or false; got {shown(self.dry_include_prompt)}.")
        if self.service_class not in SERVICE_CLASSES:
            raise GenerationError(name("service_class"), f"'{name('service_class')}' must be one of "
                                                         f"{', '.join(SERVICE_CLASSES)}; got "
                                                         f"{shown(self.service_class)}.")

    def _check_logit_bias(self, label: str) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise GenerationError(label, f"'{label}' must be an object mapping token ids (as strings) to numbers "
                                         f"from -{MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}, like {{\"50256\": -100}}.")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise GenerationError(label, f"'{label}' takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens; got {len(bias)}. "
                                         "Remove some.")
        for token, value in bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise GenerationError(label, f"'{label}' keys must be token ids such as \"50256\"; got "
                                             f"{shown(token)}.")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise GenerationError(label, f"'{label}[{token}]' must be a number from -{MAX_LOGIT_BIAS:g} to "
                                             f"{MAX_LOGIT_BIAS:g}; got {shown(value)}.")

    def _check_stop(self, label: str) -> None:
        if not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOP_STRINGS or \
                not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            raise GenerationError(label, f"'{label}' must be a string or a list of at most {MAX_STOP_STRINGS} "
                                         f"non-empty strings of at most {MAX_STOP_CHARS} characters.")

    def _check_stop_tokens(self, label: str) -> None:
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or len(ids) > MAX_STOP_TOKEN_IDS or \
                not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in ids):
            raise GenerationError(label, f"'{label}' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids "
                                         f"(integers >= 0), like [2]; got {shown(ids)}.")

    def engine_fields(self) -> dict[str, Any]:
        """The engine's SamplingParams fields (all but the service class, which the engine takes per request)."""
        out = asdict(self)
        del out["service_class"]
        return out

    def to_wire(self) -> dict[str, Any]:
        """The queued form: JSON, versioned, with the service class and the fields that differ from their defaults."""
        out: dict[str, Any] = {"v": VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if value == f.default and f.name != "service_class":
                continue
            if f.name == "logit_bias":
                value = {str(k): v for k, v in value.items()}   # JSON object keys are strings
            elif f.name in ("stop", "stop_token_ids", "dry_sequence_breakers"):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_wire(cls, data: dict[str, Any], max_tokens: int = MAX_TOKENS) -> Generation:
        """A queued request's fields, checked as the web app checked them; GenerationError if they do not pass."""
        if not isinstance(data, dict):
            raise GenerationError("params", f"A job's params must be an object; got {type(data).__name__}.")
        data = dict(data)
        version = data.pop("v", 0)
        if version not in (0, VERSION):
            raise GenerationError("v", f"The request's params are version {shown(version)} but this worker reads up "
                                       f"to {VERSION}; upgrade the worker before the web app.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise GenerationError(unknown[0], f"The request's params hold fields this worker does not know "
                                              f"({', '.join(unknown)[:200]}); upgrade the worker.")
        generation = cls(**data)
        generation.check(max_tokens, min_max_tokens=0)
        return generation

    def __post_init__(self) -> None:
        # JSON carries a single stop string or a list, and logit_bias's token ids as strings.
        if self.stop is None:
            self.stop = ()
        elif isinstance(self.stop, str):
            self.stop = (self.stop,)
        elif isinstance(self.stop, list):
            self.stop = tuple(self.stop)
        if isinstance(self.stop_token_ids, list):
            self.stop_token_ids = tuple(self.stop_token_ids)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {token_id(k): v for k, v in self.logit_bias.items()} or None
        if isinstance(self.dry_sequence_breakers, list):
            self.dry_sequence_breakers = tuple(self.dry_sequence_breakers)


def token_id(key: Any) -> Any:
    """A logit_bias key as a token id: "50256" -> 50256; anything else is left for check() to name."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9:
        return int(key)
    return key


def shown(value: Any) -> str:
    """A value as an error message quotes it: short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
