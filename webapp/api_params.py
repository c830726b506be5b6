"""OpenAI request parameters read into a job: sampling, choices, log-probabilities, response formats and tools."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from structured import Structure, StructureError, Tool, ToolError
from structured.tools import forced

from .queue import UserError
from .security import clean_text

MAX_TOKENS_LIMIT = 4096
MAX_STOP_CHARS = 200
MAX_CHOICES = 8
MAX_TOP_LOGPROBS = 20          # chat: top_logprobs
MAX_LEGACY_LOGPROBS = 5        # completions: logprobs
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_TOOLS = 64


def invalid(param: str, message: str) -> UserError:
    return UserError("invalid_value", message, param=param)


def number(body: dict, name: str, default, low: float, high: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    # Floats must be finite; ints are compared exactly, however many digits they have.
    if isinstance(value, bool) or not ok or (isinstance(value, float) and not math.isfinite(value)) \
            or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        got = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise invalid(name, f"'{name}' must be {kind} between {low} and {high}; got {got}.")
    return value


def sampling(body: dict, default_max_tokens: int, min_max_tokens: int = 1) -> dict:
    """The SamplingParams fields every endpoint shares, checked."""
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = [clean_text(s) for s in stop]
    if not isinstance(stop, list) or len(stop) > 4 or \
            not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise invalid("stop", f"'stop' must be a string or a list of at most 4 non-empty strings of at most "
                              f"{MAX_STOP_CHARS} characters.")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    params = {
        "max_new_tokens": number({"max_tokens": max_tokens}, "max_tokens", default_max_tokens, min_max_tokens,
                                 MAX_TOKENS_LIMIT, integer=True),
        "temperature": number(body, "temperature", 1.0, 0, 2),
        "top_p": number(body, "top_p", 1.0, 0, 1),
        "top_k": number(body, "top_k", 0, -1, 100_000, integer=True),
        "repetition_penalty": number(body, "repetition_penalty", 1.0, 0.01, 10),
        "stop": stop,
    }
    if params["top_p"] == 0:
        raise invalid("top_p", "'top_p' must be greater than 0.")
    if body.get("seed") is not None:
        params["seed"] = number(body, "seed", None, 0, 2**63 - 1, integer=True)
    # Only what differs from the engine's defaults goes in the job: an older worker reads the rest as before.
    for name in ("presence_penalty", "frequency_penalty"):
        if value := number(body, name, 0.0, -2, 2):
            params[name] = value
    if min_p := number(body, "min_p", 0.0, 0, 1):
        params["min_p"] = min_p
    if bias := logit_bias(body.get("logit_bias")):
        params["logit_bias"] = bias
    if (n := choices(body)) != 1:
        params["n"] = n
    return params


def logit_bias(value: Any) -> dict[str, float]:
    """OpenAI's {"token id": bias}: ids as decimal strings, biases from -100 to 100."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid("logit_bias", "'logit_bias' must be an object mapping token ids (as strings) to numbers "
                                    "from -100 to 100, like {\"50256\": -100}.")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid("logit_bias", f"'logit_bias' takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens; got "
                                    f"{len(value)}. Remove some.")
    out = {}
    for token, bias in value.items():
        if not (isinstance(token, str) and token.isdigit() and token.isascii() and len(token) <= 9):
            raise invalid("logit_bias", f"'logit_bias' keys must be token ids such as \"50256\"; got "
                                        f"{token[:20]!r}.")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or not -100 <= bias <= 100:
            raise invalid("logit_bias", f"'logit_bias[{token}]' must be a number from -100 to 100; got "
                                        f"{str(bias)[:20]}.")
        out[str(int(token))] = float(bias)
    return out


def choices(body: dict) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise invalid("n", f"'n' must be an integer from 1 to {MAX_CHOICES}; got {str(n)[:20]}. Ask for at most "
                           f"{MAX_CHOICES} choices per request (send several requests for more).")
    return n


