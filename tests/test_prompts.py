"""Tools in prompts: through a chat template's own tool format, or the fallback for templates without one."""

from __future__ import annotations

import pytest

from messaging.prompts import fallback, native
from structured.tools import Tool, instructions
from worker.engine import EngineConfig, InvalidRequestError, LLMEngine
from worker.job import CLIENT_ERRORS, refusal_code
from worker.prompts import completion_ids, has_tool_format, render_chat

LOOKUP = {"type": "function", "function": {"name": "lookup_order", "description": "Find an order.",
                                           "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}}}}
HISTORY = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Where is order 7?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "lookup_order", "arguments": '{"id": 7}'}}]},
    {"role": "tool", "content": '{"status": "shipped"}', "tool_call_id": "call_1"},
]
# A template with a tool format of its own, in the way Qwen2.5's reads `tools`, calls and tool results.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.id }}{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture()
def engine(tiny):
    return LLMEngine(*tiny, EngineConfig(num_blocks=64))


def test_the_fallback_describes_the_tools_and_writes_calls_and_results_as_text():
    out = fallback(HISTORY, [LOOKUP])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("You help.\n\n")
    assert out[0]["content"].endswith(instructions([Tool.from_openai(LOOKUP)]))
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "lookup_order", "arguments": {"id": 7}}'
                                                      '\n</tool_call>'}
    assert out[3] == {"role": "user", "content": '<tool_response>\n{"status": "shipped"}\n</tool_response>'}
    assert all(set(m) == {"role", "content"} for m in out)


def test_a_template_without_a_tool_format_gets_the_fallback(engine):
    assert not has_tool_format(engine.tokenizer)
    assert render_chat(engine, HISTORY, [LOOKUP]) == engine.render_chat(fallback(HISTORY, [LOOKUP]))
    plain = [{"role": "user", "content": "hi"}]
    assert render_chat(engine, plain) == engine.render_chat(plain), "plain chats render as before"


def test_a_template_with_a_tool_format_renders_tools_calls_and_results_itself(engine):
    engine.tokenizer.chat_template = TOOL_TEMPLATE
    assert has_tool_format(engine.tokenizer)
    text = engine.tokenizer.decode(render_chat(engine, HISTORY, [LOOKUP]))
    assert text.startswith("TOOLS:lookup_order;[system]You help.")
    assert "CALL lookup_order 7" in text, "the call's arguments reach the template as an object"
    assert '[tool]{"status": "shipped"}' in text and text.endswith("[assistant]")
    assert native(HISTORY)[2]["tool_calls"][0]["function"]["arguments"] == {"id": 7}


def test_completion_prompts_are_used_as_they_are(engine):
    assert completion_ids(engine, "Hello there") == engine.tokenizer("Hello there")["input_ids"]
    assert completion_ids(engine, [1, 2, 3]) == [1, 2, 3]
    with pytest.raises(InvalidRequestError, match="token ids the model does not have"):
        completion_ids(engine, [1, engine.vocab + 5])


# Role order checked as Mistral's and Llama 2's templates check it.
ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."
ROLE_CHECK = ("{% for m in messages | rejectattr('role', 'equalto', 'system') %}"
              "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('" + ALTERNATE + "') }}{% endif %}{% endfor %}")


def test_a_template_that_raises_is_the_clients_error_and_final(engine):
    engine.tokenizer.chat_template = ROLE_CHECK + engine.tokenizer.chat_template
    wrong = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hello?"}]
    for tools in (None, [LOOKUP]):   # the engine's own rendering, and the tools' fallback
        with pytest.raises(InvalidRequestError, match="refused these messages: " + ALTERNATE[:30]) as refused:
            render_chat(engine, wrong, tools)
        assert refusal_code(refused.value, {"source": "api"}) in CLIENT_ERRORS, "not sent again, not a 503"
    assert render_chat(engine, wrong[:1]) == engine.render_chat(wrong[:1])


# A template with a bug of its own on some messages: Jinja raises Python's TypeError, not a TemplateError.
CRASH = "{% for m in messages %}{% if m['content'] == 'crash' %}{{ 1 + 'a' }}{% endif %}{% endfor %}"


def test_a_template_that_fails_on_the_messages_is_the_clients_error_and_final(engine):
    engine.tokenizer.chat_template = CRASH + engine.tokenizer.chat_template
    crashing = [{"role": "user", "content": "crash"}]
    for tools in (None, [LOOKUP]):
        with pytest.raises(InvalidRequestError, match="chat template failed on these messages \\(TypeError: ") as failed:
            render_chat(engine, crashing, tools)
        assert "tell the server's operator" in str(failed.value)
        assert refusal_code(failed.value, {"source": "api"}) == "invalid_messages", "a 400, not sent again"
    with pytest.raises(InvalidRequestError, match="non-empty list"):   # the engine's own refusal, as it was
        render_chat(engine, [])
    assert render_chat(engine, [{"role": "user", "content": "fine"}])


def test_a_prompt_too_long_for_the_worker_is_final_with_openais_code_for_the_api(engine):
    with pytest.raises(InvalidRequestError) as too_long:
        engine.submit("r", prompt_token_ids=[1] * engine.max_model_len)
    assert refusal_code(too_long.value, {"source": "api"}) == "context_length_exceeded"
    assert refusal_code(too_long.value, {"source": "chat"}) == "prompt_too_long"
    assert {"context_length_exceeded", "prompt_too_long"} <= set(CLIENT_ERRORS)
