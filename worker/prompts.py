"""A job's prompt as token ids: chat messages through the template (tools in its own format, or the fallback), or a
completion's text or ids as they are."""

from __future__ import annotations

from jinja2 import TemplateError

from messaging.prompt_form import PromptForm, digest
from messaging.prompts import TemplateOptions, plain, shaped, template_failure, template_refusal
from worker.engine import InvalidRequestError


_PROBE = {"type": "function", "function": {"name": "probe_tool_format_x9", "description": "",
                                           "parameters": {"type": "object", "properties": {}}}}
_formats: dict[tuple[int, str | None], bool] = {}


def has_tool_format(tokenizer) -> bool:
    """Whether the chat template renders `tools=` (Qwen2.5, Qwen3, Llama 3.1 and Hermes-style templates do;
    SmolLM2's ignores them): a probe tool is rendered once per template and looked for."""
    template = getattr(tokenizer, "chat_template", None)
    key = (id(tokenizer), template if isinstance(template, str) else repr(template))
    if key not in _formats:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[_PROBE], tokenize=False,
                                                 add_generation_prompt=True)
            _formats[key] = _PROBE["function"]["name"] in text
        except Exception:   # a template that refuses tools has no tool format
            _formats[key] = False
    return _formats[key]


def prompt_form(tokenizer, max_model_len: int) -> tuple[PromptForm, str] | None:
    """What a web process needs to render and count this model's prompts as `render` does, and the tokenizer's JSON
    text; None for a tokenizer that has no single Jinja template or no `tokenizers` form."""
    template, backend = getattr(tokenizer, "chat_template", None), getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(template, str) or backend is None:
        return None
    text = backend.to_str()
    return PromptForm(template=template, special_tokens=dict(tokenizer.special_tokens_map),
                      max_model_len=max_model_len, tool_format=has_tool_format(tokenizer),
                      tokenizer=digest(text)), text


class TemplateRefused(InvalidRequestError):
    """The chat template refused the messages: the client's error, with the code the web's own check gives it."""

    code = "invalid_messages"


def template_refused(exc: Exception) -> TemplateRefused:
    """The chat template's own complaint (`raise_exception`: roles out of order, say), or its failure on the
    messages (a TypeError inside it), as the client's error: the same messages would fail again."""
    if isinstance(exc, TemplateError):
        return TemplateRefused(template_refusal(str(exc.message or exc)))
    return TemplateRefused(template_failure(exc))


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None,
           options: TemplateOptions | None = None) -> list[int]:
    """Prompt ids of chat messages in OpenAI's shape (assistant `tool_calls`, `tool` results) offering `tools`,
    rendered with `options` (a client's template variables, an open final message); InvalidRequestError when the
    template refuses them."""
    chat, kwargs = shaped(messages, tools, has_tool_format(tokenizer))
    options = options or TemplateOptions()
    try:
        return list(tokenizer.apply_chat_template(
            chat, add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message, return_dict=False, **kwargs, **options.kwargs))
    except Exception as exc:   # the template's refusal, or its own error on these messages
        raise template_refused(exc) from exc


def render_chat(engine, messages: list[dict], tools: list[dict] | None = None,
                options: TemplateOptions | None = None) -> list[int]:
    """Prompt ids of chat messages; plain messages without tools or options go through the engine's own rendering
    unchanged. InvalidRequestError when the template refuses them."""
    if not tools and options is None and plain(messages):
        try:
            return engine.render_chat(messages)
        except InvalidRequestError:
            raise
        except Exception as exc:   # the template's refusal, or its own error on these messages
            raise template_refused(exc) from exc
    return render(engine.tokenizer, messages, tools, options)


def text_ids(tokenizer, text: str) -> list[int]:
    """A completion's text as ids, tokenized as the model's tokenizer does by default (its BOS, if it adds one)."""
    return list(tokenizer(text)["input_ids"])


def completion_ids(engine, prompt: str | list[int]) -> list[int]:
    """A completion's prompt as ids: text tokenized as the model's tokenizer does by default, ids checked."""
    if isinstance(prompt, str):
        return text_ids(engine.tokenizer, prompt)
    outside = sorted({t for t in prompt if t >= engine.vocab})
    if outside:
        raise InvalidRequestError(f"The prompt has token ids the model does not have: {outside[:5]}; its ids run "
                                  f"from 0 to {engine.vocab - 1}.")
    return list(prompt)


def fit_to_context(engine, messages: list[dict], reserve: int, tools: list[dict] | None = None,
                   options: TemplateOptions | None = None) -> tuple[list[dict], list[int]]:
    """Drop the oldest turns (never the system prompt or the newest message) until the prompt fits.

    Returns the kept messages and their rendered prompt ids (with `tools`, if any), so the template is rendered once.
    """
    messages = list(messages)
    budget = engine.max_model_len - reserve
    first = 1 if messages and messages[0].get("role") == "system" else 0
    while len(ids := render_chat(engine, messages, tools, options)) > budget:
        if len(messages) - first <= 1:
            raise InvalidRequestError("This message is too long for the assistant to answer; "
                                      "shorten it or split it into several messages.")
        del messages[first]
    return messages, ids
