"""The API's bodies against OpenAI's own models, through the real stack: every response and stream chunk validates as
the `openai` package's ChatCompletion, ChatCompletionChunk or Completion, and a request the server does not take is
a 400 naming the field at fault."""

from __future__ import annotations

import json

import pytest
import requests
from typing import Literal

from openai.types import Completion, CompletionChoice
from openai.types.completion_choice import Logprobs
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.test_api_parity import ESCALATE, LOOKUP
from worker.engine.detokenizer import BYTE_DECODER, token_bytes
from tests.test_api_stack import MESSAGES


class EchoedLogprobs(Logprobs):
    """With echo, the prompt's first token has no log-probability: OpenAI (and vLLM) send null for it, which the
    package's model, typed for answers only, does not allow."""

    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None


class EchoedChoice(CompletionChoice):
    logprobs: EchoedLogprobs | None = None


class EchoedCompletion(Completion):
    choices: list[EchoedChoice]


class StreamedChoice(EchoedChoice):
    """A streamed completion's choice: OpenAI sends null for finish_reason until the choice's last chunk (the
    package's Completion, which its client uses for these chunks without validating them, types it as required)."""

    finish_reason: Literal["stop", "length", "content_filter"] | None = None


class CompletionChunk(Completion):
    choices: list[StreamedChoice]


def post(stack, path: str, body: dict) -> requests.Response:
    return requests.post(stack.web_urls[0] + path, json=body, timeout=120)


def chunks(response: requests.Response) -> list[dict]:
    """A stream's data lines up to [DONE], which must end it."""
    lines = [line[6:] for line in response.iter_lines() if line.startswith(b"data: ")]
    assert lines and lines[-1] == b"[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


