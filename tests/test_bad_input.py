"""Bad input over Socket.IO and HTTP against the running stack: each gets a clear error, and nothing is lost."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import requests

from models import Conversation, Message, RequestRecord
from tests.clients import ChatClient

INJECTION = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=1</script>'
FOREIGN = "<another session's conversation>"   # replaced by a real conversation id of another client
TOO_LONG_FOR_THE_MODEL = " ".join(str(i) for i in range(1000))[:3900]   # the tiny model's context is 512 tokens
MB = 1024 * 1024


@dataclass(frozen=True)
class SocketCase:
    name: str
    payload: object
    expect: str                 # an error code, or "accepted"
    event: str = "chat_message"
    then: str | None = None     # for accepted messages: "done" or the code of the error that follows


SOCKET_CASES = [
    SocketCase("empty text", {"text": ""}, "empty_message"),
    SocketCase("whitespace-only text", {"text": "  \n\t  "}, "empty_message"),
    SocketCase("1 MB text", {"text": "x" * MB}, "message_too_long"),
    SocketCase("text one past the limit", {"text": "y" * 4001}, "message_too_long"),
    SocketCase("text missing", {}, "empty_message"),
    SocketCase("text is a number", {"text": 42}, "empty_message"),
    SocketCase("text is a list", {"text": ["hi"]}, "empty_message"),
    SocketCase("text is binary", {"text": b"\xff\xfe\x00"}, "empty_message"),
    SocketCase("text is only control characters", {"text": "\x00\x07\x1b\x7f\x85"}, "empty_message"),
    SocketCase("text is a lone surrogate", {"text": "\ud800"}, "empty_message"),
    SocketCase("payload missing", None, "bad_request"),
    SocketCase("payload is a string", "where is my parcel", "bad_request"),
    SocketCase("payload is a list", ["where", "is", "my", "parcel"], "bad_request"),
    SocketCase("unknown field", {"text": "hi", "temperature": 2}, "unknown_field"),
    SocketCase("conversation id unknown", {"text": "hi", "conversation_id": "0" * 32}, "unknown_conversation"),
    SocketCase("conversation id malformed", {"text": "hi", "conversation_id": "../../etc/passwd"},
               "unknown_conversation"),
    SocketCase("conversation id with NUL bytes", {"text": "hi", "conversation_id": "\x00" * 32},
               "unknown_conversation"),
    SocketCase("conversation id of 100 kB", {"text": "hi", "conversation_id": "a" * 100_000}, "unknown_conversation"),
    SocketCase("conversation id is a number", {"text": "hi", "conversation_id": 7}, "bad_request"),
    SocketCase("another session's conversation", {"text": "hi", "conversation_id": FOREIGN}, "unknown_conversation"),
    SocketCase("max_new_tokens absurdly large", {"text": "hi", "max_new_tokens": 10**12}, "invalid_value"),
    SocketCase("max_new_tokens negative", {"text": "hi", "max_new_tokens": -1}, "invalid_value"),
    SocketCase("max_new_tokens fractional", {"text": "hi", "max_new_tokens": 1.5}, "invalid_value"),
    SocketCase("max_new_tokens boolean", {"text": "hi", "max_new_tokens": True}, "invalid_value"),
    SocketCase("join a malformed conversation", {"conversation_id": "'; DROP TABLE messages; --"},
               "unknown_conversation", event="join"),
    SocketCase("join another session's conversation", {"conversation_id": FOREIGN}, "unknown_conversation",
               event="join"),
    SocketCase("join without a payload", None, "unknown_conversation", event="join"),
    SocketCase("cancel an unknown request", {"request_id": "f" * 32}, "unknown_request", event="cancel"),
    SocketCase("cancel with a malformed id", {"request_id": {"$ne": None}}, "unknown_request", event="cancel"),
    SocketCase("control characters are stripped", {"text": "Where\x00 is\x07 my\x1b parcel\x85?\r\nOrder 12"},
               "accepted", then="done"),
    SocketCase("script and HTML are kept as text", {"text": INJECTION}, "accepted", then="done"),
    SocketCase("prompt beyond the model's context", {"text": TOO_LONG_FOR_THE_MODEL}, "accepted",
               then="prompt_too_long"),
]

# What the accepted messages are stored as: control characters gone, line breaks kept, HTML untouched.
STORED = {
    "control characters are stripped": "Where is my parcel?\nOrder 12",
    "script and HTML are kept as text": INJECTION,
}


@pytest.fixture(scope="module")
def foreign(stack):
    """A conversation that belongs to someone else."""
    owner = ChatClient(stack.web_urls[1])
    try:
        return owner.ask("Do you sell gift cards?")["done"]["conversation_id"]
    finally:
        owner.close()


@pytest.fixture(scope="module")
def in_flight(stack):
    """A message accepted before the table runs; its answer must still arrive whole after it."""
    c = ChatClient(stack.web_urls[0])
    c.sio.emit("chat_message", {"text": "Can I return shoes I wore once?"})
    name, accepted = c.next()
    assert name == "accepted"
    yield c, accepted
    c.close()


def substitute(payload: object, foreign_id: str) -> object:
    if isinstance(payload, dict):
        return {k: foreign_id if v == FOREIGN else v for k, v in payload.items()}
    return payload


def test_a_message_is_in_flight_while_the_table_runs(in_flight):
    assert in_flight[1]["request_id"]


@pytest.mark.parametrize("case", SOCKET_CASES, ids=[c.name for c in SOCKET_CASES])
def test_socketio_bad_input(stack, db, foreign, case):
    client = ChatClient(stack.web_urls[0])
    try:
        payload = substitute(case.payload, foreign)
        if payload is None:
            client.sio.emit(case.event)
        else:
            client.sio.emit(case.event, payload)
        name, data = client.next(30)
        if case.expect != "accepted":
            assert (name, data.get("code")) == ("error", case.expect), data
            assert data["retryable"] is False and len(data["message"]) > 15, data
            assert "request_id" not in data or data["request_id"] in (None, payload.get("request_id"))
            assert client.sio.connected, "a refused message must not drop the connection"
            return
        assert name == "accepted", (name, data)
        while True:
            name, final = client.next(60)
            assert final["request_id"] == data["request_id"], final
            if name != "token":
                break
        if case.then == "done":
            assert name == "done" and final["completion_tokens"] > 0, final
        else:
            assert (name, final["code"]) == ("error", case.then) and final["retryable"] is False, final
        with db() as s:
            user = s.query(Message).filter_by(conversation_id=data["conversation_id"], role="user").one()
            assert user.content == STORED.get(case.name, user.content)
            assert s.get(RequestRecord, data["request_id"]).finished_at is not None
    finally:
        client.close()


@dataclass(frozen=True)
class HttpCase:
    name: str
    body: bytes | dict | None
    status: int
    code: str | None                     # None: an answer is expected
    content_type: str | None = "application/json"
    method: str = "POST"
    path: str = "/v1/chat/completions"


USER = [{"role": "user", "content": "Where is my parcel?"}]


def with_(**extra) -> dict:
    return {"messages": USER, "max_tokens": 4, **extra}


HTTP_CASES = [
    HttpCase("empty body", b"", 400, "invalid_json"),
    HttpCase("malformed JSON", b'{"messages": [{"role": "user", "content": "hi"}', 400, "invalid_json"),
    HttpCase("JSON array", b"[]", 400, "invalid_json"),
    HttpCase("JSON string", b'"hello"', 400, "invalid_json"),
    HttpCase("nesting 100 000 deep", b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),
    HttpCase("a number of 5000 digits", b'{"messages": [], "seed": ' + b"9" * 5000 + b"}", 400, "invalid_json"),
    HttpCase("wrong Content-Type", json.dumps(with_()).encode(), 415, "unsupported_media_type",
             content_type="text/plain"),
    HttpCase("plain text that is not JSON", b"Where is my parcel?", 400, "invalid_json", content_type="text/plain"),
    HttpCase("form Content-Type (curl -d)", json.dumps(with_()).encode(), 415, "unsupported_media_type",
             content_type="application/x-www-form-urlencoded"),
    HttpCase("invalid UTF-8", b'{"messages": [{"role": "user", "content": "caf\xe9 \xff\xfe"}]}', 400,
             "invalid_encoding"),
    HttpCase("1 MB message", with_(messages=[{"role": "user", "content": "x" * MB}]), 413, "request_too_large"),
    HttpCase("messages beyond the character limit",
             with_(messages=[{"role": "user", "content": "word " * 14_000}]), 400, "context_length_exceeded"),
    HttpCase("messages missing", {"max_tokens": 4}, 400, "invalid_messages"),
    HttpCase("messages not a list", {"messages": "hi"}, 400, "invalid_messages"),
    HttpCase("message without a role", {"messages": [{"content": "hi"}]}, 400, "invalid_messages"),
    HttpCase("content is a number", {"messages": [{"role": "user", "content": 42}]}, 400, "invalid_messages"),
    HttpCase("content missing", {"messages": [{"role": "user"}]}, 400, "invalid_messages"),
    HttpCase("image content part", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, 400, "invalid_messages"),
    HttpCase("empty user message", {"messages": [{"role": "user", "content": ""}]}, 400, "empty_message"),
    HttpCase("whitespace-only user message", {"messages": [{"role": "user", "content": " \n\t "}]}, 400,
             "empty_message"),
    HttpCase("control characters only", {"messages": [{"role": "user", "content": "\x00\x01\x1b"}]}, 400,
             "empty_message"),
    HttpCase("temperature negative", with_(temperature=-1), 400, "invalid_value"),
    HttpCase("temperature a string", with_(temperature="hot"), 400, "invalid_value"),
    HttpCase("temperature NaN", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
             "invalid_value"),
    HttpCase("top_p above 1", with_(top_p=1.5), 400, "invalid_value"),
    HttpCase("top_p zero", with_(top_p=0), 400, "invalid_value"),
    HttpCase("top_k fractional", with_(top_k=2.5), 400, "invalid_value"),
    HttpCase("top_k below -1", with_(top_k=-2), 400, "invalid_value"),
    HttpCase("repetition_penalty zero", with_(repetition_penalty=0), 400, "invalid_value"),
    HttpCase("repetition_penalty a list", with_(repetition_penalty=[1.1]), 400, "invalid_value"),
    HttpCase("seed negative", with_(seed=-1), 400, "invalid_value"),
    HttpCase("seed a string", with_(seed="abc"), 400, "invalid_value"),
    HttpCase("seed past 63 bits", with_(seed=2**64), 400, "invalid_value"),
    HttpCase("stop a number", with_(stop=5), 400, "invalid_value"),
    HttpCase("stop an empty string", with_(stop=[""]), 400, "invalid_value"),
    HttpCase("stop of 1000 characters", with_(stop=["z" * 1000]), 400, "invalid_value"),
    HttpCase("max_tokens 10**12", with_(max_tokens=10**12), 400, "invalid_value"),
    HttpCase("max_tokens of 400 digits", with_(max_tokens=10**400), 400, "invalid_value"),
    HttpCase("max_tokens a string", with_(max_tokens="100"), 400, "invalid_value"),
    HttpCase("stream not a boolean", with_(stream="yes"), 400, "invalid_value"),
    HttpCase("model not a string", with_(model=123), 400, "invalid_value"),
    HttpCase("unknown field", with_(temprature=0.5), 400, "unknown_parameter"),
    HttpCase("unsupported legacy functions", with_(functions=[{"name": "refund"}]), 400, "unsupported_parameter"),
    HttpCase("GET instead of POST", None, 405, "method_not_allowed", method="GET"),
    HttpCase("an unknown endpoint", with_(), 404, "not_found", path="/v1/completions/legacy"),
    HttpCase("prompt beyond the model's context", with_(messages=[{"role": "user", "content": TOO_LONG_FOR_THE_MODEL}]),
             400, "context_length_exceeded"),
    HttpCase("script and HTML are answered as text", with_(messages=[{"role": "user", "content": INJECTION}]),
             200, None),
    HttpCase("neutral values of parameters", with_(presence_penalty=0, logprobs=False, functions=[], user="u-1"),
             200, None),
    HttpCase("no Content-Type at all", json.dumps(with_()).encode(), 200, None, content_type=None),
]


def send(url: str, case: HttpCase) -> requests.Response:
    body = case.body if isinstance(case.body, bytes) or case.body is None else json.dumps(case.body).encode()
    headers = {"Content-Type": case.content_type} if case.content_type else {}
    return requests.request(case.method, url + case.path, data=body, headers=headers, timeout=60)


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c.name for c in HTTP_CASES])
def test_http_bad_input(stack, case):
    response = send(stack.web_urls[1], case)
    assert response.status_code == case.status, response.text[:500]
    body = response.json()
    if case.code is None:
        assert body["choices"][0]["message"]["content"] is not None and body["usage"]["completion_tokens"] > 0
        return
    error = body["error"]
    assert error["code"] == case.code and error["type"] == "invalid_request_error", error
    assert len(error["message"]) > 15 and len(error["message"]) < 400, error


def test_http_control_characters_are_stripped_like_over_socketio(stack):
    """The same prompt with and without control characters reaches the model as the same tokens."""
    def usage(content: str) -> dict:
        response = requests.post(stack.web_urls[1] + "/v1/chat/completions", timeout=60,
                                 json={"messages": [{"role": "user", "content": content}], "max_tokens": 2})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    assert usage("Where\x00 is\x07 my\x1b parcel\x85?\r\nOrder 12") == usage("Where is my parcel?\nOrder 12")


def test_the_service_still_serves_and_nothing_accepted_was_lost(stack, db, in_flight):
    client, accepted = in_flight
    while True:
        name, data = client.next(60)
        if data.get("request_id") == accepted["request_id"] and name != "token":
            break
    assert name == "done" and data["completion_tokens"] > 0, data
    with db() as s:
        answer = s.query(Message).filter_by(request_id=accepted["request_id"]).one()
        assert answer.content == data["text"]
        # the question and its answer, once each (a grounded answer's lookups sit between them as tool rows)
        roles = [m.role for m in s.get(Conversation, accepted["conversation_id"]).messages]
        assert [r for r in roles if r in ("user", "assistant")] == ["user", "assistant"], roles
    for url in stack.web_urls[:2]:
        fresh = ChatClient(url)
        try:
            assert fresh.ask("Do you ship to Norway?")["done"]["completion_tokens"] > 0
        finally:
            fresh.close()
        response = requests.post(url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 4}, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] > 0
