"""Anthropic's Messages API (/v1/messages, as vLLM's and llama.cpp's servers take it) through the real queue and
worker, driven by Anthropic's own client: the same answers as the chat completion it stands for, its stream events,
tool use and results, keys sent as x-api-key, and errors in that API's shape."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
import requests

from tests.test_api_parity import LOOKUP

QUESTION = "Can I change the delivery address of order 1234?"
SYSTEM = "You answer questions about orders."
# The current client has no sampling parameters (Anthropic's newer models take none); older clients, vLLM's and
# llama.cpp's servers do, as a top-level `temperature`.
GREEDY = {"temperature": 0}
TOOL = {"name": "lookup_order", "description": "Find an order by its number.",
        "input_schema": LOOKUP["function"]["parameters"]}


@pytest.fixture()
def client(stack):
    return anthropic.Anthropic(base_url=stack.web_urls[0], api_key="not-needed", max_retries=0, timeout=60)


@pytest.fixture()
def chat(stack):
    return openai.OpenAI(base_url=stack.web_urls[0] + "/v1", api_key="not-needed", max_retries=0, timeout=60)


def test_a_message_answers_as_the_chat_completion_it_stands_for(client, chat):
    reply = client.messages.create(model="any", max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                   messages=[{"role": "user", "content": QUESTION}])
    same = chat.chat.completions.create(model="any", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert reply.content[0].type == "text" and reply.content[0].text == same.choices[0].message.content
    assert reply.stop_reason == ("max_tokens" if same.choices[0].finish_reason == "length" else "end_turn")
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (same.usage.prompt_tokens,
                                                                     same.usage.completion_tokens)
    blocks = client.messages.create(model="any", max_tokens=12, extra_body=GREEDY,
                                    system=[{"type": "text", "text": SYSTEM}],
                                    messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}])
    assert blocks.content[0].text == reply.content[0].text


def test_a_streamed_message_is_what_the_client_accumulates(client):
    whole = client.messages.create(model="any", max_tokens=10, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": QUESTION}])
    with client.messages.stream(model="any", max_tokens=10, extra_body=GREEDY,
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_matched_stop_sequence_is_reported_whole_and_streamed(client):
    ask = {"model": "any", "max_tokens": 16, "extra_body": GREEDY, "messages": [{"role": "user", "content": QUESTION}]}
    full = client.messages.create(**ask).content[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"the answer {full!r} is too short to cut"
    reply = client.messages.create(**ask, stop_sequences=["\x00never", stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == full[:full.index(stop)]
    with client.messages.stream(**ask, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == \
        (reply.stop_reason, reply.stop_sequence, reply.content[0].text)


def test_count_tokens_is_what_the_message_is_charged_for(client):
    ask = {"model": "any", "system": SYSTEM, "messages": [{"role": "user", "content": QUESTION}]}
    counts = []
    for tools in ([], [TOOL]):
        extra = {"tools": tools} if tools else {}
        counts.append(client.messages.count_tokens(**ask, **extra).input_tokens)
        reply = client.messages.create(**ask, **extra, max_tokens=1, extra_body=GREEDY)
        assert counts[-1] == reply.usage.input_tokens, tools
    assert counts[1] > counts[0], "the offered tool should be in the prompt"
    with pytest.raises(anthropic.BadRequestError, match="messages") as bad:
        client.messages.count_tokens(model="any", messages=[])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"


def test_tool_use_whole_and_streamed_and_its_result_sent_back(client, chat):
    reply = client.messages.create(model="any", max_tokens=60, extra_body=GREEDY, tools=[TOOL],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   messages=[{"role": "user", "content": "Where is order 7?"}])
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "lookup_order"
    assert set(uses[0].input) == {"order_id"}
    with client.messages.stream(model="any", max_tokens=60, extra_body=GREEDY, tools=[TOOL],
                                tool_choice={"type": "tool", "name": "lookup_order"},
                                messages=[{"role": "user", "content": "Where is order 7?"}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    assert set(final.content[0].input) == {"order_id"}

    back = [{"role": "user", "content": "Where is order 7?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "lookup_order",
                                               "input": uses[0].input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                          "content": '{"status": "shipped"}'}]}]
    answer = client.messages.create(model="any", max_tokens=4, extra_body=GREEDY, tools=[TOOL], messages=back)
    same = chat.chat.completions.create(model="any", max_tokens=4, temperature=0, tools=[LOOKUP], messages=[
        {"role": "user", "content": "Where is order 7?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": uses[0].id, "type": "function", "function": {
            "name": "lookup_order", "arguments": json.dumps(uses[0].input)}}]},
        {"role": "tool", "tool_call_id": uses[0].id, "content": '{"status": "shipped"}'}])
    assert answer.usage.input_tokens == same.usage.prompt_tokens


@pytest.mark.parametrize("fields, phrase", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "'thinking' is not supported"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "only client tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "got type 'image'"),
    ({"max_tokens": 0}, "'max_tokens'"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "'stop_sequences'"),
    ({"top_a": 1}, "top_a"),
])
def test_refusals_come_in_anthropics_shape(stack, fields, phrase):
    body = {"model": "any", "max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}], **fields}
    response = requests.post(stack.web_urls[0] + "/v1/messages", json=body, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert phrase in error["error"]["message"], error


def test_an_output_format_holds_the_answer_to_its_schema(client):
    schema = {"type": "object", "properties": {"status": {"enum": ["shipped", "lost"]}}, "required": ["status"],
              "additionalProperties": False}
    reply = client.messages.create(model="any", max_tokens=40, extra_body=GREEDY, output_config={
        "format": {"type": "json_schema", "schema": schema}}, messages=[{"role": "user", "content": QUESTION}])
    assert json.loads(reply.content[0].text)["status"] in ("shipped", "lost") and reply.stop_reason == "end_turn"


def test_the_anthropic_client_sees_a_bad_request_as_its_own_error(client):
    with pytest.raises(anthropic.BadRequestError, match="only client tools"):
        client.messages.create(model="any", max_tokens=8, messages=[{"role": "user", "content": QUESTION}],
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
