"""OpenAI request parameters read into a job: sampling, choices, log-probabilities, response formats and tools."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from messaging import jobs
from messaging.generation import MAX_LEGACY_LOGPROBS, MAX_LOGPROBS, Generation, GenerationError
from messaging.prompts import RESERVED_TEMPLATE_NAMES, TemplateOptions
from structured import Structure, StructureError, Tool, ToolError
from structured.tools import forced, offered

from .queue import UserError
from .security import clean_text

MAX_TOOLS = 64
# DRY as llama.cpp's server and vLLM's clients send it (top-level body fields); dry_include_prompt is this server's.
DRY_FIELDS = ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers",
              "dry_include_prompt")


def invalid(param: str, message: str) -> UserError:
    return UserError("invalid_value", message, param=param)


def renamed(exc: UserError, names: dict[str, str]) -> UserError:
    """An error about a chat-completion field in the words of the request it was translated from (`names`: chat
    field -> that request's field), for the APIs read as a chat completion."""
    param = exc.param or ""
    head = param.split(".")[0]
    if head not in names:
        return exc
    return UserError(exc.code, exc.message.replace(f"'{head}'", f"'{names[head]}'"), exc.retryable, exc.status,
                     names[head] + param[len(head):], exc.retry_after)


def sampling(body: dict, default_max_tokens: int, min_max_tokens: int = 1, logprobs: int | None = None,
             score_prompt: bool = False) -> Generation:
    """The generation every endpoint shares, read from the body and checked against messaging/generation.py's
    limits. `logprobs`: alternatives per answer token (read by the endpoint); `score_prompt`: /v1/completions' echo,
    whose prompt is scored when log-probabilities are asked for or no answer is (max_tokens 0)."""
    def given(name: str, default: Any) -> Any:
        return default if body.get(name) is None else body[name]

    stop = given("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = [clean_text(s) for s in stop]
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    generation = Generation(
        max_new_tokens=given(max_name, default_max_tokens), temperature=given("temperature", 1.0),
        top_p=given("top_p", 1.0), top_k=given("top_k", 0), min_p=given("min_p", 0.0),
        repetition_penalty=given("repetition_penalty", 1.0), presence_penalty=given("presence_penalty", 0.0),
        frequency_penalty=given("frequency_penalty", 0.0), logit_bias=body.get("logit_bias"), seed=body.get("seed"),
        stop=stop, n=given("n", 1), logprobs=logprobs, min_tokens=given("min_tokens", 0),
        ignore_eos=given("ignore_eos", False), skip_special_tokens=given("skip_special_tokens", True),
        stop_token_ids=given("stop_token_ids", ()), include_stop_str_in_output=given("include_stop_str_in_output", False),
        **dry(body))
    if score_prompt and (logprobs is not None or generation.max_new_tokens == 0):
        generation.prompt_logprobs = logprobs or 0
    try:
        generation.check(names={"max_new_tokens": max_name}, min_max_tokens=min_max_tokens)
    except GenerationError as exc:
        raise invalid(exc.field, exc.message) from None
    return generation


def dry(body: dict) -> dict[str, Any]:
    """The DRY fields the body sends, as Generation's; a breaker string in text-generation-webui's form
    ('"\\n", ":"', a JSON list without its brackets) becomes that list."""
    out = {name: body[name] for name in DRY_FIELDS if body.get(name) is not None}
    breakers = out.get("dry_sequence_breakers")
    if isinstance(breakers, str):
        try:
            parsed = json.loads(f"[{breakers}]")
        except ValueError:
            parsed = None
        if isinstance(parsed, list):
            out["dry_sequence_breakers"] = parsed
    return out


def chat_logprobs(body: dict) -> int | None:
    """The alternatives per token the engine reports (chat: `logprobs` true and `top_logprobs`); None: none."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise invalid("logprobs", f"'logprobs' must be true or false on chat completions; got {str(wanted)[:20]}. "
                                  "Ask for alternatives with 'top_logprobs' (0 to 20).")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS):
        raise invalid("top_logprobs", f"'top_logprobs' must be an integer from 0 to {MAX_LOGPROBS}; got "
                                      f"{str(top)[:20]}.")
    if not wanted:
        if top:
            raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true; send both.")
        return None
    return top or 0


def token_names(body: dict) -> dict:
    """The job field for vLLM's return_tokens_as_token_ids: log-probabilities that name each token "token_id:N"
    (its text can be ambiguous, or not a whole character)."""
    return {jobs.TOKENS_AS_IDS: True} if body.get("return_tokens_as_token_ids") else {}


def token_ids(body: dict) -> dict:
    """The job field for vLLM's return_token_ids: the answer carries the prompt's token ids and each choice's."""
    return {jobs.TOKEN_IDS: True} if body.get("return_token_ids") else {}


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


# vLLM's structured outputs: `structured_outputs` holds one of these; its older top-level `guided_*` fields name one
# each. A grammar is Lark, in llguidance's dialect.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# Options vLLM takes beside the kind that change nothing here: JSON is always written without spare whitespace,
# and there is one backend (llguidance), so nothing to fall back from.
STRUCTURED_NEUTRAL = ("disable_any_whitespace", "disable_fallback")


def structured_outputs(body: dict) -> Structure | None:
    """vLLM's `structured_outputs` ({"json": schema}, {"regex": ...}, {"choice": [...]}, {"grammar": lark} or
    {"json_object": true}), or its older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`,
    compiled here: a constraint that cannot be used is refused before anything is queued."""
    spec = body.get("structured_outputs")
    guided = {kind: body[name] for name, kind in GUIDED_FIELDS.items() if body.get(name) is not None}
    if body.get("guided_whitespace_pattern") is not None:
        raise UserError("unsupported_parameter", "'guided_whitespace_pattern' is not supported by this server (JSON "
                                                 "is written without spare whitespace); remove it.",
                        param="guided_whitespace_pattern")
    if spec is None and not guided:
        return None
    if spec is not None and guided:
        raise invalid("structured_outputs", "Send either 'structured_outputs' or the older 'guided_*' fields, not "
                                            "both.")
    if spec is not None:
        param = "structured_outputs"
        if not isinstance(spec, dict):
            raise invalid(param, "'structured_outputs' must be an object with one of "
                                 f"{', '.join(STRUCTURED_KINDS)}, e.g. {{\"choice\": [\"yes\", \"no\"]}}.")
        other = [k for k in spec if k not in STRUCTURED_KINDS and k not in STRUCTURED_NEUTRAL]
        if other:
            name = f"structured_outputs.{str(other[0])[:40]}"
            raise UserError("unsupported_parameter", f"'{name}' is not supported by this server; remove it (it takes "
                                                     f"{', '.join(STRUCTURED_KINDS)}).", param=name)
        for name in STRUCTURED_NEUTRAL:
            if name in spec and not isinstance(spec[name], bool):
                raise invalid(f"{param}.{name}", f"'{param}.{name}' must be true or false.")
        kinds = {k: spec[k] for k in STRUCTURED_KINDS if spec.get(k) is not None and spec.get(k) is not False}
    else:
        param = next(name for name, kind in GUIDED_FIELDS.items() if kind in guided)
        kinds = guided
    if len(kinds) != 1:
        raise invalid(param, f"'{param}' must name exactly one constraint ({', '.join(STRUCTURED_KINDS)}); got "
                             f"{len(kinds)}.")
    kind, value = next(iter(kinds.items()))
    where = f"{param}.{kind}" if param == "structured_outputs" else param
    structure = structured_one(kind, value, where)
    try:
        structure.check()
    except StructureError as exc:
        raise UserError("invalid_schema" if kind == "json" else "invalid_value", f"{where}: {exc}",
                        param=where) from None
    return structure


def structured_one(kind: str, value: Any, where: str) -> Structure:
    """One kind of vLLM's structured outputs as a Structure; UserError when the value is not of its type."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise invalid(where, f"'{where}' must be a JSON schema: an object, or its JSON text.") from None
        if not isinstance(value, dict):
            raise invalid(where, f"'{where}' must be a JSON schema: an object, or its JSON text.")
        return Structure(value)
    if kind == "json_object":
        if value is not True:
            raise invalid(where, f"'{where}' must be true (any JSON object) or left out.")
        return Structure()
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(t, str) and t for t in value):
            raise invalid(where, f"'{where}' must be a list of one or more non-empty strings.")
        return Structure(choice=tuple(value))
    if not isinstance(value, str) or not value:
        raise invalid(where, f"'{where}' must be a non-empty string"
                             + (" (a Lark grammar)." if kind == "grammar" else "."))
    return Structure(regex=value) if kind == "regex" else Structure(lark=value)


MAX_TEMPLATE_KWARGS_BYTES = 8 * 1024


def template_options(body: dict, messages: list[dict]) -> TemplateOptions | None:
    """vLLM's chat fields: `chat_template_kwargs` (extra variables for the model's chat template, such as Qwen3's
    enable_thinking), `add_generation_prompt` (default true) and `continue_final_message` (default false: the
    answer continues the final, assistant message). None when none is set."""
    kwargs = body.get("chat_template_kwargs")
    add = body.get("add_generation_prompt")
    cont = body.get("continue_final_message")
    if kwargs is None and add is None and cont is None:
        return None
    kwargs = kwargs or {}
    if not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs", "'chat_template_kwargs' must be an object of template variables, e.g. "
                                              "{\"enable_thinking\": false}.")
    reserved = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_NAMES or k.startswith("_"))
    if reserved:
        raise invalid("chat_template_kwargs", f"'chat_template_kwargs' cannot set {reserved[0][:40]!r}: the server "
                                              "sets it (messages, tools and the generation prompt have fields of "
                                              "their own).")
    if len(json.dumps(kwargs)) > MAX_TEMPLATE_KWARGS_BYTES:
        raise invalid("chat_template_kwargs", f"'chat_template_kwargs' is longer than "
                                              f"{MAX_TEMPLATE_KWARGS_BYTES // 1024} KiB; send fewer variables.")
    for name, value in (("add_generation_prompt", add), ("continue_final_message", cont)):
        if value is not None and not isinstance(value, bool):
            raise invalid(name, f"'{name}' must be true or false.")
    options = TemplateOptions(kwargs, add if add is not None else not cont, bool(cont))
    if options.continue_final_message:
        if options.add_generation_prompt:
            raise invalid("continue_final_message", "'continue_final_message' continues the final message, so "
                                                    "'add_generation_prompt' must be false with it.")
        if messages[-1]["role"] != "assistant" or not messages[-1].get("content"):
            raise invalid("continue_final_message", "'continue_final_message' continues the final message, which "
                                                    "must be the assistant's, with the text to continue.")
    return options


@dataclass
class ToolUse:
    """The tools a request offers the model and how it must use them."""

    tools: list[Tool] = field(default_factory=list)
    choice: str = "none"                   # none | auto | required | function
    structure: Structure | None = None     # the calls' grammar: forced (required, a named function) or lazy (auto)

    @property
    def forces(self) -> bool:
        """The answer is calls only (required, a named function)."""
        return self.choice in ("required", "function")

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
    if choice != "none":
        try:
            # auto: text is free, but a call the model opens is held to the offered tools' schemas.
            structure = offered(tools, parallel=parallel is not False) if choice == "auto" else \
                forced(tools, name, parallel=parallel is not False)
            structure.check()
        except ToolError as exc:
            raise invalid("tool_choice", str(exc)) from None
        except StructureError as exc:
            raise UserError("invalid_schema", f"tools: {exc}", param="tools") from None
    return ToolUse(tools, choice, structure)
