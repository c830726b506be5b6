"""OpenAI's Responses API (/v1/responses) through the real queue and worker, driven by the official `openai` client:
the same answers as the chat completion it stands for, its typed stream events, function calls and their outputs,
text formats, and refusals that name the field."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from structured.tools import StreamParser
from tests.test_api_parity import LOOKUP
from webapp.api_answers import Shape
from webapp.api_responses import Output, response

QUESTION = "Can I change the delivery address of order 1234?"
FUNCTION = {"type": "function", "name": LOOKUP["function"]["name"], "description": LOOKUP["function"]["description"],
            "parameters": LOOKUP["function"]["parameters"], "strict": True}


@pytest.fixture()
def client(stack):
    return openai.OpenAI(base_url=stack.web_urls[0] + "/v1", api_key="not-needed", max_retries=0, timeout=60)


def test_a_response_answers_as_the_chat_completion_it_stands_for(client):
    reply = client.responses.create(model="any", input=QUESTION, max_output_tokens=12, temperature=0,
                                    instructions="You answer questions about orders.")
    chat = client.chat.completions.create(model="any", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "You answer questions about orders."}, {"role": "user", "content": QUESTION}])
    assert reply.id.startswith("resp_") and reply.object == "response"
    assert reply.output_text == chat.choices[0].message.content
    assert reply.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    if reply.status == "incomplete":
        assert reply.incomplete_details.reason == "max_output_tokens" and reply.output[-1].status == "incomplete"
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                     chat.usage.completion_tokens)
    assert reply.instructions == "You answer questions about orders." and reply.max_output_tokens == 12
    # A list of input items with text parts and OpenAI's developer role is the same conversation.
    items = client.responses.create(model="any", max_output_tokens=12, temperature=0, input=[
        {"role": "developer", "content": "You answer questions about orders."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert items.output_text == reply.output_text


def test_a_streamed_response_sends_the_typed_events_in_order(client):
    whole = client.responses.create(model="any", input=QUESTION, max_output_tokens=10, temperature=0)
    events = list(client.responses.create(model="any", input=QUESTION, max_output_tokens=10, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert events[-2].item.status == final.output[0].status == ("incomplete" if whole.status == "incomplete"
                                                                else "completed")
    assert {e.item_id for e in events if e.type == "response.output_text.delta"} == {final.output[0].id}


def test_function_calls_whole_and_streamed_and_their_outputs_sent_back(client):
    reply = client.responses.create(model="any", input="Where is order 7?", tools=[FUNCTION], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    calls = [item for item in reply.output if item.type == "function_call"]
    assert reply.status == "completed" and calls, reply.output
    assert calls[0].name == "lookup_order" and calls[0].call_id and calls[0].status == "completed"
    assert set(json.loads(calls[0].arguments)) == {"order_id"}

    events = list(client.responses.create(model="any", input="Where is order 7?", tools=[FUNCTION],
                                          tool_choice={"type": "function", "name": "lookup_order"},
                                          max_output_tokens=60, temperature=0, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    final = events[-1].response
    assert events[-1].type == "response.completed" and len(done) == 1
    assert deltas == done[0].arguments == final.output[0].arguments
    assert set(json.loads(deltas)) == {"order_id"}

    # The call and its output go back in `input`: the worker renders them as the chat's tool messages.
    back = [{"role": "user", "content": "Where is order 7?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "lookup_order",
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"status": "shipped"}'}]
    answer = client.responses.create(model="any", input=back, tools=[FUNCTION], max_output_tokens=4, temperature=0)
    chat = [{"role": "user", "content": "Where is order 7?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": calls[0].call_id, "type": "function",
                                                                 "function": {"name": "lookup_order",
                                                                              "arguments": calls[0].arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": '{"status": "shipped"}'}]
    same = client.chat.completions.create(model="any", messages=chat, tools=[LOOKUP], max_tokens=4,
                                          temperature=0)
    assert answer.usage.input_tokens == same.usage.prompt_tokens
    assert answer.output_text == (same.choices[0].message.content or "")


def test_log_probabilities_when_included_whole_and_streamed(client):
    """`include` with the output text's logprobs: the chat completion's entries, on the message's text part and
    spread over the stream's text deltas; top_logprobs alone sends none, as OpenAI's API does."""
    ask = {"model": "any", "input": QUESTION, "max_output_tokens": 10, "temperature": 0, "top_logprobs": 2}
    reply = client.responses.create(**ask, include=["message.output_text.logprobs"])
    chat = client.chat.completions.create(model="any", messages=[{"role": "user", "content": QUESTION}], max_tokens=10,
                                          temperature=0, logprobs=True, top_logprobs=2)
    want = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    got = [entry.model_dump() for entry in reply.output[0].content[0].logprobs]
    assert len(got) == chat.usage.completion_tokens and got == want
    assert all(len(entry["top_logprobs"]) == 2 for entry in got)
    events = list(client.responses.create(**ask, include=["message.output_text.logprobs"], stream=True))
    streamed = [entry.model_dump() for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert streamed == [entry.model_dump() for entry in done.logprobs] == want
    assert client.responses.create(**ask).output[0].content[0].logprobs == []


def test_a_json_schema_text_format_holds_the_answer(client):
    schema = {"type": "object", "properties": {"status": {"enum": ["shipped", "lost"]}}, "required": ["status"],
              "additionalProperties": False}
    reply = client.responses.create(model="any", input=QUESTION, max_output_tokens=40, temperature=0, text={
        "format": {"type": "json_schema", "name": "status", "schema": schema, "strict": True}})
    assert json.loads(reply.output_text)["status"] in ("shipped", "lost")
    assert reply.text.format.type == "json_schema"


@pytest.mark.parametrize("fields, code, param", [
    ({"previous_response_id": "resp_1"}, "unsupported_parameter", "previous_response_id"),
    ({"reasoning": {"effort": "low"}}, "unsupported_parameter", "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "unsupported_parameter", "tools"),
    ({"max_output_tokens": 0}, "invalid_value", "max_output_tokens"),
    ({"input": [{"type": "input_image", "image_url": "http://127.0.0.1/x.png"}]}, "invalid_value", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "invalid_value", "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strnig"}}}}, "invalid_schema",
     "text.format"),
    ({"truncation": "sometimes"}, "invalid_value", "truncation"),
    ({"frequency_penalty": 1}, "unknown_parameter", "frequency_penalty"),
    ({"include": ["reasoning.encrypted_content"]}, "unsupported_parameter", "include"),
    ({"include": "message.output_text.logprobs"}, "invalid_value", "include"),
    ({"include": ["message.output_text.logprobs"], "tools": [FUNCTION]}, "unsupported_parameter", "include"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "invalid_value", "top_logprobs"),
    ({"top_logprobs": -1}, "invalid_value", "top_logprobs"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_field(stack, fields, code, param):
    body = {"model": "any", "input": QUESTION, **fields}
    response = requests.post(stack.web_urls[0] + "/v1/responses", json=body, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error


def test_no_response_is_kept_so_retrieving_one_says_so(client):
    reply = client.responses.create(model="any", input=QUESTION, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError, match="keeps no responses") as missing:
        client.responses.retrieve(reply.id)
    assert missing.value.code == "not_found"
    with pytest.raises(openai.NotFoundError, match="keeps no responses"):
        client.responses.delete(reply.id)


def test_text_and_calls_come_out_as_items_in_the_order_written_whole_and_streamed():
    job = {"request_id": "r1", "enqueued_at": 0.0}
    text = ('Let me look. <tool_call>\n{"name": "lookup_order", "arguments": {"order_id": 7}}\n</tool_call>'
            " Then I will tell you.")
    done = {"choices": [{"index": 0, "text": text, "finish_reason": "stop", "completion_tokens": 30}],
            "prompt_tokens": 5, "completion_tokens": 30}
    whole = response(job, Shape("m", tools=True), done)
    assert [(i["type"], i["id"], i["status"]) for i in whole["output"]] == [
        ("message", "msg_r1", "completed"), ("function_call", whole["output"][1]["id"], "completed"),
        ("message", "msg_r1_2", "completed")]
    assert whole["output"][0]["content"][0]["text"] == "Let me look."
    assert whole["output"][1]["arguments"] == '{"order_id": 7}'
    # Streamed a few characters at a time, the same items, each added once and done once.
    output, parser, events = Output(job), StreamParser("r1"), []
    for k in range(0, len(text), 3):
        for piece in parser.feed(text[k:k + 3]):
            events += output.feed(piece)
    for piece in parser.finish():
        events += output.feed(piece)
    events += output.close()
    assert output.items == whole["output"]
    added = [f["item"]["id"] for kind, f in events if kind == "response.output_item.added"]
    assert added == [f["item"]["id"] for kind, f in events if kind == "response.output_item.done"] == \
        [i["id"] for i in whole["output"]]


def test_log_probabilities_of_tokens_without_text_ride_on_the_next_delta_or_an_empty_last_one():
    from structured.tools import Delta

    entry = [{"token": t, "logprob": -1.0, "bytes": list(t.encode()), "top_logprobs": []} for t in "abcd"]
    output = Output({"request_id": "r1", "enqueued_at": 0.0})
    events = output.feed(Delta(content="Hi"), entry[:1])
    output.hold(entry[1:2])   # part of a character: no text yet
    events += output.feed(Delta(content=" there"), entry[2:3])
    output.hold(entry[3:])    # the end-of-turn token, whose text is not shown
    events += output.close()
    deltas = [f for kind, f in events if kind == "response.output_text.delta"]
    assert [(d["delta"], d["logprobs"]) for d in deltas] == [("Hi", entry[:1]), (" there", entry[1:3]),
                                                             ("", entry[3:])]
    done = next(f for kind, f in events if kind == "response.output_text.done")
    assert done["logprobs"] == entry and output.items[0]["content"][0]["logprobs"] == entry