def chat_logprobs(body: dict) -> int | None:
    """The alternatives per token the engine reports (chat: `logprobs` true and `top_logprobs`); None: none."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise invalid("logprobs", f"'logprobs' must be true or false on chat completions; got {str(wanted)[:20]}. "
                                  "Ask for alternatives with 'top_logprobs' (0 to 20).")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise invalid("top_logprobs", f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}; got "
                                      f"{str(top)[:20]}.")
    if not wanted:
        if top:
            raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true; send both.")
        return None
    return top or 0


def legacy_logprobs(body: dict) -> int | None:
    """/v1/completions' `logprobs`: an integer from 0 to 5 (alternatives per token); None: none."""
    value = body.get("logprobs")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LEGACY_LOGPROBS:
        raise invalid("logprobs", f"'logprobs' must be an integer from 0 to {MAX_LEGACY_LOGPROBS} on completions "
                                  f"(the alternatives to report per token); got {str(value)[:20]}.")
    return value


def response_format(body: dict) -> Structure | None:
    """`text` (none), `json_object` (any JSON object) or `json_schema` (that schema), compiled here: a schema that
    cannot be used is refused before anything is queued."""
    spec = body.get("response_format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        structure = Structure()
    elif kind == "json_schema":
        wrapper = spec.get("json_schema")
        if not isinstance(wrapper, dict) or not isinstance(wrapper.get("schema", {}), dict):
            raise invalid("response_format", "'response_format.json_schema' must be an object like {\"name\": "
                                             "\"order\", \"schema\": {...}, \"strict\": true}.")
        name = wrapper.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise invalid("response_format", "'response_format.json_schema.name' must be a name of 1 to 64 "
                                             "characters.")
        if not isinstance(wrapper.get("strict", False), (bool, type(None))):
            raise invalid("response_format", "'response_format.json_schema.strict' must be true or false.")
        structure = Structure(wrapper.get("schema") or {"type": "object"})
    else:
        raise invalid("response_format", "'response_format' must be {\"type\": \"text\"}, {\"type\": "
                                         "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": {...}}.")
    try:
        structure.check()
    except StructureError as exc:
        raise UserError("invalid_schema", f"response_format: {exc}", param="response_format") from None
    return structure


@dataclass
class ToolUse:
    """The tools a request offers the model and how it must use them."""

    tools: list[Tool] = field(default_factory=list)
    choice: str = "none"                   # none | auto | required | function
    structure: Structure | None = None     # the grammar that forces the calls (required, a named function)

    @property
    def offered(self) -> bool:
        """The model is told about the tools and its answers are read for calls."""
        return bool(self.tools) and self.choice != "none"


def tool_use(body: dict) -> ToolUse:
    specs, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", "'parallel_tool_calls' must be true or false.")
    if specs is None:
        specs = []
    if not isinstance(specs, list) or len(specs) > MAX_TOOLS:
        raise invalid("tools", f"'tools' must be a list of at most {MAX_TOOLS} {{\"type\": \"function\", "
                               "\"function\": {...}} objects.")
    try:
        tools = [Tool.from_openai(spec, f"tools[{i}]") for i, spec in enumerate(specs)]
    except ToolError as exc:
        raise invalid("tools", str(exc)) from None
    if len({t.name for t in tools}) != len(tools):
        raise invalid("tools", "Each tool in 'tools' needs its own name; two share one.")
    for i, tool in enumerate(tools):   # every argument schema must compile, whatever the choice
        try:
            Structure(tool.parameters).check()
        except StructureError as exc:
            raise UserError("invalid_schema", f"tools[{i}].function.parameters: {exc}", param="tools") from None
    name = None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if choice.get("type") == "function" and isinstance(function, dict) else None
        if not isinstance(name, str):
            raise invalid("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": "
                                         "\"function\", \"function\": {\"name\": ...}}.")
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise invalid("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": "
                                     "\"function\", \"function\": {\"name\": ...}}.")
    if choice != "none" and not tools:
        raise invalid("tool_choice", f"'tool_choice' {str(name or choice)[:64]!r} needs 'tools'; send the tools "
                                     "the model may call, or leave 'tool_choice' out.")
    structure = None
    if choice in ("required", "function"):
        try:
            structure = forced(tools, name, parallel=parallel is not False)
            structure.check()
        except ToolError as exc:
            raise invalid("tool_choice", str(exc)) from None
        except StructureError as exc:
            raise UserError("invalid_schema", f"tools: {exc}", param="tools") from None
    return ToolUse(tools, choice, structure)
