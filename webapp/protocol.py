"""OpenAI's request bodies as pydantic models: each field's type, and the fields there are. A field no model knows
is a 400 naming it; a value of the wrong type is a 400 naming its field. Limits (how long, how hot) are not here:
they are messaging/generation.py's, the same for the chat page, the API and the worker."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from messaging.generation import shown

from .queue import UserError

Number = StrictFloat | StrictInt
# OpenAI fields this server does not implement: accepted only at the value that means "not used".
NEUTRAL = {"functions": [], "function_call": "none", "suffix": "", "best_of": 1}
# Fields taken and logged that change nothing about the answer (service_tier picks the class: webapp/keyring.py).
NO_EFFECT = ("user", "metadata", "store", "prompt_cache_key", "safety_identifier")
# The error code a type error in these fields is reported under; any other field's is invalid_value.
FIELD_CODES = {"messages": "invalid_messages", "prompt": "invalid_prompt"}
UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "StreamOptions"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")   # OpenAI adds options a stream does without (include_obfuscation)

    include_usage: StrictBool = False


class CommonRequest(BaseModel):
    """What both endpoints take."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None             # vLLM's
    min_p: Number | None = None                # vLLM's
    repetition_penalty: Number | None = None   # vLLM's
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None   # token ids as strings; their biases are checked with the limits
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None       # vLLM's
    include_stop_str_in_output: StrictBool | None = None   # vLLM's
    return_tokens_as_token_ids: StrictBool | None = None   # vLLM's: log-probabilities name tokens "token_id:N"
    return_token_ids: StrictBool | None = None   # vLLM's: the prompt's and each choice's token ids
    n: StrictInt | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    min_tokens: StrictInt | None = None           # vLLM's
    ignore_eos: StrictBool | None = None          # vLLM's
    skip_special_tokens: StrictBool | None = None  # vLLM's
    dry_multiplier: Number | None = None           # DRY, as llama.cpp's server and vLLM's clients send it
    dry_base: Number | None = None
    dry_allowed_length: StrictInt | None = None
    dry_penalty_last_n: StrictInt | None = None
    dry_sequence_breakers: StrictStr | list[StrictStr] | None = None   # a list, or text-generation-webui's string
    dry_include_prompt: StrictBool | None = None
    structured_outputs: Any = None             # vLLM's; read by webapp/api_params.py, which says what is wrong
    guided_json: Any = None                    # vLLM's older structured-output fields, the same
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: StrictStr | None = None   # taken, no effect: there is one backend (llguidance)
    guided_whitespace_pattern: Any = None      # refused unless null
    service_tier: Any = None                   # its values and their classes: webapp/keyring.py
    user: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None


class ChatCompletionRequest(CommonRequest):
    """POST /v1/chat/completions. Messages, tools and formats are read further by webapp/api.py and api_params.py,
    which say what is wrong inside them."""

    messages: list[Any]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[Any] | None = None
    function_call: StrictStr | dict[str, Any] | None = None
    chat_template_kwargs: Any = None                  # vLLM's; read by webapp/api_params.py
    add_generation_prompt: StrictBool | None = None   # vLLM's
    continue_final_message: StrictBool | None = None  # vLLM's


class CompletionRequest(CommonRequest):
    """POST /v1/completions."""

    prompt: Any = None
    echo: StrictBool | None = None
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Its input items, tools and text format are read further by webapp/api_responses.py,
    which says what is wrong inside them and which fields it cannot honour."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    input: Any = None
    instructions: Any = None
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    tools: list[Any] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    truncation: StrictStr | None = None
    service_tier: Any = None
    user: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None
    prompt_cache_key: StrictStr | None = None     # taken, no effect: prefixes are cached whatever their key
    safety_identifier: StrictStr | None = None    # taken, logged, as `user`
    # Refused unless neutral (webapp/api_responses.py says why for each):
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    prompt: Any = None
    reasoning: Any = None
    include: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None


class MessagesRequest(BaseModel):
    """POST /v1/messages (Anthropic's Messages API). Its messages, content blocks and tools are read further by
    webapp/api_messages.py, which says what is wrong inside them."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None   # required by Anthropic; the chat's default here, as llama.cpp's server
    messages: Any = None
    system: Any = None
    stop_sequences: list[StrictStr] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    stream: StrictBool | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None   # Anthropic's (auto, standard_only): taken, no effect
    output_config: dict[str, Any] | None = None   # its `format` (a JSON schema) holds the answer; `effort`: no effect
    cache_control: Any = None               # taken, no effect: prefixes are cached whatever the marks
    thinking: Any = None                    # refused unless {"type": "disabled"}


def read(schema: type[CommonRequest], body: dict) -> CommonRequest:
    """The body as `schema`, or a UserError in OpenAI's shape naming the first field at fault."""
    try:
        request = schema.model_validate(body)
    except ValidationError as exc:
        raise refusal(exc) from None
    for name, neutral in NEUTRAL.items():
        value = getattr(request, name, None)
        if value is not None and value != neutral:
            raise UserError("unsupported_parameter", f"'{name}' is not supported by this server; remove it.",
                            param=name)
    return request


def refusal(exc: ValidationError) -> UserError:
    errors = exc.errors(include_url=False)
    # Unknown fields first; then the first field at fault, at its deepest (a union such as `stop`, a string or a
    # list of strings, reports each of its branches: the list's item is the one to name).
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    first = errors[0]["loc"][:1]
    error = unknown[0] if unknown else max((e for e in errors if e["loc"][:1] == first), key=lambda e: len(e["loc"]))
    loc = [str(part) for part in error["loc"]]
    field = loc[0] if loc else "body"
    if error["type"] == "extra_forbidden":
        return UserError("unknown_parameter", f"Unrecognized request argument supplied: {field[:40]!r}. Remove it; "
                                              "the README lists the fields this server takes.", param=field)
    # The branch tags a union adds to the path (str, list[str], float, function-after[...]) are left out.
    path = ".".join(part for part in loc if "[" not in part and part not in UNION_TAGS)
    if error["type"] == "missing":
        message = f"'{path}' is required."
    else:
        message = f"'{path}': {error['msg'][0].lower()}{error['msg'][1:]}; got {shown(error.get('input'))}."
    return UserError(FIELD_CODES.get(field, "invalid_value"), message, param=path or field)
