"""The OpenAI-compatible API through the real queue and worker, driven by the official `openai` client."""

from __future__ import annotations

import openai
import pytest
import requests

from models import RequestRecord
from worker.engine import EngineConfig, LLMEngine, RequestFinished, SamplingParams
from worker.model_loader import load_model

MESSAGES = [{"role": "system", "content": "You answer questions about orders."},
            {"role": "user", "content": "Can I change the delivery address of order 1234?"}]


@pytest.fixture()
def client(stack):
    return openai.OpenAI(base_url=stack.web_urls[1] + "/v1", api_key="not-needed", max_retries=0, timeout=60)


def engine_direct(model_dir, messages: list[dict], max_tokens: int) -> str:
    model, tokenizer = load_model(str(model_dir))
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=64))
    engine.add_request("direct", messages=messages, params=SamplingParams(temperature=0, max_new_tokens=max_tokens))
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, RequestFinished):
                return event.text
    raise AssertionError("no answer")


def test_greedy_completion_equals_the_engine_run_directly(client, tiny_model_dir, db):
    reply = client.chat.completions.create(model="any", messages=MESSAGES, temperature=0, max_tokens=20)
    text = reply.choices[0].message.content
    assert text and text == engine_direct(tiny_model_dir, MESSAGES, 20)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens > 0 and reply.usage.total_tokens > reply.usage.prompt_tokens
    with db() as s:
        record = s.get(RequestRecord, reply.id.removeprefix("chatcmpl-"))
        assert record.source == "api" and record.finish_reason == reply.choices[0].finish_reason


def test_streaming_sends_the_same_answer_in_pieces(client):
    plain = client.chat.completions.create(model="any", messages=MESSAGES, temperature=0, max_tokens=20)
    chunks = list(client.chat.completions.create(model="any", messages=MESSAGES, temperature=0, max_tokens=20,
                                                 stream=True))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(pieces) > 1
    assert "".join(pieces) == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_models_lists_what_the_worker_serves(client, tiny_model_dir):
    assert [m.id for m in client.models.list().data] == [str(tiny_model_dir)]


@pytest.mark.parametrize("body, code", [
    ({"messages": []}, "invalid_messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "invalid_messages"),
    ({"messages": MESSAGES, "temperature": 5}, "invalid_value"),
    ({"messages": MESSAGES, "max_tokens": 0}, "invalid_value"),
    ({"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, "invalid_value"),
    ({"messages": MESSAGES, "n": 3}, "invalid_value"),
])
def test_bad_requests_get_openai_style_errors(stack, body, code):
    response = requests.post(stack.web_urls[0] + "/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error" and error["message"]


def test_a_body_that_is_not_json_is_refused(stack):
    response = requests.post(stack.web_urls[0] + "/v1/chat/completions", data="hello", timeout=10)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_the_openai_client_raises_a_bad_request_error(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="any", messages=MESSAGES, temperature=-1)