CHAT_BODIES = {   # each seeded, so the whole answer and the streamed one are the same
    "plain": {"max_tokens": 12, "temperature": 0},
    "n and logprobs": {"max_tokens": 6, "n": 2, "logprobs": True, "top_logprobs": 3, "seed": 1},
    "a forced tool call": {"max_tokens": 60, "tools": [LOOKUP, ESCALATE], "tool_choice": "required", "seed": 2},
    "a named tool": {"max_tokens": 60, "seed": 3, "tools": [LOOKUP], "tool_choice": {"type": "function",
                                                                         "function": {"name": "lookup_order"}}},
    "json_schema": {"max_tokens": 60, "seed": 4, "response_format": {"type": "json_schema", "json_schema": {
        "name": "order", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}},
    "stop and penalties": {"max_tokens": 12, "seed": 5, "stop": ["."], "presence_penalty": 0.5,
                           "frequency_penalty": 0.5},
}


@pytest.mark.parametrize("name", CHAT_BODIES)
def test_chat_answers_and_chunks_validate_as_openais_models(stack, name):
    body = {"messages": MESSAGES, **CHAT_BODIES[name]}
    whole = post(stack, "/v1/chat/completions", body)
    assert whole.status_code == 200, whole.text
    reply = ChatCompletion.model_validate(whole.json())
    assert reply.object == "chat.completion" and reply.usage is not None
    streamed = post(stack, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200
    parsed = [ChatCompletionChunk.model_validate(chunk) for chunk in chunks(streamed)]
    assert all(c.object == "chat.completion.chunk" and c.id == parsed[0].id for c in parsed)
    assert parsed[-1].usage is not None and parsed[-1].choices == []
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in parsed if c.choices
                and c.choices[0].finish_reason}
    assert finishes == {choice.index: choice.finish_reason for choice in reply.choices}


@pytest.mark.parametrize("extra", [
    {"prompt": "Order 1234 is", "max_tokens": 8, "seed": 6},   # seeded: the whole and the streamed answer agree
    {"prompt": "Order 1234 is", "max_tokens": 4, "echo": True, "logprobs": 2, "seed": 7},
    {"prompt": [1, 2, 3], "max_tokens": 4, "n": 2, "seed": 5},
])
def test_completions_and_their_chunks_validate_as_openais_model(stack, extra):
    whole = post(stack, "/v1/completions", extra)
    assert whole.status_code == 200, whole.text
    reply = (EchoedCompletion if extra.get("echo") else Completion).model_validate(whole.json())
    assert reply.object == "text_completion" and reply.usage is not None
    streamed = post(stack, "/v1/completions", {**extra, "stream": True})
    assert streamed.status_code == 200
    parsed = [CompletionChunk.model_validate(chunk) for chunk in chunks(streamed)]
    assert parsed and all(c.id == parsed[0].id for c in parsed)
    finishes = {choice.index: choice.finish_reason for c in parsed for choice in c.choices if choice.finish_reason}
    assert finishes == {choice.index: choice.finish_reason for choice in reply.choices}


@pytest.mark.parametrize("body, param, says", [
    ({"temprature": 0.5}, "temprature", "Unrecognized request argument supplied: 'temprature'"),
    ({"temperature": "hot"}, "temperature", "'temperature'"),
    ({"max_tokens": 1.5}, "max_tokens", "'max_tokens'"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "'stream_options.include_usage'"),
    ({"stop": [1]}, "stop.0", "'stop.0'"),
    ({"metadata": {"team": 5}}, "metadata.team", "'metadata.team'"),
    ({"store": "yes"}, "store", "'store'"),
    ({"logprobs": 3}, "logprobs", "'logprobs'"),
])
def test_a_field_of_the_wrong_type_or_name_is_a_400_naming_it(stack, body, param, says):
    response = post(stack, "/v1/chat/completions", {"messages": MESSAGES, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_fields_without_effect_are_taken_and_logged(stack):
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "user": "customer-7", "store": False,
            "metadata": {"ticket": "T-991"}}
    reply = post(stack, "/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    plain = post(stack, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "temperature": 0})
    assert reply.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    log = (stack.workdir / f"web{stack.web_urls[0].rsplit(':', 1)[1]}.log").read_text()
    rid = reply.json()["id"].removeprefix("chatcmpl-")
    assert any(rid in line and "T-991" in line and "customer-7" in line for line in log.splitlines())


def test_vllms_extras_are_taken_from_the_body(stack, tokenizer):
    """min_tokens, ignore_eos and skip_special_tokens as vLLM's clients send them, on an answer whose every pick
    would be EOS."""
    eos = tokenizer.eos_token_id
    base = {"messages": MESSAGES, "temperature": 0, "max_tokens": 10, "logit_bias": {str(eos): 100}}

    def ask(**extra) -> dict:
        response = post(stack, "/v1/chat/completions", {**base, **extra})
        assert response.status_code == 200, response.text
        return response.json()

    plain, longer = ask(), ask(min_tokens=5)
    assert plain["usage"]["completion_tokens"] == 1 and plain["choices"][0]["finish_reason"] == "stop"
    assert longer["usage"]["completion_tokens"] == 6 and longer["choices"][0]["finish_reason"] == "stop"
    hidden, shown = ask(ignore_eos=True, max_tokens=3), ask(ignore_eos=True, max_tokens=3, skip_special_tokens=False)
    assert hidden["usage"]["completion_tokens"] == 3 and hidden["choices"][0]["finish_reason"] == "length"
    assert hidden["choices"][0]["message"]["content"] == ""
    assert shown["choices"][0]["message"]["content"] == tokenizer.eos_token * 3
    too_many = post(stack, "/v1/chat/completions", {**base, "min_tokens": 11})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "min_tokens"


def test_logprobs_report_each_tokens_own_bytes(stack, tokenizer):
    """A token holding the first byte of a three-byte character ("€" is E2 82 AC) reads as U+FFFD, but its bytes
    are its own: [0xE2], not U+FFFD's three."""
    stand_in = next(c for c, b in BYTE_DECODER.items() if b == 0xE2)
    first = tokenizer.convert_tokens_to_ids(stand_in)
    assert token_bytes(tokenizer, [first]) == [b"\xe2"]
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 2, "logprobs": True, "top_logprobs": 2,
            "logit_bias": {str(first): 100}}
    reply = post(stack, "/v1/chat/completions", body).json()
    content = reply["choices"][0]["logprobs"]["content"]
    assert [entry["bytes"] for entry in content] == [[0xE2], [0xE2]]
    assert [entry["token"] for entry in content] == ["\ufffd", "\ufffd"]
    for alternative in (a for entry in content for a in entry["top_logprobs"]):   # the model's own picks
        assert bytes(alternative["bytes"]).decode("utf-8", "replace") == alternative["token"]


def test_completions_take_a_list_of_prompts(stack):
    """lm-evaluation-harness's batches: choice i * n + j is prompt i's choice j, each the same as that prompt sent
    alone; usage adds up; the stream renumbers its chunks the same way and ends once."""
    prompts = ["Order 1234 is", "Your refund", [1, 2, 3, 4]]
    base = {"max_tokens": 5, "temperature": 0, "n": 2}
    alone = [post(stack, "/v1/completions", {**base, "prompt": p}).json() for p in prompts]
    whole = post(stack, "/v1/completions", {**base, "prompt": prompts})
    assert whole.status_code == 200, whole.text
    reply = Completion.model_validate(whole.json())
    assert [c.index for c in reply.choices] == list(range(6))
    assert [c.text for c in reply.choices] == [c["text"] for one in alone for c in one["choices"]]
    assert reply.usage.completion_tokens == sum(one["usage"]["completion_tokens"] for one in alone)
    assert reply.usage.prompt_tokens == sum(one["usage"]["prompt_tokens"] for one in alone)
    streamed = post(stack, "/v1/completions", {**base, "prompt": prompts, "stream": True,
                                               "stream_options": {"include_usage": True}})
    parsed = [CompletionChunk.model_validate(chunk) for chunk in chunks(streamed)]
    assert len({c.id for c in parsed}) == 1
    texts: dict[int, str] = {}
    for c in parsed:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in reply.choices}
    usage = [c.usage for c in parsed if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == reply.usage.completion_tokens
    too_many = post(stack, "/v1/completions", {**base, "prompt": ["x"] * 65})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"


def test_a_stop_string_cannot_cut_structured_output_short(stack):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    body = {"messages": MESSAGES, "max_tokens": 60, "seed": 8, "stop": ['"ok"'],
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
    reply = post(stack, "/v1/chat/completions", body).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["message"]["content"])["ok"], bool)
